"""The check a replica makes of a fleet version it has just taken: its own reference prompts and its live rules.

A swapped router is checked, never trusted: each replica reads the reference prompts of the version's business
line (its own set, else the default one) through the routers now serving, and the version passes there only if

* every router the version changed reads inside the band of the job that made it (``reference_band``) and, where
  this replica holds a healthy baseline of those prompts, within the reference drift of it (``reference_drift``):
  the checks :class:`~mla_watch.references.gate.ReferenceGate` makes of every candidate;
* no threshold rule loaded here breaches on those routers over the same readings (``rules``): a replica whose
  rules are stricter than the canary's holds the version to them.

A check that cannot be made (no reference prompts, a reading that fails) fails: nothing is taken on trust.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mla_watch.quality.band import Band
from mla_watch.references.gate import ReferenceGate
from mla_watch.references.readers import ReferenceReader
from mla_watch.retune.health import judge_health

__all__ = ["StepCheck", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    passed: bool
    reason: str  # one sentence: what passed, or the first things that failed
    checks: tuple[Mapping[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "checks": [dict(check) for check in self.checks]}


class StepCheck:
    """Checks the routers serving now against a version's manifest (see the module docstring)."""

    def __init__(
        self, gate: ReferenceGate, reader: Callable[[], ReferenceReader | None], rules: Callable[[], Sequence[Any]]
    ) -> None:
        self._gate = gate
        self._reader = reader
        self._rules = rules

    def __call__(self, manifest: Mapping[str, Any]) -> StepResult:
        line = manifest.get("business_line")
        routers = [str(router) for router in manifest.get("routers", [])]
        band = Band.from_dict(manifest.get("band") or {})
        sets = self._gate.sets_for(line)
        if not sets:
            return StepResult(
                False,
                f"no reference prompts describe {line or 'all lines'} here: the version cannot "
                "be checked on this replica",
            )
        reader = self._reader()
        if reader is None:
            return StepResult(False, "no reference prompts are read on this replica: the version cannot be checked")
        try:
            scores = {reference.name: reader.read(reference) for reference in sets}
        except Exception as error:  # an engine that does not answer: the check is not made, so it does not pass
            return StepResult(
                False,
                f"the reference prompts could not be read through {reader.where}: "
                f"{type(error).__name__}: {str(error)[:200]}",
            )
        checks = self._gate.router_checks(sets, scores, routers=routers, band=band)
        rules = list(self._rules())
        for name, score in scores.items():
            for breach in judge_health(score, rules).get("breaches", []):
                if breach["router"] in routers:
                    checks.append(
                        {
                            "gate": "rules",
                            "router": breach["router"],
                            "value": breach["value"],
                            "limit": breach["threshold"],
                            "decision": "reject",
                            "passed": False,
                            "message": f"{breach['router']}: {breach['rule']} breaches on the reference prompts "
                            f"{name} ({breach['metric']} {breach['value']:g}, threshold "
                            f"{breach['threshold']:g})",
                        }
                    )
        failed = [check for check in checks if check.get("binding", True) and not check.get("passed")]
        if failed:
            return StepResult(
                False,
                "; ".join(str(check["message"]) for check in failed[:3])
                + (f"; and {len(failed) - 3} more" if len(failed) > 3 else ""),
                tuple(checks),
            )
        judged = ", ".join(sorted({str(check["gate"]) for check in checks})) or "nothing"
        return StepResult(
            True, f"{', '.join(routers)} passed {judged} on this replica's reference prompts", tuple(checks)
        )
