"""The perplexity gate's statistics: is a candidate worse than the live model by more than a margin?

Both models score the same held-out samples, so the comparison is *paired*: per sample ``i``,
``d_i`` is the candidate's summed next-token loss minus the live model's (nats) over the same
``n_i`` scored tokens. Their ratio ``D = sum(d) / sum(n)`` is exactly ``log(ppl_candidate /
ppl_live)``. Its standard error is the ratio estimator's, ``sqrt(sum((d_i - D n_i)^2) / (m - 1)
/ m) / mean(n)`` over the ``m`` samples (the tokens of one sample are not independent; the
samples are), and the bounds are Student-t at the stated one-sided confidence. The margin is
one-sided too: a candidate may be better by any amount.

Three decisions, never two:

* ``pass``: the upper bound of ``D`` is within the margin: not worse than allowed, at that confidence;
* ``reject``: the lower bound of ``D`` is beyond the margin: worse than allowed, at that confidence;
* ``insufficient``: the held-out set has fewer scored tokens than ``min_tokens``, or fewer samples
  than ``min_samples``, or the interval straddles the margin: more data decides.

The samples must be distinct texts (:func:`mla_watch.retune.data.split_held_out` holds each out
once): the interval's width comes from the spread *between* samples, and copies of one text
would shrink it to nothing and turn four texts into false certainty. ``min_samples`` (8) keeps a
handful of texts, however long, from deciding: with fewer, one odd text moves the verdict.

A margin is absolute (``0.3``: the candidate's perplexity may exceed the live one's by 0.3) or
relative (``"2%"``). Relative is the default: a perplexity's scale depends on the model and the
data (the bundled model reads 2-3 on its corpus, 14 on chat prompts, ~100 on random tokens), so a
fixed 0.3 asks for 10 % on one and 0.3 % on another.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_number

__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_MARGIN",
    "DEFAULT_MIN_SAMPLES",
    "DEFAULT_MIN_TOKENS",
    "Decision",
    "PairedComparison",
    "PerplexityMargin",
    "compare_perplexity",
    "parse_confidence",
    "parse_margin",
]

Decision = Literal["pass", "reject", "insufficient"]

DEFAULT_MARGIN = "2%"
DEFAULT_CONFIDENCE = 0.95
# Scored held-out tokens below which no decision is taken. At the default margin and confidence,
# a per-token loss difference with the spread measured on the bundled model's captured prompts
# (bench/retune.py) needs a few hundred tokens to be decided either way.
DEFAULT_MIN_TOKENS = 400
DEFAULT_MIN_SAMPLES = 8  # distinct held-out texts below which no decision is taken

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class PerplexityMargin:
    """How much worse than the live model a candidate may be: ``value`` absolute, or relative (a fraction)."""

    value: float
    relative: bool

    def log_ratio_limit(self, live_perplexity: float) -> float:
        """The largest allowed ``log(ppl_candidate / ppl_live)``."""
        if self.relative:
            return math.log1p(self.value)
        return math.log1p(self.value / live_perplexity)

    def __str__(self) -> str:
        return f"{self.value * 100:g}%" if self.relative else f"{self.value:g}"


def parse_margin(value: object, where: str = "max_perplexity_increase") -> PerplexityMargin:
    """``0.3`` (absolute) or ``"2%"`` (relative); ``ValueError`` naming ``where``, the value and the forms."""
    if isinstance(value, PerplexityMargin):
        return value
    if is_number(value, finite=True) and value >= 0:
        return PerplexityMargin(float(value), relative=False)
    if isinstance(value, str):
        match = _PERCENT.match(value)
        if match and float(match.group(1)) <= 100:
            return PerplexityMargin(float(match.group(1)) / 100, relative=True)
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number) and number >= 0:
            return PerplexityMargin(number, relative=False)
    raise ValueError(
        f"{where} = {describe_value(value)}: expected an absolute perplexity increase (a number >= 0, "
        f'e.g. 0.3) or a relative one (a percentage up to 100%, e.g. "2%")'
    )


def parse_confidence(value: object, where: str = "gate_confidence") -> float:
    if not is_number(value, finite=True) or not 0.5 <= value < 1:
        raise ValueError(f"{where} = {describe_value(value)}: expected a one-sided confidence in [0.5, 1), e.g. 0.95")
    return float(value)


@dataclass(frozen=True)
class PairedComparison:
    """The perplexity gate's measurement and decision (see the module docstring)."""

    decision: Decision
    live_perplexity: float
    candidate_perplexity: float
    low: float  # the candidate's perplexity at the lower / upper one-sided bound
    high: float
    limit: float  # the largest candidate perplexity the margin allows
    margin: PerplexityMargin
    confidence: float
    tokens: int
    samples: int
    min_tokens: int
    min_samples: int = DEFAULT_MIN_SAMPLES

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    def message(self) -> str:
        """One sentence with the figures behind the decision."""
        interval = (
            f"candidate perplexity {self.candidate_perplexity:.3f} (bounds {self.low:.3f} to {self.high:.3f} "
            f"at {self.confidence:.0%} each side), live {self.live_perplexity:.3f}, allowed up to "
            f"{self.limit:.3f} (margin {self.margin}), on {self.tokens} held-out tokens in "
            f"{self.samples} distinct samples"
        )
        if self.decision == "pass":
            return f"perplexity passed: {interval}"
        if self.decision == "reject":
            return f"perplexity worse than allowed: {interval}"
        if self.tokens < self.min_tokens or self.samples < self.min_samples:
            return (
                f"not enough held-out data to judge perplexity: {self.tokens} scored tokens in {self.samples} "
                f"distinct samples, the gate needs at least {self.min_tokens} tokens in {self.min_samples} "
                f"distinct samples"
            )
        return f"not enough held-out data to judge perplexity: the interval straddles the limit; {interval}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (an unbounded side, with fewer than two samples, is ``None``)."""
        return {
            "decision": self.decision,
            "live": _figure(self.live_perplexity),
            "candidate": _figure(self.candidate_perplexity),
            "low": _figure(self.low),
            "high": _figure(self.high),
            "limit": _figure(self.limit),
            "margin": str(self.margin),
            "confidence": self.confidence,
            "tokens": self.tokens,
            "samples": self.samples,
            "min_tokens": self.min_tokens,
            "min_samples": self.min_samples,
        }


