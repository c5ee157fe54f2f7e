"""Selectors in rule files: which routers a rule watches (``select: {kind, layers, router, business_line,
slots, hash_routed}``).

Used by :mod:`mla_watch.alerting.rules`; every error names the key path, the value and what was expected.
"""

from __future__ import annotations

import re

from mla_watch.alerting.vocabulary import Selector, SlotRange
from mla_watch.common.values import is_integer
from mla_watch.common.yamlcheck import Checker as _Checker
from mla_watch.common.yamlcheck import fmt as _fmt
from mla_watch.routing.stats import KINDS

__all__ = ["SELECTOR_NAME_RE", "parse_selector"]


_SELECT_KEYS = ("kind", "layers", "router", "business_line", "slots", "hash_routed")
_SLOTS_EXPECTED = (
    "a number of slots (64), an inclusive range ([8, 63], null for no upper end), or either under `not:` ({not: 64})"
)
SELECTOR_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_selector(chk: _Checker, path: str, raw: object) -> Selector:
    if raw is None:
        return Selector()
    data = chk.mapping(path, raw, _SELECT_KEYS, "with keys " + ", ".join(_SELECT_KEYS))
    if data is None:
        return Selector()
    kind = data.get("kind")
    if kind is not None and kind not in KINDS:
        chk.bad(f"{path}.kind", kind, "one of: expert, indexer (any other kind matches no router)")
        kind = None
    layers = None
    raw_layers = data.get("layers")
    if raw_layers is not None:
        if is_integer(raw_layers):
            raw_layers = [raw_layers, raw_layers]
        if not isinstance(raw_layers, list) or len(raw_layers) != 2 or not all(is_integer(x) for x in raw_layers):
            chk.bad(f"{path}.layers", raw_layers, "[first, last]: two integers, an inclusive range of layer indices")
        elif raw_layers[0] > raw_layers[1]:
            chk.bad(
                f"{path}.layers",
                raw_layers,
                f"[first, last] with first <= last; [{raw_layers[0]}, {raw_layers[1]}] matches no layer",
            )
        elif raw_layers[1] < -1:
            chk.bad(f"{path}.layers", raw_layers, "a range that includes layers >= -1; it matches no layer")
        else:
            layers = (raw_layers[0], raw_layers[1])
    router = data.get("router")
    if router is not None:
        if not isinstance(router, str) or not router:
            chk.bad(f"{path}.router", router, "a glob over router module names, e.g. '*.mlp.gate'")
            router = None
        elif router == "*":
            router = None
        elif router.count("[") != router.count("]"):
            chk.bad(f"{path}.router", router, "a glob with balanced [ ] brackets")
            router = None
    line = data.get("business_line")
    if line is not None and (not isinstance(line, str) or not (line == "*" or SELECTOR_NAME_RE.match(line))):
        chk.bad(f"{path}.business_line", line, "a business line name or '*' (every line, one alert per line)")
        line = None
    slots = _parse_slots(chk, f"{path}.slots", data.get("slots")) if "slots" in data else None
    hashed = data.get("hash_routed", False)
    if not isinstance(hashed, bool):
        chk.bad(
            f"{path}.hash_routed", hashed, "true (watch hash routers only) or false (the default: learned routers only)"
        )
        hashed = False
    return Selector(kind=kind, layers=layers, router=router, business_line=line, slots=slots, hash_routed=hashed)


def _parse_slots(chk: _Checker, path: str, raw: object) -> SlotRange | None:
    exclude = False
    if isinstance(raw, dict):
        if set(raw) != {"not"}:
            chk.bad(path, raw, _SLOTS_EXPECTED)
            return None
        raw, exclude = raw["not"], True

    def count(value: object) -> bool:
        return is_integer(value) and value >= 1

    if count(raw):
        return SlotRange(raw, raw, exclude)  # type: ignore[arg-type]
    if isinstance(raw, list) and len(raw) == 2 and count(raw[0]) and (raw[1] is None or count(raw[1])):
        if raw[1] is not None and raw[1] < raw[0]:
            chk.bad(path, raw, f"[low, high] with low <= high; {_fmt(raw)} matches no router")
            return None
        return SlotRange(raw[0], raw[1], exclude)
    chk.bad(path, raw, _SLOTS_EXPECTED)
    return None
