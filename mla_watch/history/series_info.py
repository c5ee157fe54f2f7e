"""A series of the routing history: what names it (one router x business line), the order the status page and
``/v1/history`` list series in, and a series' entry in their answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mla_watch.routing.windows import ALL_LINES

__all__ = [
    "SeriesInfo",
    "series_entry",
    "series_info",
    "shown_order",
]


@dataclass(frozen=True)
class SeriesInfo:
    router: str
    business_line: str
    layer: int
    kind: str
    floor_bits: float | None
    ceiling_bits: float | None
    num_slots: int | None


def shown_order(item: tuple[int, SeriesInfo]) -> tuple:
    """Series as the status page and /v1/history list them: ``all`` first, then by line, layer and router."""
    info = item[1]
    return info.business_line != ALL_LINES, info.business_line, info.layer, info.router


def series_entry(info: SeriesInfo, values: list[float | None], too_small: list[bool]) -> dict[str, Any]:
    return {
        "router": info.router,
        "layer": info.layer,
        "kind": info.kind,
        "business_line": info.business_line,
        "floor_bits": info.floor_bits,
        "ceiling_bits": info.ceiling_bits,
        "num_slots": info.num_slots,
        "values": values,
        "too_small": too_small,
    }


def series_info(key: tuple[str, str], meta: tuple) -> SeriesInfo:
    layer, kind, floor_bits, ceiling_bits, num_slots = meta
    return SeriesInfo(
        str(key[0]),
        str(key[1]),
        int(layer),
        str(kind),
        _optional_float(floor_bits),
        _optional_float(ceiling_bits),
        None if num_slots is None else int(num_slots),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
