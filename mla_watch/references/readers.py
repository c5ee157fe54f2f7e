"""How a reading of reference prompts is taken: through the model served here, or through the engine beside.

A :class:`ReferenceReader` has one abstract method, :meth:`ReferenceReader.read`: one set of reference
prompts through the routers serving now, scored (each prompt's loss) and routed (every router's counts).

* :class:`ModelReader` (the model this sidecar serves): a hook-free copy of the live model, taken under the
  model lock between two forward passes, reads the prompts in batches outside the request path; live windows
  never see them.
* :class:`EngineReader` (vLLM or SGLang beside): each prompt is one request to the engine (``prompt_logprobs``
  / ``return_logprob`` and ``max_tokens`` 1: one prefill, with the routing it chose), started at most ``rate``
  a second, a few at a time; the prompts are tokenized once per set by the engine's own ``/tokenize``.

Each reads a prompt up to its ``limit`` (the model's context here, ``--reference-max-tokens`` beside an
engine) and a set within its token budget (:mod:`mla_watch.references.budget`); the routing of expert routers is
counted by position too, where the model's context is known, so that a reading says which positions it reached.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mla_watch.quality.score import ModelScore
from mla_watch.references.budget import ReadPlan, plan_reading
from mla_watch.references.prompts import MAX_SET_TOKENS, ReferenceSet

__all__ = [
    "DEFAULT_ENGINE_PROMPT_TOKENS",
    "DEFAULT_MODEL_CONTEXT",
    "MAX_ENGINE_PROMPT_TOKENS",
    "EngineReader",
    "ModelReader",
    "ReadingAbandoned",
    "ReadingDeferred",
    "ReferenceReader",
    "model_context",
    "reference_batches",
]

DEFAULT_ENGINE_PROMPT_TOKENS = 8192  # --reference-max-tokens: a prompt's tokens read through an engine
# At most: the engine's answer to one prompt (a log-probability and every MoE layer's routing a token, ~0.8 KB on
# DeepSeek-V3) must fit the 64 MiB an answer may hold (engines/vllm_weights.py).
MAX_ENGINE_PROMPT_TOKENS = 65_536
DEFAULT_MODEL_CONTEXT = 4096  # a model whose config names no context length
YIELD_STEP_SECONDS = 0.5  # how often a reading waiting for clients looks again
BATCH_TOKENS = 16_384  # the positions of one batch of the model here: long prompts go a few at a time


class ReferenceReader(abc.ABC):
    """Reads reference prompts through the routers serving now."""

    where: str = "the model"  # for messages: "the model", "the vLLM engine at URL"
    limit: int = MAX_SET_TOKENS  # the tokens of a prompt read at most

    @abc.abstractmethod
    def read(self, reference: ReferenceSet) -> ModelScore:
        """``reference``'s prompts scored and routed by the routers serving now (blocks while it runs)."""

    def plan(self, reference: ReferenceSet) -> ReadPlan | None:
        """What :meth:`read` reads of ``reference`` (``None``: a reader that reads every prompt whole)."""
        return None


