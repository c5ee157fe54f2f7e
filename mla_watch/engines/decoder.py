"""Decoding engine routing off the event loop: in worker processes, so that a large response holds no GIL here.

A 2,000-token DeepSeek-V3 response carries about a million expert ids (5 MB of base64 in
SGLang's field). Parsing and counting that in a thread would still hold the GIL, and so the
event loop, for milliseconds. A large body goes to the worker as a file in a private directory
(tmpfs where there is one): one write, instead of a pipe's many 64 KB writes, each of which
makes the writing thread take the GIL back from the event loop.

The processes follow the load: none runs before there is something to decode; another starts when
an answer finds every running one busy, up to ``workers``; each stops once it has had no work for
``idle_seconds``, and a later answer starts one again.
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
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.engines.formats import DataError, Decoded, RoutingPlan, count_response, decode_chunk, decode_response

__all__ = ["FILE_HANDOFF_BYTES", "DecoderDied", "RoutingDecoder"]

log = logging.getLogger("mla_watch.engines")

FILE_HANDOFF_BYTES = 256 << 10  # bodies at least this large go to a worker process as a file
IDLE_SECONDS = 60.0  # a decoding process without work for this long stops


class _Process:
    """One decoding process (a pool of one: how busy each process is stays known here) and its work in hand."""

    def __init__(self) -> None:
        # spawn: the server has threads running; a forked child would inherit their locks mid-flight.
        self.executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self.busy = 0
        self.idle_since = 0.0

    def stop(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class RoutingDecoder:
    """Runs :func:`decode_response`, :func:`count_response` and :func:`decode_chunk` in up to ``workers``
    processes (0: one thread). A process starts when an answer finds every running one busy, and stops
    after ``idle_seconds`` without work; none runs before the first answer that needs one."""

    def __init__(
        self, workers: int = 1, *, idle_seconds: float = IDLE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if workers < 0:
            raise SettingsError([SettingProblem("decode_workers", f"{workers}", "an integer >= 0")])
        self.workers = workers
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._processes: list[_Process] = []
        self._thread: ThreadPoolExecutor | None = None
        self._handoff: Path | None = None
        self._names = itertools.count()
        self.submitted = 0  # calls handed to a process (or the thread): what left the event loop
        self._idle_check: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None

    @property
    def running(self) -> bool:
        """Whether a decoding process (or the thread) is up."""
        return bool(self._processes) or self._thread is not None

    def start(self) -> None:
        """Ready to take work: the thread, or the private directory large answers travel through; processes
        start as work arrives."""
        if self.workers == 0:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mla-watch-decode")
            return
        if self._handoff is None:  # 0700: the files hold the engine's answers
            shm = Path("/dev/shm")
            self._handoff = Path(
                tempfile.mkdtemp(
                    prefix="mla-watch-decode-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None
                )
            )

    def retire_idle(self) -> int:
        """Stop the processes that have had no work for ``idle_seconds``; how many were stopped."""
        now = self._clock()
        idle = [
            process for process in self._processes if not process.busy and now - process.idle_since >= self.idle_seconds
        ]
        for process in idle:
            self._processes.remove(process)
            process.stop()
        if idle:
            log.debug("stopped %d routing decoder process(es) idle for %g s", len(idle), self.idle_seconds)
        return len(idle)

    def close(self) -> None:
        if self._idle_check is not None:
            self._idle_check[1].cancel()
            self._idle_check = None
        for process in self._processes:
            process.stop()
        self._processes.clear()
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
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

    async def chunk(self, plan: RoutingPlan, data: bytes | str, *, first: bool) -> Decoded:
        """One stream chunk's JSON; bytes are decoded as UTF-8 where the chunk is read (a long one's in a decoding
        process: decoding megabytes would hold the event loop)."""
        if isinstance(data, str):
            data = data.encode()
        if self.workers and len(data) >= FILE_HANDOFF_BYTES:
            return await self._via_file(data, _decode_chunk_file, plan, first)
        return await self._run(_decode_chunk, plan, data.decode("utf-8", "replace"), first)

    async def offload(self, function: Callable[..., Any], data: bytes, *args: Any) -> Any:
        """``function(data, *args)`` in a decoding process (a module-level function: it travels by name).
        Raises :class:`DecoderDied` where the process died doing it."""
        if self.workers and len(data) >= FILE_HANDOFF_BYTES:
            self.start()
            assert self._handoff is not None  # start() made it: workers > 0
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
        if not self._processes:
            await self._run(os.getpid)
        loop = asyncio.get_running_loop()
        return sorted(
            await asyncio.gather(*(loop.run_in_executor(process.executor, os.getpid) for process in self._processes))
        )

    async def _via_file(self, body: bytes, function: Callable[..., Any], plan: RoutingPlan, *args: Any) -> Decoded:
        self.start()
        assert self._handoff is not None  # start() made it: workers > 0
        path = self._handoff / f"{os.getpid()}-{next(self._names)}"
        try:
            await asyncio.to_thread(_write_private, path, body)
            return await self._run(function, plan, str(path), *args)
        finally:
            path.unlink(missing_ok=True)  # the worker removes it first; this covers a worker that died

    async def _run(self, function: Callable[..., Any], *args: Any, died: Callable[[], Any] | None = None) -> Any:
        """``function(*args)`` in a worker. A worker that dies holding this answer (killed, out of memory)
        is replaced and the answer is a ``decoder`` data error: it is never decoded again, least of all
        here, where it would move the worker's memory into the server."""
        loop = asyncio.get_running_loop()
        if self.workers == 0:
            self.start()
            self.submitted += 1
            return await loop.run_in_executor(self._thread, function, *args)
        process = self._process()
        try:
            future = loop.run_in_executor(process.executor, function, *args)
        except BrokenProcessPool:  # it died before this answer reached it: not the answer's doing
            self._forget(process)
            process = self._process()
            future = loop.run_in_executor(process.executor, function, *args)
        self.submitted += 1
        process.busy += 1
        try:
            return await future
        except BrokenProcessPool:
            log.warning(
                "a routing decoder process died while decoding an engine answer; the next answer starts a "
                "new one, and that answer's routing is not counted"
            )
            self._forget(process)
            if died is not None:
                return died()
            return Decoded(
                None,
                error=DataError(
                    "decoder",
                    "the process decoding this answer died (killed, or out of memory); its routing is not counted",
                ),
            )
        finally:
            process.busy -= 1
            if not process.busy:
                process.idle_since = self._clock()
                self._check_idle_later(loop, self.idle_seconds)

    def _process(self) -> _Process:
        """An idle process; else a new one, up to ``workers``; else the least busy (its work waits its turn)."""
        self.start()
        for process in reversed(self._processes):  # the most recently started first: the others may retire
            if not process.busy:
                return process
        if len(self._processes) < self.workers:
            self._processes.append(_Process())
            return self._processes[-1]
        return min(self._processes, key=lambda process: process.busy)

    def _forget(self, process: _Process) -> None:
        if process in self._processes:
            self._processes.remove(process)
            process.stop()

    def _check_idle_later(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        """One pending check at a time, on the running loop (a check left on a closed loop never runs)."""
        if self._idle_check is not None and self._idle_check[0] is loop:
            return
        self._idle_check = (loop, loop.call_later(delay, self._idle_check_due))

    def _idle_check_due(self) -> None:
        loop, _ = self._idle_check  # type: ignore[misc]
        self._idle_check = None
        self.retire_idle()
        waiting = [process.idle_since for process in self._processes if not process.busy]
        if waiting:  # the next to become due (a busy process checks again when its work is done)
            self._check_idle_later(loop, max(0.0, min(waiting) + self.idle_seconds - self._clock()))


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
    return decode_chunk(plan, _take_file(path).decode("utf-8", "replace"), first=first)


def _decode_chunk(plan: RoutingPlan, data: str, first: bool) -> Decoded:
    return decode_chunk(plan, data, first=first)
