"""The rule linter: does each rule make sense on each router it watches, given that router's geometry?

``mla-watch check`` runs :func:`lint` against the model's routers before anything is served: a rule
"below X" with X above a router's ceiling always fires, "above X" over its ceiling never can, and a
``min_tokens`` too small for the router reads low however healthy it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.rules import format_number as num
from mla_watch.alerting.trend import MIN_POINTS
from mla_watch.alerting.vocabulary import Rule, RuleSet, Selector
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import entropy_bounds, minimum_window_tokens

__all__ = ["HISTORY_INTERVAL_SECONDS", "HISTORY_RETENTION_SECONDS", "LintFinding", "applies_to", "lint"]

# The routing history's defaults that trend rules are linted against (its own settings may differ).
HISTORY_INTERVAL_SECONDS = 10.0
HISTORY_RETENTION_SECONDS = 30 * 86400.0


@dataclass(frozen=True)
class LintFinding:
    """One problem of one rule on one router (``router`` is None for rule-wide findings)."""

    severity: Literal["error", "warning", "info"]
    rule: str
    router: str | None
    message: str
    code: str = ""  # "never_fires" for a threshold the router's range cannot reach

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"


@dataclass(frozen=True)
class _Range:
    low: float
    high: float
    low_why: str  # e.g. "its floor is log2 6 = 2.585 bits"
    high_why: str
    unit: str = ""
    applies: bool = True  # False: the metric is never reported for this router
    why_not: str = ""


def _log2_text(n: int) -> str:
    return f"log2 {n} = {math.log2(n):.3f} bits"


def _metric_range(metric: str, info: RouterInfo) -> _Range:
    n = info.num_slots
    k = min(info.top_k, n)
    floor, ceiling = entropy_bounds(n, info.top_k)
    indexer = info.kind == "indexer"
    context = f" (at the full context of {n} positions; shorter contexts read lower)" if indexer else ""
    per = "key position" if indexer else "expert"
    if metric == "entropy_bits":
        if indexer:
            return _Range(
                0.0,
                ceiling,
                f"an indexer reads as low as 0 bits on short contexts (its floor is "
                f"{_log2_text(k)} only once contexts exceed index_topk = {k})",
                f"its ceiling is {_log2_text(n)}{context}",
                " bits",
            )
        return _Range(
            floor,
            ceiling,
            f"its floor is {_log2_text(k)} (every token picks {k} distinct {per}s)",
            f"its ceiling is {_log2_text(n)}{context}",
            " bits",
        )
    if metric == "bits_below_ceiling":
        span = ceiling if indexer else ceiling - floor
        return _Range(
            0.0,
            span,
            "an entropy cannot exceed its ceiling (0 bits below it)",
            f"it is at most {span:.3f} bits below its ceiling (ceiling {_log2_text(n)}"
            + (")" if indexer else f", floor {_log2_text(k)})"),
            " bits",
        )
    if metric == "normalized_entropy":
        return _Range(
            0.0, 1.0, "normalized entropy is at least 0 (the floor)", "normalized entropy is at most 1 (the ceiling)"
        )
    if metric == "max_violation":
        if indexer:
            return _Range(
                0.0,
                n - 1.0,
                "MaxVio is at least 0 (perfect balance)",
                f"MaxVio is at most N - 1 = {n - 1} (every query picking the same one of {n} positions)",
            )
        top = n / k - 1.0
        return _Range(
            0.0,
            top,
            "MaxVio is at least 0 (perfect balance)",
            f"MaxVio is at most N/k - 1 = {n}/{k} - 1 = {top:.3f} (an expert picked by every token)",
        )
    if metric == "dead_slots":
        if indexer:
            return _Range(
                0.0,
                n - 1.0,
                "dead slots are at least 0",
                f"at most N - 1 = {n - 1} of its {n} key positions can be dead{context}",
            )
        return _Range(
            0.0,
            float(n - k),
            "dead slots are at least 0",
            f"at most N - k = {n} - {k} = {n - k} {per}s can be dead (every token picks {k})",
        )
    if metric == "js_divergence":
        return _Range(
            0.0,
            1.0,
            "Jensen–Shannon divergence is at least 0 bits",
            "Jensen–Shannon divergence is at most 1 bit",
            " bits",
        )
    if metric == "long_context_drift":
        if indexer:
            return _Range(
                0.0,
                1.0,
                "",
                "",
                applies=False,
                why_not="routing by position is counted for expert routers, and this is an indexer",
            )
        return _Range(
            0.0,
            1.0,
            "Jensen–Shannon divergence is at least 0 bits",
            "Jensen–Shannon divergence is at most 1 bit",
            " bits",
        )
    if metric == "locality":
        if not indexer:
            return _Range(
                0.0,
                1.0,
                "",
                "",
                applies=False,
                why_not="locality is only reported for indexers, and this is an expert router",
            )
        return _Range(0.0, 1.0, "locality is at least 0", "locality is at most 1 (a pure sliding window)")
    raise ValueError(f"unknown metric {metric!r}")


def _router_text(info: RouterInfo) -> str:
    return f"{info.name} ({info.kind}, layer {info.layer}, {info.num_slots} slots, top-{info.top_k})"


def _lint_router(rule: Rule, info: RouterInfo, tolerance_bits: float) -> list[LintFinding]:
    findings: list[LintFinding] = []
    head = f"{rule.name} ({rule.source})" if rule.source else rule.name

    def add(severity: Literal["error", "warning"], text: str) -> None:
        code = "never_fires" if " can never fire on " in text else ""
        findings.append(LintFinding(severity, rule.name, info.name, f"{head}: {text}", code))

    rng = _metric_range(rule.metric, info)
    where = _router_text(info)
    if not rng.applies:
        add("warning", f"{rule.metric} can never fire on {where}: {rng.why_not}")
        return findings
    u = rng.unit
    if rule.trend is not None and rule.trend.kind == "slope":
        findings.extend(_lint_slope(rule, rng, info, head))
    else:
        # A steady series predicts its own level, so a predicted threshold is judged against the
        # metric's range like a plain one.
        what = rule.metric
        if rule.trend is not None:
            what = f"{rule.metric} predicted {format_duration(rule.trend.ahead_seconds)} ahead"
        if rule.above is not None:
            if rule.above >= rng.high:
                add(
                    "warning",
                    f"{what} above {num(rule.above)}{u} can never fire on {info.name}: {rng.high_why}. Router: {where}",
                )
            elif rule.above < rng.low:
                add(
                    "error",
                    f"{what} above {num(rule.above)}{u} always fires on {info.name}: {rng.low_why}. Router: {where}",
                )
            elif rule.above == rng.low:
                add(
                    "warning",
                    f"{what} above {num(rule.above)}{u} fires on {info.name} unless it sits exactly at "
                    f"its minimum: {rng.low_why}. Router: {where}",
                )
            if rule.resolve_below is not None and rule.resolve_below < rng.low and rule.above < rng.high:
                add(
                    "error",
                    f"{what} resolve_below {num(rule.resolve_below)}{u} can never be reached on "
                    f"{info.name}, so once firing the alert never resolves: {rng.low_why}. Router: {where}",
                )
        if rule.below is not None:
            if rule.below <= rng.low:
                add(
                    "warning",
                    f"{what} below {num(rule.below)}{u} can never fire on {info.name}: {rng.low_why}. Router: {where}",
                )
            elif rule.below > rng.high:
                add(
                    "error",
                    f"{what} below {num(rule.below)}{u} always fires on {info.name}: {rng.high_why}. Router: {where}",
                )
            elif rule.below == rng.high:
                add(
                    "warning",
                    f"{what} below {num(rule.below)}{u} fires on {info.name} unless it is perfectly "
                    f"balanced: {rng.high_why}. Router: {where}",
                )
            if rule.resolve_above is not None and rule.resolve_above > rng.high and rule.below > rng.low:
                add(
                    "error",
                    f"{what} resolve_above {num(rule.resolve_above)}{u} can never be reached on "
                    f"{info.name}, so once firing the alert never resolves: {rng.high_why}. Router: {where}",
                )

    if rule.min_tokens is not None and rule.metric != "locality":
        needed = minimum_window_tokens(info.num_slots, info.top_k, tolerance_bits)
        if rule.min_tokens < needed:
            k = min(info.top_k, info.num_slots)
            bias = (info.num_slots - 1) / (2.0 * rule.min_tokens * k * math.log(2.0))
            add(
                "warning",
                f"minimum window too small on {info.name}: min_tokens {rule.min_tokens} lets windows of "
                f"{rule.min_tokens} tokens be judged, where even a perfectly balanced router reads about "
                f"{bias:.3f} bits low (small-window bias (N-1)/(2·T·k·ln 2) with N={info.num_slots}, k={k}, "
                f"T={rule.min_tokens}); recommended min_tokens >= {needed} (bias <= {tolerance_bits:g} bits), "
                "or leave min_tokens out to use the router's own minimum. Router: " + where,
            )
    return findings


def _lint_slope(rule: Rule, rng: _Range, info: RouterInfo, head: str) -> list[LintFinding]:
    """A slope threshold against the metric's range: a steady series has slope 0."""
    assert rule.trend is not None
    unit = "hour" if rule.trend.per_seconds == 3600.0 else "day"
    where = _router_text(info)
    span = rng.high - rng.low
    over = format_duration(rule.trend.over_seconds)
    out: list[LintFinding] = []
    for side, threshold in (("below", rule.below), ("above", rule.above)):
        if threshold is None:
            continue
        if (threshold >= 0) if side == "below" else (threshold <= 0):
            out.append(
                LintFinding(
                    "error",
                    rule.name,
                    info.name,
                    f"{head}: the slope of {rule.metric} {side} "
                    f"{num(threshold)}{rng.unit} per {unit} always fires on {info.name}: a steady "
                    f"series has slope 0. Router: {where}",
                )
            )
        elif abs(threshold) * rule.trend.over_seconds / rule.trend.per_seconds > span:
            out.append(
                LintFinding(
                    "warning",
                    rule.name,
                    info.name,
                    f"{head}: the slope of {rule.metric} {side} "
                    f"{num(threshold)}{rng.unit} per {unit} can never fire on {info.name}: over the "
                    f"{over} look-back it means a change of more than the metric's whole range there "
                    f"({rng.low:.3f} to {rng.high:.3f}{rng.unit}). Router: {where}",
                )
            )
    return out


