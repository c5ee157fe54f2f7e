"""Quality gates: a candidate router version goes live only if it is measurably better.

Both gates are measured on held-out samples (never trained on), in one pass per model state
over a hook-free copy of the live model, so live traffic is never routed by a candidate:

* **band**: every watched router's metric is back inside the band of the rule that triggered
  the job. The band uses the rule's *resolve* threshold (5.2 bits for the shipped
  ``RoutingEntropyLow``), so a promoted router does not hover at the edge and keep the alert
  firing.
* **perplexity**: the candidate's per-token perplexity is at most ``max_perplexity_increase``
  above the live model's before the job (0.3 by default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_watch.probe import attach, discover_routers
from mla_watch.retune.loss import next_token_loss

__all__ = ["Band", "GateReport", "ModelScore", "band_of_rule", "evaluate_gates", "score_model"]


@dataclass(frozen=True)
class Band:
    """Where a router metric must lie: ``low <= value <= high`` (either side may be open)."""

    metric: str = "entropy_bits"
    low: float | None = None
    high: float | None = None

    def contains(self, value: float) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"{self.low:g} <= {self.metric} <= {self.high:g}"
        if self.low is not None:
            return f"{self.metric} >= {self.low:g}"
        if self.high is not None:
            return f"{self.metric} <= {self.high:g}"
        return f"any {self.metric}"

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "low": self.low, "high": self.high}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Band:
        return cls(metric=str(data.get("metric", "entropy_bits")), low=data.get("low"), high=data.get("high"))


def band_of_rule(rule: Any) -> Band:
    """The band an alert rule's routers must return to: its resolve threshold (else its firing one)."""
    if rule.below is not None:
        return Band(rule.metric, low=rule.resolve_above if rule.resolve_above is not None else rule.below)
    if rule.above is not None:
        return Band(rule.metric, high=rule.resolve_below if rule.resolve_below is not None else rule.above)
    return Band(rule.metric)


@dataclass
class ModelScore:
    """One model state measured on the held-out samples."""

    perplexity: float
    tokens: int
    routers: dict[str, dict[str, Any]]  # router name -> its statistics record over the held-out pass

    def metric(self, router: str, name: str) -> float | None:
        value = self.routers.get(router, {}).get(name)
        return None if value is None else float(value)

    def as_dict(self, routers: Sequence[str], metric: str) -> dict[str, Any]:
        return {"perplexity": round(self.perplexity, 4), "tokens": self.tokens,
                metric: {name: _round(self.metric(name, metric)) for name in routers}}


@dataclass
class GateReport:
    passed: bool
    checks: list[dict[str, Any]]  # {gate, router?, value, limit, passed}
    before: dict[str, Any]
    after: dict[str, Any]
    band: Band
    max_perplexity_increase: float

    def reasons(self) -> list[str]:
        """One sentence per failed check, with its figures."""
        return [check["message"] for check in self.checks if not check["passed"]]

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "band": self.band.as_dict(),
                "max_perplexity_increase": self.max_perplexity_increase, "checks": self.checks,
                "before": self.before, "after": self.after}


@torch.no_grad()
def score_model(model: torch.nn.Module, batches: Sequence[Mapping[str, torch.Tensor]],
                business_line: str = "gate") -> ModelScore:
    """Perplexity and per-router statistics of ``model`` over ``batches`` (padding excluded).

    ``model`` must not carry another probe counting into live windows: pass a hook-free copy.
    """
    indexers = {type(module).__name__ for module, info, _ in discover_routers(model) if info.kind != "expert"}
    probe = attach(model, window_tokens=None, ignore=sorted(indexers))
    total_loss, total_tokens = 0.0, 0
    try:
        device = next(model.parameters()).device
        with probe.attribute(business_line):
            for batch in batches:
                loss_mask = batch.get("loss_mask")
                loss, tokens = next_token_loss(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                               None if loss_mask is None else loss_mask.to(device))
                total_loss += float(loss)
                total_tokens += tokens
        records = {record["name"]: record for record in probe.stats(business_line)}
    finally:
        probe.detach()
    if total_tokens == 0:
        raise ValueError("the samples hold no token to predict: a sample needs at least 2 scored tokens "
                         "(captured traffic scores the prompt only)")
    return ModelScore(perplexity=math.exp(total_loss / total_tokens), tokens=total_tokens, routers=records)


def evaluate_gates(before: ModelScore, after: ModelScore, *, routers: Sequence[str], band: Band,
                   max_perplexity_increase: float = 0.3) -> GateReport:
    """Judge the candidate (``after``) against the live model before the job (``before``)."""
    checks: list[dict[str, Any]] = []
    for router in routers:
        value = after.metric(router, band.metric)
        passed = value is not None and math.isfinite(value) and band.contains(value)
        shown = "unmeasured" if value is None else f"{value:.3f}"
        checks.append({"gate": "band", "router": router, "value": _round(value), "limit": band.describe(),
                       "passed": passed,
                       "message": f"{router}: {band.metric} {shown} on held-out samples is outside the band "
                                  f"({band.describe()})"})
    limit = before.perplexity + max_perplexity_increase
    checks.append({"gate": "perplexity", "value": round(after.perplexity, 4), "limit": round(limit, 4),
                   "passed": after.perplexity <= limit,
                   "message": f"perplexity {after.perplexity:.3f} exceeds {before.perplexity:.3f} + "
                              f"{max_perplexity_increase:g} = {limit:.3f} (the live model before the job)"})
    return GateReport(passed=all(check["passed"] for check in checks), checks=checks,
                      before=before.as_dict(routers, band.metric), after=after.as_dict(routers, band.metric),
                      band=band, max_perplexity_increase=max_perplexity_increase)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
