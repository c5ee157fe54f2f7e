"""Forwarding generation to an OpenAI-compatible engine (``serve --upstream``), with the policy applied.

Beside vLLM or SGLang (``serve --engine``), the proxy also reads the routing the engine returns
with each response (:mod:`mla_watch.engines.formats`): it asks for it where the engine needs
asking, decodes and counts it per business line in a worker process, and strips it from what
the client receives unless the client asked for it itself (``return_routed_experts: true``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.formats import ROUTING_REQUEST_FIELD, RoutingPlan
from mla_watch.engines.watch import EngineRouting
from mla_watch.policy import Decision
from mla_watch.server.requests import ApiError, GenerationRequest

__all__ = ["ENGINE_OWNERS", "Upstream"]

log = logging.getLogger("mla_watch.server")

# `auto`: the routing format, by the `owned_by` of the upstream's /v1/models (an mla_watch sidecar
# serving with --return-routed-experts speaks vLLM's fields).
ENGINE_OWNERS = {"vllm": "vllm", "sglang": "sglang", "mla_watch": "vllm"}


class Upstream:
    """The engine behind the sidecar: requests go there with the policy's applied values."""

    def __init__(self, url: str, timeout: float, *, routing: EngineRouting | None = None,
                 decoder: RoutingDecoder | None = None) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout, connect=5.0))
        self.routing = routing
        self._decoder = decoder
        # The routing format: fixed by --engine, or found on the first request (`auto`).
        self.engine: str | None = None if routing is None or routing.engine == "auto" else routing.engine

    async def close(self) -> None:
        await self._client.aclose()

    async def models(self, request: Request) -> Response:
        try:
            upstream = await self._client.get("/v1/models", headers=_forwarded_auth(request))
        except httpx.HTTPError as error:
            raise self._failed(error) from error
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    async def forward(self, request: Request, parsed: GenerationRequest, body: dict[str, Any],
                      decision: Decision) -> Response:
        payload = parsed.upstream_body(body, decision.applied)
        headers = {"Content-Type": "application/json", **_forwarded_auth(request),
                   "X-Business-Line": decision.business_line, "X-Task": decision.task}
        path = request.url.path
        extra = decision.as_dict()
        plan = await self._plan(request, body, extra)
        if plan is not None and plan.engine == "sglang":
            payload[ROUTING_REQUEST_FIELD] = True  # SGLang returns routing only to requests that ask
        try:
            if not parsed.stream:
                upstream = await self._client.post(path, json=payload, headers=headers)
                if upstream.status_code != 200:
                    return Response(upstream.content, status_code=upstream.status_code,
                                    media_type=upstream.headers.get("content-type", "application/json"))
                if plan is None:
                    document = upstream.json()
                    document["mla_watch"] = extra
                    return JSONResponse(document)
                decoded = await self._decoder.response(plan, upstream.content)
                self.routing.count(decision.business_line, decoded)
                return Response(decoded.body, media_type="application/json")
            upstream_request = self._client.build_request("POST", path, json=payload, headers=headers)
            upstream = await self._client.send(upstream_request, stream=True)
        except httpx.HTTPError as error:
            raise self._failed(error) from error
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"))
        return StreamingResponse(self._relay_stream(upstream, extra, plan, decision.business_line),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _plan(self, request: Request, body: dict[str, Any], extra: dict[str, Any]) -> RoutingPlan | None:
        """How to read this response's routing (``None``: not watching an engine's routing)."""
        if self.routing is None:
            return None
        if self.engine is None:
            self.engine = await self._detect(request)
            if self.engine is None:
                return None
        return RoutingPlan(self.engine, self.routing.geometry, keep=body.get(ROUTING_REQUEST_FIELD) is True,
                           extra=extra)

    async def _detect(self, request: Request) -> str | None:
        """``--engine auto``: the format of the engine that owns the upstream's first model."""
        try:
            answer = await self._client.get("/v1/models", headers=_forwarded_auth(request))
            owner = answer.json()["data"][0]["owned_by"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            log.warning("--engine auto: %s/v1/models did not name its engine; no routing read yet", self.url)
            return None
        engine = ENGINE_OWNERS.get(owner) if isinstance(owner, str) else None
        if engine is None:
            log.warning("--engine auto: %s/v1/models is owned by %r, not one of %s; no routing is read (set --engine)",
                        self.url, owner, sorted(ENGINE_OWNERS))
            self.routing = None  # asked once: an unknown engine stays unknown
        else:
            log.info("--engine auto: %s is %s; reading its routing in %s's format", self.url, owner, engine)
            self.routing.engine = engine
        return engine

    def _failed(self, error: httpx.HTTPError) -> ApiError:
        return ApiError(502, f"upstream {self.url} failed: {type(error).__name__}: {error}", code="upstream_error",
                        error_type="server_error")

    async def _relay_stream(self, upstream: httpx.Response, extra: dict[str, Any], plan: RoutingPlan | None,
                            business_line: str) -> AsyncIterator[bytes]:
        """Pass the upstream's server-sent events through, adding mla_watch's object to the first chunk.

        SGLang sends a stream's routing in one chunk of its own after the last token; vLLM sends none
        (the response is counted as one without routing).
        """
        first = True
        counted = False
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    if plan is not None and plan.engine == "sglang" and '"sglext"' in line:
                        decoded = await self._decoder.chunk(plan, line[5:], first=first)
                        if decoded.found:
                            self.routing.count(business_line, decoded)
                            counted = True
                        first = False
                        if decoded.body is None:
                            continue
                        line = "data: " + decoded.body.decode()
                    elif first:
                        try:
                            chunk = json.loads(line[5:])
                            chunk["mla_watch"] = extra
                            line = "data: " + json.dumps(chunk)
                            first = False
                        except json.JSONDecodeError:
                            pass
                yield (line + "\n").encode()
            if plan is not None and not counted:
                self.routing.count(business_line, None)
        finally:
            await upstream.aclose()


def _forwarded_auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"Authorization": value} if value else {}
