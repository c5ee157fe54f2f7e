"""Thresholds in rule files: plain numbers, levels relative to the healthy baseline, and trend/predict blocks.

A threshold key (``below``, ``above``, ``resolve_above``, ``resolve_below``) holds a number, or a level
relative to the learned healthy baseline, ``{baseline_times, baseline_plus, floor}`` (above /
resolve_below) or ``{..., ceiling}`` (below / resolve_above).  A rule's ``trend:`` or ``predict:``
block judges a slope or a prediction instead, and may hold the thresholds itself.

Used by :mod:`mla_watch.alerting.rules`; every error names the key path, the value and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mla_watch.alerting.durations import duration_key
from mla_watch.alerting.vocabulary import BaselineScale, Trend
from mla_watch.common.values import is_number
from mla_watch.common.yamlcheck import Checker as _Checker

__all__ = ["format_number", "number_key", "parse_baseline_thresholds", "parse_trend"]


_THRESHOLD_KEYS = ("below", "above", "resolve_above", "resolve_below")
# A trend block may hold the thresholds itself, as the issue wrote `predict: {over: 6h, ahead: 3d, below: 5.0}`.
_TREND_KEYS = ("over", "per", *_THRESHOLD_KEYS)
_PREDICT_KEYS = ("over", "ahead", *_THRESHOLD_KEYS)
_PER_UNITS = {"hour": 3600.0, "day": 86400.0}


def format_number(x: float) -> str:
    """A threshold as people write it: 5.0 -> '5', 6.5 -> '6.5'."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def number_key(chk: _Checker, data: Mapping[str, Any], key: str, path: str) -> float | None:
    if key not in data or data[key] is None:
        return None
    value = data[key]
    if not is_number(value):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = " (YAML reads this as text; write it unquoted)"
            except ValueError:
                pass
        chk.bad(f"{path}.{key}", value, f"a number{hint}")
        return None
    if not math.isfinite(value):
        chk.bad(f"{path}.{key}", value, "a finite number")
        return None
    return float(value)


def parse_trend(chk: _Checker, data: Mapping[str, Any], path: str) -> tuple[Trend | None, Mapping[str, Any], str]:
    """A rule's ``trend:`` / ``predict:`` block, and where its thresholds are: ``(trend, mapping, path)``."""
    given = [key for key in ("trend", "predict") if data.get(key) is not None]
    if len(given) > 1:
        chk.bad(f"{path}.predict", data["predict"], "at most one of trend and predict in a rule")
        return None, data, path
    if not given:
        return None, data, path
    key = given[0]
    bpath = f"{path}.{key}"
    allowed = _TREND_KEYS if key == "trend" else _PREDICT_KEYS
    example = "{over: 6h, per: hour}" if key == "trend" else "{over: 6h, ahead: 3d}"
    block = chk.mapping(bpath, data[key], allowed, f"a mapping such as {example} with keys " + ", ".join(allowed))
    if block is None:
        return None, data, path
    where, wpath = data, path
    inside = [k for k in _THRESHOLD_KEYS if k in block]
    if inside:
        outside = [k for k in _THRESHOLD_KEYS if k in data]
        if outside:
            chk.bad(
                f"{path}.{outside[0]}",
                data[outside[0]],
                f"the thresholds in one place: {bpath} holds {', '.join(inside)} already",
            )
        where, wpath = block, bpath
    if "over" not in block:
        chk.missing(f"{bpath}.over", "the look-back, a duration such as 6h")
    over = duration_key(chk, block, "over", bpath, 0.0, positive=True)
    if key == "trend":
        per = block.get("per", "hour")
        if per not in _PER_UNITS:
            chk.bad(f"{bpath}.per", per, "hour or day (below / above are the slope per that unit)")
            per = "hour"
        return Trend("slope", over, per_seconds=_PER_UNITS[per]), where, wpath
    if "ahead" not in block:
        chk.missing(f"{bpath}.ahead", "how far ahead to predict, a duration such as 3d")
    ahead = duration_key(chk, block, "ahead", bpath, 0.0, positive=True)
    return Trend("predict", over, ahead_seconds=ahead), where, wpath


_UPPER_SIDE = ("above", "resolve_below")  # bounded from below by a floor; the others by a ceiling
_SCALE_EXPECTED = (
    "a number, or a threshold relative to the healthy baseline such as "
    "{baseline_times: 2.0, floor: 1.0} (above / resolve_below) or "
    "{baseline_plus: -0.5, ceiling: 5.0} (below / resolve_above)"
)


def parse_baseline_thresholds(
    chk: _Checker,
    data: Mapping[str, Any],
    path: str,
) -> tuple[Mapping[str, Any], dict[str, BaselineScale]]:
    """Thresholds written relative to the learned healthy baseline: ``(data with each such threshold replaced by
    its bound, the scales by threshold key)``."""
    scales: dict[str, BaselineScale] = {}
    plain = dict(data)
    for key in _THRESHOLD_KEYS:
        raw = data.get(key)
        if not isinstance(raw, dict):
            continue
        bound_key = "floor" if key in _UPPER_SIDE else "ceiling"
        kpath = f"{path}.{key}"
        block = chk.mapping(kpath, raw, ("baseline_times", "baseline_plus", bound_key), _SCALE_EXPECTED)
        plain[key] = None
        if block is None:
            continue
        if "baseline_times" not in block and "baseline_plus" not in block:
            chk.missing(
                f"{kpath}.baseline_times",
                "baseline_times and/or baseline_plus: the threshold as times x healthy + plus",
            )
            continue
        times = number_key(chk, block, "baseline_times", kpath)
        plus = number_key(chk, block, "baseline_plus", kpath)
        if times is not None and not times > 0:
            chk.bad(f"{kpath}.baseline_times", times, "a number > 0 (how many times the healthy value)")
            continue
        if bound_key not in block:
            side = (
                "a floor the threshold never goes below"
                if key in _UPPER_SIDE
                else "a ceiling the threshold never goes above"
            )
            chk.missing(
                f"{kpath}.{bound_key}", f"{side} (a number): a healthy value near zero must not turn noise into a page"
            )
            continue
        plain[key] = block[bound_key]
        scales[key] = BaselineScale(times=1.0 if times is None else times, plus=0.0 if plus is None else plus)
    return plain, scales
