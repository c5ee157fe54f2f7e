"""What a router is (:class:`RouterInfo`), the one shape its counts travel in (:class:`CountDelta`) and the name of
its correction bias (:data:`CORRECTION_BIAS`); no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mla_watch.common.values import is_integer
from mla_watch.routing.stats import KINDS, Kind

__all__ = ["CORRECTION_BIAS", "CountDelta", "RouterInfo", "parse_zero_slots"]

# DeepSeek-V3's per-expert bias beside a gate's weight (auxiliary-loss-free balancing): added to the scores for the
# top-k choice only. The leaf name of that tensor in a model, a checkpoint and an engine.
CORRECTION_BIAS = "e_score_correction_bias"


@dataclass(frozen=True)
class RouterInfo:
    """What one router is: where it sits and how many slots it chooses from.

    ``zero_slots`` are slots that are zero-compute experts (LongCat-Flash's zero experts, Zaya's skip expert):
    a pick of one is a real routing decision - the token skips expert compute - so it is counted in its own
    slot rather than dropped, and readers can tell those slots apart. ``hash_routed`` marks a router whose choice
    is a fixed lookup of the token id (DeepSeek-V4's first MoE layers), not a learned score: its entropy
    describes the traffic's vocabulary, not the router's health, and may sit below ``log2 top_k`` when the
    lookup table repeats an expert. Both default to the plain learned router and are left out of
    :meth:`as_dict` then, so records of plain routers keep their exact shape.
    """

    name: str
    layer: int
    kind: Kind
    num_slots: int
    top_k: int
    zero_slots: tuple[int, ...] = ()
    hash_routed: bool = False

    def as_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "name": self.name,
            "layer": self.layer,
            "kind": self.kind,
            "num_slots": self.num_slots,
            "top_k": self.top_k,
        }
        if self.zero_slots:
            record["zero_slots"] = list(self.zero_slots)
        if self.hash_routed:
            record["hash_routed"] = True
        return record

    @classmethod
    def from_dict(cls, data: Any, where: str = "router") -> RouterInfo:
        """Parse a record of :meth:`as_dict`, with errors naming ``where``, the key and the value."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object with name, layer, kind, num_slots, top_k; got {data!r}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name = {name!r}: expected a non-empty string")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{where}.kind = {kind!r}: expected 'expert' or 'indexer'")
        values = {}
        for key, lowest in (("layer", -1), ("num_slots", 1), ("top_k", 1)):
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{where}.{key} = {value!r}: expected an integer >= {lowest}")
            values[key] = value
        zero_slots = parse_zero_slots(data.get("zero_slots", []), values["num_slots"], f"{where}.zero_slots")
        hash_routed = data.get("hash_routed", False)
        if not isinstance(hash_routed, bool):
            raise ValueError(f"{where}.hash_routed = {hash_routed!r}: expected true or false")
        return cls(name=name, kind=kind, zero_slots=zero_slots, hash_routed=hash_routed, **values)


def parse_zero_slots(value: Any, num_slots: int, where: str) -> tuple[int, ...]:
    """A list of distinct slot numbers in ``[0, num_slots)``, as :attr:`RouterInfo.zero_slots` keeps them."""
    if not isinstance(value, list | tuple) or not all(is_integer(slot) and 0 <= slot < num_slots for slot in value):
        raise ValueError(f"{where} = {value!r}: expected a list of slot numbers in [0, {num_slots})")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} = {value!r}: expected distinct slot numbers")
    return tuple(sorted(value))


@dataclass
class CountDelta:
    """What one router chose for one business line over some tokens: the one shape counts travel in,
    from the probe to the windows, the shipper and the ingestion wire."""

    counts: np.ndarray  # int64, one per slot
    tokens: int
    local_selections: int = 0
    choice_selections: int = 0

    def merge(self, other: CountDelta) -> None:
        """Add ``other`` into this delta (sums of the same router and line)."""
        self.counts = self.counts + other.counts
        self.tokens += other.tokens
        self.local_selections += other.local_selections
        self.choice_selections += other.choice_selections