def _lint_trend(rule: Rule, head: str, interval: float, retention: float, with_history: bool) -> list[LintFinding]:
    """Rule-wide findings of a trend rule: the history it needs, and look-backs it cannot have."""
    trend = rule.trend
    assert trend is not None
    out: list[LintFinding] = []

    def add(text: str) -> None:
        out.append(LintFinding("warning", rule.name, None, f"{head}: {text}"))

    kind = "trend" if trend.kind == "slope" else "predict"
    if not with_history:
        add(
            f"a {kind} rule is judged from the routing history, and an alert engine without one (no "
            "trend_source) never judges it"
        )
    over = format_duration(trend.over_seconds)
    if trend.over_seconds < (MIN_POINTS - 1) * interval:
        add(
            f"the look-back over: {over} can never be judged: it holds at most "
            f"{int(trend.over_seconds // interval) + 1} points at the history interval of "
            f"{format_duration(interval)}, and a trend needs {MIN_POINTS}; make it at least "
            f"{format_duration((MIN_POINTS - 1) * interval)} (hours, for a trend that is not noise)"
        )
    if trend.over_seconds > retention:
        add(f"the look-back over: {over} is longer than the history keeps ({format_duration(retention)})")
    if trend.ahead_seconds > retention:
        add(
            f"predicts ahead: {format_duration(trend.ahead_seconds)}, further ahead than the history keeps "
            f"({format_duration(retention)}): a line fitted over {over} says little that far out"
        )
    return out


