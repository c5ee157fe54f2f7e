"""Decoding engine routing off the event loop: in worker processes, so that a large response holds no GIL here.

A 2,000-token DeepSeek-V3 response carries about a million expert ids (5 MB of base64 in
SGLang's field). Parsing and counting that in a thread would still hold the GIL, and so the
event loop, for milliseconds. A large body goes to the worker as a file in a private directory
(tmpfs where there is one): one write, instead of a pipe's many 64 KB writes, each of which
makes the writing thread take the GIL back from the event loop.

The processes follow the load: none is started before there is something to decode; another is
started while every one is busy, up to ``workers``; all of them stop once none has had work for
``idle_seconds``, and the next answer starts one again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from mla_watch.engines.formats import DataError, Decoded, RoutingPlan, count_response, decode_chunk, decode_response

__all__ = ["FILE_HANDOFF_BYTES", "DecoderDied", "RoutingDecoder"]

log = logging.getLogger("mla_watch.engines")

FILE_HANDOFF_BYTES = 256 << 10  # bodies at least this large go to a worker process as a file
IDLE_SECONDS = 60.0  # a pool with no work for this long stops its processes


class RoutingDecoder:
    """Runs :func:`decode_response`, :func:`count_response` and :func:`decode_chunk` in up to ``workers``
    processes (0: one thread), started when there is work and stopped after ``idle_seconds`` without any."""

    def __init__(self, workers: int = 1, *, idle_seconds: float = IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 0:
            raise ValueError(f"--decode-workers {workers}: expected an integer >= 0")
        self.workers = workers
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._executor: Executor | None = None
        self._handoff: Path | None = None
        self._names = itertools.count()
        self.submitted = 0  # calls handed to the pool since it was made: what left the event loop's process
        self._busy = 0
        self._idle_since = clock()
        self._idle_check: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None

    @property
    def running(self) -> bool:
        """Whether the pool is up (processes, or the thread, may be running)."""
        return self._executor is not None

    def start(self) -> None:
        """Make the pool; its processes start as work arrives (``ProcessPoolExecutor`` spawns one whenever none
        is idle, up to ``workers``)."""
        if self._executor is not None:
            return
        if self.workers == 0:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mla-watch-decode")
            return
        if self._handoff is None:  # 0700: the files hold the engine's answers
            shm = Path("/dev/shm")
            self._handoff = Path(tempfile.mkdtemp(prefix="mla-watch-decode-",
                                                  dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
        # spawn: the server has threads running; a forked child would inherit their locks mid-flight.
        self._executor = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))

    def retire_idle(self) -> bool:
        """Stop the pool's processes if none has had work for ``idle_seconds``; whether they were stopped."""
        if self._executor is None or self._busy or self._clock() - self._idle_since < self.idle_seconds:
            return False
        log.debug("routing decoder idle for %g s: stopping its processes", self.idle_seconds)
        self._executor.shutdown(wait=False)
        self._executor = None
        return True

    def close(self) -> None:
        if self._idle_check is not None:
            self._idle_check[1].cancel()
            self._idle_check = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._handoff is not None:
            shutil.rmtree(self._handoff, ignore_errors=True)
            self._handoff = None

    async def response(self, plan: RoutingPlan, body: bytes) -> Decoded:
        if self.workers and len(body) >= FILE_HANDOFF_BYTES:
            return await self._via_file(body, _decode_response_file, plan)
        return await self._run(decode_response, plan, body)

    async def count(self, plan: RoutingPlan, body: bytes) -> Decoded:
        """:func:`count_response`: the routing of an answer (or a stream chunk) the client already has."""
        if self.workers and len(body) >= FILE_HANDOFF_BYTES:
            return await self._via_file(body, _count_response_file, plan)
        return await self._run(count_response, plan, body)

    async def chunk(self, plan: RoutingPlan, data: str, *, first: bool) -> Decoded:
        if self.workers and len(data) >= FILE_HANDOFF_BYTES:
            return await self._via_file(data.encode(), _decode_chunk_file, plan, first)
        return await self._run(_decode_chunk, plan, data, first)

    async def offload(self, function: Callable[..., Any], data: bytes, *args: Any) -> Any:
        """``function(data, *args)`` in a decoding process (a module-level function: it travels by name).
        Raises :class:`DecoderDied` where the process died doing it."""
        if self.workers and len(data) >= FILE_HANDOFF_BYTES:
            self.start()
            path = self._handoff / f"{os.getpid()}-{next(self._names)}"
            try:
                await asyncio.to_thread(_write_private, path, data)
                return await self._run(_call_on_file, function, str(path), *args, died=_raise_died)
            finally:
                path.unlink(missing_ok=True)
        return await self._run(function, data, *args, died=_raise_died)

    async def worker_pids(self) -> list[int]:
        """The decoding processes running, one started if none was (empty with ``workers=0``)."""
        if self.workers == 0:
            return []
        await self._run(os.getpid)
        return sorted(self._executor._processes)  # type: ignore[union-attr]  # the pool's own record of them

    async def _via_file(self, body: bytes, function, plan: RoutingPlan, *args) -> Decoded:  # type: ignore[no-untyped-def]
        self.start()
        path = self._handoff / f"{os.getpid()}-{next(self._names)}"
        try:
            await asyncio.to_thread(_write_private, path, body)
            return await self._run(function, plan, str(path), *args)
        finally:
            path.unlink(missing_ok=True)  # the worker removes it first; this covers a worker that died

    async def _run(self, function, *args, died: Callable[[], Any] | None = None) -> Any:  # type: ignore[no-untyped-def]
        """``function(*args)`` in a worker. A worker that dies holding this answer (killed, out of memory)
        is replaced and the answer is a ``decoder`` data error: it is never decoded again, least of all
        here, where it would move the worker's memory into the server."""
        if self._executor is None:
            self.start()
        loop = asyncio.get_running_loop()
        self._busy += 1
        try:
            try:
                future = loop.run_in_executor(self._executor, function, *args)
            except BrokenProcessPool:  # broken before this answer reached it: not the answer's doing
                self._restart()
                future = loop.run_in_executor(self._executor, function, *args)
            self.submitted += 1
            try:
                return await future
            except BrokenProcessPool:
                log.warning("a routing decoder process died while decoding an engine answer; starting new ones, "
                            "and that answer's routing is not counted")
                self._restart()
                if died is not None:
                    return died()
                return Decoded(None, error=DataError("decoder", "the process decoding this answer died (killed, or "
                                                                "out of memory); its routing is not counted"))
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle_since = self._clock()
                self._check_idle_later(loop, self.idle_seconds)

    def _check_idle_later(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        """One pending check at a time, on the running loop (a check left on a closed loop never runs)."""
        if self._idle_check is not None and self._idle_check[0] is loop:
            return
        self._idle_check = (loop, loop.call_later(delay, self._idle_check_due))

    def _idle_check_due(self) -> None:
        loop, _ = self._idle_check  # type: ignore[misc]
        self._idle_check = None
        if self._executor is None or self._busy:  # a pool at work checks again when it is idle
            return
        if not self.retire_idle():
            self._check_idle_later(loop, max(0.0, self.idle_seconds - (self._clock() - self._idle_since)))

    def _restart(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self.start()


class DecoderDied(RuntimeError):
    """The decoding process died while running an :meth:`RoutingDecoder.offload` call."""


def _raise_died() -> Any:
    raise DecoderDied("the decoding process died (killed, or out of memory)")


def _call_on_file(function: Callable[..., Any], path: str, *args: Any) -> Any:
    return function(_take_file(path), *args)


def _write_private(path: Path, body: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(body)


def _take_file(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    finally:
        os.unlink(path)


def _decode_response_file(plan: RoutingPlan, path: str) -> Decoded:
    return decode_response(plan, _take_file(path))


def _count_response_file(plan: RoutingPlan, path: str) -> Decoded:
    return count_response(plan, _take_file(path))


def _decode_chunk_file(plan: RoutingPlan, path: str, first: bool) -> Decoded:
    return decode_chunk(plan, _take_file(path).decode(), first=first)


def _decode_chunk(plan: RoutingPlan, data: str, first: bool) -> Decoded:
    return decode_chunk(plan, data, first=first)
