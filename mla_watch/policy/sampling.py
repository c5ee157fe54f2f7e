"""Our own sampler: pure logits processors and a streaming, KV-cached decode loop.

The server enforces per-business-line sampling policies and must be able to show that the values it
reports as *applied* are the values the sampler really uses: with a fixed seed, a request whose
parameters were clamped generates exactly what a request made with the clamped values does.  So the
sampler is owned here rather than hidden inside ``model.generate``:

* :class:`SamplingParams` (:class:`~mla_watch.sampling_params.SamplingValues`, whose defaults and limits
  come from the table of sampling parameters) validates a request's sampling values (frozen, so the
  applied values cannot drift after validation).
* :class:`RepetitionPenalty`, :class:`Temperature`, :class:`TopK` and :class:`TopP` are pure logits
  processors that compute exactly what their ``transformers.generation.logits_process`` counterparts
  compute (``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
  ``TopPLogitsWarper``), but never modify their inputs.
* :func:`build_processors`, :func:`apply_processors` and :func:`choose_next` turn parameters into a
  next-token choice; randomness comes only from an explicit :class:`torch.Generator`.
* :func:`generate_stream` runs the ``n`` choices of a request as one batch of identical prompt rows
  over the model's own KV cache and yields :class:`TokenEvent` text deltas, honouring EOS, stop
  strings, ``max_tokens``, a seed and cancellation (:class:`GenerationCancelled`);
  :func:`generate` drains it into a :class:`GenerationResult`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_watch.common.values import is_integer, is_number
from mla_watch.policy.params import GREEDY_BELOW, SamplingValues

__all__ = [
    "GREEDY_BELOW",
    "GenerationCancelled",
    "GenerationResult",
    "LogitsProcessor",
    "RepetitionPenalty",
    "SamplingParams",
    "SamplingValues",
    "Temperature",
    "TokenEvent",
    "TopK",
    "TopP",
    "apply_processors",
    "build_processors",
    "choose_next",
    "generate",
    "generate_stream",
]

_REPLACEMENT_CHAR = "\ufffd"

SamplingParams = SamplingValues
"""The sampler's name for :class:`~mla_watch.sampling_params.SamplingValues` (defaults and limits from
:data:`~mla_watch.sampling_params.SAMPLING_PARAMS`)."""


# --------------------------------------------------------------------------------------------------
# Logits processors
# --------------------------------------------------------------------------------------------------


class LogitsProcessor(ABC):
    """A pure transformation of next-token scores.

    ``input_ids`` is ``(batch, seq_len)`` (prompt plus generated tokens so far), ``scores`` is
    ``(batch, vocab)``.  Implementations return a new tensor and never modify their inputs.
    """

    @abstractmethod
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Return processed scores (a new tensor)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class RepetitionPenalty(LogitsProcessor):
    """CTRL-style repetition penalty, identical to ``RepetitionPenaltyLogitsProcessor``.

    For every token id present in ``input_ids`` (each row separately), a positive score is divided by
    ``penalty`` and a negative score multiplied by it.  Ids outside the score vocabulary are ignored.
    """

    def __init__(self, penalty: float) -> None:
        if not is_number(penalty, finite=True) or penalty <= 0:
            raise ValueError(f"penalty={penalty!r} is invalid: expected a finite number > 0")
        self.penalty = float(penalty)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(1)
        vocab_size = scores.shape[-1]
        ids = input_ids.to(scores.device).clamp(max=vocab_size)  # out-of-vocab ids -> padding slot
        padded = torch.nn.functional.pad(scores, (0, 1))
        seen = torch.gather(padded, 1, ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return padded.scatter(1, ids, seen)[..., :vocab_size]


class Temperature(LogitsProcessor):
    """Divide scores by ``temperature`` (> 0), identical to ``TemperatureLogitsWarper``."""

    def __init__(self, temperature: float) -> None:
        if not is_number(temperature, finite=True) or temperature <= 0:
            raise ValueError(f"temperature={temperature!r} is invalid: expected a finite number > 0")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopK(LogitsProcessor):
    """Keep the ``top_k`` highest scores (ties with the k-th kept), identical to ``TopKLogitsWarper``."""

    def __init__(self, top_k: int, filter_value: float = -math.inf, min_tokens_to_keep: int = 1) -> None:
        if not is_integer(top_k) or top_k <= 0:
            raise ValueError(f"top_k={top_k!r} is invalid: expected an integer >= 1")
        if not is_integer(min_tokens_to_keep) or min_tokens_to_keep < 1:
            raise ValueError(f"min_tokens_to_keep={min_tokens_to_keep!r} is invalid: expected an integer >= 1")
        self.top_k = max(int(top_k), int(min_tokens_to_keep))
        self.filter_value = float(filter_value)
        self.min_tokens_to_keep = int(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.size(-1))
        kth = torch.topk(scores, k)[0][..., -1, None]
        return scores.masked_fill(scores < kth, self.filter_value)


class TopP(LogitsProcessor):
    """Nucleus filtering, identical to ``TopPLogitsWarper``: keep the smallest set of most likely
    tokens whose probabilities add up to at least ``top_p`` (and at least ``min_tokens_to_keep``)."""

    def __init__(self, top_p: float, filter_value: float = -math.inf, min_tokens_to_keep: int = 1) -> None:
        if not is_number(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p!r} is invalid: expected a number in (0, 1]")
        if not is_integer(min_tokens_to_keep) or min_tokens_to_keep < 1:
            raise ValueError(f"min_tokens_to_keep={min_tokens_to_keep!r} is invalid: expected an integer >= 1")
        self.top_p = float(top_p)
        self.filter_value = float(filter_value)
        self.min_tokens_to_keep = int(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - self.top_p)
        sorted_remove[..., -self.min_tokens_to_keep :] = False
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        return scores.masked_fill(remove, self.filter_value)


def build_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors for ``params`` in application order: repetition penalty, temperature, top-k,
    top-p.  No-ops are skipped: penalty 1.0, temperature 1.0 or greedy (0), top_k 0, top_p 1.0."""
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty))
    if not params.greedy and params.temperature != 1.0:
        processors.append(Temperature(params.temperature))
    if params.top_k > 0:
        processors.append(TopK(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopP(params.top_p))
    return processors


def apply_processors(
    processors: Sequence[LogitsProcessor], input_ids: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """Apply ``processors`` in order; the inputs are not modified."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def choose_next(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of ``scores`` ``(batch, vocab)``; returns ``(batch,)`` token ids.

    Greedy (``temperature == 0``) takes the argmax; otherwise one draw from ``softmax(scores)`` with
    ``torch.multinomial`` using ``generator`` (never the global RNG when a generator is given).
    """
    if params.greedy:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------------------------------
# Decode loop
# --------------------------------------------------------------------------------------------------


class GenerationCancelled(Exception):
    """Raised by :func:`generate_stream` when ``should_stop()`` returned True before generation ended."""


@dataclass(frozen=True)
class TokenEvent:
    """One streamed event of choice ``index``.

    Every generated token yields an event with its ``token_id`` and the text delta it released (``""``
    while an incomplete UTF-8 character or a possible stop-string prefix is held back, and for EOS).
    The last event of a choice has ``token_id=None``, the remaining text and ``finish_reason`` set to
    ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens`` reached).
    """

    index: int
    token_id: int | None
    text: str
    finish_reason: str | None


@dataclass
class GenerationResult:
    """The drained outcome of a request: one text, finish reason and completion-token count per choice."""

    texts: list[str]
    finish_reasons: list[str]
    prompt_tokens: int
    completion_tokens: list[int] = field(default_factory=list)


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _forward_kwargs(model: Any) -> tuple[str, bool]:
    """Name of the cache keyword (``cache`` in transformers >= 5.x, else ``past_key_values``) and
    whether ``logits_to_keep`` is accepted."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return "past_key_values", False
    cache_kw = "cache" if "cache" in names else "past_key_values"
    return cache_kw, "logits_to_keep" in names


def _output_cache(outputs: Any) -> Any:
    cache = getattr(outputs, "cache", None)
    if cache is None:
        cache = getattr(outputs, "past_key_values", None)
    if cache is None:
        raise RuntimeError("the model returned no KV cache although use_cache=True was passed")
    return cache


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset({eos})
    return frozenset(int(e) for e in eos)


def _held_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for j in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:j]):
                longest = j
                break
    return longest


class _Row:
    """Text state of one choice."""

    __slots__ = ("emitted", "finished", "ids")

    def __init__(self) -> None:
        self.ids: list[int] = []  # generated ids that carry text (EOS excluded)
        self.emitted = ""  # text already released as deltas
        self.finished = False

    def _delta(self, text: str) -> str:
        # Normally ``text`` extends what was emitted; if a tokenizer rewrote earlier text, the
        # released text stays authoritative and only the part beyond it is released.
        delta = text[len(self.emitted) :]
        self.emitted += delta
        return delta

    def step(self, text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
        """Release the safe part of ``text``; returns ``(delta, stop_string_found)``."""
        if stops:
            cut = min((i for i in (text.find(s, 0) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                return self._delta(text[:cut]), True
        safe = text.rstrip(_REPLACEMENT_CHAR)
        if stops:
            safe = safe[: len(safe) - _held_stop_prefix(safe, stops)]
        if len(safe) <= len(self.emitted):
            return "", False
        return self._delta(safe), False

    def flush(self, text: str) -> str:
        return self._delta(text)


def generate_stream(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    on_forward: Callable[[], None] | None = None,
    step_lock: AbstractContextManager[Any] | None = None,
) -> Iterator[TokenEvent]:
    """Stream the ``params.n`` choices for ``prompt_ids`` as :class:`TokenEvent` objects.

    Arguments are checked when this is called (a ``ValueError`` is raised before any iteration), in
    particular ``len(prompt_ids) + params.max_tokens`` against ``model.config.max_position_embeddings``.
    The choices run as one batch of identical prompt rows: one prefill forward, then one token per row
    per forward over the model's KV cache; ``on_forward`` is called after every forward pass and
    ``should_stop`` before each, raising :class:`GenerationCancelled` when it returns True.  Finished
    rows keep being fed (the batch stays rectangular) but emit nothing more.  Sampling uses one
    ``torch.Generator`` on the model's device, seeded with ``params.seed`` or a fresh random seed;
    the global RNG is never used.  ``step_lock`` is held around each forward pass, so that whoever
    takes it (a router promotion) changes weights only between two passes of this generation.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty: expected at least one prompt token")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and len(prompt) + params.max_tokens > limit:
        raise ValueError(
            f"prompt length {len(prompt)} + max_tokens {params.max_tokens} = {len(prompt) + params.max_tokens} "
            f"exceeds the model's max_position_embeddings limit of {limit}"
        )
    return _decode(model, tokenizer, prompt, params, should_stop, on_forward, step_lock or contextlib.nullcontext())


def _decode(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    params: SamplingParams,
    should_stop: Callable[[], bool],
    on_forward: Callable[[], None] | None,
    step_lock: AbstractContextManager[Any],
) -> Iterator[TokenEvent]:
    device = _model_device(model)
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    processors = build_processors(params)
    eos_ids = _eos_ids(tokenizer)
    stops = params.stop
    cache_kw, keep_kw = _forward_kwargs(model)
    n = params.n
    rows = [_Row() for _ in range(n)]
    counts = [0] * n

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    with torch.inference_mode():
        all_ids = torch.tensor([prompt] * n, dtype=torch.long, device=device)
        attention_mask = torch.ones_like(all_ids)
        step_input = all_ids
        cache: Any = None
        while True:
            if should_stop():
                raise GenerationCancelled(f"generation cancelled after {max(counts)} of {params.max_tokens} tokens")
            kwargs: dict[str, Any] = {"input_ids": step_input, "attention_mask": attention_mask, "use_cache": True}
            if cache is not None:
                kwargs[cache_kw] = cache
            if keep_kw:
                kwargs["logits_to_keep"] = 1
            with step_lock:
                outputs = model(**kwargs)
            if on_forward is not None:
                on_forward()
            cache = _output_cache(outputs)
            scores = outputs.logits[:, -1, :].float()
            scores = apply_processors(processors, all_ids, scores)
            next_tokens = choose_next(scores, params, generator)
            all_ids = torch.cat([all_ids, next_tokens[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((n, 1))], dim=1)
            step_input = next_tokens[:, None]

            for i, token in enumerate(next_tokens.tolist()):
                row = rows[i]
                if row.finished:
                    continue
                counts[i] += 1
                reason: str | None = None
                if token in eos_ids:
                    yield TokenEvent(i, token, "", None)
                    reason = "stop"
                    final = row.flush(decode(row.ids))
                else:
                    row.ids.append(token)
                    text = decode(row.ids)
                    delta, hit_stop = row.step(text, stops)
                    yield TokenEvent(i, token, delta, None)
                    if hit_stop:
                        reason, final = "stop", ""
                    elif counts[i] >= params.max_tokens:
                        reason, final = "length", row.flush(text)
                if reason is not None:
                    row.finished = True
                    yield TokenEvent(i, None, final, reason)
            if all(row.finished for row in rows):
                return


def generate(
    model: Any, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, **kwargs: Any
) -> GenerationResult:
    """Run :func:`generate_stream` to the end and collect the choices' texts, finish reasons and counts."""
    prompt = list(prompt_ids)
    texts = [""] * params.n
    reasons = [""] * params.n
    counts = [0] * params.n
    for event in generate_stream(model, tokenizer, prompt, params, **kwargs):
        texts[event.index] += event.text
        if event.token_id is not None:
            counts[event.index] += 1
        if event.finish_reason is not None:
            reasons[event.index] = event.finish_reason
    return GenerationResult(texts=texts, finish_reasons=reasons, prompt_tokens=len(prompt), completion_tokens=counts)