def _selector_text(selector: Selector) -> str:
    parts = []
    if selector.kind is not None:
        parts.append(f"kind: {selector.kind}")
    if selector.layers is not None:
        parts.append(f"layers: [{selector.layers[0]}, {selector.layers[1]}]")
    if selector.router is not None:
        parts.append(f"router: {selector.router!r}")
    if selector.slots is not None:
        parts.append(f"slots: {selector.slots}")
    return "{" + ", ".join(parts) + "}" if parts else "{} (every router)"


def lint(
    rules: RuleSet,
    routers: Sequence[RouterInfo],
    *,
    tolerance_bits: float = 0.05,
    history_interval_seconds: float = HISTORY_INTERVAL_SECONDS,
    history_retention_seconds: float = HISTORY_RETENTION_SECONDS,
    with_history: bool = False,
) -> list[LintFinding]:
    """Check each rule against each router its selector matches (``business_line`` is ignored).

    Errors: a threshold that pages for ever on that router ("always fires", "never resolves").
    Warnings: a threshold that can never fire there (the rule is inert on that router, which is
    worth knowing but harms nothing - the shipped "above 6.5 bits" on 64 experts is one), a
    ``min_tokens`` below the router's trusted minimum (:func:`~mla_watch.routing.minimum_window_tokens`),
    a threshold at the very edge of the range, a selector that matches none of the routers.
    One finding per (rule, router) problem, in rule order then router order.

    Trend rules also get rule-wide warnings: ``with_history`` False (the default until the server
    reads one: the engine that serves them has no routing history, so they are never judged), a
    look-back too short for the history's interval to give enough points, a look-back or a
    prediction further than the history's retention (the history's settings, with defaults of
    :data:`HISTORY_INTERVAL_SECONDS` and :data:`HISTORY_RETENTION_SECONDS`). A slope threshold
    that a steady series passes is an error; one that needs more than the metric's whole range
    within the look-back can never fire.
    """
    findings: list[LintFinding] = []
    for rule in rules.rules:
        if rule.trend is not None:
            head = f"{rule.name} ({rule.source})" if rule.source else rule.name
            findings.extend(_lint_trend(rule, head, history_interval_seconds, history_retention_seconds, with_history))
        selector = dataclasses.replace(rule.selector, business_line=None)
        matched = [info for info in routers if selector.matches(info.as_dict())]
        if not matched:
            head = f"{rule.name} ({rule.source})" if rule.source else rule.name
            kinds = sorted({info.kind for info in routers})
            layers = sorted({info.layer for info in routers})
            span = f"layers {layers[0]}..{layers[-1]}" if layers else "no layers"
            others = [info for info in routers if dataclasses.replace(selector, slots=None).matches(info.as_dict())]
            if rule.selector.slots is not None and others:
                # A rule for another geometry (the seed's 64 experts, or everything else): as it should be.
                slots = sorted({info.num_slots for info in others})
                findings.append(
                    LintFinding(
                        "info",
                        rule.name,
                        None,
                        f"{head}: for routers of slots {rule.selector.slots}; this model's "
                        f"have {', '.join(map(str, slots))}, so it does not apply here",
                    )
                )
                continue
            if rule.selector.kind is not None and rule.selector.kind not in kinds:
                # A rule for a kind of router this model has none of (DSA indexers on Mixtral): as it should be.
                findings.append(
                    LintFinding(
                        "info",
                        rule.name,
                        None,
                        f"{head}: for {rule.selector.kind} routers; this model has none "
                        f"(kinds: {', '.join(kinds) or 'none'}), so it does not apply here",
                    )
                )
                continue
            findings.append(
                LintFinding(
                    "warning",
                    rule.name,
                    None,
                    f"{head}: selector {_selector_text(rule.selector)} matches none of the model's {len(routers)} "
                    f"routers (kinds: {', '.join(kinds) or 'none'}; {span}); this rule will never be evaluated",
                )
            )
            continue
        if rule.baseline:
            head = f"{rule.name} ({rule.source})" if rule.source else rule.name
            findings.append(
                LintFinding(
                    "info",
                    rule.name,
                    None,
                    f"{head}: judges {rule.metric} against the healthy baseline learned for each "
                    "router and line (serve learns one once a window holds --baseline-tokens of healthy traffic); "
                    "silent where none is learned yet",
                )
            )
        found = [finding for info in matched for finding in _lint_router(rule, info, tolerance_bits)]
        findings.extend(_merge_never_fires(rule, matched, found))
    return findings


