"""Decoding engine routing off the event loop: in worker processes, so that a large response holds no GIL here.

A 2,000-token DeepSeek-V3 response carries about a million expert ids (5 MB of base64, or of
JSON lists in vLLM <= 0.21). Parsing and counting that in a thread would still hold the GIL,
and so the event loop, for tens of milliseconds; a worker process costs the loop one copy of
the bytes each way.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from mla_watch.engines.formats import Decoded, RoutingPlan, decode_chunk, decode_response

__all__ = ["RoutingDecoder"]

log = logging.getLogger("mla_watch.engines")


class RoutingDecoder:
    """Runs :func:`decode_response` / :func:`decode_chunk` in ``workers`` processes (0: one thread)."""

    def __init__(self, workers: int = 1) -> None:
        if workers < 0:
            raise ValueError(f"--decode-workers {workers}: expected an integer >= 0")
        self.workers = workers
        self._executor: Executor | None = None

    def start(self) -> None:
        if self._executor is not None:
            return
        if self.workers == 0:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mla-watch-decode")
        else:
            # spawn: the server has threads running; a forked child would inherit their locks mid-flight.
            self._executor = ProcessPoolExecutor(max_workers=self.workers,
                                                 mp_context=multiprocessing.get_context("spawn"))
            for _ in range(self.workers):  # start the workers now, not on the first response
                self._executor.submit(os.getpid)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def response(self, plan: RoutingPlan, body: bytes) -> Decoded:
        return await self._run(decode_response, plan, body)

    async def chunk(self, plan: RoutingPlan, data: str, *, first: bool) -> Decoded:
        return await self._run(_decode_chunk, plan, data, first)

    async def worker_pids(self) -> list[int]:
        """The decoding processes (empty with ``workers=0``)."""
        if self.workers == 0:
            return []
        self.start()
        loop = asyncio.get_running_loop()
        return sorted({await loop.run_in_executor(self._executor, os.getpid) for _ in range(self.workers)})

    async def _run(self, function, *args) -> Decoded:  # type: ignore[no-untyped-def]
        if self._executor is None:
            self.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
        except BrokenProcessPool:
            # A worker died (killed, out of memory): this response is decoded here, the pool starts afresh.
            log.warning("a routing decoder process died; starting new ones")
            self.close()
            self.start()
            return await asyncio.to_thread(function, *args)


def _decode_chunk(plan: RoutingPlan, data: str, first: bool) -> Decoded:
    return decode_chunk(plan, data, first=first)
