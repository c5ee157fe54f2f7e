"""Annotation templates: a rule's ``summary`` and friends rendered over an alert's fields.

The one renderer of the engine and the service: ``str.format`` syntax over TEMPLATE_FIELDS, and
lenient, because an alert must never be lost to a template.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from mla_watch.alerting.vocabulary import Rule

__all__ = ["render_annotations"]


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return "n/a"


class _LenientFormatter(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None:
            return "n/a"
        try:
            return format(value, format_spec)
        except (ValueError, TypeError):
            return str(value)


def render_annotations(rule: Rule, fields: Mapping[str, object]) -> dict[str, str]:
    """Each of ``rule.annotations`` rendered with ``str.format_map`` over ``fields`` (TEMPLATE_FIELDS).

    ``alertname``, ``metric``, ``severity``, ``threshold``, ``resolve_threshold`` and ``min_tokens``
    default to the rule's own values. A missing or ``None`` field renders as ``n/a``; a format spec
    that does not suit the value (``{value:.2f}`` with text) falls back to ``str(value)``: an alert
    is never lost to a template.
    """
    threshold = rule.below if rule.below is not None else rule.above
    resolve = rule.resolve_above if rule.below is not None else rule.resolve_below
    defaults: dict[str, object] = {
        "alertname": rule.name,
        "metric": rule.metric,
        "severity": rule.severity,
        "threshold": threshold,
        "resolve_threshold": resolve if resolve is not None else threshold,
        "min_tokens": rule.min_tokens,
    }
    values = _Fields({**defaults, **{k: v for k, v in fields.items() if v is not None or k not in defaults}})
    formatter = _LenientFormatter()
    out: dict[str, str] = {}
    for key, template in rule.annotations.items():
        try:
            out[key] = formatter.vformat(template, (), values)
        except (ValueError, KeyError, IndexError, AttributeError, TypeError):
            out[key] = template
    return out