def applies_to(rule: Rule, routers: Sequence[RouterInfo]) -> bool:
    """Whether ``rule``'s selector takes any of ``routers`` (business lines aside)."""
    selector = dataclasses.replace(rule.selector, business_line=None)
    return any(selector.matches(info.as_dict()) for info in routers)


def _merge_never_fires(rule: Rule, matched: Sequence[RouterInfo], found: list[LintFinding]) -> list[LintFinding]:
    """A threshold none of the selected routers can reach is one finding, not one per router; and an info, not a
    warning, when the rule says why it is expected (``lint_expect: {never_fires: ...}``)."""
    inert = [finding for finding in found if finding.code == "never_fires"]
    if len(inert) < len(matched) or not inert:
        return found
    rest = [finding for finding in found if finding.code != "never_fires"]
    first = inert[0].message.split(". Router: ")[0]
    text = (
        first.replace(
            f" on {inert[0].router}:",
            f" on any of the {len(inert)} routers it selects "
            f"({', '.join(f.router or '' for f in inert[:4])}"
            f"{', ...' if len(inert) > 4 else ''}); on {inert[0].router}:",
        )
        if len(inert) > 1
        else first
    )
    why = rule.lint_expect.get("never_fires")
    if why is not None:
        return [LintFinding("info", rule.name, None, f"{text}. Expected: {why}", "never_fires"), *rest]
    return [LintFinding("warning", rule.name, None, text, "never_fires"), *rest]
