"""Quality gates: a candidate router version goes live only if it is measurably better.

Besides the held-out samples (captured traffic: what clients sent), every candidate is judged on the reference
prompts the sidecar controls (:mod:`mla_watch.references.gate`), so that captured traffic alone never promotes one.

Both gates are measured on held-out samples (never trained on), in one pass per model state
over a hook-free copy of the live model, so live traffic is never routed by a candidate:

* **band**: every watched router's metric is back inside the band of the rule that triggered
  the job. The band uses the rule's *resolve* threshold (5.2 bits for the shipped
  ``RoutingEntropyLow``), so a promoted router does not hover at the edge and keep the alert
  firing.
* **perplexity**: the candidate is not worse than the live model before the job by more than
  the margin (``max_perplexity_increase``, 2 % by default), judged per held-out sample, paired,
  at a stated confidence (:mod:`mla_watch.quality.paired`).

Each check decides ``pass``, ``reject`` or ``insufficient`` (too few held-out tokens or distinct
texts to know), and so does the report: ``reject`` if any binding check rejects, else
``insufficient`` if any lacks data, else ``pass``. A band reading over fewer tokens than the
router's trusted minimum is ``insufficient``, not a failure: entropy reads low on small samples.

A candidate *restored* from a known-good source (:class:`KnownGood`: a reference checkpoint, a
version an operator marked good, or one that passed its gates) is judged against that source's
own health as well: the start-up health check (:func:`mla_watch.retune.health.judge_health`) on
the health text, a fixed mixed text no served model wrote. The band gate falls back to that text
when the held-out samples are too few to read a router. And while the live router is itself
outside its band, the perplexity check against the live model is reported but not binding: the
broken model is no standard of quality, and on its own traffic it scores the words its collapsed
router chose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mla_watch.quality.band import DEFAULT_BAND, Band
from mla_watch.quality.paired import (
    DEFAULT_CONFIDENCE,
    DEFAULT_MIN_SAMPLES,
    DEFAULT_MIN_TOKENS,
    Decision,
    PairedComparison,
    PerplexityMargin,
    compare_perplexity,
    parse_margin,
)
from mla_watch.quality.score import ModelScore

if TYPE_CHECKING:  # the gates' rules are arithmetic; only score_model runs the model (the [model] extra)
    pass

__all__ = ["DEFAULT_BAND", "Band", "GateReport", "KnownGood", "ModelScore", "band_of_rule", "evaluate_gates"]


def band_of_rule(rule: Any) -> Band:
    """The band an alert rule's routers must return to: its resolve threshold (else its firing one); for a
    threshold relative to the healthy baseline, its bound (the strictest level it can take)."""
    if rule.below is not None:
        return Band(rule.metric, low=rule.resolve_above if rule.resolve_above is not None else rule.below)
    if rule.above is not None:
        return Band(rule.metric, high=rule.resolve_below if rule.resolve_below is not None else rule.above)
    return Band(rule.metric)


@dataclass
class GateReport:
    decision: Decision
    checks: list[dict[str, Any]]  # {gate, router?, value, limit, decision, passed, message}
    before: dict[str, Any]
    after: dict[str, Any]
    band: Band
    perplexity: PairedComparison

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    def reasons(self) -> list[str]:
        """One sentence per binding check that did not pass, with its figures."""
        return [check["message"] for check in self.checks if not check["passed"] and check.get("binding", True)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "decision": self.decision,
            "band": self.band.as_dict(),
            "max_perplexity_increase": str(self.perplexity.margin),
            "perplexity": self.perplexity.as_dict(),
            "checks": self.checks,
            "before": self.before,
            "after": self.after,
        }


def _band_check(score: ModelScore, router: str, band: Band, where: str) -> tuple[Decision, str, float | None]:
    value = score.metric(router, band.metric)
    measured = value is not None and math.isfinite(value)
    too_small = score.too_small(router)
    if measured and band.contains(cast(float, value)):  # measured: not None
        return "pass", f"{router}: {band.metric} {value:.3f} on {where} is inside the band ({band.describe()})", value
    if measured and not too_small:
        return (
            "reject",
            (f"{router}: {band.metric} {value:.3f} on {where} is outside the band ({band.describe()})"),
            value,
        )
    record = score.routers.get(router)
    tokens = 0 if record is None else record.stats.tokens
    return (
        "insufficient",
        (
            f"{router}: {band.metric} is {'unmeasured' if not measured else f'{value:.3f}'} on "
            f"{tokens} tokens of {where}, fewer than the router's trusted minimum "
            f"({band.describe()} not judged)"
        ),
        value,
    )


@dataclass
class KnownGood:
    """What a restored candidate is judged by besides the held-out samples (see the module docstring)."""

    source: str  # "reference model /models/v3", "router version 3 (marked good)"
    health: dict[str, Any]  # judge_health of the candidate on the health text
    score: ModelScore  # the candidate on the health text: the band gate's fallback
    live_outside_band: bool  # the live router reads outside its band (on the health text)


def evaluate_gates(
    before: ModelScore,
    after: ModelScore,
    *,
    routers: Sequence[str],
    band: Band,
    max_perplexity_increase: PerplexityMargin | float | str = "2%",
    confidence: float = DEFAULT_CONFIDENCE,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    known_good: KnownGood | None = None,
    reference: Sequence[dict[str, Any]] = (),
) -> GateReport:
    """Judge the candidate (``after``) against the live model before the job (``before``), on the same samples
    (distinct texts); a restore from a known-good source also by ``known_good``; ``reference``: the checks on the
    reference prompts (:class:`mla_watch.references.gate.ReferenceGate`), binding like the others."""
    checks: list[dict[str, Any]] = []
    for router in routers:
        decision, message, value = _band_check(after, router, band, "held-out samples")
        if decision == "insufficient" and known_good is not None:
            decision, message, value = _band_check(known_good.score, router, band, "the health text")
        checks.append(
            {
                "gate": "band",
                "router": router,
                "value": _round(value),
                "limit": band.describe(),
                "decision": decision,
                "passed": decision == "pass",
                "message": message,
            }
        )
    if known_good is not None:
        health = known_good.health
        decision = "pass" if health.get("passed") else "reject" if health.get("checked") else "insufficient"
        checks.append(
            {
                "gate": "reference_health",
                "value": known_good.source,
                "limit": "no rule breached",
                "decision": decision,
                "passed": decision == "pass",
                "message": f"{known_good.source} on the health text ({health.get('tokens', 0)} tokens): "
                f"{health.get('reason')}",
            }
        )
    comparison = compare_perplexity(
        before.losses,
        after.losses,
        before.counts,
        margin=parse_margin(max_perplexity_increase),
        confidence=confidence,
        min_tokens=min_tokens,
        min_samples=min_samples,
    )
    binding = known_good is None or not known_good.live_outside_band
    message = comparison.message()
    if not binding:
        message = (
            f"{message} (not binding: the live router reads outside its band, so the live model's perplexity "
            f"is no standard for a known-good restore)"
        )
    checks.append(
        {
            "gate": "perplexity",
            "value": round(comparison.candidate_perplexity, 4),
            "limit": round(comparison.limit, 4),
            "decision": comparison.decision,
            "passed": comparison.passed,
            "binding": binding,
            "message": message,
        }
    )
    checks.extend(reference)
    decisions = {check["decision"] for check in checks if check.get("binding", True)}
    overall: Decision = "reject" if "reject" in decisions else "insufficient" if "insufficient" in decisions else "pass"
    return GateReport(
        decision=overall,
        checks=checks,
        before=before.as_dict(routers, band.metric),
        after=after.as_dict(routers, band.metric),
        band=band,
        perplexity=comparison,
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
