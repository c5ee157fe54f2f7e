"""Where a re-tuned router's metric must lie (no torch: job specs, which the torch-free job store keeps, carry one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_BAND", "Band"]


@dataclass(frozen=True)
class Band:
    """Where a router metric must lie: ``low <= value <= high`` (either side may be open)."""

    metric: str = "entropy_bits"
    low: float | None = None
    high: float | None = None

    def contains(self, value: float) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"{self.low:g} <= {self.metric} <= {self.high:g}"
        if self.low is not None:
            return f"{self.metric} >= {self.low:g}"
        if self.high is not None:
            return f"{self.metric} <= {self.high:g}"
        return f"any {self.metric}"

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "low": self.low, "high": self.high}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Band:
        return cls(metric=str(data.get("metric", "entropy_bits")), low=data.get("low"), high=data.get("high"))


# The band of the shipped RoutingEntropyLow (fires below 5.0 bits, resolves at 5.2: band_of_rule takes the resolve
# threshold): a job no rule asks for (an admin request while no rule has a `retune` action) must meet it.
DEFAULT_BAND = Band("entropy_bits", low=5.2)
