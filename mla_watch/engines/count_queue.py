"""Counting engine routing after the client has its answer: a bounded queue, decoded in worker processes.

Beside vLLM or SGLang the proxy cuts the routing out of an answer on the event loop (a search
for its base64 strings, no decoding: :func:`mla_watch.engines.formats.strip_response`), answers
the client, and only then queues the answer here. Consumers hand it to the decoding processes and
count what they return per business line. The queue holds at most ``max_jobs`` answers and
``max_bytes`` of them (one answer is always admitted into an empty queue: it fits
``--upstream-max-bytes``); an answer that finds it full is not counted, and is counted as dropped.
When it drains after at least ``release_after_bytes`` of answers, the C heap's free pages go back to
the system (:mod:`mla_watch.common.heap`): a burst does not stay resident once it is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mla_watch.common import heap
from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.formats import Decoded, RoutingPlan
from mla_watch.engines.watch import EngineRouting

__all__ = ["COUNT_QUEUE_BYTES", "COUNT_QUEUE_JOBS", "DROP_REASONS", "Capture", "CountQueue"]

log = logging.getLogger("mla_watch.engines")

COUNT_QUEUE_JOBS = 1024
COUNT_QUEUE_BYTES = 256 << 20  # 200 DeepSeek-V3 answers of 2,000 tokens in vLLM's format
# Why an answer's routing was not counted (mla_watch_engine_count_dropped_total{reason}).
DROP_REASONS = ("queue_full", "shutdown")
SHUTDOWN_DRAIN_SECONDS = 2.0
# Once this much has passed through the queue, its draining returns the heap's free pages to the system
# (mla_watch.common.heap): often enough that a burst does not stay resident, seldom enough to cost nothing.
RELEASE_AFTER_BYTES = 64 << 20
# (business line, [(prompt + completion ids, prompt length), ...], client): one answer's choices, to capture
Capture = Callable[[str, list[tuple[list[int], int]], str | None], None]


@dataclass(frozen=True)
class _Job:
    business_line: str
    plan: RoutingPlan
    body: bytes
    streamed: bool
    client: str | None = None


class CountQueue:
    """Answers whose routing is still to be counted, and the tasks that count them.

    Once the queue drains after ``release_after_bytes`` of answers, ``release`` returns the heap's free pages to the
    system (:func:`mla_watch.common.heap.release_free_memory`)."""

    def __init__(
        self,
        routing: EngineRouting,
        decoder: RoutingDecoder,
        *,
        max_jobs: int = COUNT_QUEUE_JOBS,
        max_bytes: int = COUNT_QUEUE_BYTES,
        capture: Capture | None = None,
        release_after_bytes: int = RELEASE_AFTER_BYTES,
        release: Callable[[], bool] = heap.release_free_memory,
    ) -> None:
        self.routing = routing
        self.capture = capture  # where the token ids of answers asked for them go (serve --capture)
        self._decoder = decoder
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self._jobs: deque[_Job] = deque()
        self._bytes = 0
        self._ready: asyncio.Event | None = None
        self._consumers: list[asyncio.Task[None]] = []
        self._in_flight = 0
        self.release_after_bytes = release_after_bytes
        self._release = release
        self._passed = 0  # bytes of answers counted since the heap's free pages were last returned

    @property
    def queued(self) -> int:
        """Answers waiting, and being counted."""
        return len(self._jobs) + self._in_flight

    def submit(
        self, business_line: str, plan: RoutingPlan, body: bytes, *, streamed: bool, client: str | None = None
    ) -> bool:
        """Queue one answer (on the event loop; never waits). False: the queue was full, the answer is dropped."""
        if self._jobs and (len(self._jobs) >= self.max_jobs or self._bytes + len(body) > self.max_bytes):
            self._dropped("queue_full")
            return False
        self._start()
        self._jobs.append(_Job(business_line, plan, body, streamed, client))
        self._bytes += len(body)
        self._ready.set()  # type: ignore[union-attr]
        return True

    async def count_replay(
        self, business_line: str, plan: RoutingPlan, bodies: list[bytes], client: str | None = None
    ) -> str:
        """Count the replays of one stream's choices as one streamed response; returns the outcome
        (:meth:`EngineRouting.count`'s)."""
        decodes = [await self._decoder.count(plan, body) for body in bodies]
        if any(decoded.not_json for decoded in decodes):
            raise ValueError("the engine's answer to a replay is not a JSON object")
        merged = next((decoded for decoded in decodes if decoded.error is not None), None)
        if merged is None and all(decoded.counts is not None for decoded in decodes):
            positioned = all(decoded.position_counts is not None for decoded in decodes)
            # every one counted (checked above), so no None; mypy also types the 0 of an empty sum, which a replay's
            # prompts never give
            merged = Decoded(
                None,
                counts=sum(decoded.counts for decoded in decodes),  # type: ignore[arg-type, misc]
                tokens=sum(decoded.tokens for decoded in decodes),
                position_counts=sum(
                    decoded.position_counts  # type: ignore[arg-type, misc]
                    for decoded in decodes
                )
                if positioned
                else None,
                prompt_tokens=plan.prompt_tokens if positioned else None,
                footprint_rows=[rows for decoded in decodes for rows in decoded.footprint_rows or ()],
            )
        return self.routing.count(business_line, merged, streamed=True, client=client)

    async def close(self, drain_seconds: float = SHUTDOWN_DRAIN_SECONDS) -> None:
        """Count what is queued for at most ``drain_seconds``; what is left is dropped (``shutdown``)."""
        if self._consumers:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained(), drain_seconds)
            for consumer in self._consumers:
                consumer.cancel()
            await asyncio.gather(*self._consumers, return_exceptions=True)
            self._consumers = []
        for _ in self._jobs:
            self._dropped("shutdown")
        self._jobs.clear()
        self._bytes = 0

    # ------------------------------------------------------------------ internals
    def _start(self) -> None:
        if self._consumers:
            return
        self._ready = asyncio.Event()
        # As many consumers as decoding processes: each waits on its own worker.
        for index in range(max(1, self._decoder.workers)):
            self._consumers.append(asyncio.create_task(self._consume(), name=f"mla-watch-count-{index}"))

    async def _consume(self) -> None:
        while True:
            while not self._jobs:
                self._ready.clear()  # type: ignore[union-attr]
                await self._ready.wait()  # type: ignore[union-attr]
            job = self._jobs.popleft()
            self._bytes -= len(job.body)
            self._in_flight += 1
            try:
                decoded = await self._decoder.count(job.plan, job.body)
                # An answer that was no JSON object carried no routing.
                self.routing.count(
                    job.business_line, None if decoded.not_json else decoded, streamed=job.streamed, client=job.client
                )
                if decoded.samples and self.capture is not None:  # SQLite: off the loop
                    await asyncio.to_thread(self.capture, job.business_line, decoded.samples, job.client)
            except asyncio.CancelledError:
                self._dropped("shutdown")
                raise
            except Exception:  # a consumer that stopped would stop all counting: log, go on
                log.exception("counting an engine answer's routing failed; it is not counted")
            finally:
                self._in_flight -= 1
                self._passed += len(job.body)
            if not self._jobs and not self._in_flight and self._passed >= self.release_after_bytes:
                self._passed = 0
                await asyncio.to_thread(self._release)

    async def _drained(self) -> None:
        while self._jobs or self._in_flight:
            await asyncio.sleep(0.02)

    def _dropped(self, reason: str) -> None:
        self.routing.metrics.count_dropped.labels(reason).inc()
