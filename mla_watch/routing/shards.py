"""Router shards: a fleet's routing series split by layer, so that several Prometheus servers (or rule groups)
each take a share.

Shard ``K/N`` holds the routers whose layer number modulo ``N`` is ``K``. The fleet statistics are per router and
business line, so a shard computes its routers' statistics exactly from its own series: no shard needs another's.
The same partition is written twice - as a sidecar's ``GET /metrics?shard=K/N`` (what it serves) and as a PromQL
label matcher (what a rule group selects) - and both come from here. ``N`` divides 100, so that the matcher is a
regular expression on the layer number's last two digits, whatever the model's depth.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_watch.common.describe import describe_value

__all__ = ["SHARD_COUNTS", "SHARD_FORM", "RouterShard"]

SHARD_COUNTS: tuple[int, ...] = tuple(n for n in range(1, 101) if 100 % n == 0)  # 1, 2, 4, 5, 10, 20, 25, 50, 100
SHARD_FORM = f"K/N with N one of {', '.join(map(str, SHARD_COUNTS))} and K from 0 to N-1 (e.g. 3/10)"
_MAX_CHARS = 16


@dataclass(frozen=True)
class RouterShard:
    """The routers whose layer number modulo ``count`` is ``index``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count not in SHARD_COUNTS or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: expected {SHARD_FORM}")

    @classmethod
    def parse(cls, text: object, where: str) -> RouterShard:
        """The shard ``text`` (``"3/10"``) names; ``ValueError`` naming ``where`` (a flag, or ``param=``), the value
        and the form."""
        index, sep, count = text.partition("/") if isinstance(text, str) and len(text) <= _MAX_CHARS else ("", "", "")
        if not (
            sep
            and index.isdigit()
            and count.isdigit()
            and index.isascii()
            and count.isascii()
            and int(count) in SHARD_COUNTS
            and int(index) < int(count)
        ):
            shown = f"{where}{describe_value(text)}" if where.endswith("=") else f"{where} {describe_value(text)}"
            raise ValueError(f"{shown}: expected {SHARD_FORM}")
        return cls(int(index), int(count))

    @classmethod
    def split(cls, count: int) -> tuple[RouterShard, ...]:
        """Every shard of ``count``, in order."""
        return tuple(cls(index, count) for index in range(count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, layer: int) -> bool:
        return layer % self.count == self.index

    def layer_regex(self) -> str:
        """An RE2 expression (anchored, as PromQL anchors it) that matches the decimal layer numbers of this shard:
        a number's residue modulo a divisor of 100 is its last two digits' residue."""
        residues = [r for r in range(100) if r % self.count == self.index]
        if self.count == 1:
            return "[0-9]+"
        short = [str(r) for r in residues if r < 10]  # one-digit numbers have no second-to-last digit
        return "|".join([f"[0-9]*(?:{'|'.join(f'{r:02d}' for r in residues)})", *short])
