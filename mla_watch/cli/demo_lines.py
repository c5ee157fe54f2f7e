"""How the demo says what happened, one line each: an alert, a re-tune job, a policy's changes."""

from __future__ import annotations

import math
from typing import Any

from mla_watch.alerting.causes import CAUSE_LABEL
from mla_watch.routing.series import BUSINESS_LINE, ROUTER

__all__ = [
    "alert_bits",
    "alert_line",
    "job_line",
    "policy_changes",
]


def _value(value: Any) -> str:
    """A value as a person reads it: 0.9, 5.0, 512 (a number in a string too); never a Python None (``?``)."""
    if value is None or value == "None":
        return "?"
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    if isinstance(value, float):
        text = f"{value:.6g}"
        return text if any(c in text for c in ".en") else text + ".0"  # 5.0 reads as a threshold, 5 as a count
    return str(value)


def alert_bits(alert: dict[str, Any]) -> float | None:
    """The value a notification carries (its ``value`` annotation), in bits; ``None`` if it carries none."""
    try:
        text = (alert.get("annotations") or {}).get("value")
        if text is None:
            return None
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _bits(text: Any) -> str:
    value = alert_bits({"annotations": {"value": text}})
    return "? bits" if value is None else f"{value:.2f} bits"


def alert_line(alert: dict[str, Any]) -> str:
    """One notification as on-call reads it: what fired (or resolved), where, and what the value is now."""
    labels, notes = alert.get("labels") or {}, alert.get("annotations") or {}
    line = labels.get(BUSINESS_LINE)
    where = f"{labels.get('alertname', 'alert')} on {labels.get(ROUTER, '?')}" + (
        f" ({'all lines' if line == 'all' else line})" if line else ""
    )
    if alert_bits(alert) is None:  # an event (RouterRetuneRejected): its summary says what happened
        summary = " ".join(str(notes.get("summary") or "").split())
        return f"{'resolved' if alert.get('status') == 'resolved' else 'paged'}: {where}" + (
            f": {summary[:200]}" if summary else ""
        )
    if alert.get("status") == "resolved":
        return f"resolved: {where}: {_bits(notes.get('value'))}, back above {_value(notes.get('resolve_threshold'))}"
    cause = labels.get(CAUSE_LABEL)
    said = " ".join(str(notes.get("cause") or "").split())[:200]
    return f"paged: {where}: {_bits(notes.get('value'))}, below {_value(notes.get('threshold'))}" + (
        f"; cause: {cause}" + (f" ({said})" if said else "") if cause else ""
    )


def job_line(job: dict[str, Any]) -> str:
    """A re-tune job as the demo shows it: its status, the version it promoted, and why a candidate was rejected
    (a job waiting after a rejection tries again on newer traffic)."""
    result = job.get("result") or {}
    line = f"job {job['id']} ({result.get('strategy') or '/'.join(job['spec']['strategies'])}): {job['status']}"
    if result.get("version"):
        line += f" -> router version {result['version']}"
    rejected = [a for a in result.get("attempts") or [] if a.get("outcome") == "rejected"]
    if rejected:
        line += f", {rejected[0].get('strategy')} rejected: {' '.join(str(rejected[0].get('reason')).split())[:240]}"
    elif job["status"] == "waiting":
        line += " for more captured traffic"
    return line


def policy_changes(key: str, adjustments: list[dict[str, Any]]) -> list[str]:
    """The adjustments that changed a value the request asked for ("requested -> applied"); the
    defaults a policy filled in where the request said nothing are no event."""
    return [
        f"{key}: {a['param']} {_value(a['requested'])} -> {_value(a['applied'])}"
        for a in adjustments
        if a.get("requested") is not None and a.get("requested") != a.get("applied")
    ]
