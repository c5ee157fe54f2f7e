"""Whether the engine behind the sidecar answers (``serve --upstream``): what ``/readyz`` and the status page say.

The sidecar is ready only while its upstream answers: a ``GET /health`` (vLLM's and SGLang's health check;
another OpenAI-compatible server answers it too, a 404 included) every ``interval`` seconds, within
``timeout``. An answer below 500 is an engine that answers; a 5xx, a refused connection or a timeout is a
problem, logged when it starts and when it ends. The answer's body is never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

__all__ = ["HEALTH_PATH", "UpstreamHealth"]

log = logging.getLogger("mla_watch.server")

HEALTH_PATH = "/health"


class UpstreamHealth:
    """The upstream's last health check, repeated every ``interval`` seconds once :meth:`start` ran."""

    def __init__(
        self,
        url: str,
        *,
        credentials: tuple[str, str] | None = None,
        interval: float = 5.0,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url.rstrip("/")  # without credentials: it is shown in problems and logs
        self.interval = interval
        self._client = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, auth=httpx.BasicAuth(*credentials) if credentials else None
        )
        self._clock = clock
        self._checked_at: float | None = None
        self._problem: str | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def problem(self) -> str | None:
        """Why the upstream is not usable, by the last check (``None``: it answered, or no check ran yet)."""
        return self._problem

    async def current(self) -> str | None:
        """The problem now: the last check's while it is fresher than ``interval``, else a new check's."""
        async with self._lock:
            if self._checked_at is None or self._clock() - self._checked_at >= self.interval:
                await self._check()
            return self._problem

    async def _check(self) -> None:
        try:
            async with self._client.stream("GET", HEALTH_PATH) as response:
                status = response.status_code
            problem = None if status < 500 else f"the upstream at {self.url} answered {status} to GET {HEALTH_PATH}"
        except httpx.HTTPError as error:
            reason = " ".join(str(error).split())[:200] or type(error).__name__
            problem = f"the upstream at {self.url} cannot be reached ({type(error).__name__}: {reason})"
        self._checked_at = self._clock()
        if problem != self._problem:
            if problem is not None:
                log.warning("not ready: %s", problem)
            else:
                log.info("the upstream at %s answers again: ready", self.url)
        self._problem = problem

    def start(self) -> None:
        """Check now and every ``interval`` seconds on the running event loop, until :meth:`close`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="mla-watch-upstream-health")

    async def _run(self) -> None:
        while True:
            await self.current()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()