def model_context(model: Any) -> int:
    """The context length of a model loaded here: what the reference prompts are read up to."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return (
        context
        if isinstance(context, int) and not isinstance(context, bool) and context >= 2
        else DEFAULT_MODEL_CONTEXT
    )


def reference_batches(tokenizer: Any, reference: ReferenceSet, limit: int) -> list[Any]:
    """The prompts of ``reference`` read ``limit`` tokens a prompt at most, as batches for
    :func:`mla_watch.quality.local_model.score_model` (torch)."""
    return _batches(tokenizer, _plan(tokenizer, reference, limit))


def _plan(tokenizer: Any, reference: ReferenceSet, limit: int) -> ReadPlan:
    return plan_reading(reference, lambda texts: [_token_ids(tokenizer, text) for text in texts], limit)


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    try:  # a text longer than the model's context is cut after: transformers' warning about it says nothing here
        return list(tokenizer(text, verbose=False)["input_ids"])
    except TypeError:  # a tokenizer without the keyword
        return list(tokenizer(text)["input_ids"])


def _batches(tokenizer: Any, plan: ReadPlan) -> list[Any]:
    from mla_watch.quality.local_model import make_batches

    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    size = max(1, min(8, BATCH_TOKENS // max(plan.lengths, default=1)))
    return make_batches([list(ids) for ids in plan.ids], batch_size=size, pad_id=pad)


class ModelReader(ReferenceReader):
    """Reference prompts through a hook-free copy of the model served here (``model_lock``: held by the decode
    loop around each forward pass, so the copy holds the routers of one moment)."""

    where = "the model served here"

    def __init__(self, model: Any, tokenizer: Any, model_lock: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._lock = model_lock
        self.limit = model_context(model)  # a prompt up to the model's context
        self._plans: dict[str, tuple[ReadPlan, list[Any]]] = {}  # by the set's digest

    def _planned(self, reference: ReferenceSet) -> tuple[ReadPlan, list[Any]]:
        found = self._plans.get(reference.digest)
        if found is None:
            plan = _plan(self.tokenizer, reference, self.limit)
            found = self._plans[reference.digest] = (plan, _batches(self.tokenizer, plan))
        return found

    def plan(self, reference: ReferenceSet) -> ReadPlan:
        return self._planned(reference)[0]

    def batches(self, reference: ReferenceSet) -> list[Any]:
        return self._planned(reference)[1]

    def read(self, reference: ReferenceSet) -> ModelScore:
        import torch

        from mla_watch.quality.local_model import copy_without_hooks, score_model

        batches = self.batches(reference)
        with self._lock:
            copy = copy_without_hooks(self.model).eval()
        try:
            with torch.no_grad():
                return score_model(
                    copy, batches, business_line=reference.name, indexers=True, context_length=self.limit
                )
        finally:
            del copy


class ReadingAbandoned(RuntimeError):
    """A reading stopped before its end (:meth:`EngineReader.cancel`): the sidecar is stopping."""


class ReadingDeferred(RuntimeError):
    """A reading stopped early: clients have waited longer than usual for ``yield_seconds``; it resumes later."""


class EngineReader(ReferenceReader):
    """Reference prompts through the engine beside the sidecar (:class:`~mla_watch.engines.swap.EngineWeights`),
    started at ``rate`` prompts a second at most, ``concurrency`` at a time (one by default, sent from the reading
    thread: a reference prompt takes one slot of the engine's batch at most, so that clients come first).

    ``busy()`` (:meth:`~mla_watch.references.client_load.ClientLatency.busy`): while it is true no prompt of a reading
    under :meth:`yielding` is sent; after ``yield_seconds`` of it the reading stops with :class:`ReadingDeferred`, to
    be taken again later. A re-tune gate's reading does not yield: the candidate routers serve clients meanwhile."""

    def __init__(
        self,
        weights: Any,
        geometry: Any,
        *,
        rate: float,
        max_tokens: int = DEFAULT_ENGINE_PROMPT_TOKENS,
        concurrency: int = 1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        busy: Callable[[], bool] | None = None,
        yield_seconds: float = 30.0,
    ) -> None:
        if not rate > 0:
            raise ValueError(f"rate = {rate!r}: expected requests a second > 0")
        context = getattr(geometry, "context_length", None)
        # The engine generates one token after the prompt: a prompt fills its context but one position.
        self.limit = min(max_tokens, context - 1) if isinstance(context, int) and context > 2 else max_tokens
        self.weights = weights
        self.geometry = geometry
        self.rate = float(rate)
        self.concurrency = concurrency
        self.where = f"the {weights.name} engine at {getattr(weights, 'base_url', '?')}"
        self._clock = clock
        self._sleep = sleep
        self._next = 0.0
        self._plans: dict[str, ReadPlan] = {}  # by the set's digest
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self.busy = busy
        self._yields = threading.local()  # this thread's readings yield to clients (yielding())
        self.yield_seconds = yield_seconds
        self.yielded_seconds = 0.0  # waited for clients, in all
        self.deferred = 0  # readings stopped early for clients
        self.requests = 0  # sent to the engine, tokenizing included
        self.tokens = 0  # prompt tokens scored by the engine

    def cancel(self) -> None:
        """No request is sent from now on: a reading under way raises :class:`ReadingAbandoned` before its next."""
        self._cancelled.set()

    def _pace(self) -> None:
        if self._cancelled.is_set():
            raise ReadingAbandoned(f"the reading through {self.where} was abandoned: the sidecar is stopping")
        self._yield_to_clients()
        now = self._clock()
        if now < self._next:
            self._sleep(self._next - now)
        self._next = max(now, self._next) + 1.0 / self.rate
        self.requests += 1

    @contextlib.contextmanager
    def yielding(self) -> Iterator[None]:
        """Readings in this block, in this thread, yield to clients (see the class docstring)."""
        self._yields.on = True
        try:
            yield
        finally:
            self._yields.on = False

    def _yield_to_clients(self) -> None:
        """Wait while clients wait longer than usual; :class:`ReadingDeferred` after ``yield_seconds`` of it."""
        waited = 0.0
        while self.busy is not None and getattr(self._yields, "on", False) and self.busy():
            if waited >= self.yield_seconds:
                self.deferred += 1
                raise ReadingDeferred(f"clients of {self.where} waited longer than usual for {waited:.0f} s")
            if self._cancelled.is_set():
                raise ReadingAbandoned(f"the reading through {self.where} was abandoned: the sidecar is stopping")
            step = min(YIELD_STEP_SECONDS, self.yield_seconds - waited)
            self._sleep(step)
            waited += step
            self.yielded_seconds += step

    def _paced(self, call: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``call`` of each item, started at the pace, ``concurrency`` at a time; the results in order."""
        if self.concurrency == 1:  # in this thread: nothing else to wait for when the sidecar stops
            results = []
            for item in items:
                self._pace()
                results.append(call(item))
            return results
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="mla-watch-reference") as pool:
            futures = []
            for item in items:
                self._pace()
                futures.append(pool.submit(call, item))
            return [future.result() for future in futures]

    def plan(self, reference: ReferenceSet) -> ReadPlan:
        found = self._plans.get(reference.digest)
        if found is None:
            found = self._plans[reference.digest] = plan_reading(
                reference, lambda texts: self._paced(self.weights.tokenize, list(texts)), self.limit
            )
        return found

    def token_ids(self, reference: ReferenceSet) -> list[list[int]]:
        return [list(ids) for ids in self.plan(reference).ids]

    def read(self, reference: ReferenceSet) -> ModelScore:
        from mla_watch.quality.score import engine_score

        with self._lock:  # one reading at a time: the pace is the engine's, not one thread's
            ids = self.token_ids(reference)
            scores = [
                score for scored in self._paced(lambda sample: self.weights.score([sample]), ids) for score in scored
            ]
            self.tokens += sum(len(sample) for sample in ids)
            return engine_score(scores, self.geometry, positions=True)
