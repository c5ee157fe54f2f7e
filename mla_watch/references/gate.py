"""The re-tune gate on the reference prompts: a candidate router is judged on text the sidecar controls too.

Captured traffic is what clients sent: a gate that judges a candidate only there lets a client's texts decide
which router serves. :class:`ReferenceGate` adds, for every candidate, checks on the reference prompts of the
job's business line (its own set, else the default one; every set for all lines), each binding:

* ``reference_band``: every watched router reads inside the job's band on them;
* ``reference_drift``: their routing is at most ``drift_bits`` (Jensen-Shannon) from its healthy baseline (not
  judged, and said, where no healthy baseline of them exists yet);
* ``reference_perplexity``: their perplexity under the candidate is no worse than under the live routers by more
  than the job's margin, paired per prompt (:mod:`mla_watch.quality.paired`).

The runners score the prompts - a hook-free copy here, the engine beside - and hand the scores in (no torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mla_watch.quality.band import Band
from mla_watch.quality.paired import compare_perplexity, parse_margin
from mla_watch.quality.score import ModelScore
from mla_watch.references.prompts import ReferenceSet, ReferenceSets
from mla_watch.references.readings import ReferenceBaselines, ReferenceReading, compare

__all__ = ["REFERENCE_DRIFT_BITS", "ReferenceGate"]

REFERENCE_DRIFT_BITS = 0.05  # the shipped RoutingDrift threshold: routing this far from healthy has drifted


class ReferenceGate:
    """The reference prompts' checks of a candidate (see the module docstring)."""

    def __init__(
        self,
        sets: Callable[[], ReferenceSets],
        baselines: ReferenceBaselines,
        *,
        drift_bits: float = REFERENCE_DRIFT_BITS,
    ) -> None:
        self._sets = sets
        self.baselines = baselines
        self.drift_bits = drift_bits

    def sets_for(self, business_line: str | None) -> list[ReferenceSet]:
        return self._sets().for_line(business_line)

    def checks(
        self,
        business_line: str | None,
        live: Mapping[str, ModelScore],
        candidate: Mapping[str, ModelScore],
        *,
        routers: Sequence[str],
        band: Band,
        margin: Any,
        confidence: float,
        min_tokens: int,
        min_samples: int,
    ) -> list[dict[str, Any]]:
        """The checks of ``candidate`` against ``live``: both the scores of the line's sets (by set name)."""
        sets = [reference for reference in self.sets_for(business_line) if reference.name in candidate]
        if not sets:
            return [
                {
                    "gate": "reference_band",
                    "value": None,
                    "limit": band.describe(),
                    "decision": "insufficient",
                    "passed": False,
                    "message": f"no reference prompts describe {business_line or 'all lines'}: "
                    "a candidate is not judged on captured traffic alone",
                }
            ]
        checks = self.router_checks(sets, candidate, routers=routers, band=band)
        names = _names(sets)
        live_losses = [loss for reference in sets for loss in live[reference.name].losses]
        candidate_losses = [loss for reference in sets for loss in candidate[reference.name].losses]
        counts = [count for reference in sets for count in live[reference.name].counts]
        paired = compare_perplexity(
            live_losses,
            candidate_losses,
            counts,
            margin=parse_margin(margin),
            confidence=confidence,
            min_tokens=min_tokens,
            min_samples=min_samples,
        )
        checks.append(
            {
                "gate": "reference_perplexity",
                "value": round(paired.candidate_perplexity, 4),
                "limit": round(paired.limit, 4),
                "decision": paired.decision,
                "passed": paired.passed,
                "message": f"on the reference prompts ({names}): {paired.message()}",
            }
        )
        return checks

    def router_checks(
        self, sets: Sequence[ReferenceSet], scores: Mapping[str, ModelScore], *, routers: Sequence[str], band: Band
    ) -> list[dict[str, Any]]:
        """``reference_band`` and ``reference_drift`` of each of ``routers`` on the scores of ``sets`` (by set name):
        the checks a candidate meets here, and a rollout step on every replica that takes a version."""
        readings = [
            ReferenceReading(
                reference.name, reference.version, reference.digest, time.time(), None, scores[reference.name]
            )
            for reference in sets
        ]
        baselines = [self.baselines.get(reference.name, reference.digest) for reference in sets]
        names = _names(sets)
        checks: list[dict[str, Any]] = []
        if not any(scores[reference.name].routers for reference in sets):  # an engine returning no routing
            checks.append(
                {
                    "gate": "reference_band",
                    "value": None,
                    "limit": band.describe(),
                    "decision": "insufficient",
                    "passed": False,
                    "binding": False,
                    "message": f"the reference prompts ({names}) came back without routing (vLLM: "
                    "--enable-return-routed-experts): band and drift not judged on them",
                }
            )
            routers = []
        for router in routers:
            info = next((score.routers[router].router for score in scores.values() if router in score.routers), None)
            comparison = None if info is None else compare(info, readings, baselines)
            if comparison is None:
                checks.append(
                    {
                        "gate": "reference_band",
                        "router": router,
                        "value": None,
                        "limit": band.describe(),
                        "decision": "insufficient",
                        "passed": False,
                        "message": f"{router}: not routed by the reference prompts ({names})",
                    }
                )
                continue
            value = getattr(comparison.stats, band.metric)
            inside = value is not None and math.isfinite(value) and band.contains(value)
            decision = "pass" if inside else ("insufficient" if comparison.stats.too_small else "reject")
            checks.append(
                {
                    "gate": "reference_band",
                    "router": router,
                    "value": _round(value),
                    "limit": band.describe(),
                    "decision": decision,
                    "passed": decision == "pass",
                    "message": f"{router}: {band.metric} {_shown(value)} on the reference prompts ({names}): "
                    f"{'inside' if inside else 'outside'} the band ({band.describe()})",
                }
            )
            js = comparison.stats.js_divergence
            if comparison.baseline is None or js is None:
                checks.append(
                    {
                        "gate": "reference_drift",
                        "router": router,
                        "value": None,
                        "limit": self.drift_bits,
                        "decision": "insufficient",
                        "passed": False,
                        "binding": False,
                        "message": f"{router}: no healthy baseline of the reference prompts "
                        f"({names}) yet: drift not judged",
                    }
                )
                continue
            near = js <= self.drift_bits
            checks.append(
                {
                    "gate": "reference_drift",
                    "router": router,
                    "value": round(js, 6),
                    "limit": self.drift_bits,
                    "decision": "pass" if near else "reject",
                    "passed": near,
                    "message": f"{router}: {js:.4f} bits (Jensen-Shannon) from the healthy routing of the "
                    f"reference prompts ({names}); at most {self.drift_bits:g}",
                }
            )
        return checks


def _names(sets: Sequence[ReferenceSet]) -> str:
    return ", ".join(f"{reference.name} v{reference.version}" for reference in sets)


def _round(value: float | None) -> float | None:
    return None if value is None or value != value else round(float(value), 4)


def _shown(value: float | None) -> str:
    return "unmeasured" if value is None or value != value else f"{value:.3f}"
