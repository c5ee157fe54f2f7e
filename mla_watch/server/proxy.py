"""Forwarding generation to an OpenAI-compatible engine (``serve --upstream``), with the policy applied."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mla_watch.policy import Decision
from mla_watch.server.requests import ApiError, GenerationRequest

__all__ = ["Upstream"]


class Upstream:
    """The engine behind the sidecar: requests go there with the policy's applied values."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout, connect=5.0))

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
        try:
            if not parsed.stream:
                upstream = await self._client.post(path, json=payload, headers=headers)
                if upstream.status_code != 200:
                    return Response(upstream.content, status_code=upstream.status_code,
                                    media_type=upstream.headers.get("content-type", "application/json"))
                document = upstream.json()
                document["mla_watch"] = extra
                return JSONResponse(document)
            upstream_request = self._client.build_request("POST", path, json=payload, headers=headers)
            upstream = await self._client.send(upstream_request, stream=True)
        except httpx.HTTPError as error:
            raise self._failed(error) from error
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"))
        return StreamingResponse(_relay_stream(upstream, extra), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _failed(self, error: httpx.HTTPError) -> ApiError:
        return ApiError(502, f"upstream {self.url} failed: {type(error).__name__}: {error}", code="upstream_error",
                        error_type="server_error")


async def _relay_stream(upstream: httpx.Response, extra: dict[str, Any]) -> AsyncIterator[bytes]:
    """Pass the upstream's server-sent events through, adding mla_watch's object to the first chunk."""
    first = True
    try:
        async for line in upstream.aiter_lines():
            if first and line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                try:
                    chunk = json.loads(line[5:])
                    chunk["mla_watch"] = extra
                    line = "data: " + json.dumps(chunk)
                    first = False
                except json.JSONDecodeError:
                    pass
            yield (line + "\n").encode()
    finally:
        await upstream.aclose()


def _forwarded_auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"Authorization": value} if value else {}
