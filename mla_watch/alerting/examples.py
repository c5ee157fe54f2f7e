"""The RoutingEntropyLow rule file that the demo, the benchmarks and the end-to-end tests write.

One builder instead of the same YAML inlined in each: every caller varies only the thresholds,
the actions and the annotations. The shipped rules (``mla_watch/shipped/rules``) are the
production ones; this file is for a sidecar started to show or measure one loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

__all__ = ["entropy_low_rules"]


def entropy_low_rules(
    *,
    below: float = 5.0,
    resolve_above: float = 5.2,
    hold: str = "0s",
    min_tokens: int = 64,
    actions: Sequence[str] = ("notify",),
    strategies: Sequence[str] = (),
    business_line: str | None = None,
    group_by: bool = True,
    group_wait: str = "0s",
    group_interval: str = "0s",
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> str:
    """A rules file: receiver ``oncall`` at ``${MLA_WATCH_ONCALL_URL}`` and one RoutingEntropyLow rule
    over every expert router (``business_line``: a selector such as ``all`` or ``"*"``). The receiver notifies
    at the next evaluation (``group_wait``, ``group_interval`` 0 s): a loop shown or measured pages at once."""
    select = {"kind": "expert", **({"business_line": business_line} if business_line is not None else {})}
    lines = ["receivers:", "  - name: oncall", "    type: alertmanager_webhook", "    url: ${MLA_WATCH_ONCALL_URL}"]
    if group_by:
        lines.append("    group_by: [alertname, router, layer, business_line]")
    lines += [f"    group_wait: {group_wait}", f"    group_interval: {group_interval}"]
    lines += [
        "rules:",
        "  - alert: RoutingEntropyLow",
        "    metric: entropy_bits",
        f"    select: {json.dumps(select)}",
        f"    below: {below}",
        f"    resolve_above: {resolve_above}",
        f"    for: {hold}",
        f"    min_tokens: {min_tokens}",
        "    severity: critical",
        f"    actions: [{', '.join(actions)}]",
    ]
    if strategies:
        lines.append(f"    retune_strategy: [{', '.join(strategies)}]")
    if labels:
        lines.append(f"    labels: {json.dumps(dict(labels))}")
    if annotations:
        lines.append("    annotations:")
        lines += [f"      {key}: {json.dumps(value)}" for key, value in annotations.items()]
    return "\n".join(lines) + "\n"
