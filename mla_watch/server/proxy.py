"""Forwarding generation to an OpenAI-compatible engine (``serve --upstream``), with the policy applied.

The proxy relays bytes, bounds them and times them; it speaks no engine's format. Each request gets a
reader of the engine's answers (:mod:`mla_watch.engines.reading`: vLLM's, SGLang's, or one that only adds
mla_watch's object), which asks the engine for what it needs, turns the answer, or each read of a stream,
into what the client gets, and counts the routing it carried once the client has it (in a worker process).
The answer's path runs down, from here into :mod:`mla_watch.engines`, and never back.

Whatever answers at the upstream's address is not trusted: an answer is read within
``--upstream-max-bytes`` after decompression and within ``--request-timeout`` in all (a stream:
until its headers and each of its lines), parsed off the event loop, and anything that is not
an OpenAI-style answer becomes a 502 in OpenAI's error shape that says what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mla_watch.engines.answer_reader import (
    AnswerReader,
    NotAnAnswer,
    ProxiedRequest,
    RequestFieldError,
    UnreadableAnswer,
)
from mla_watch.engines.count_queue import COUNT_QUEUE_BYTES, Capture, CountQueue
from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.reading import ENGINE_OWNERS, EngineReading
from mla_watch.engines.replay import ReplayBudget, StreamReplayer
from mla_watch.engines.watch import EngineRouting
from mla_watch.policy.model import Decision
from mla_watch.server.http import by_deadline
from mla_watch.server.requests import ApiError, GenerationRequest, describe_value
from mla_watch.server.upstream_http import UpstreamClient, UpstreamError, UpstreamResponse
from mla_watch.server.upstream_io import AnswerTooLarge, BoundedInflater, LineDeadline, UnsupportedEncoding

__all__ = ["ENGINE_OWNERS", "ERROR_BODY_MAX_BYTES", "MODELS_MAX_BYTES", "Upstream"]

log = logging.getLogger("mla_watch.server")

ERROR_BODY_MAX_BYTES = 64 << 10  # an engine's error answer is a message, relayed only when it is one
MODELS_MAX_BYTES = 1 << 20  # /v1/models lists names


class Upstream:
    """The engine behind the sidecar: requests go there with the policy's applied values."""

    def __init__(
        self,
        url: str,
        timeout: float,
        *,
        decoder: RoutingDecoder,
        routing: EngineRouting | None = None,
        max_bytes: int,
        max_line_bytes: int | None = None,
        credentials: tuple[str, str] | None = None,
        replay: ReplayBudget | None = None,
        count_queue_bytes: int = COUNT_QUEUE_BYTES,
        capture: Capture | None = None,
    ) -> None:
        self.url = url.rstrip("/")  # without credentials: it is shown in errors and logs
        # identity: an engine on the pod's loopback gains nothing from compression, and one that compresses
        # all the same is inflated here within max_bytes.
        self._client = UpstreamClient(
            self.url,
            connect_timeout=min(timeout, 5.0),
            credentials=credentials,
            headers={"Accept-Encoding": "identity"},
        )
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_line_bytes = min(max_bytes, max_line_bytes or max_bytes)  # a stream line without routing
        # The engine's answers: read in its format (fixed by --engine, or found on the first request: auto), their
        # routing counted after the client has them (a vLLM stream's by replaying it).
        self.reading = EngineReading(
            decoder,
            max_bytes=max_bytes,
            max_line_bytes=self.max_line_bytes,
            routing=routing,
            send_replay=self._send_replay,
            replay=replay,
            count_queue_bytes=count_queue_bytes,
            capture=capture,
        )

    @property
    def counter(self) -> CountQueue | None:
        """The answers still to count (``None`` where no routing is read)."""
        return self.reading.parts.counter

    @property
    def replayer(self) -> StreamReplayer | None:
        """What replays vLLM's streams (``None`` where none are)."""
        return self.reading.parts.replayer

    async def close(self) -> None:
        await self.reading.close()
        await self._client.aclose()

    async def models(self, request: Request) -> Response:
        status, content_type, content = await self._exchange(
            "GET", "/v1/models", MODELS_MAX_BYTES, _forwarded_auth(request)
        )
        if status != 200:
            return _relayed_error(self.url, status, content_type, content)
        document = _json_object(content)
        if document is None:
            raise _not_openai(self.url, "/v1/models", content_type, len(content))
        return JSONResponse(document)

    async def forward(
        self,
        request: Request,
        parsed: GenerationRequest,
        body: dict[str, Any],
        decision: Decision,
        client: str | None = None,
    ) -> Response:
        """The engine's answer to the request, with the policy applied; its routing counted for the business line
        and ``client`` (:mod:`mla_watch.routing.clients`) once the client has it."""
        headers = {
            "Content-Type": "application/json",
            **_forwarded_auth(request),
            "X-Business-Line": decision.business_line,
            "X-Task": decision.task,
        }
        proxied = ProxiedRequest(
            parsed.upstream_body(body, decision.applied),
            body,
            parsed.kind,
            parsed.stream,
            parsed.model,
            decision.as_dict(),
            decision.business_line,
            client,
            headers,
        )
        reader = await self._reader(request, proxied)
        path = request.url.path
        if parsed.stream:
            return await self._stream(path, proxied, reader)
        status, content_type, content = await self._exchange(
            "POST", path, self.max_bytes, headers, _json_body(proxied.payload)
        )
        if status != 200:
            return _relayed_error(self.url, status, content_type, content)
        reading = reader.answer(content)
        del content  # the reader holds the answer: its megabytes go as soon as it has read them
        try:
            answer = await reading
        except NotAnAnswer as error:
            raise _not_openai(self.url, path, content_type, error.size) from None
        except UnreadableAnswer as error:
            raise ApiError(
                502,
                f"the answer of {self.url}{path} could not be read: {error}",
                code="upstream_error",
                error_type="server_error",
            ) from None
        background = BackgroundTask(_finish, reader) if reader.pending else None
        return Response(answer, media_type="application/json", background=background)

    async def _reader(self, request: Request, proxied: ProxiedRequest) -> AnswerReader:
        """The reader of this request's answer (``--engine auto``: once the engine has said what it is)."""
        if self.reading.undetermined:
            await self._detect(request)
        try:
            return self.reading.reader(proxied)
        except RequestFieldError as error:
            raise ApiError(400, str(error), param=error.param, code=error.code) from None

    async def _send_replay(self, payload: dict[str, Any], headers: dict[str, str]) -> bytes:
        status, content_type, content = await self._exchange(
            "POST", "/v1/completions", self.max_bytes, headers, _json_body(payload)
        )
        if status != 200:
            raise ApiError(
                502,
                f"{self.url}/v1/completions answered a replay with HTTP {status} ({_media_type(content_type)})",
                code="upstream_error",
            )
        return content

    # ------------------------------------------------------------------ one bounded exchange
    async def _exchange(
        self, method: str, path: str, limit: int, headers: dict[str, str], body: bytes = b""
    ) -> tuple[int, str, bytes]:
        """Status, content type and decoded body of one request: at most ``limit`` bytes (an error answer at
        most :data:`ERROR_BODY_MAX_BYTES`), all of it within the request timeout."""
        try:
            return await by_deadline(
                asyncio.get_running_loop().time() + self.timeout, self._read(method, path, limit, headers, body)
            )
        except asyncio.TimeoutError:
            raise ApiError(
                504,
                f"{self.url}{path} did not answer in full within {self.timeout:g} s (--request-timeout)",
                code="upstream_timeout",
                error_type="server_error",
            ) from None
        except UpstreamError as error:
            raise self._failed(error) from None

    async def _read(
        self, method: str, path: str, limit: int, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, bytes]:
        async with await self._client.send(method, path, headers=headers, body=body) as answer:
            content_type = answer.headers.get("content-type", "")
            if answer.status_code != 200:
                limit = min(limit, ERROR_BODY_MAX_BYTES)
            try:
                content = await self._inflate(answer, limit)
            except AnswerTooLarge as error:
                if answer.status_code != 200:  # a message that long is no message: say what came
                    return answer.status_code, content_type, b""
                raise ApiError(
                    502,
                    f"the answer of {self.url}{path} is larger than {error.limit} bytes (--upstream-max-bytes)",
                    code="upstream_too_large",
                    error_type="server_error",
                ) from None
            return answer.status_code, content_type, content

    async def _inflate(self, answer: UpstreamResponse, limit: int) -> bytes:
        try:
            inflater = BoundedInflater(answer.headers.get("content-encoding"), limit)
            body = bytearray()  # grown in place: a list of pieces joined at the end fragments the heap
            async for raw in answer.aiter_raw():
                body += inflater.feed(raw)
            body += inflater.finish()
        except UnsupportedEncoding as error:
            raise ApiError(
                502,
                f"the answer of {self.url} cannot be read: {error}",
                code="upstream_error",
                error_type="server_error",
            ) from None
        except zlib.error:
            raise ApiError(
                502,
                f"the answer of {self.url} is not valid compressed data (Content-Encoding "
                f"{answer.headers.get('content-encoding', '')[:40]!r})",
                code="upstream_error",
                error_type="server_error",
            ) from None
        return bytes(body)

    # ------------------------------------------------------------------ streams
    async def _stream(self, path: str, proxied: ProxiedRequest, reader: AnswerReader) -> Response:
        deadline = asyncio.get_running_loop().time() + self.timeout
        try:
            upstream = await by_deadline(
                deadline, self._client.send("POST", path, headers=proxied.headers, body=_json_body(proxied.payload))
            )
        except asyncio.TimeoutError:
            raise ApiError(
                504,
                f"{self.url}{path} sent no answer within {self.timeout:g} s (--request-timeout)",
                code="upstream_timeout",
                error_type="server_error",
            ) from None
        except UpstreamError as error:
            raise self._failed(error) from None
        if upstream.status_code != 200:
            try:
                content_type = upstream.headers.get("content-type", "")
                try:
                    content = await by_deadline(deadline, self._inflate(upstream, ERROR_BODY_MAX_BYTES))
                except (AnswerTooLarge, asyncio.TimeoutError, UpstreamError):
                    content = b""
            finally:
                await upstream.aclose()
            return _relayed_error(self.url, upstream.status_code, content_type, content)
        return StreamingResponse(
            self._relay_stream(upstream, reader, path),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _relay_stream(self, upstream: UpstreamResponse, reader: AnswerReader, path: str) -> AsyncIterator[bytes]:
        """Pass the upstream's server-sent events through the reader, each read within its bounds, each line within
        the request timeout. A stream that breaks a bound ends with one ``error`` event saying which."""
        try:
            try:  # a stream is relayed read by read: a read, and a line, must fit; the whole need not
                inflater = BoundedInflater(upstream.headers.get("content-encoding"), self.max_bytes, per_read=True)
            except UnsupportedEncoding as error:
                raise ApiError(
                    502,
                    f"the stream of {self.url}{path} cannot be read: {error}",
                    code="upstream_error",
                    error_type="server_error",
                ) from None
            raw = upstream.aiter_raw()
            deadline = LineDeadline(self.timeout)  # a line dripped a byte at a time must still end within the timeout
            try:
                while True:
                    try:
                        data = await deadline.read(anext(raw))
                    except StopAsyncIteration:
                        break
                    except asyncio.TimeoutError:
                        raise ApiError(
                            504,
                            f"the stream of {self.url}{path} sent no line end within "
                            f"{self.timeout:g} s (--request-timeout)",
                            code="upstream_timeout",
                            error_type="server_error",
                        ) from None
                    except UpstreamError as error:
                        raise self._failed(error) from None
                    relayed = await self._relay_read(reader, inflater, data, path)
                    if reader.line_ended:
                        deadline.restart()
                    if relayed:
                        yield relayed
            finally:
                deadline.close()
            relayed = await reader.end()
            if relayed:
                yield relayed
        except ApiError as error:
            log.warning("stream from %s%s cut: %s", self.url, path, error.message)
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        finally:
            try:  # after the last byte, or on a client that left (cancelled: so before any await)
                reader.finish()
            finally:
                await upstream.aclose()

    async def _relay_read(self, reader: AnswerReader, inflater: BoundedInflater, data: bytes, path: str) -> bytes:
        """What the client gets of one read of the stream."""
        try:
            return await reader.feed(inflater.feed(data))
        except zlib.error:
            raise ApiError(
                502,
                f"the stream of {self.url}{path} is not valid compressed data",
                code="upstream_error",
                error_type="server_error",
            ) from None
        except AnswerTooLarge as error:
            flag = "--upstream-max-bytes" if error.limit == self.max_bytes else "--upstream-max-line-bytes"
            what = error.what if error.what.startswith("a line") else "a line of the stream"
            raise ApiError(
                502,
                f"{what} of {self.url}{path} is larger than {error.limit} bytes ({flag})",
                code="upstream_too_large",
                error_type="server_error",
            ) from None

    # ------------------------------------------------------------------ --engine auto
    async def _detect(self, request: Request) -> None:
        """``--engine auto``: the format of the engine that owns the upstream's first model."""
        try:
            status, _, content = await self._exchange("GET", "/v1/models", MODELS_MAX_BYTES, _forwarded_auth(request))
        except ApiError as error:
            log.warning("--engine auto: %s/v1/models did not answer (%s); no routing read yet", self.url, error.message)
            return
        document = _json_object(content) if status == 200 else None
        try:
            owner = document["data"][0]["owned_by"]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            log.warning("--engine auto: %s/v1/models did not name its engine; no routing read yet", self.url)
            return
        engine = self.reading.found(owner)  # an unknown engine stays unknown: asked once
        if engine is None:
            log.warning(
                "--engine auto: %s/v1/models is owned by %s, not one of %s; no routing is read (set --engine)",
                self.url,
                describe_value(owner, 40),
                sorted(ENGINE_OWNERS),
            )
        else:
            log.info("--engine auto: %s is %s; reading its routing in %s's format", self.url, owner, engine)

    def _failed(self, error: UpstreamError) -> ApiError:
        detail = " ".join(str(error).split())[:200]  # no credentials in it: they travel in a header of their own
        return ApiError(
            502,
            f"upstream {self.url} failed: {error.kind}" + (f": {detail}" if detail else ""),
            code="upstream_error",
            error_type="server_error",
        )


def _json_body(payload: dict[str, Any]) -> bytes:
    """A request's JSON as the engine receives it (compact, UTF-8; the request was parsed without NaN)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _json_object(content: bytes) -> dict[str, Any] | None:
    """``content`` as a JSON object, or ``None`` where it is not one (deep nesting included)."""
    try:
        document = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _relayed_error(url: str, status: int, content_type: str, content: bytes) -> Response:
    """An engine's error answer: its own JSON error object where it sent one, else ours naming what came.

    Only 4xx and 5xx are relayed as the engine said them; any other status is a 502. Nothing but JSON
    leaves: an engine's HTML page would be served from the sidecar's origin, beside its status page.
    """
    if not 400 <= status <= 599:
        return JSONResponse(
            ApiError(
                502,
                f"{url} answered HTTP {status}: expected 200 with an OpenAI-style answer, or an error status",
                code="upstream_error",
                error_type="server_error",
            ).body(),
            status_code=502,
        )
    document = _json_object(content) if "json" in content_type.lower() else None
    if document is not None:
        return JSONResponse(document, status_code=status)
    kind = _media_type(content_type)
    what = f"{len(content)} bytes of {kind}" if content else f"an unreadable or over-long body ({kind})"
    error = ApiError(
        status,
        f"{url} answered HTTP {status} with {what}: expected an OpenAI-style JSON error",
        code="upstream_error",
        error_type="invalid_request_error" if status < 500 else "server_error",
    )
    return JSONResponse(error.body(), status_code=status)


def _not_openai(url: str, path: str, content_type: str, size: int) -> ApiError:
    return ApiError(
        502,
        f"the answer of {url}{path} ({size} bytes of {_media_type(content_type)}) is not a JSON "
        "object: expected an OpenAI-style answer",
        code="upstream_error",
        error_type="server_error",
    )


def _media_type(content_type: str) -> str:
    """The engine's Content-Type without its parameters, cut short, for a message."""
    return content_type.split(";")[0].strip()[:60] or "no content type"


async def _finish(reader: AnswerReader) -> None:
    """Once the client has the answer (a coroutine: a starlette background function would run in a thread)."""
    reader.finish()


def _forwarded_auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"Authorization": value} if value else {}
