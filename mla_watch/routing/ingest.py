"""Routing counts shipped by probes in other processes: the wire format, its limits, the windows it feeds.

A probe attached with ``agent_url=`` POSTs to the sidecar's ``/v1/routing/ingest``::

    {"source": "worker-1",
     "routers": [{"name", "layer", "kind", "num_slots", "top_k"}, ...],
     "deltas": [{"router", "business_line", "slots": [...], "counts": [...], "tokens",
                 "local_selections", "choice_selections"}, ...]}

Every field an outsider controls is bounded by :class:`IngestLimits`, and a request is
validated whole before any of it is applied. Remote routers are kept per source and named
``<source>/<router>``: a local router's name is a module path, which has no ``/``, so a
worker can never feed or re-tune a router of the sidecar's own model.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mla_watch.common.describe import describe_value
from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.common.values import is_integer
from mla_watch.routing.baselines import Baselines
from mla_watch.routing.routers import CountDelta, RouterInfo, parse_zero_slots
from mla_watch.routing.stats import KINDS
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS, NAME_RE, NAME_RULE, RouterWindows

__all__ = [
    "INGEST_FLAGS",
    "INGEST_PATH",
    "IngestError",
    "IngestLimits",
    "RemoteRouting",
    "Snapshot",
    "parse_snapshot",
    "remote_name",
    "snapshot_body",
]

INGEST_PATH = "/v1/routing/ingest"
SOURCE_SEPARATOR = "/"
ROUTER_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-\[\]]{0,199}$")
MAX_LAYER = 100_000
# Window sums stay below this, so adding a bounded delta can never wrap int64.
COUNT_CEILING = 2**62
# A remote window keeps at most this many deltas apart (older ones merge): bounded memory per window
# however small and frequent the deltas, at the price of granularity in the oldest part of the window.
REMOTE_MAX_BUCKETS = 8


# The limits `serve --ingest-<name>` sets, and what each bounds.
INGEST_FLAGS: dict[str, str] = {
    "max_slots": "most slots (experts, key positions) of one remote router",
    "max_top_k": "most top-k of one remote router",
    "max_routers": "most routers one source may report",
    "max_sources": "most sources reporting at once",
    "max_lines": "most business lines over every source",
    "max_window_slots": "most slots of every remote window together (at most 136 bytes each)",
    "max_records": "most router x business line statistics exported for every source together",
    "max_tokens": "most tokens in one delta",
    "source_idle_seconds": "seconds of silence after which a source gives its place to a new one",
}


@dataclass(frozen=True)
class IngestLimits:
    """Caps on what remote probes may make the sidecar hold (``serve --ingest-max-*``)."""

    max_slots: int = 262_144  # per router: DeepSeek-V3.2's indexer sees up to 163,840 key positions
    max_top_k: int = 4_096
    max_routers: int = 1_024  # per source: DeepSeek-V3.2 has 122 (61 gates, 61 indexers)
    max_sources: int = 16
    max_lines: int = 64  # distinct business lines over every source
    # Slots of every remote window together: 8 bytes of counts each, plus at most REMOTE_MAX_BUCKETS
    # buckets of 16 bytes per slot - 136 MiB at most for 2**20 slots.
    max_window_slots: int = 1 << 20
    max_records: int = 4_096  # router x line records (lines summed included): /metrics exports ~10 series each
    max_tokens: int = 1 << 32  # per delta
    source_idle_seconds: float = 900.0  # a source silent this long gives its place to a new one

    def __post_init__(self) -> None:
        for name in (
            "max_slots",
            "max_top_k",
            "max_routers",
            "max_sources",
            "max_lines",
            "max_window_slots",
            "max_records",
            "max_tokens",
        ):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise SettingsError([SettingProblem(f"ingest_limits.{name}", repr(value), "an integer >= 1")])
        if self.max_tokens * self.max_top_k > 2**48:
            raise SettingsError(
                [
                    SettingProblem(
                        "ingest_limits.max_tokens",
                        repr(self.max_tokens),
                        "at most 2**48 tokens times top-k, so that window sums cannot overflow",
                        problem=f"times a top-k of {self.max_top_k} it is {self.max_tokens * self.max_top_k}",
                    )
                ]
            )
        if not self.source_idle_seconds > 0:
            raise SettingsError(
                [SettingProblem("ingest_limits.source_idle_seconds", repr(self.source_idle_seconds), "a number > 0")]
            )


class IngestError(ValueError):
    """A snapshot refused; ``field`` names the part of the request, ``status`` the HTTP answer."""

    def __init__(self, message: str, field: str, *, status: int = 400, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field = field
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Snapshot:
    source: str
    routers: tuple[RouterInfo, ...]
    deltas: dict[tuple[str, str], CountDelta]  # by (router, business line)


def remote_name(source: str, router: str) -> str:
    """The name a remote router is watched under: never the name of a local one."""
    return f"{source}{SOURCE_SEPARATOR}{router}"


def snapshot_body(
    source: str, routers: Iterable[RouterInfo], deltas: Mapping[tuple[str, str], CountDelta]
) -> dict[str, Any]:
    """The request body for ``deltas`` keyed by (router, business line)."""
    shipped = []
    for (router, line), delta in deltas.items():
        slots = np.flatnonzero(delta.counts)
        shipped.append(
            {
                "router": router,
                "business_line": line,
                "slots": slots.tolist(),
                "counts": delta.counts[slots].tolist(),
                "tokens": int(delta.tokens),
                "local_selections": int(delta.local_selections),
                "choice_selections": int(delta.choice_selections),
            }
        )
    return {"source": source, "routers": [info.as_dict() for info in routers], "deltas": shipped}


def _label(value: Any, field: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise IngestError(f"{field}={describe_value(value)} is invalid: expected {NAME_RULE}", field)
    return value


def _integer(value: Any, field: str, low: int, high: int) -> int:
    if not is_integer(value) or not low <= value <= high:
        raise IngestError(f"{field}={describe_value(value)} is invalid: expected an integer in [{low}, {high}]", field)
    return value


def _integers(value: Any, field: str, high: int) -> np.ndarray:
    """A JSON list of integers in [0, high] as int64; booleans, floats and strings are refused."""
    if not isinstance(value, list):
        raise IngestError(f"{field} is invalid: expected a list of integers, got {type(value).__name__}", field)
    if not value:  # the common idle delta: no array made for it
        return _NO_INTEGERS
    if not all(type(item) is int for item in value):  # bool is a subclass of int: type() excludes it
        bad = next(item for item in value if type(item) is not int)
        raise IngestError(f"{field} holds {describe_value(bad)}: expected integers only", field)
    if min(value) < 0 or max(value) > high:
        raise IngestError(f"{field} holds values outside [0, {high}]", field)
    return np.asarray(value, dtype=np.int64)


_NO_INTEGERS = np.zeros(0, dtype=np.int64)
_NO_INTEGERS.flags.writeable = False  # shared by every empty list: nobody may fill it


def _router(data: Any, field: str, limits: IngestLimits) -> RouterInfo:
    if not isinstance(data, dict):
        raise IngestError(f"{field} is invalid: expected an object with name, layer, kind, num_slots, top_k", field)
    unknown = sorted(set(data) - {"name", "layer", "kind", "num_slots", "top_k", "zero_slots", "hash_routed"})
    if unknown:
        raise IngestError(f"{field}: unknown field(s) {unknown}", f"{field}.{unknown[0]}", code="unknown_field")
    name = data.get("name")
    if not isinstance(name, str) or not ROUTER_NAME_RE.fullmatch(name):
        raise IngestError(
            f"{field}.name={describe_value(name)} is invalid: expected a module path of at most 200 "
            "characters (letters, digits, _ . : - [ ])",
            f"{field}.name",
        )
    kind = data.get("kind")
    if kind not in KINDS:
        raise IngestError(
            f"{field}.kind={describe_value(kind)} is invalid: expected 'expert' or 'indexer'", f"{field}.kind"
        )
    layer = _integer(data.get("layer"), f"{field}.layer", -1, MAX_LAYER)
    num_slots = _integer(data.get("num_slots"), f"{field}.num_slots", 1, limits.max_slots)
    top_k = _integer(data.get("top_k"), f"{field}.top_k", 1, min(limits.max_top_k, num_slots))
    try:  # optional since RouterInfo gained them: zero-compute expert slots, token-id (hash) routing
        zero_slots = parse_zero_slots(data.get("zero_slots", []), num_slots, f"{field}.zero_slots")
    except ValueError as error:
        raise IngestError(str(error), f"{field}.zero_slots") from None
    hash_routed = data.get("hash_routed", False)
    if not isinstance(hash_routed, bool):
        raise IngestError(
            f"{field}.hash_routed={describe_value(hash_routed)} is invalid: expected true or false",
            f"{field}.hash_routed",
        )
    return RouterInfo(
        name=name,
        layer=layer,
        kind=kind,
        num_slots=num_slots,
        top_k=top_k,
        zero_slots=zero_slots,
        hash_routed=hash_routed,
    )


@dataclass
class _DeltaSum:
    """One (router, line)'s deltas of a request, summed sparsely as they are checked: the dense counts
    are made once, by :meth:`dense`, so a delta costs what it carries and an empty one next to nothing."""

    num_slots: int
    slots: list[np.ndarray] = dataclasses.field(default_factory=list)
    counts: list[np.ndarray] = dataclasses.field(default_factory=list)
    tokens: int = 0
    local_selections: int = 0
    choice_selections: int = 0

    def add(self, slots: np.ndarray, counts: np.ndarray, tokens: int, local: int, choice: int) -> None:
        if slots.size:
            self.slots.append(slots)
            self.counts.append(counts)
        self.tokens += tokens
        self.local_selections += local
        self.choice_selections += choice

    def dense(self) -> CountDelta:
        counts = np.zeros(self.num_slots, dtype=np.int64)
        if self.slots:  # a slot may come in several deltas: add.at sums repeats, fancy += would not
            np.add.at(counts, np.concatenate(self.slots), np.concatenate(self.counts))
        return CountDelta(counts, self.tokens, self.local_selections, self.choice_selections)


def parse_snapshot(body: Mapping[str, Any], limits: IngestLimits) -> Snapshot:
    """Validate a whole request body; nothing is applied here."""
    unknown = sorted(set(body) - {"source", "routers", "deltas"})
    if unknown:
        raise IngestError(
            f"unknown field(s) {unknown}: expected source, routers, deltas", unknown[0], code="unknown_field"
        )
    source = _label(body.get("source"), "source")
    routers = body.get("routers")
    if not isinstance(routers, list) or not routers or len(routers) > limits.max_routers:
        raise IngestError(
            f"routers is invalid: expected a list of 1 to {limits.max_routers} router descriptions", "routers"
        )
    infos = tuple(_router(item, f"routers[{index}]", limits) for index, item in enumerate(routers))
    known = {info.name: info for info in infos}
    if len(known) != len(infos):
        raise IngestError("routers is invalid: a router name is listed twice", "routers")
    deltas = body.get("deltas", [])
    if not isinstance(deltas, list):
        raise IngestError("deltas is invalid: expected a list", "deltas")
    sums: dict[tuple[str, str], _DeltaSum] = {}
    lines: set[str] = set()
    dense_slots = 0
    for index, delta in enumerate(deltas):
        where = f"deltas[{index}]"
        info, line = _delta_key(delta, where, known)
        checked = _delta_counts(delta, where, info, limits)
        if (info.name, line) not in sums:
            # Dense counts are made for each (router, line) once parsed, before RemoteRouting checks its caps:
            # bound them here too, or one request of many lines of a wide router would allocate gigabytes on
            # its way to a 429.
            lines.add(line)
            dense_slots += info.num_slots
            if len(lines) > limits.max_lines:
                raise IngestError(
                    f"this snapshot names more than {limits.max_lines} business lines, the most this "
                    "sidecar keeps (serve --ingest-max-lines)",
                    "deltas.business_line",
                    status=429,
                    code="too_many_lines",
                )
            if dense_slots > limits.max_window_slots:
                raise IngestError(
                    f"this snapshot's deltas span more than {limits.max_window_slots} slots "
                    "(serve --ingest-max-window-slots)",
                    "deltas",
                    status=429,
                    code="too_many_slots",
                )
            sums[(info.name, line)] = _DeltaSum(info.num_slots)
        sums[(info.name, line)].add(*checked)
    return Snapshot(source, infos, {key: summed.dense() for key, summed in sums.items()})


def _delta_key(delta: Any, where: str, known: Mapping[str, RouterInfo]) -> tuple[RouterInfo, str]:
    """The router and business line of one delta, its fields checked."""
    if not isinstance(delta, dict):
        raise IngestError(f"{where} is invalid: expected an object", where)
    extra = sorted(
        set(delta) - {"router", "business_line", "slots", "counts", "tokens", "local_selections", "choice_selections"}
    )
    if extra:
        raise IngestError(f"{where}: unknown field(s) {extra}", f"{where}.{extra[0]}", code="unknown_field")
    router = delta.get("router")
    info = known.get(router) if isinstance(router, str) else None  # a list or object is no name (nor hashable)
    if info is None:
        raise IngestError(
            f"{where}.router={describe_value(delta.get('router'))} is invalid: expected one of the "
            "routers listed in this request",
            f"{where}.router",
        )
    return info, _label(delta.get("business_line"), f"{where}.business_line")


def _delta_counts(
    delta: Mapping[str, Any], where: str, info: RouterInfo, limits: IngestLimits
) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """``(slots, counts, tokens, local_selections, choice_selections)`` of one delta, checked against its router."""
    tokens = _integer(delta.get("tokens", 0), f"{where}.tokens", 0, limits.max_tokens)
    most = tokens * info.top_k  # each token picks at most top_k slots
    slots = _integers(delta.get("slots"), f"{where}.slots", info.num_slots - 1)
    counts = _integers(delta.get("counts"), f"{where}.counts", most)
    if slots.shape != counts.shape:
        raise IngestError(
            f"{where}: slots has {slots.size} entries and counts {counts.size}; expected equal lengths",
            f"{where}.counts",
        )
    if slots.size and np.unique(slots).size != slots.size:
        raise IngestError(f"{where}.slots lists a slot twice", f"{where}.slots")
    selections = int(counts.sum())
    if selections > most:
        raise IngestError(
            f"{where}: {selections} selections over {tokens} tokens exceed tokens × top_k = {most}", f"{where}.counts"
        )
    choice = _integer(delta.get("choice_selections", 0), f"{where}.choice_selections", 0, most)
    local = _integer(delta.get("local_selections", 0), f"{where}.local_selections", 0, choice)
    return slots, counts, tokens, local, choice


@dataclass
class _Source:
    routers: dict[str, RouterInfo]  # by the name the worker uses
    windows: RouterWindows  # routers named remote_name(source, name)
    open_windows: set[tuple[str, str]]
    last_seen: float


class RemoteRouting:
    """The rolling windows of every remote source, within :class:`IngestLimits`."""

    def __init__(
        self,
        limits: IngestLimits | None = None,
        *,
        window_tokens: int | None = DEFAULT_WINDOW_TOKENS,
        window_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        baselines: Baselines | None = None,
    ) -> None:
        self.limits = limits or IngestLimits()
        self._baselines = baselines  # shared by every source's windows (router names carry the source)
        self._window_tokens = window_tokens
        self._window_seconds = window_seconds
        self._clock = clock
        self._sources: dict[str, _Source] = {}
        self._lines: set[str] = set()
        self._window_slots = 0
        self._lock = threading.Lock()

    def windows(self) -> list[RouterWindows]:
        with self._lock:
            return [source.windows for source in self._sources.values()]

    @property
    def business_lines(self) -> set[str]:
        with self._lock:
            return set(self._lines)

    @property
    def window_slots(self) -> int:
        """Slots held by every remote window together (bounded by ``max_window_slots``)."""
        return self._window_slots

    def ingest(self, snapshot: Snapshot) -> str | None:
        """Apply a snapshot whole, or raise :class:`IngestError` and change nothing.

        Returns the idle source dropped to make room for a new one, if any.
        """
        with self._lock:
            now = self._clock()
            source = self._sources.get(snapshot.source)
            evict = self._room_for_source(now) if source is None else None
            if source is not None and set(source.routers.values()) != set(snapshot.routers):
                raise IngestError(
                    f"source {snapshot.source!r} lists routers other than it reported before; ship "
                    "under another source name to watch another model",
                    "routers",
                    status=409,
                    code="conflict",
                )
            routers = source.routers if source is not None else {info.name: info for info in snapshot.routers}
            others = [other for name, other in self._sources.items() if name != evict]
            lines = self._lines if evict is None else {line for other in others for _, line in other.open_windows}
            new_lines = {line for _, line in snapshot.deltas} - lines
            if len(lines) + len(new_lines) > self.limits.max_lines:
                raise IngestError(
                    f"{len(new_lines)} new business line(s) would exceed the {self.limits.max_lines} "
                    "remote lines this sidecar keeps (serve --ingest-max-lines)",
                    "deltas.business_line",
                    status=429,
                    code="too_many_lines",
                )
            open_windows = source.open_windows if source is not None else set()
            new_windows = set(snapshot.deltas) - open_windows
            freed = self._slots_of(self._sources[evict]) if evict is not None else 0
            needed = sum(routers[router].num_slots for router, _ in new_windows)
            if self._window_slots - freed + needed > self.limits.max_window_slots:
                raise IngestError(
                    f"this snapshot opens windows of {needed} slots; remote windows already hold "
                    f"{self._window_slots} of the {self.limits.max_window_slots} allowed "
                    "(serve --ingest-max-window-slots)",
                    "deltas",
                    status=429,
                    code="too_many_slots",
                )
            records = self._records(snapshot.source, routers, open_windows | new_windows, evict)
            if records > self.limits.max_records:
                raise IngestError(
                    f"this snapshot would make {records} router x business line records to export, "
                    f"over the {self.limits.max_records} allowed (serve --ingest-max-records)",
                    "deltas",
                    status=429,
                    code="too_many_records",
                )
            if source is not None:
                self._check_overflow(source, snapshot)
            # Checked: from here on nothing can fail.
            if evict is not None:
                self._drop(evict)
            if source is None:
                source = self._open(snapshot.source, routers, now)
            for (router, line), delta in snapshot.deltas.items():
                source.windows.add(remote_name(snapshot.source, router), line, delta)
                if (router, line) not in source.open_windows:
                    source.open_windows.add((router, line))
                    self._window_slots += routers[router].num_slots
            self._lines |= new_lines
            source.last_seen = now
            return evict

    # ------------------------------------------------------------------ internals
    def _room_for_source(self, now: float) -> str | None:
        """The source to evict for a new one (``None``: there is room), or raise when all are active."""
        if len(self._sources) < self.limits.max_sources:
            return None
        name, oldest = min(self._sources.items(), key=lambda item: item[1].last_seen)
        if now - oldest.last_seen < self.limits.source_idle_seconds:
            raise IngestError(
                f"{len(self._sources)} sources are reporting, the most this sidecar keeps "
                f"(serve --ingest-max-sources); a source gives its place after "
                f"{self.limits.source_idle_seconds:g} s of silence",
                "source",
                status=429,
                code="too_many_sources",
            )
        return name

    def _check_overflow(self, source: _Source, snapshot: Snapshot) -> None:
        for (router, line), delta in snapshot.deltas.items():
            totals = source.windows.window_totals(remote_name(snapshot.source, router), line)
            if totals is None:
                continue
            if (
                totals.tokens + delta.tokens > COUNT_CEILING
                or int((totals.counts + delta.counts).max(initial=0)) > COUNT_CEILING
            ):
                raise IngestError(
                    f"router {router!r}, business line {line!r}: the window's sums would pass {COUNT_CEILING}",
                    "deltas",
                    code="count_overflow",
                )

    def _open(self, name: str, routers: dict[str, RouterInfo], now: float) -> _Source:
        infos = [dataclasses.replace(info, name=remote_name(name, info.name)) for info in routers.values()]
        windows = RouterWindows(
            infos,
            window_tokens=self._window_tokens,
            window_seconds=self._window_seconds,
            clock=self._clock,
            max_buckets=REMOTE_MAX_BUCKETS,
            baselines=self._baselines,
        )
        source = _Source(routers, windows, set(), now)
        self._sources[name] = source
        return source

    def _records(
        self, name: str, routers: dict[str, RouterInfo], windows: set[tuple[str, str]], evict: str | None
    ) -> int:
        """Statistics records once ``name`` holds ``windows``: each router, for each line and all lines."""
        records = len(routers) * (len({line for _, line in windows}) + 1)
        for other_name, other in self._sources.items():
            if other_name not in (name, evict):
                records += len(other.routers) * (len({line for _, line in other.open_windows}) + 1)
        return records

    @staticmethod
    def _slots_of(source: _Source) -> int:
        return sum(source.routers[router].num_slots for router, _ in source.open_windows)

    def _drop(self, name: str) -> None:
        source = self._sources.pop(name)
        self._window_slots -= self._slots_of(source)
        self._lines = {line for other in self._sources.values() for _, line in other.open_windows}
