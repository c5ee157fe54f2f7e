"""Forwarding generation to an OpenAI-compatible engine (``serve --upstream``), with the policy applied.

Beside vLLM or SGLang (``serve --engine``), the proxy also reads the routing the engine returns
with each response (:mod:`mla_watch.engines.formats`): it asks for it where the engine needs
asking, decodes and counts it per business line in a worker process, and strips it from what
the client receives unless the client asked for it itself (``return_routed_experts: true``).

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
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mla_watch.engines.count_queue import COUNT_QUEUE_BYTES, Capture, CountQueue
from mla_watch.engines.decoder import FILE_HANDOFF_BYTES, DecoderDied, RoutingDecoder
from mla_watch.engines.formats import (
    DROP_CHUNK,
    PROMPT_START_FIELD,
    ROUTING_REQUEST_FIELD,
    SGLANG_START_FIELD,
    STRIP_ON_LOOP_BYTES,
    DataError,
    Decoded,
    RoutingPlan,
    add_extra,
    routing_strings,
    strip_chunk,
    strip_response,
    strip_routing,
)
from mla_watch.engines.replay import (
    TOKEN_IDS_FIELD,
    ReplayBudget,
    StreamReplayer,
    StreamTokens,
    read_chunk,
    read_chunk_apart,
)
from mla_watch.engines.watch import FOOTPRINT_TOKENS, EngineRouting
from mla_watch.policy.model import Decision
from mla_watch.server.http import by_deadline
from mla_watch.server.requests import ApiError, GenerationRequest, describe_value
from mla_watch.server.upstream_http import Answer, UpstreamClient, UpstreamError
from mla_watch.server.upstream_io import (
    AnswerTooLarge,
    BoundedInflater,
    EventLines,
    LineDeadline,
    UnsupportedEncoding,
)

__all__ = ["ENGINE_OWNERS", "ERROR_BODY_MAX_BYTES", "MODELS_MAX_BYTES", "Upstream"]

log = logging.getLogger("mla_watch.server")

# `auto`: the routing format, by the `owned_by` of the upstream's /v1/models (an mla_watch sidecar
# serving with --return-routed-experts speaks vLLM's fields).
ENGINE_OWNERS = {"vllm": "vllm", "sglang": "sglang", "mla_watch": "vllm"}
ERROR_BODY_MAX_BYTES = 64 << 10  # an engine's error answer is a message, relayed only when it is one
MODELS_MAX_BYTES = 1 << 20  # /v1/models lists names


class Upstream:
    """The engine behind the sidecar: requests go there with the policy's applied values."""

    def __init__(self, url: str, timeout: float, *, decoder: RoutingDecoder, routing: EngineRouting | None = None,
                 max_bytes: int, max_line_bytes: int | None = None, credentials: tuple[str, str] | None = None,
                 replay: ReplayBudget | None = None,
                 count_queue_bytes: int = COUNT_QUEUE_BYTES, capture: Capture | None = None) -> None:
        self.url = url.rstrip("/")  # without credentials: it is shown in errors and logs
        # identity: an engine on the pod's loopback gains nothing from compression, and one that compresses
        # all the same is inflated here within max_bytes.
        self._client = UpstreamClient(self.url, connect_timeout=min(timeout, 5.0), credentials=credentials,
                                      headers={"Accept-Encoding": "identity"})
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_line_bytes = min(max_bytes, max_line_bytes or max_bytes)  # a stream line without routing
        self.routing = routing
        self._decoder = decoder
        # The routing format: fixed by --engine, or found on the first request (`auto`).
        self.engine: str | None = None if routing is None or routing.engine == "auto" else routing.engine
        # Routing is counted after the client has its answer; a vLLM stream's, by replaying it.
        self.counter = None if routing is None else CountQueue(routing, decoder, max_bytes=count_queue_bytes,
                                                              capture=capture)
        # serve --capture: the token ids of vLLM's answers (asked for, stripped unless the client asked too)
        self.capture = None if self.counter is None else capture
        self._capturing: set[asyncio.Task[None]] = set()
        self.replayer = None if self.counter is None or replay is None else StreamReplayer(
            self._send_replay, self.counter, replay)

    async def close(self) -> None:
        if self._capturing:
            await asyncio.gather(*self._capturing, return_exceptions=True)
        if self.replayer is not None:
            await self.replayer.close()
        if self.counter is not None:
            await self.counter.close()
        await self._client.aclose()

    async def models(self, request: Request) -> Response:
        status, content_type, content = await self._exchange("GET", "/v1/models", MODELS_MAX_BYTES,
                                                             _forwarded_auth(request))
        if status != 200:
            return _relayed_error(self.url, status, content_type, content)
        document = _json_object(content)
        if document is None:
            raise _not_openai(self.url, "/v1/models", content_type, len(content))
        return JSONResponse(document)

    async def forward(self, request: Request, parsed: GenerationRequest, body: dict[str, Any],
                      decision: Decision, client: str | None = None) -> Response:
        """The engine's answer to the request, with the policy applied; its routing counted for the business line
        and ``client`` (:mod:`mla_watch.routing.clients`) once the client has it."""
        payload = parsed.upstream_body(body, decision.applied)
        prompt_start = _prompt_start(payload)  # the proxy counts every row
        headers = {"Content-Type": "application/json", **_forwarded_auth(request),
                   "X-Business-Line": decision.business_line, "X-Task": decision.task}
        path = request.url.path
        extra = decision.as_dict()
        plan = await self._plan(request, body, extra, prompt_start)
        if plan.engine == "sglang":
            payload[ROUTING_REQUEST_FIELD] = True  # SGLang returns routing only to requests that ask
        if plan.engine == "vllm" and self.capture is not None and not parsed.stream:
            plan = replace(plan, token_ids=parsed.kind, strip_token_ids=body.get(TOKEN_IDS_FIELD) is not True)
            payload[TOKEN_IDS_FIELD] = True
        if parsed.stream:
            replay = self._stream_tokens(plan, parsed, body, payload)
            return await self._stream(path, payload, headers, plan, decision.business_line, replay, client)
        status, content_type, content = await self._exchange("POST", path, self.max_bytes, headers,
                                                             _json_body(payload))
        if status != 200:
            return _relayed_error(self.url, status, content_type, content)
        if plan.engine == "none" and len(content) < STRIP_ON_LOOP_BYTES:
            # No routing to read: checked and marked here, in ~0.1 ms; only a long answer goes to a decoding process.
            marked = add_extra(content, plan.extra)
            if marked is None:
                raise _not_openai(self.url, path, content_type, len(content))
            return Response(marked, media_type="application/json")
        counting = self.counter is not None and plan.engine != "none"
        stripped = strip_response(plan, content)  # the routing's base64 cut out, not decoded: ~0.1 ms
        if stripped is not None:
            background = (BackgroundTask(self._count_after, decision.business_line, plan, content, client)
                          if counting else None)
            return Response(stripped, media_type="application/json", background=background)
        # Kept routing, lists, a long answer: the decoding process reads it whole and counts it on the way.
        decoded = await self._decoder.response(plan, content)
        del content
        if decoded.not_json:
            raise _not_openai(self.url, path, content_type, len(decoded.body or b""))
        if counting:
            self.routing.count(decision.business_line, decoded, streamed=False, client=client)  # type: ignore[union-attr]
        if decoded.samples and self.capture is not None:
            await asyncio.to_thread(self.capture, decision.business_line, decoded.samples, client)
        if decoded.body is None:  # the decoding process died holding it: nothing is left to relay
            raise ApiError(502, f"the answer of {self.url}{path} could not be read: {decoded.error}",
                           code="upstream_error", error_type="server_error")
        return Response(decoded.body, media_type="application/json")

    async def _count_after(self, business_line: str, plan: RoutingPlan, content: bytes, client: str | None) -> None:
        """Once the client has the answer (a coroutine: a starlette background function would run in a thread)."""
        self.counter.submit(business_line, plan, content, streamed=False, client=client)  # type: ignore[union-attr]

    def _stream_tokens(self, plan: RoutingPlan, parsed: GenerationRequest, body: dict[str, Any],
                       payload: dict[str, Any]) -> _StreamReplay | None:
        """For a vLLM stream to be replayed or captured: ask for its token ids, and what will read them."""
        if plan.engine != "vllm" or (self.replayer is None and self.capture is None):
            return None
        sampled = self.replayer is not None and self.replayer.sampled()
        if not sampled and self.capture is None:  # counted as sampled out once the stream has ended
            return _StreamReplay(None, parsed.model, replay=False)
        client_asked = body.get(TOKEN_IDS_FIELD) is True
        payload[TOKEN_IDS_FIELD] = True
        return _StreamReplay(StreamTokens(parsed.kind, strip=not client_asked), parsed.model, replay=sampled)

    async def _send_replay(self, payload: dict[str, Any], headers: dict[str, str]) -> bytes:
        status, content_type, content = await self._exchange("POST", "/v1/completions", self.max_bytes, headers,
                                                             _json_body(payload))
        if status != 200:
            raise ApiError(502, f"{self.url}/v1/completions answered a replay with HTTP {status} "
                                f"({_media_type(content_type)})", code="upstream_error")
        return content

    # ------------------------------------------------------------------ one bounded exchange
    async def _exchange(self, method: str, path: str, limit: int, headers: dict[str, str],
                        body: bytes = b"") -> tuple[int, str, bytes]:
        """Status, content type and decoded body of one request: at most ``limit`` bytes (an error answer at
        most :data:`ERROR_BODY_MAX_BYTES`), all of it within the request timeout."""
        try:
            return await by_deadline(asyncio.get_running_loop().time() + self.timeout,
                                     self._read(method, path, limit, headers, body))
        except asyncio.TimeoutError:
            raise ApiError(504, f"{self.url}{path} did not answer in full within {self.timeout:g} s "
                                "(--request-timeout)", code="upstream_timeout", error_type="server_error") from None
        except UpstreamError as error:
            raise self._failed(error) from None

    async def _read(self, method: str, path: str, limit: int, headers: dict[str, str],
                    body: bytes) -> tuple[int, str, bytes]:
        async with await self._client.send(method, path, headers=headers, body=body) as answer:
            content_type = answer.headers.get("content-type", "")
            if answer.status_code != 200:
                limit = min(limit, ERROR_BODY_MAX_BYTES)
            try:
                content = await self._inflate(answer, limit)
            except AnswerTooLarge as error:
                if answer.status_code != 200:  # a message that long is no message: say what came
                    return answer.status_code, content_type, b""
                raise ApiError(502, f"the answer of {self.url}{path} is larger than {error.limit} bytes "
                                    "(--upstream-max-bytes)", code="upstream_too_large",
                               error_type="server_error") from None
            return answer.status_code, content_type, content

    async def _inflate(self, answer: Answer, limit: int) -> bytes:
        try:
            inflater = BoundedInflater(answer.headers.get("content-encoding"), limit)
            body = bytearray()  # grown in place: a list of pieces joined at the end fragments the heap
            async for raw in answer.aiter_raw():
                body += inflater.feed(raw)
            body += inflater.finish()
        except UnsupportedEncoding as error:
            raise ApiError(502, f"the answer of {self.url} cannot be read: {error}", code="upstream_error",
                           error_type="server_error") from None
        except zlib.error:
            raise ApiError(502, f"the answer of {self.url} is not valid compressed data (Content-Encoding "
                                f"{answer.headers.get('content-encoding', '')[:40]!r})", code="upstream_error",
                           error_type="server_error") from None
        return bytes(body)

    # ------------------------------------------------------------------ streams
    async def _stream(self, path: str, payload: dict[str, Any], headers: dict[str, str], plan: RoutingPlan,
                      business_line: str, replay: _StreamReplay | None, client: str | None) -> Response:
        deadline = asyncio.get_running_loop().time() + self.timeout
        try:
            upstream = await by_deadline(deadline, self._client.send("POST", path, headers=headers,
                                                                     body=_json_body(payload)))
        except asyncio.TimeoutError:
            raise ApiError(504, f"{self.url}{path} sent no answer within {self.timeout:g} s (--request-timeout)",
                           code="upstream_timeout", error_type="server_error") from None
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
        relay = _StreamRelay(plan, business_line, replay, headers, client)
        return StreamingResponse(self._relay_stream(upstream, relay, path), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _relay_stream(self, upstream: Answer, relay: _StreamRelay, path: str) -> AsyncIterator[bytes]:
        """Pass the upstream's server-sent events through, adding mla_watch's object to the first chunk.

        SGLang sends a stream's routing in a chunk of its own after the last token: it is cut out and
        counted after. vLLM sends none: a stream whose token ids were asked for is replayed once it has
        ended (:mod:`mla_watch.engines.replay`). A stream that breaks a bound ends with one ``error``
        event saying which.
        """
        try:
            async for lines in self._stream_lines(upstream, path):
                relayed = []
                for line in lines:
                    out = await self._relay_line(line, relay)
                    if out is not None:
                        relayed.append(out)
                if relayed:  # the lines of one read in one write: a write per line costs the client's latency
                    yield b"\n".join(relayed) + b"\n"
        except ApiError as error:
            log.warning("stream from %s%s cut: %s", self.url, path, error.message)
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        finally:
            try:  # after the last byte, or on a client that left (cancelled: so before any await)
                self._stream_ended(relay)
            finally:
                await upstream.aclose()

    def _stream_ended(self, relay: _StreamRelay) -> None:
        if self.routing is None or relay.plan.engine == "none" or relay.counted:
            return
        replay = relay.replay
        if replay is not None and replay.tokens is not None and self.capture is not None:
            samples = replay.tokens.samples()
            if samples:
                task = asyncio.ensure_future(asyncio.to_thread(self.capture, relay.business_line, samples,
                                                               relay.client))
                self._capturing.add(task)  # held until done: a task nobody holds may be collected
                task.add_done_callback(self._capturing.discard)
        if relay.routing_bytes and self.counter is not None:  # the stream carried its routing: no replay
            self._count_stream_routing(relay)
        elif replay is None:
            self.routing.count(relay.business_line, None, streamed=True)
        elif replay.tokens is None or not replay.replay:
            if self.replayer is not None:
                self.replayer.skipped(relay.business_line, "sampled_out")
            else:
                self.routing.count(relay.business_line, None, streamed=True)
        else:
            self.replayer.after_stream(relay.business_line, relay.plan, replay.model,  # type: ignore[union-attr]
                                       relay.headers, replay.tokens, client=relay.client)

    async def _relay_line(self, line: bytes, relay: _StreamRelay) -> bytes | None:
        if not line.startswith(b"data:") or line[5:].strip() in (b"", b"[DONE]"):
            return line
        data = line[5:]
        plan = relay.plan
        if plan.engine == "sglang" and b'"routed_experts"' in data:
            return await self._routing_chunk(data, relay)
        if plan.engine == "vllm" and b'"routed_experts"' in data:
            carried = await self._vllm_routing_chunk(data, relay)
            if carried is None:
                return None
            data = carried
            line = b"data: " + data
        tokens = relay.replay.tokens if relay.replay is not None else None
        if tokens is not None:
            extra = plan.extra if relay.first else None
            if len(data) < STRIP_ON_LOOP_BYTES:
                body = read_chunk(tokens, data, extra)
            else:  # a long prompt's ids: parsed in a decoding process, not on the event loop
                try:
                    body, part = await self._decoder.offload(read_chunk_apart, bytes(data), tokens.kind,
                                                             tokens.strip, extra)
                except DecoderDied:
                    tokens.unreadable = "the process reading a chunk of it died"
                    return line
                tokens.merge(part)
            if body == DROP_CHUNK:
                return None
            if body is not None and extra is not None:
                relay.first = False
            return line if body is None else b"data: " + body
        if not relay.first:
            return line
        if len(line) >= FILE_HANDOFF_BYTES:  # parsing megabytes would hold the event loop
            decoded = await self._decoder.chunk(RoutingPlan("none", None, keep=True, extra=plan.extra),
                                                data, first=True)
            if decoded.not_json or decoded.body is None:
                return line
            relay.first = False
            return b"data: " + decoded.body
        marked = add_extra(data, plan.extra)
        if marked is None:  # not a JSON object: relayed as it came, the next chunk carries the object
            return line
        relay.first = False
        return b"data: " + marked

    async def _vllm_routing_chunk(self, data: bytes, relay: _StreamRelay) -> bytes | None:
        """A vLLM chunk whose choice carries its routing (the terminal chunk of the stream that vLLM's RFC #56745
        proposes; ``GenerateResponseStreamChoice.routed_experts``): the strings are held to be counted once the
        stream has ended, and the chunk goes on without them (with them, trimmed to its prompt start, where the
        client asked). ``None``: nothing is left of it to relay."""
        plan = relay.plan
        strings = routing_strings(data)
        held = relay.routing_bytes + sum(map(len, strings))
        if held > self.max_bytes:  # bounded as one answer is: past it, nothing of this stream is counted
            relay.routing.clear()
            relay.routing_bytes = self.max_bytes + 1
        else:
            relay.routing += strings
            relay.routing_bytes = held
        if plan.keep and not plan.prompt_start:
            return data
        stripped = None if plan.keep else strip_routing(plan, data)
        if stripped is None:  # kept and trimmed, lists, or a long chunk: the decoding process, off the event loop
            decoded = await self._decoder.chunk(replace(plan, extra=None), data,
                                                first=False)
            if decoded.not_json:
                return data
            stripped = decoded.body
        if stripped is not None and relay.prompt_tokens is None and b'"prompt_tokens"' in stripped \
                and len(stripped) < STRIP_ON_LOOP_BYTES:
            usage = (_json_object(stripped) or {}).get("usage")
            tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            relay.prompt_tokens = tokens if type(tokens) is int and tokens >= 0 else None
        return stripped

    def _count_stream_routing(self, relay: _StreamRelay) -> None:
        """What a vLLM stream's chunks carried, counted as the unstreamed answer's choices are."""
        if relay.routing_bytes > self.max_bytes:
            too_much = DataError("decoder", f"the routing a stream carried exceeds {self.max_bytes} bytes "
                                            "(--upstream-max-bytes)")
            self.routing.count(relay.business_line, Decoded(None, error=too_much), streamed=True,  # type: ignore[union-attr]
                               client=relay.client)
            return
        prompt = relay.prompt_tokens
        tokens = relay.replay.tokens if relay.replay is not None else None
        if prompt is None and tokens is not None:
            prompt = tokens.prompt_length()
        body = b'{"choices":[' + b",".join(b'{"routed_experts":"' + text + b'"}' for text in relay.routing) + b"]"
        body += b"}" if prompt is None else b',"usage":{"prompt_tokens":' + str(prompt).encode() + b"}}"
        plan = RoutingPlan("vllm", relay.plan.geometry, keep=False)
        self.counter.submit(relay.business_line, plan, body, streamed=True,  # type: ignore[union-attr]
                            client=relay.client)

    async def _routing_chunk(self, data: bytes, relay: _StreamRelay) -> bytes | None:
        """SGLang's chunk with the stream's routing: cut out here, counted after (kept, where the client asked)."""
        plan = relay.plan
        stripped = strip_chunk(plan, data, first=relay.first)
        if stripped is None:  # kept routing, or too long a chunk: the decoding process reads it, on the way
            decoded = await self._decoder.chunk(plan, data, first=relay.first)
            if decoded.found and self.routing is not None:
                self.routing.count(relay.business_line, decoded, streamed=True, client=relay.client)
                relay.counted = True
            relay.first = False
            return None if decoded.body is None else b"data: " + decoded.body
        if self.counter is not None:
            self.counter.submit(relay.business_line, plan, bytes(data), streamed=True, client=relay.client)
            relay.counted = True
        if stripped == DROP_CHUNK:
            return None
        relay.first = False
        return b"data: " + stripped

    async def _stream_lines(self, upstream: Answer, path: str) -> AsyncIterator[list[bytes]]:
        """The stream's lines, those of each read together, each line whole within the request timeout and at
        most ``max_bytes``."""
        try:  # a stream is relayed line by line: a read, and a line, must fit; the whole need not
            inflater = BoundedInflater(upstream.headers.get("content-encoding"), self.max_bytes, per_read=True)
        except UnsupportedEncoding as error:
            raise ApiError(502, f"the stream of {self.url}{path} cannot be read: {error}", code="upstream_error",
                           error_type="server_error") from None
        lines = EventLines(self.max_line_bytes, routing_limit=self.max_bytes)
        raw = upstream.aiter_raw()
        deadline = LineDeadline(self.timeout)  # a line dripped a byte at a time must still end within the timeout
        try:
            while True:
                try:
                    data = await deadline.read(anext(raw))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise ApiError(504, f"the stream of {self.url}{path} sent no line end within {self.timeout:g} s "
                                        "(--request-timeout)", code="upstream_timeout",
                                   error_type="server_error") from None
                except UpstreamError as error:
                    raise self._failed(error) from None
                try:
                    complete = lines.feed(inflater.feed(data))
                except zlib.error:
                    raise ApiError(502, f"the stream of {self.url}{path} is not valid compressed data",
                                   code="upstream_error", error_type="server_error") from None
                except AnswerTooLarge as error:
                    flag = "--upstream-max-bytes" if error.limit == self.max_bytes else "--upstream-max-line-bytes"
                    what = error.what if error.what.startswith("a line") else "a line of the stream"
                    raise ApiError(502, f"{what} of {self.url}{path} is larger than {error.limit} "
                                        f"bytes ({flag})", code="upstream_too_large",
                                   error_type="server_error") from None
                if complete:
                    deadline.restart()
                    yield complete
        finally:
            deadline.close()
        rest = lines.finish()
        if rest:
            yield rest

    # ------------------------------------------------------------------ routing plan
    async def _plan(self, request: Request, body: dict[str, Any], extra: dict[str, Any],
                    prompt_start: int) -> RoutingPlan:
        """How to read this response (engine ``none``: only mla_watch's object is added)."""
        if self.routing is not None and self.engine is None:
            self.engine = await self._detect(request)
        if self.routing is None or self.engine is None:
            return RoutingPlan("none", None, keep=True, extra=extra)
        # A client that sets vLLM's prompt start wants routing: it gets the rows it asked for.
        keep = body.get(ROUTING_REQUEST_FIELD) is True or any(field in body for field in START_FIELDS)
        return RoutingPlan(self.engine, self.routing.geometry, keep=keep, extra=extra, prompt_start=prompt_start,
                           position_edges=self.routing.position_edges, footprint_tokens=FOOTPRINT_TOKENS)

    async def _detect(self, request: Request) -> str | None:
        """``--engine auto``: the format of the engine that owns the upstream's first model."""
        try:
            status, _, content = await self._exchange("GET", "/v1/models", MODELS_MAX_BYTES, _forwarded_auth(request))
        except ApiError as error:
            log.warning("--engine auto: %s/v1/models did not answer (%s); no routing read yet", self.url,
                        error.message)
            return None
        document = _json_object(content) if status == 200 else None
        try:
            owner = document["data"][0]["owned_by"]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            log.warning("--engine auto: %s/v1/models did not name its engine; no routing read yet", self.url)
            return None
        engine = ENGINE_OWNERS.get(owner) if isinstance(owner, str) else None
        if engine is None:
            log.warning("--engine auto: %s/v1/models is owned by %s, not one of %s; no routing is read (set "
                        "--engine)", self.url, describe_value(owner, 40), sorted(ENGINE_OWNERS))
            self.routing = None  # asked once: an unknown engine stays unknown
        else:
            log.info("--engine auto: %s is %s; reading its routing in %s's format", self.url, owner, engine)
            self.routing.engine = engine  # type: ignore[union-attr]
        return engine

    def _failed(self, error: UpstreamError) -> ApiError:
        detail = " ".join(str(error).split())[:200]  # no credentials in it: they travel in a header of their own
        return ApiError(502, f"upstream {self.url} failed: {error.kind}" + (f": {detail}" if detail else ""),
                        code="upstream_error", error_type="server_error")


@dataclass
class _StreamReplay:
    """A vLLM stream to count by replay: its token ids as they pass (``None``: sampled out)."""

    tokens: StreamTokens | None
    model: str | None
    replay: bool = True  # False: its ids are read for the capture only (sampled out of replays)


@dataclass
class _StreamRelay:
    """One stream being relayed."""

    plan: RoutingPlan
    business_line: str
    replay: _StreamReplay | None
    headers: dict[str, str]
    client: str | None = None  # who sent it (mla_watch.routing.clients)
    first: bool = True  # no chunk has carried mla_watch's object yet
    counted: bool = False  # its routing was counted (or queued to be)
    # vLLM routing its own chunks carried (base64, undecoded): counted together once the stream has ended, so that
    # the prompt rows each choice repeats are counted once, as in an unstreamed answer
    routing: list[bytes] = field(default_factory=list)
    routing_bytes: int = 0
    prompt_tokens: int | None = None  # usage.prompt_tokens of a chunk that carried routing


START_FIELDS = (PROMPT_START_FIELD, SGLANG_START_FIELD)  # vLLM's and SGLang's spelling of one idea


def _prompt_start(payload: dict[str, Any]) -> int:
    """The client's prompt start (either engine's field), taken out of what the engine is sent."""
    given = {name: payload.pop(name) for name in START_FIELDS if name in payload}
    for name, value in given.items():
        if type(value) is not int or value < 0:
            raise ApiError(400, f"{name}={describe_value(value, 40)} is invalid: expected an integer >= 0 (prompt "
                                "tokens left out of the routing returned)", param=name, code="invalid_value")
    if len(set(given.values())) > 1:
        raise ApiError(400, f"{PROMPT_START_FIELD} and {SGLANG_START_FIELD} disagree; send one",
                       param=SGLANG_START_FIELD, code="conflict")
    return next(iter(given.values()), 0)


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
        return JSONResponse(ApiError(502, f"{url} answered HTTP {status}: expected 200 with an OpenAI-style answer, "
                                          "or an error status", code="upstream_error",
                                     error_type="server_error").body(), status_code=502)
    document = _json_object(content) if "json" in content_type.lower() else None
    if document is not None:
        return JSONResponse(document, status_code=status)
    kind = _media_type(content_type)
    what = f"{len(content)} bytes of {kind}" if content else f"an unreadable or over-long body ({kind})"
    error = ApiError(status, f"{url} answered HTTP {status} with {what}: expected an OpenAI-style JSON error",
                     code="upstream_error", error_type="invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error.body(), status_code=status)


def _not_openai(url: str, path: str, content_type: str, size: int) -> ApiError:
    return ApiError(502, f"the answer of {url}{path} ({size} bytes of {_media_type(content_type)}) is not a JSON "
                         "object: expected an OpenAI-style answer", code="upstream_error", error_type="server_error")


def _media_type(content_type: str) -> str:
    """The engine's Content-Type without its parameters, cut short, for a message."""
    return content_type.split(";")[0].strip()[:60] or "no content type"


def _forwarded_auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"Authorization": value} if value else {}
