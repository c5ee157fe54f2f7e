"""A healthy baseline as it is kept: :class:`Baseline` (one series' healthy window), its JSON, and the baseline
file that holds them (``mla_watch.baseline/2``, or the older ``/1``: one set of counts per router), read whole
and checked (:func:`read_baseline_file`) and written atomically (:func:`write_json`) (no torch).

:class:`~mla_watch.routing.baselines.Baselines` learns, sets and persists them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.common.describe import describe_value
from mla_watch.common.output_file import write_file
from mla_watch.common.values import is_integer, is_number
from mla_watch.routing.client_mix import ClientMix
from mla_watch.routing.stats import BASELINE_METRICS

__all__ = [
    "BASELINE_FORMAT",
    "LEGACY_BASELINE_FORMAT",
    "MAX_COUNTS",
    "MAX_FILE_BYTES",
    "MAX_SERIES",
    "Baseline",
    "BaselineError",
    "read_baseline_file",
    "write_json",
]

BASELINE_FORMAT = "mla_watch.baseline/2"
LEGACY_BASELINE_FORMAT = "mla_watch.baseline/1"
MAX_SERIES = 100_000  # routers x lines a file may hold: a bound on what a planted file costs to load
# Selection counts held in all (64 MiB as int64): workers that report routing come and go, and their series'
# baselines outlive them, so the series bound alone would let wide indexers' position counts grow memory.
MAX_COUNTS = 8 * 1024 * 1024
MAX_FILE_BYTES = 128 * 1024 * 1024


class BaselineError(ValueError):
    """A baseline file that cannot be used; the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class Baseline:
    """One router's healthy window for one business line (``"all"``: every line summed)."""

    router: str
    business_line: str
    counts: np.ndarray  # int64, one per slot
    tokens: int
    values: Mapping[str, float]  # of BASELINE_METRICS, those defined for this router
    taken_at: float  # wall clock
    source: str  # "learned" | "set" (POST /admin/baseline, the baseline command) | "legacy" (a /1 file)
    clients: ClientMix | None = None  # whose tokens the window was; None: not seen here (or not recorded then)

    def as_dict(self) -> dict[str, Any]:
        """What a routing record carries as its ``baseline``: the healthy values, without the counts."""
        return {
            **self.values,
            "tokens": self.tokens,
            "taken_at": self.taken_at,
            "source": self.source,
            "clients": None if self.clients is None else self.clients.to_json(),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "business_line": self.business_line,
            "tokens": self.tokens,
            "taken_at": self.taken_at,
            "source": self.source,
            "values": dict(self.values),
            "counts": self.counts.tolist(),
            **({"clients": self.clients.to_json()} if self.clients is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Baseline:
        if not isinstance(data, dict):
            raise BaselineError(f"{where}: expected an object with router, business_line, counts, tokens, values")
        router, line = data.get("router"), data.get("business_line")
        if not isinstance(router, str) or not router or len(router) > 512:
            raise BaselineError(
                f"{where}.router = {describe_value(router, form='repr')}: expected a router's module name"
            )
        if not isinstance(line, str) or not line or len(line) > 64:
            raise BaselineError(
                f"{where}.business_line = {describe_value(line, form='repr')}: expected a business line's name"
            )
        counts = data.get("counts")
        if (
            not isinstance(counts, list)
            or not counts
            or len(counts) > 1_000_000
            or not all(is_integer(c) and c >= 0 for c in counts)
        ):
            raise BaselineError(f"{where}.counts: expected a non-empty list of selection counts (integers >= 0)")
        tokens = data.get("tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise BaselineError(f"{where}.tokens = {describe_value(tokens, form='repr')}: expected an integer >= 0")
        values = data.get("values")
        if not isinstance(values, dict) or not all(
            key in BASELINE_METRICS and is_number(value, finite=True) for key, value in values.items()
        ):
            raise BaselineError(f"{where}.values: expected finite numbers for any of {', '.join(BASELINE_METRICS)}")
        taken_at = data.get("taken_at")
        if not is_number(taken_at, finite=True):
            raise BaselineError(
                f"{where}.taken_at = {describe_value(taken_at, form='repr')}: expected a time (seconds since the epoch)"
            )
        source = data.get("source")
        if source not in ("learned", "set", "legacy"):
            raise BaselineError(f"{where}.source = {describe_value(source, form='repr')}: expected learned or set")
        try:  # optional: files written before baselines recorded their clients have none
            clients = None if data.get("clients") is None else ClientMix.from_json(data["clients"], f"{where}.clients")
        except ValueError as error:
            raise BaselineError(str(error)) from None
        return cls(
            router,
            line,
            np.asarray(counts, dtype=np.int64),
            tokens,
            {key: float(value) for key, value in values.items()},
            float(taken_at),
            source,
            clients,
        )


def read_baseline_file(path: Path) -> tuple[list[Baseline], dict[str, np.ndarray]]:
    """The series of a ``mla_watch.baseline/2`` file, or a ``/1`` file's counts per router (legacy)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise BaselineError(
                f"baseline {path}: larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB: expected a "
                "file this sidecar wrote"
            )
        document = json.loads(path.read_text())
    except OSError as error:
        raise BaselineError(f"baseline {path}: cannot be read ({error.strerror or type(error).__name__})") from None
    except ValueError as error:
        raise BaselineError(f"baseline {path}: not JSON ({str(error)[:120]})") from None
    if not isinstance(document, dict):
        raise BaselineError(f"baseline {path}: expected a JSON object with key 'format'")
    fmt = document.get("format")
    if fmt == LEGACY_BASELINE_FORMAT:
        return [], _legacy_counts(document, path)
    if fmt != BASELINE_FORMAT:
        raise BaselineError(
            f"baseline {path}: format = {describe_value(fmt, form='repr')}: expected "
            f"{BASELINE_FORMAT!r} (or {LEGACY_BASELINE_FORMAT!r})"
        )
    entries = document.get("series")
    if not isinstance(entries, list) or len(entries) > MAX_SERIES:
        raise BaselineError(f"baseline {path}: series: expected a list of at most {MAX_SERIES} baselines")
    series = [Baseline.from_json(entry, f"baseline {path}: series[{index}]") for index, entry in enumerate(entries)]
    if sum(b.counts.size for b in series) > MAX_COUNTS:
        raise BaselineError(
            f"baseline {path}: series: {sum(b.counts.size for b in series)} selection counts in all: "
            f"expected at most {MAX_COUNTS}"
        )
    legacy = _legacy_counts(
        {"routers": [{"name": name, "counts": counts} for name, counts in (document.get("legacy") or {}).items()]}, path
    )
    return series, legacy


def _legacy_counts(document: dict[str, Any], path: Path) -> dict[str, np.ndarray]:
    routers = document.get("routers", [])
    if not isinstance(routers, list) or len(routers) > MAX_SERIES:
        raise BaselineError(f"baseline {path}: routers: expected a list of at most {MAX_SERIES} routers")
    counts: dict[str, np.ndarray] = {}
    for index, entry in enumerate(routers):
        name = entry.get("name") if isinstance(entry, dict) else None
        values = entry.get("counts") if isinstance(entry, dict) else None
        if (
            not isinstance(name, str)
            or not isinstance(values, list)
            or not all(is_integer(c) and c >= 0 for c in values)
        ):
            raise BaselineError(f"baseline {path}: routers[{index}]: expected name and counts (integers >= 0)")
        if sum(values) > 0:
            counts[name] = np.asarray(values, dtype=np.int64)
    return counts


def write_json(path: Path, document: Mapping[str, Any], *, label: str | None = None) -> None:
    """``document`` to ``path`` (:func:`~mla_watch.common.output_file.write_file`: atomically, mode 0600, a device
    written through); :class:`~mla_watch.common.output_file.OutputError` naming ``label`` (default the path)."""
    write_file(path, json.dumps(document) + "\n", private=True, parents=True, label=label)
