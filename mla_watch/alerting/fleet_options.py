"""How the fleet rules select, group and judge: the ``rules export --fleet*`` flags as :class:`FleetOptions`, and their
checks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mla_watch.alerting.durations import format_duration
from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.routing.series import (
    DEFAULT_JOB,
    EXPERT,
    INSTANCE,
    JOB,
    ROUTER_LABELS,
    SERIES_LABELS,
)
from mla_watch.routing.shards import SHARD_COUNTS

__all__ = [
    "DEFAULT_FLEET_LABELS",
    "DEFAULT_INTERVAL_SECONDS",
    "DEFAULT_OUTLIER_BITS",
    "DEFAULT_OUTLIER_FACTOR",
    "DEFAULT_OUTLIER_INTERVAL_SECONDS",
    "DEFAULT_REPLICA_LABEL",
    "DEFAULT_SHARDS",
    "OUTLIER_FOR_SECONDS",
    "SCOPE_LABEL",
    "SHARD_LABEL",
    "FleetOptions",
    "parse_label_list",
]

SCOPE_LABEL = "scope"  # "fleet" on the twins, "replica" on every per-replica alert: Alertmanager routes on it
SHARD_LABEL = "fleet_shard"  # "K/N" on what a shard's group records and fires, where the fleet is split
DEFAULT_FLEET_LABELS: tuple[str, ...] = (JOB,)
DEFAULT_REPLICA_LABEL = INSTANCE
DEFAULT_SHARDS = 1
# The fleet group passes over every replica's per-expert series once an evaluation, the replica group twice (its
# own fleet shares, then each replica's cross-entropy with them: bench/fleet_rules.py). The fleet's statistics
# follow the windows minute by minute; a replica apart from its peers is judged over ten minutes, so its group
# runs less often.
DEFAULT_INTERVAL_SECONDS = 60.0
DEFAULT_OUTLIER_INTERVAL_SECONDS = 300.0
# A replica whose routing carries 0.1 bits of its own against the fleet's mix, and 3 times its peers' median:
# one collapsed replica of three (8 experts top-2, two experts left) reads 1 bit, its healthy peers 0.19.
DEFAULT_OUTLIER_BITS = 0.1
DEFAULT_OUTLIER_FACTOR = 3.0
OUTLIER_FOR_SECONDS = 600.0  # ten minutes apart from its peers is no blip
_RESERVED = frozenset({*SERIES_LABELS, EXPERT, "le", "quantile", "alertname", "severity", SCOPE_LABEL, SHARD_LABEL})
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_LABELS = 8
_MAX_LABEL_CHARS = 64
_MAX_INTERVAL_SECONDS = 3600.0


def _bad(field: str, shown: str, expected: str, problem: str = "") -> SettingsError:
    return SettingsError([SettingProblem(f"fleet_rules.{field}", shown, expected, problem=problem)])


def _check_label(name: str, field: str, given: str) -> str:
    if len(name) > _MAX_LABEL_CHARS or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
        raise _bad(
            field,
            repr(given[:200]),
            "letters, digits and '_', not starting with a digit or '__'",
            f"{name[:80]!r} is not a Prometheus label name",
        )
    if name in _RESERVED:
        raise _bad(
            field,
            repr(given[:200]),
            "the label(s) your scrape config puts on every target",
            f"{name!r} is a label the rules set or aggregate by themselves",
        )
    return name


def parse_label_list(text: str) -> tuple[str, ...]:
    """Comma-separated label names (``job`` or ``namespace,deployment``); a ``SettingsError`` naming
    ``fleet_rules.fleet_labels``."""
    names = tuple(part.strip() for part in text.split(",")) if len(text) <= 1024 else ()
    if not names or any(not name for name in names) or len(names) > _MAX_LABELS:
        raise _bad(
            "fleet_labels",
            repr(text[:200]),
            f"1 to {_MAX_LABELS} label names separated by ',' (e.g. job, or namespace,deployment)",
        )
    for name in names:
        _check_label(name, "fleet_labels", text)
    if len(set(names)) != len(names):
        raise _bad("fleet_labels", repr(text[:200]), "each label once", "a label is named twice")
    return names


@dataclass(frozen=True)
class FleetOptions:
    """How the fleet rules select, group and judge (the ``rules export --fleet*`` flags)."""

    fleet_labels: tuple[str, ...] = DEFAULT_FLEET_LABELS
    replica_label: str = DEFAULT_REPLICA_LABEL
    outlier_bits: float = DEFAULT_OUTLIER_BITS
    outlier_factor: float = DEFAULT_OUTLIER_FACTOR
    outlier_for_seconds: float = OUTLIER_FOR_SECONDS
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS
    outlier_interval_seconds: float = DEFAULT_OUTLIER_INTERVAL_SECONDS
    shards: int = DEFAULT_SHARDS
    job: str = DEFAULT_JOB  # the series are selected with job="<job>", as the per-replica rules' are

    def __post_init__(self) -> None:
        joined = ",".join(self.fleet_labels)
        parse_label_list(joined)
        _check_label(self.replica_label, "replica_label", self.replica_label)
        if self.replica_label in self.fleet_labels:
            raise _bad(
                "replica_label",
                repr(self.replica_label),
                "the label that tells replicas of one fleet apart",
                f"it is also one of {{fleet_rules.fleet_labels}} {joined[:200]!r}",
            )
        if not (math.isfinite(self.outlier_bits) and self.outlier_bits > 0):
            raise _bad("outlier_bits", repr(self.outlier_bits), "a positive number of bits (e.g. 0.1)")
        if not (math.isfinite(self.outlier_factor) and self.outlier_factor >= 1):
            raise _bad("outlier_factor", repr(self.outlier_factor), "a number >= 1 (e.g. 3)")
        for field, i, example in (
            ("interval_seconds", self.interval_seconds, "1m"),
            ("outlier_interval_seconds", self.outlier_interval_seconds, "5m"),
        ):
            if not (math.isfinite(i) and 1.0 <= i <= _MAX_INTERVAL_SECONDS):
                raise _bad(
                    field,
                    repr(format_duration(i) if math.isfinite(i) else i),
                    f"a duration from 1s to 1h (e.g. {example})",
                )
        if not (math.isfinite(self.outlier_for_seconds) and 0 <= self.outlier_for_seconds <= 31 * 86400.0):
            raise _bad("outlier_for_seconds", repr(self.outlier_for_seconds), "a duration from 0s to 31d (e.g. 10m)")
        if self.shards not in SHARD_COUNTS:
            raise _bad(
                "shards",
                repr(self.shards),
                f"one of {', '.join(map(str, SHARD_COUNTS))} (a divisor of "
                "100: shard K holds the layers whose number modulo N is K)",
            )

    @property
    def fleet_key(self) -> str:
        """The labels of a fleet series (``job, router, layer, kind, business_line``)."""
        return ", ".join((*self.fleet_labels, *SERIES_LABELS))

    @property
    def replica_key(self) -> str:
        """The labels of a replica series: the fleet's and the replica label."""
        return ", ".join((*self.fleet_labels, self.replica_label, *SERIES_LABELS))

    @property
    def router_key(self) -> str:
        return ", ".join((*self.fleet_labels, *ROUTER_LABELS))
