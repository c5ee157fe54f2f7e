"""What the reference readings say of a routing alert's cause, in words and in details: the :class:`Cause` that a
comparison of the readings with their healthy baseline tells, whether the alert's rule breaches on them, and why no
reading reached the positions an alert concerns.

Pure functions: :class:`mla_watch.references.prober.ReferenceProber` picks the readings and hands them here.
"""

from __future__ import annotations

from typing import Any

from mla_watch.alerting.causes import Cause
from mla_watch.alerting.vocabulary import breached, judged_window
from mla_watch.references.prompts import ReferenceSet
from mla_watch.references.reach import Need
from mla_watch.references.readings import ReferenceReading, RouterComparison
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.windows import RouterStats

__all__ = ["cause_of", "unreached"]


def cause_of(
    rule: Any,
    record: RouterStats,
    comparison: RouterComparison,
    readings: list[ReferenceReading],
    *,
    tolerance: float,
    clients: ClientShares | None,
    need: Need | None = None,
) -> Cause:
    """The cause ``comparison`` of ``readings`` tells of ``rule``'s alert on ``record``: ``model`` where they route
    beyond ``tolerance`` bits from their healthy routing or breach the rule, ``traffic`` where they do neither (the
    ``clients`` whose share moved most named), ``undetermined`` where neither can be judged."""
    changed = comparison.changed(tolerance)
    breach = None if need is not None and need.by_position else _rule_breach(rule, comparison)
    metric = rule.metric
    value = getattr(comparison.stats, metric)
    healthy = None if comparison.baseline is None else getattr(comparison.baseline, metric)
    js = comparison.stats.js_divergence if comparison.baseline is not None else None
    sets = ", ".join(f"{reading.set_name} v{reading.set_version}" for reading in readings)
    if need is not None:
        sets += f"; {need.what}, {comparison.stats.tokens} tokens there"
    figures = (
        f"{record.router.name} reads {metric} {_number(value)} on them"
        if value is not None or need is None or not need.by_position
        else f"{record.router.name}'s routing there"
    )
    figures += (f" ({_number(healthy)} while healthy)" if healthy is not None else "") + (
        f", {js:.4f} bits (Jensen-Shannon) from their healthy routing, tolerance {tolerance:g}"
        if js is not None
        else ", with no healthy baseline of them yet"
    )
    details: dict[str, Any] = {
        "sets": [reading.summary() for reading in readings],
        "router": record.router.name,
        "metric": metric,
        "value": _json_number(value),
        "healthy": _json_number(healthy),
        "js_bits": _json_number(js),
        "tolerance_bits": tolerance,
        "rule_breached": breach,
        "changed": changed,
        "reach": None if need is None else need.as_dict(),
    }
    reading_at = min(reading.taken_at for reading in readings)
    if changed or breach:
        why = "route differently now" if changed else f"breach {rule.name} too"
        return Cause("model", f"the reference prompts ({sets}) {why}: {figures}", reading_at, details)
    if changed is None and breach is None:
        return Cause(
            "undetermined",
            f"the reference prompts ({sets}) cannot tell: {figures}, and {rule.name} cannot judge them",
            reading_at,
            details,
        )
    summary = f"the reference prompts ({sets}) route as while healthy: {figures}; what changed is the traffic"
    if clients is not None:
        movers = clients.movers(record.business_line)
        details["clients"] = [mover.as_dict() for mover in movers]
        if movers:
            summary += ": " + "; ".join(mover.describe() for mover in movers)
    return Cause("traffic", summary, reading_at, details)


def unreached(
    need: Need, sets: list[ReferenceSet], readings: dict[str, ReferenceReading], *, where: str, limit: int
) -> str:
    """Why no reading reached ``need``'s positions: how far each set reaches, and what would reach them (``where``:
    the reader, which reads ``limit`` tokens of a prompt at most)."""
    reach = ", ".join(
        f"{reference.name} v{reference.version} {readings[reference.name].reach} tokens"
        for reference in sets
        if reference.name in readings
    )
    said = (
        f"no reading of the reference prompts reached {need.what}: the longest prompt each set read "
        f"({reach or 'none read'})"
    )
    if any(reading.reach > need.start for reading in readings.values()):
        return (
            f"{said}; the routing of {where} was not counted by position (its context length is "
            "not known: --model-config's max_position_embeddings)"
        )
    if need.start >= limit:
        return (
            f"{said}; those positions lie past what {where} reads of a prompt ({limit} tokens: the "
            "model's context, or --reference-max-tokens beside an engine)"
        )
    if not any(reference.long for reference in sets):
        return (
            f"{said}; add a long set (long: true, with prompts past position {need.start}, or generate) to "
            "the reference prompt directory"
        )
    return f"{said}; give a long set prompts past position {need.start}, or raise its max_tokens"


def _rule_breach(rule: Any, comparison: RouterComparison) -> bool | None:
    """Whether ``rule`` breaches on the reference reading (its levels from their baseline where it is relative
    to one); ``None`` when it cannot judge it (a slope, a metric not measured, a reading under its minimum)."""
    trend = getattr(rule, "trend", None)
    if trend is not None and trend.kind == "slope":
        return None
    stats = comparison.stats
    value = getattr(stats, rule.metric, None)
    if value is None or value != value or not judged_window(stats.tokens, rule.min_tokens, stats.min_tokens):
        return None
    healthy = None if comparison.baseline is None else getattr(comparison.baseline, rule.metric, None)
    levels = rule.levels(healthy)
    if levels is None:
        return None
    return breached(float(value), levels[0], levels[1])


def _number(value: Any) -> str:
    return "n/a" if value is None or value != value else f"{float(value):.3f}"


def _json_number(value: Any) -> float | None:
    return None if value is None or value != value else round(float(value), 6)
