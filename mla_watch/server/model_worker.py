"""One model, one worker thread, a bounded queue in front of it.

Requests never touch the model from the event loop: each becomes a :class:`Job` queued for
the worker thread, which runs the decode loop under the probe's business-line attribution
and hands token events back to the waiting request through its event loop. A full queue is
refused at once (the server answers 429 with ``Retry-After``) instead of growing memory;
a job whose deadline passes, queued or running, ends with :class:`JobTimedOut`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mla_watch.routing.footprint import FootprintSampler

if TYPE_CHECKING:  # the sampler (torch) is imported where the embedded model generates, never beside an engine
    from mla_watch.policy.sampling import SamplingParams, TokenEvent

__all__ = ["GenerationFailed", "Job", "JobTimedOut", "ModelWorker", "Overloaded"]

log = logging.getLogger("mla_watch.model_worker")


class Overloaded(Exception):
    """The queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the model queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class JobTimedOut(Exception):
    """The request's deadline passed before its generation finished."""


class GenerationFailed(Exception):
    """The generation raised; the message says why."""


_DONE = object()


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    business_line: str
    deadline: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    prompt_tokens: int = 0
    record_routing: bool = False  # keep the expert ids of each pass (serve --return-routed-experts)
    routing: list[Any] | None = None  # then: per choice, [tokens, expert routers, top_k], set before the end
    client: str | None = None  # who sent it (mla_watch.routing.clients)

    def push(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    async def next_event(self) -> TokenEvent | None:
        """The next token event; ``None`` once the job is over. Raises what the job raised."""
        item = await self.events.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class ModelWorker:
    """Runs generation jobs for one model on one worker thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        probe: Any,
        *,
        max_queue: int = 32,
        clock: Callable[[], float] = time.monotonic,
        on_job_done: Callable[[Job, float], None] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.probe = probe
        self._clock = clock
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_job_done = on_job_done
        # Called with (business_line, prompt + first choice's token ids, prompt length, client) after each finished
        # job, e.g. to record traffic for router re-tuning; set by the owner.
        self.capture: Callable[[str, list[int], int, str | None], None] | None = None
        self._busy = threading.Event()
        # The expert footprint of a batch (routing/footprint.py): every `footprint_every`-th job's routing per token
        # is recorded and its decode tokens kept; set by the owner.
        self.footprint: FootprintSampler | None = None
        self.footprint_every = 4
        self._jobs_run = 0
        # Held around each forward pass: a router promotion takes it to swap tensors between two passes.
        self.model_lock = threading.Lock()
        self._recent_seconds = 1.0
        self._collected_at = float("-inf")
        self.collect_interval = 0.25
        self._thread = threading.Thread(target=self._work, name="mla-watch-model", daemon=True)
        self._thread.start()

    def _sample_footprint(self, job: Job, rows: Any) -> None:
        """Keep the job's decode tokens' routing (its prompt's when it decoded nothing) for the footprint."""
        decoded = rows[job.prompt_tokens :]
        try:
            self.footprint.add(job.business_line, decoded if len(decoded) else rows)  # type: ignore[union-attr]
        except Exception:  # the footprint must never fail a request
            log.exception("keeping a request's routing for the batch footprint failed")

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + (1 if self._busy.is_set() else 0)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = max(1, round(self._recent_seconds * (self._queue.qsize() + 1)))
            raise Overloaded(retry_after=min(wait, 60)) from None

    def close(self, timeout: float = 30.0) -> None:
        """Finish the jobs already queued, then stop the worker."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                job.push(_DONE)
                continue
            if self._clock() > job.deadline:
                job.push(JobTimedOut("the request timed out while queued for the model"))
                continue
            self._busy.set()
            started = self._clock()
            try:
                self._run(job)
            finally:
                self._busy.clear()
                elapsed = self._clock() - started
                self._recent_seconds = 0.8 * self._recent_seconds + 0.2 * elapsed
                if self._on_job_done is not None:
                    self._on_job_done(job, elapsed)

    def _run(self, job: Job) -> None:
        from mla_watch.policy.sampling import GenerationCancelled, generate_stream

        def should_stop() -> bool:
            return job.cancelled.is_set() or self._clock() > job.deadline

        generated: list[int] = []
        sampled = self.footprint is not None and self._jobs_run % self.footprint_every == 0
        self._jobs_run += 1
        try:
            recording = self.probe.record_routing() if job.record_routing or sampled else contextlib.nullcontext()
            # Routing by position counts the prompt's tokens, each client's apart (mla_watch.routing.positions).
            with (
                self.probe.attribute(job.business_line, clients=job.client, prompt_tokens=len(job.prompt_ids)),
                recording as recorded,
            ):
                for event in generate_stream(
                    self.model,
                    self.tokenizer,
                    job.prompt_ids,
                    job.params,
                    should_stop=should_stop,
                    step_lock=self.model_lock,
                ):
                    if event.index == 0 and event.token_id is not None:
                        generated.append(event.token_id)
                    job.push(event)
            if recorded is not None and job.record_routing:
                job.routing = [recorded.rows(row) for row in range(job.params.n)]
            if recorded is not None and sampled:
                self._sample_footprint(job, recorded.rows(0))
            job.push(_DONE)
            if self.capture is not None:
                try:
                    self.capture(job.business_line, [*job.prompt_ids, *generated], len(job.prompt_ids), job.client)
                except Exception:  # recording traffic must never fail a request
                    log.exception("traffic capture failed")
        except GenerationCancelled:
            if job.cancelled.is_set():
                job.push(_DONE)
            else:
                job.push(JobTimedOut("the request timed out during generation"))
        except Exception as error:  # the worker must survive whatever one request does
            log.exception("generation failed")
            job.push(GenerationFailed(f"generation failed: {type(error).__name__}: {error}"))
        finally:
            # Reading the counters costs a host copy; between requests that follow each other
            # closely once per collect_interval is enough (readers of /v1/routing collect too).
            if self._clock() - self._collected_at >= self.collect_interval:
                self.probe.collect()
                self._collected_at = self._clock()
