"""Durations in rule files: ``30s``, ``2m``, ``1h30m``, ``500ms`` or seconds; and back, as Prometheus writes them."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from mla_watch.alerting.vocabulary import RuleError
from mla_watch.common.values import is_number
from mla_watch.common.yamlcheck import Checker
from mla_watch.common.yamlcheck import fmt as _fmt

__all__ = ["duration_key", "format_duration", "parse_duration"]

_DURATION_UNITS: tuple[tuple[str, float], ...] = (
    ("w", 7 * 86400.0),
    ("d", 86400.0),
    ("h", 3600.0),
    ("m", 60.0),
    ("s", 1.0),
    ("ms", 0.001),
)
_DURATION_RE = re.compile(
    r"^(?:(\d+(?:\.\d+)?)w)?(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?"
    r"(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?$"
)
_DURATION_HINT = "a duration such as 30s, 2m, 1h or 1h30m (units ms, s, m, h, d, w), or a number of seconds, >= 0"


def parse_duration(text: str | int | float, where: str) -> float:
    """Seconds in a duration: ``"30s"``, ``"2m"``, ``"1h"``, ``"1h30m"``, ``"500ms"``; bare numbers are seconds.

    Raises :class:`RuleError` naming ``where`` for anything else, including negative durations.
    """
    if is_number(text):
        value = float(text)
        if not math.isfinite(value):
            raise RuleError([f"{where} = {_fmt(text)}: expected a finite {_DURATION_HINT}"])
        if value < 0:
            raise RuleError([f"{where} = {_fmt(text)}: expected a non-negative duration ({_DURATION_HINT})"])
        return value
    if not isinstance(text, str):
        raise RuleError([f"{where} = {_fmt(text)}: expected {_DURATION_HINT}"])
    raw = text.strip()
    if raw.startswith("-"):
        raise RuleError([f"{where} = {_fmt(text)}: expected a non-negative duration ({_DURATION_HINT})"])
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
        raise RuleError([f"{where} = {_fmt(text)}: expected a finite {_DURATION_HINT}"])
    match = _DURATION_RE.match(raw)
    if not raw or match is None or not any(match.groups()):
        raise RuleError([f"{where} = {_fmt(text)}: expected {_DURATION_HINT}, largest unit first"])
    return sum(float(part) * scale for part, (_, scale) in zip(match.groups(), _DURATION_UNITS, strict=True) if part)


def format_duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (``"2m"``, ``"1h30m"``, ``"0s"``), to the millisecond."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    parts = []
    for unit, scale in _DURATION_UNITS:
        size = round(scale * 1000)
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts)


def duration_key(
    chk: Checker, data: Mapping[str, Any], key: str, path: str, default: float, positive: bool = False
) -> float:
    if key not in data or data[key] is None:
        return default
    try:
        value = parse_duration(data[key], f"{chk.label}: {path}.{key}")
    except RuleError as exc:
        for error in exc.errors:
            chk.add(f"{path}.{key}", error)
        return default
    if positive and value <= 0:
        chk.bad(f"{path}.{key}", data[key], "a duration > 0")
        return default
    return value
