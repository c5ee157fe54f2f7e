"""How a reading of reference prompts is taken: through the model served here, or through the engine beside.

A :class:`ReferenceReader` has one abstract method, :meth:`ReferenceReader.read`: one set of reference
prompts through the routers serving now, scored (each prompt's loss) and routed (every router's counts).

* :class:`ModelReader` (the model this sidecar serves): a hook-free copy of the live model, taken under the
  model lock between two forward passes, reads the prompts in batches outside the request path; live windows
  never see them.
* :class:`EngineReader` (vLLM or SGLang beside): each prompt is one request to the engine (``prompt_logprobs``
  / ``return_logprob`` and ``max_tokens`` 1: one prefill, with the routing it chose), started at most ``rate``
  a second, a few at a time; the prompts are tokenized once per set by the engine's own ``/tokenize``.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mla_watch.cause.prompts import ReferenceSet
from mla_watch.quality.score import ModelScore

__all__ = ["EngineReader", "ModelReader", "ReferenceReader", "reference_batches"]

MAX_PROMPT_TOKENS = 256  # a prompt's tokens read (the shipped prompts are shorter); bounds a reading's cost


class ReferenceReader(abc.ABC):
    """Reads reference prompts through the routers serving now."""

    where: str = "the model"  # for messages: "the model", "the vLLM engine at URL"

    @abc.abstractmethod
    def read(self, reference: ReferenceSet) -> ModelScore:
        """``reference``'s prompts scored and routed by the routers serving now (blocks while it runs)."""


def reference_batches(tokenizer: Any, reference: ReferenceSet, max_tokens: int = MAX_PROMPT_TOKENS) -> list[Any]:
    """The prompts of ``reference`` as batches for :func:`mla_watch.quality.local_model.score_model` (torch)."""
    from mla_watch.quality.local_model import make_batches

    ids = [tokenizer(text)["input_ids"][:max_tokens] for text in reference.prompts]
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    return make_batches([sample for sample in ids if len(sample) >= 2], batch_size=8, pad_id=pad,
                        max_tokens=max_tokens)


class ModelReader(ReferenceReader):
    """Reference prompts through a hook-free copy of the model served here (``model_lock``: held by the decode
    loop around each forward pass, so the copy holds the routers of one moment)."""

    where = "the model served here"

    def __init__(self, model: Any, tokenizer: Any, model_lock: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._lock = model_lock
        self._batches: dict[str, list[Any]] = {}  # by the set's digest

    def batches(self, reference: ReferenceSet) -> list[Any]:
        batches = self._batches.get(reference.digest)
        if batches is None:
            batches = self._batches[reference.digest] = reference_batches(self.tokenizer, reference)
        return batches

    def read(self, reference: ReferenceSet) -> ModelScore:
        import torch

        from mla_watch.quality.local_model import copy_without_hooks, score_model

        batches = self.batches(reference)
        with self._lock:
            copy = copy_without_hooks(self.model).eval()
        try:
            with torch.no_grad():
                return score_model(copy, batches, business_line=reference.name, indexers=True)
        finally:
            del copy


class EngineReader(ReferenceReader):
    """Reference prompts through the engine beside the sidecar (:class:`~mla_watch.engines.swap.EngineWeights`),
    started at ``rate`` prompts a second at most, ``concurrency`` at a time (the engine batches them): it serves
    clients first."""

    def __init__(self, weights: Any, geometry: Any, *, rate: float, concurrency: int = 4,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate > 0:
            raise ValueError(f"rate = {rate!r}: expected requests a second > 0")
        self.weights = weights
        self.geometry = geometry
        self.rate = float(rate)
        self.concurrency = concurrency
        self.where = f"the {weights.name} engine at {getattr(weights, 'base_url', '?')}"
        self._clock = clock
        self._sleep = sleep
        self._next = 0.0
        self._ids: dict[str, list[list[int]]] = {}  # by the set's digest
        self._lock = threading.Lock()
        self.requests = 0  # sent to the engine, tokenizing included
        self.tokens = 0  # prompt tokens scored by the engine

    def _pace(self) -> None:
        now = self._clock()
        if now < self._next:
            self._sleep(self._next - now)
        self._next = max(now, self._next) + 1.0 / self.rate
        self.requests += 1

    def _paced(self, call: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``call`` of each item, started at the pace, ``concurrency`` at a time; the results in order."""
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="mla-watch-reference") as pool:
            futures = []
            for item in items:
                self._pace()
                futures.append(pool.submit(call, item))
            return [future.result() for future in futures]

    def token_ids(self, reference: ReferenceSet) -> list[list[int]]:
        ids = self._ids.get(reference.digest)
        if ids is None:
            ids = [tokens[:MAX_PROMPT_TOKENS] for tokens in self._paced(self.weights.tokenize, list(reference.prompts))]
            self._ids[reference.digest] = ids
        return ids

    def read(self, reference: ReferenceSet) -> ModelScore:
        from mla_watch.quality.score import engine_score

        with self._lock:  # one reading at a time: the pace is the engine's, not one thread's
            ids = self.token_ids(reference)
            scores = [score for scored in self._paced(lambda sample: self.weights.score([sample]), ids)
                      for score in scored]
            self.tokens += sum(len(sample) for sample in ids)
            return engine_score(scores, self.geometry)
