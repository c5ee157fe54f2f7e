"""HTTP plumbing every endpoint of the sidecar shares: the error answer, bounded body reads, bearer tokens."""

from __future__ import annotations

import asyncio
import hmac
import sys
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from mla_watch.server.requests import ApiError, parse_body

__all__ = ["authorise", "by_deadline", "error_response", "read_body", "read_json"]

T = TypeVar("T")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body: at most ``limit`` bytes (413), arrived within ``timeout`` seconds (408)."""
    try:
        return await by_deadline(asyncio.get_running_loop().time() + timeout, _read_body(request, limit))
    except asyncio.TimeoutError as error:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from error


async def read_json(request: Request, limit: int, timeout: float) -> dict:
    """The body's JSON object, read as :func:`read_body` reads it."""
    return parse_body(await read_body(request, limit, timeout))


async def by_deadline(deadline: float, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, raising :class:`asyncio.TimeoutError` once the event loop's clock (``loop.time()``,
    monotonic) passes ``deadline``. Where the loop has ``asyncio.timeout_at`` (Python 3.11), a timer on the
    task awaiting: about half what ``asyncio.wait_for`` costs, which wraps the awaitable in a task of its own."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout_at(deadline):
            return await awaitable
    return await asyncio.wait_for(awaitable, max(0.0, deadline - asyncio.get_running_loop().time()))


def authorise(request: Request, token: str | None, *, what: str, variables: str) -> None:
    """Require ``Authorization: Bearer <token>``, compared in constant time; 403 while ``token`` is unset."""
    if not token:
        raise ApiError(
            403,
            f"{what} endpoints are disabled: set {variables} to enable them",
            code="admin_disabled",
            error_type="permission_error",
        )
    supplied = request.headers.get("authorization", "")
    if not hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode()):
        raise ApiError(
            401,
            "missing or wrong bearer token in the Authorization header",
            code="unauthorized",
            error_type="authentication_error",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"the request body has {declared} bytes; at most {limit} are accepted", code="body_too_large"
        )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect as error:
        raise ApiError(400, "the client disconnected while sending the body", code="client_disconnected") from error
    return b"".join(chunks)
