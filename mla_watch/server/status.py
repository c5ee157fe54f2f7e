"""The status page: its files (shipped in the package, no build step, no CDN) and the JSON it reads.

``GET /`` serves ``static/index.html``, which loads ``static/status.js`` and ``static/status.css``
and polls ``GET /v1/status``. The JSON holds what on-call needs at a glance:

* ``history``: routing entropy per router and business line over the last hour
  (:meth:`~mla_watch.history.store.HistoryStore.recent`), each series with its **band**: the
  thresholds of the alert rules on ``entropy_bits`` that watch it (see :func:`entropy_band`);
* ``alerts``: the alert instances with their labels, annotations (runbook links), their rule's
  ``metric`` (the page colours the alert's row and opens its link on that metric) and their
  ``incident``, the notification group they are in (the page shows each as one row that opens into
  its alerts);
* ``policies``: the sampling policies in force, each task with its adjustment and refusal counts;
* ``retune``: the re-tuning jobs with their gates, the live router version and the promote /
  rollback history.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

from prometheus_client import Counter

__all__ = ["STATIC_FILES", "counter_values", "entropy_band", "policies_view", "static_file"]

STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
}


def static_file(name: str) -> tuple[bytes, str]:
    """``(content, media type)`` of one of the page's files (``KeyError`` for any other name)."""
    media_type = STATIC_FILES[name]
    return resources.files("mla_watch.server").joinpath("static").joinpath(name).read_bytes(), media_type


def entropy_band(rules: Iterable[Any], series: Mapping[str, Any]) -> dict[str, Any]:
    """Where ``entropy_bits`` of one series should lie, from the rules that watch it.

    ``fire_below`` / ``resolve_above``: the highest ``below`` / resolve threshold among the
    matching rules (the first to fire); ``fire_above`` / ``resolve_below``: the lowest ``above``
    ones. ``None`` where no rule watches that side; ``rules`` names the rules. When no rule
    watches the series' own business line (the shipped rules watch each line, not their sum),
    the band of the rules that watch the router on any line is given, with ``inherited: true``.
    """
    rules = list(rules)
    record = {
        "name": series["router"],
        "layer": series["layer"],
        "kind": series["kind"],
        "business_line": series["business_line"],
        "num_slots": series.get("num_slots") or 0,
    }
    band = _band(rules, record, series.get("floor_bits"), series.get("ceiling_bits"))
    if not band["rules"]:
        del record["business_line"]  # a selector then matches the router whatever the line
        inherited = _band(rules, record, series.get("floor_bits"), series.get("ceiling_bits"))
        if inherited["rules"]:
            band = {**inherited, "inherited": True}
    return band


def _band(rules: list[Any], record: dict[str, Any], floor: float | None, ceiling: float | None) -> dict[str, Any]:
    band: dict[str, Any] = {
        "fire_below": None,
        "resolve_above": None,
        "fire_above": None,
        "resolve_below": None,
        "rules": [],
        "inherited": False,
    }

    def keep(key: str, value: float | None, pick: Any) -> None:
        if value is not None:
            band[key] = value if band[key] is None else pick(band[key], value)

    for rule in rules:
        to_bits = _in_bits(rule.metric, floor, ceiling)
        # A trend rule's thresholds bound a slope or a forecast, not the value drawn
        if rule.trend is not None or to_bits is None or not rule.selector.matches(record):
            continue
        if rule.baseline:  # levels of its own per router and line: no one band to draw
            continue
        band["rules"].append(rule.name)
        below, above = rule.below, rule.above
        resolve_above, resolve_below = rule.resolve_above, rule.resolve_below
        if rule.metric == "bits_below_ceiling":  # more bits below the ceiling is less entropy: the sides swap
            below, above, resolve_above, resolve_below = above, below, resolve_below, resolve_above
        if below is not None:
            keep("fire_below", to_bits(below), max)
            keep("resolve_above", to_bits(resolve_above if resolve_above is not None else below), max)
        if above is not None:
            keep("fire_above", to_bits(above), min)
            keep("resolve_below", to_bits(resolve_below if resolve_below is not None else above), min)
    return band


def _in_bits(metric: str, floor: float | None, ceiling: float | None) -> Any:
    """How a threshold of ``metric`` reads in entropy bits for a router of this floor and ceiling."""
    if metric == "entropy_bits":
        return lambda value: value
    if floor is None or ceiling is None:
        return None
    if metric == "normalized_entropy":
        return lambda value: round(floor + value * (ceiling - floor), 4)
    if metric == "bits_below_ceiling":
        return lambda value: round(ceiling - value, 4)
    return None


def counter_values(counter: Counter) -> dict[tuple[str, ...], float]:
    """A labelled counter's current values: label values (in label order) -> count."""
    values: dict[tuple[str, ...], float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[tuple(sample.labels.values())] = sample.value
    return values


def policies_view(
    policies: Mapping[str, Any],
    adjustments: Mapping[tuple[str, ...], float],
    rejections: Mapping[tuple[str, ...], float],
    defaults: Mapping[tuple[str, ...], float],
) -> list[dict[str, Any]]:
    """The policies in force (``PolicySet.as_dict()``), each task with its counts by parameter.

    ``adjustments`` (values clamped), ``rejections`` and ``defaults`` (parameters left out and
    filled in) are keyed ``(business_line, task, param)``.
    """
    lines = []
    for line, policy in sorted(policies.get("business_lines", {}).items()):
        tasks = []
        for task, body in policy["tasks"].items():

            def counts(source: Mapping[tuple[str, ...], float], line: str = line, task: str = task) -> dict[str, int]:
                return {param: int(n) for (l_, t, param), n in sorted(source.items()) if l_ == line and t == task}

            tasks.append(
                {
                    "task": task,
                    **body,
                    "adjustments": counts(adjustments),
                    "rejections": counts(rejections),
                    "defaults": counts(defaults),
                }
            )
        lines.append(
            {
                "business_line": line,
                "description": policy.get("description", ""),
                "default_task": policy.get("default_task"),
                "source": policy.get("source"),
                "tasks": tasks,
            }
        )
    return lines
