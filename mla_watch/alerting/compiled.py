"""Rules compiled for the evaluation loop: thresholds resolved, labels and selector ready to apply.

A :class:`CompiledRule` is one rule of a :class:`~mla_watch.alerting.vocabulary.RuleSet` as the alert
engine judges it; :func:`compile_rules` gives every rule an id (its name, ``NAME#2`` and on for
a name used again) and says which rules will never be judged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mla_watch.alerting.instances import RecordKey
from mla_watch.alerting.vocabulary import Rule, RuleSet
from mla_watch.routing.series import SERIES_LABELS
from mla_watch.routing.windows import ALL_LINES, RouterStats

__all__ = ["CompiledRule", "compile_rules"]

log = logging.getLogger("mla_watch.alerting.alert_engine")  # the alert engine's records keep their logger's name


class CompiledRule:
    """A rule with its thresholds resolved, for the hot loop."""

    __slots__ = (
        "above",
        "below",
        "bounds",
        "for_s",
        "id",
        "keep_s",
        "levels",
        "metric",
        "min_tokens",
        "notify",
        "of_the_baseline",
        "resolve_above",
        "resolve_below",
        "retune",
        "rule",
        "trend",
    )

    def __init__(self, rule_id: str, rule: Rule) -> None:
        self.id = rule_id
        self.rule = rule
        self.metric = rule.metric
        self.below = rule.below
        self.above = rule.above
        self.resolve_above = rule.below if rule.resolve_above is None else rule.resolve_above
        self.resolve_below = rule.above if rule.resolve_below is None else rule.resolve_below
        self.for_s = float(rule.for_seconds)
        self.keep_s = float(rule.keep_firing_for_seconds)
        self.min_tokens = rule.min_tokens
        self.notify = "notify" in rule.actions
        self.retune = "retune" in rule.actions
        self.trend = rule.trend
        # (below, above, resolve_above, resolve_below) as the rule writes them: for a rule relative to the
        # healthy baseline, the bounds of its levels; `levels`, the same where they are the levels (else None)
        self.bounds = (self.below, self.above, self.resolve_above, self.resolve_below)
        self.levels = None if rule.baseline else self.bounds
        # Judged against the series' healthy baseline: a level relative to it, or the drift measured from it.
        self.of_the_baseline = bool(rule.baseline) or rule.metric == "js_divergence"

    def series_levels(self, record: RouterStats) -> tuple[Any, Any, Any, Any] | None:
        """The levels of a rule relative to the baseline for ``record``'s series; ``None`` without a baseline."""
        healthy = record.baseline.values.get(self.metric) if record.baseline is not None else None
        return self.rule.levels(healthy)

    def labels(self, key: RecordKey) -> dict[str, str]:
        name, layer, kind, line = key
        values = (str(name), str(layer), str(kind), ALL_LINES if line is None else str(line))
        series = dict(zip(SERIES_LABELS, values, strict=True))
        return {
            "alertname": self.rule.name,
            "severity": self.rule.severity,
            **series,
            **{str(k): str(v) for k, v in self.rule.labels.items()},
        }

    def matches(self, key: RecordKey, num_slots: int | None = None, hash_routed: bool = False) -> bool:
        """Whether the selector takes this router x line; ``num_slots`` None (a state file written before
        instances kept it): any geometry."""
        name, layer, kind, line = key
        record = {"name": name, "layer": layer, "kind": kind, "business_line": line, "hash_routed": hash_routed}
        if num_slots is None:
            return dataclasses.replace(self.rule.selector, slots=None).matches(record)
        record["num_slots"] = num_slots
        return self.rule.selector.matches(record)


def compile_rules(rules: RuleSet, *, with_trend_source: bool) -> dict[str, CompiledRule]:
    """Rule id -> compiled rule, in the rule set's order; a warning for each rule that shares an earlier
    rule's name, and (``with_trend_source`` false) for each trend rule, which is then never judged."""
    compiled: dict[str, CompiledRule] = {}
    for rule in rules.rules:
        rule_id, n = rule.name, 1
        while rule_id in compiled:
            n += 1
            rule_id = f"{rule.name}#{n}"
        if n > 1:
            log.warning(
                "rule %r (%s) shares its name with an earlier rule; its instances are tracked as %r",
                rule.name,
                rule.source or "?",
                rule_id,
            )
        compiled[rule_id] = CompiledRule(rule_id, rule)
    if not with_trend_source:
        for entry in compiled.values():
            if entry.trend is not None:
                log.warning(
                    "rule %r (%s) is a trend rule, and this alert engine has no routing history "
                    "(trend_source): it is never judged",
                    entry.rule.name,
                    entry.rule.source or "?",
                )
    return compiled
