"""Alert instances rendered for people: their annotations, their status page link, their alerts.

:class:`AlertRenderer` turns an instance and the record it was judged on into the
:class:`~mla_watch.alerting.vocabulary.Alert` a transition sends (firing or resolved) and the
annotations ``GET /v1/alerts`` shows; a template that fails to render never stops evaluation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Literal
from urllib.parse import urlencode

from mla_watch.alerting.causes import CAUSE_HEADLINES, Cause
from mla_watch.alerting.compiled import CompiledRule
from mla_watch.alerting.instances import Action, InstanceState
from mla_watch.alerting.templates import render_annotations
from mla_watch.alerting.vocabulary import Alert, Rule
from mla_watch.routing.series import BUSINESS_LINE, KIND, LAYER, ROUTER
from mla_watch.routing.windows import RouterStats

__all__ = ["TREND_FIELDS", "AlertRenderer", "Render", "with_cause"]

log = logging.getLogger("mla_watch.alerting.alert_engine")  # the alert engine's records keep their logger's name

# What a trend rule adds to its annotations' fields (AlertEngine fills them in).
TREND_FIELDS = ("current", "slope_per_hour", "slope_per_day", "predicted", "crossing_in")

Render = Callable[[Rule, Mapping[str, object]], dict[str, str]]


class AlertRenderer:
    """Renders the alert engine's instances; ``rules`` gives the engine's current rules by id."""

    def __init__(
        self, rules: Callable[[], Mapping[str, CompiledRule]], *, render: Render | None = None, status_url: str = ""
    ) -> None:
        self._rules = rules
        self._render = render or render_annotations
        self._status_url = status_url

    def resolved_action(self, inst: InstanceState, rule: CompiledRule, now: float) -> Action:
        """The resolved ``notify`` of ``inst``, resolved at ``now``; its annotations are kept on it."""
        alert = self.alert(inst, rule, "resolved", now)
        inst.annotations = dict(alert.annotations)
        return Action("notify", alert, rule.rule, inst.record)

    def alert(
        self, inst: InstanceState, rule: CompiledRule, status: Literal["firing", "resolved"], ends_at: float | None
    ) -> Alert:
        """The :class:`Alert` of ``inst`` (``ends_at``: when it resolved), annotated from the statistics it was
        judged on, or with the annotations it kept (an instance restored from the state file)."""
        record = inst.record
        annotations = self.annotations(rule, inst, record) if record is not None else dict(inst.annotations)
        value = inst.value
        return Alert(
            labels=dict(inst.public_labels),
            annotations=annotations,
            status=status,
            starts_at=inst.firing_since if inst.firing_since is not None else inst.active_since or 0.0,
            ends_at=ends_at,
            value=float("nan") if value is None else float(value),
            generator_url=self.router_url(inst),
        )

    def router_url(self, inst: InstanceState) -> str:
        """The status page's link to ``inst``'s router and alert; ``""`` without a status URL."""
        if not self._status_url:
            return ""
        # The status page reads this anchor: it selects the business line and the rule's metric, and
        # highlights the row and the alert.
        rule = self._rules().get(inst.rule_id)
        anchor = urlencode(
            {
                "router": inst.labels.get(ROUTER, ""),
                "layer": inst.labels.get(LAYER, ""),
                "business_line": inst.labels.get(BUSINESS_LINE, ""),
                "metric": rule.metric if rule is not None else "",
                "alertname": inst.labels.get("alertname", ""),
            }
        )
        return f"{self._status_url}#{anchor}"

    def annotations(self, rule: CompiledRule, inst: InstanceState, record: RouterStats) -> dict[str, str]:
        """The rule's annotations rendered for ``inst`` judged on ``record`` (and, for a trend rule, ``inst.trend``);
        a fallback summary if that fails."""
        value = inst.value
        below, above, resolve_above, resolve_below = inst.levels or rule.bounds
        if below is not None and (above is None or value is None or value < below):
            threshold, resolve = below, resolve_above
        else:
            threshold, resolve = above, resolve_below
        labels = inst.public_labels
        stats = record.stats
        healthy = record.baseline.values.get(rule.metric) if record.baseline is not None else None
        trend = inst.trend or {}
        fields = {
            "alertname": rule.rule.name,
            "metric": rule.metric,
            "value": value,
            "threshold": threshold,
            "healthy": healthy,
            "resolve_threshold": resolve,
            "router": labels.get(ROUTER),
            "layer": labels.get(LAYER),
            "kind": labels.get(KIND),
            "business_line": labels.get(BUSINESS_LINE),
            "floor_bits": stats.floor_bits,
            "ceiling_bits": stats.ceiling_bits,
            "tokens": stats.tokens,
            "min_tokens": rule.min_tokens if rule.min_tokens is not None else stats.min_tokens,
            "severity": labels.get("severity"),
            "status_url": self.router_url(inst),
            "cause": None if inst.cause is None else inst.cause.name,
            "position_bucket": stats.long_context_edge,
            "position_compared": stats.long_context_compared,
            "position_clients": stats.long_context_clients,
            **{name: trend.get(name) for name in TREND_FIELDS},
        }
        try:
            rendered = {str(k): str(v) for k, v in self._render(rule.rule, fields).items()}
        except Exception as error:  # a render bug must never stop evaluation
            log.error("rendering the annotations of rule %r failed: %s", rule.rule.name, error)
            rendered = {
                "summary": f"{rule.rule.name}: {rule.metric} = {value} on {labels.get(ROUTER)} "
                f"(annotation rendering failed: {type(error).__name__}: {error})"
            }
        return with_cause(rendered, inst.cause)


def with_cause(annotations: dict[str, str], cause: Cause | None) -> dict[str, str]:
    """The cause first: the summary starts with it, and the ``cause`` annotation says what decided it."""
    if cause is None:
        return annotations
    summary = annotations.get("summary", "")
    return {
        **annotations,
        "summary": f"{CAUSE_HEADLINES[cause.name]}: {summary}" if summary else CAUSE_HEADLINES[cause.name],
        "cause": cause.summary,
    }
