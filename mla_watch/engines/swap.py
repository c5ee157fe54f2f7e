"""What mla_watch asks of an engine to repair a router in place: swap router tensors, score text.

An engine backend (vLLM's dev mode in :mod:`mla_watch.engines.vllm_weights`, SGLang's weight-update
endpoints in :mod:`mla_watch.engines.sglang_weights`) implements :class:`EngineWeights`:

* :meth:`EngineWeights.swap` loads the router tensors of a checkpoint directory the engine can
  read (written by :func:`mla_watch.engines.weights.write_router_checkpoint`) into the running
  engine, every other weight left as it is, with requests held while it happens;
* :meth:`EngineWeights.score` scores token ids with the live engine (the log-probability of
  every token given the ones before it), for the paired perplexity gate, and returns the
  routing the engine chose for those tokens where it returns any, for the band gate;
* :meth:`EngineWeights.tokenize` turns a text into the engine's token ids (``POST /tokenize``, the same
  shape in vLLM and SGLang), so that reference prompts written as text can be scored.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_integer

__all__ = [
    "ENGINE_MESSAGE_CHARS",
    "MAX_TOKENIZE_ANSWER_BYTES",
    "EngineWeights",
    "SampleScore",
    "SwapError",
    "SwapResult",
    "engine_said",
    "tokens_of_answer",
]

MAX_TOKENIZE_ANSWER_BYTES = 16 << 20  # a reference prompt's ids (its text cut at 16 characters a token, ~10 B an id)
ENGINE_MESSAGE_CHARS = 200  # of an engine's own message, in an error


def engine_said(message: object) -> str:
    """An engine's message as an error quotes it: its first :data:`ENGINE_MESSAGE_CHARS` characters (``""`` when it
    sent no text)."""
    if not isinstance(message, str):
        return ""
    return describe_value(message, ENGINE_MESSAGE_CHARS, form="text", ellipsis="")


class SwapError(RuntimeError):
    """The engine refused or failed a weight operation; the message names the endpoint, the status and why."""


@dataclass(frozen=True)
class SwapResult:
    """One swap into the running engine, timed."""

    weights_path: str
    paused_seconds: float  # requests held (queued, not dropped) from pause to resume
    reload_seconds: float  # the reload call itself
    detail: dict[str, Any] = field(default_factory=dict)  # JSON-able: what the engine answered

    def as_dict(self) -> dict[str, Any]:
        return {
            "weights_path": self.weights_path,
            "paused_seconds": round(self.paused_seconds, 4),
            "reload_seconds": round(self.reload_seconds, 4),
            **self.detail,
        }


@dataclass(frozen=True)
class SampleScore:
    """The live engine's score of one sample's first ``tokens + 1`` token ids."""

    loss: float  # summed next-token loss (nats, minus the summed log-probabilities) ...
    tokens: int  # ... over this many predicted tokens (every id but the first)
    routing: Any = None  # numpy int array [tokens + 1 or fewer, MoE layers, top_k] when the engine returned it


class EngineWeights(abc.ABC):
    """A running engine's router tensors and its scores (see the module docstring)."""

    name: str = "engine"

    @abc.abstractmethod
    def problem(self) -> str | None:
        """``None`` when the engine accepts weight swaps now; else why not, in one sentence (what to set)."""

    @abc.abstractmethod
    def swap(self, weights_path: Path) -> SwapResult:
        """Load the tensors in ``weights_path`` into the running engine; ``SwapError`` if it did not.

        Requests reaching the engine meanwhile wait and are served afterwards; the prefix cache is
        dropped, since cached keys and values were computed by the old routers.
        """

    # The request priority a scoring request carries (vLLM with --scheduling-policy priority); None: none sent.
    priority: int | None = None

    @abc.abstractmethod
    def score(self, samples: Sequence[Sequence[int]]) -> list[SampleScore]:
        """Each sample scored by the live engine, in order; ``SwapError`` if the engine cannot."""

    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids as the engine reads a prompt (special tokens added); ``SwapError`` if it cannot
        (an engine without a tokenizer endpoint: its reference prompts cannot be read, and causes are said to be
        undetermined)."""
        raise SwapError(f"the {self.name} engine cannot tokenize text here: its reference prompts cannot be read")


def tokens_of_answer(answer: Any, where: str) -> list[int]:
    """The ``tokens`` of a ``POST /tokenize`` answer (vLLM ``entrypoints/serve/tokenize/protocol.py``, SGLang
    ``entrypoints/openai/protocol.py`` ``TokenizeResponse``: ``{"tokens": [...], "count": n, ...}``)."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or len(tokens) < 2 or not all(is_integer(t) and t >= 0 for t in tokens):
        raise SwapError(f'{where}: expected {{"tokens": [token ids, at least 2]}}')
    return tokens