def compare_perplexity(
    live_losses: Sequence[float],
    candidate_losses: Sequence[float],
    tokens: Sequence[int],
    *,
    margin: PerplexityMargin,
    confidence: float = DEFAULT_CONFIDENCE,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> PairedComparison:
    """Decide on per-sample summed losses (nats) of the live model and the candidate over the same ``tokens``
    (one entry per distinct held-out text)."""
    if not len(live_losses) == len(candidate_losses) == len(tokens):
        raise ValueError(
            f"compare_perplexity: {len(live_losses)} live, {len(candidate_losses)} candidate losses and "
            f"{len(tokens)} token counts: expected one of each per held-out sample"
        )
    rows = [
        (float(a), float(b), int(n)) for a, b, n in zip(live_losses, candidate_losses, tokens, strict=True) if n > 0
    ]
    m = len(rows)
    total = sum(n for _, _, n in rows)
    if total == 0:
        raise ValueError(
            "the held-out samples hold no scored token: a sample needs at least 2 scored tokens "
            "(captured traffic scores the prompt only)"
        )
    live = math.exp(sum(a for a, _, _ in rows) / total)
    difference = sum(b - a for a, b, _ in rows) / total  # log(ppl_candidate / ppl_live)
    candidate = live * math.exp(difference)
    limit_log = margin.log_ratio_limit(live)
    if m >= 2:
        spread = sum(((b - a) - difference * n) ** 2 for a, b, n in rows) / (m - 1)
        error = math.sqrt(spread / m) / (total / m)
        from scipy.stats import t as student_t  # here: scipy.stats takes ~0.3 s to import, --help none

        quantile = float(student_t.ppf(confidence, m - 1))
        low_log, high_log = difference - quantile * error, difference + quantile * error
    else:
        low_log, high_log = -math.inf, math.inf
    if total < min_tokens or m < max(2, min_samples):
        decision: Decision = "insufficient"
    elif high_log <= limit_log:
        decision = "pass"
    elif low_log > limit_log:
        decision = "reject"
    else:
        decision = "insufficient"
    return PairedComparison(
        decision=decision,
        live_perplexity=live,
        candidate_perplexity=candidate,
        low=live * math.exp(low_log),
        high=live * math.exp(high_log),
        limit=live * math.exp(limit_log),
        margin=margin,
        confidence=confidence,
        tokens=total,
        samples=m,
        min_tokens=min_tokens,
        min_samples=max(2, min_samples),
    )


def _figure(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) and value > 0 else None
