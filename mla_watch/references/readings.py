"""Readings of the reference prompts, their healthy baselines, and how a reading compares with its baseline
(numpy only).

A :class:`ReferenceReading` is one pass of one set of reference prompts through the model (here, or in the
engine): every router's statistics over the set's tokens, and the loss of each prompt. While the routers
serving are known to be good, a reading becomes its set's :class:`ReferenceBaseline` (kept per set and per
version of the set's prompts, in ``STATE_DIR/reference_baseline.json``). The same prompts through the same
routers route the same way: a reading that departs from its baseline by more than a tolerance (Jensen-Shannon
divergence, bits) says that the model changed, whatever the traffic did.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.common.output_file import write_error
from mla_watch.common.state_dir import set_aside
from mla_watch.common.state_writes import StateWrites
from mla_watch.common.values import is_integer, is_number
from mla_watch.quality.score import ModelScore
from mla_watch.routing.baselines import write_json
from mla_watch.routing.positions import PositionBuckets
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import RoutingStats, compute_stats

__all__ = [
    "BASELINE_FILE",
    "LEGACY_PROMPT_TOKENS",
    "REFERENCE_BASELINE_FORMAT",
    "ReferenceBaseline",
    "ReferenceBaselines",
    "ReferenceReading",
    "RouterComparison",
    "compare",
    "position_tokens",
]

log = logging.getLogger("mla_watch.references")

BASELINE_FILE = "reference_baseline.json"
REFERENCE_BASELINE_FORMAT = "mla_watch.reference_baseline/1"
_MAX_FILE_BYTES = 256 * 1024 * 1024
# Every prompt was cut to this many tokens before readings recorded their prompts' lengths: a baseline that records
# none stands for readings whose prompts all fit it.
LEGACY_PROMPT_TOKENS = 256


def position_tokens(lengths: Sequence[int], edges: Sequence[int]) -> list[int]:
    """The tokens of prompts ``lengths`` long in each position bucket ending at ``edges`` (and one past them)."""
    starts = [0, *edges]
    ends = [*edges, None]
    return [
        sum(max(0, min(length, end if end is not None else length) - start) for length in lengths)
        for start, end in zip(starts, ends, strict=True)
    ]


@dataclass(frozen=True)
class ReferenceReading:
    """One set of reference prompts read once through the routers serving at ``taken_at``."""

    set_name: str
    set_version: int
    digest: str  # the set's prompts and version (ReferenceSet.digest)
    taken_at: float  # wall clock, when the reading began (the routers it read were serving then)
    router_version: int | None  # the router version serving (None: not known here)
    score: ModelScore  # every router's statistics (business line: the set's name) and each prompt's loss
    seconds: float = 0.0  # how long the reading took
    note: str | None = None  # what of the set this reading cut or left out (mla_watch.references.budget)
    long: bool = False  # a long set's

    @property
    def tokens(self) -> int:
        return self.score.tokens

    @property
    def lengths(self) -> tuple[int, ...]:
        """The tokens read of each prompt (each scored all but its first)."""
        return tuple(count + 1 for count in self.score.counts)

    @property
    def reach(self) -> int:
        """The positions it reached: ``0`` to ``reach - 1``, its longest prompt's."""
        return max(self.lengths, default=0)

    def positions(self) -> dict[str, int] | None:
        """Its tokens per position bucket (``None`` where its routing was not counted by position)."""
        edges = self.score.position_edges
        if not edges:
            return None
        buckets = PositionBuckets(edges[-1])
        return dict(zip(buckets.labels, position_tokens(self.lengths, edges), strict=True))

    def counts(self, router: str, from_position: int | None = None) -> tuple[np.ndarray, int] | None:
        """``router``'s selection counts over the reading and the tokens they were made over; from position
        ``from_position`` on only (a bucket's start) where that is given (``None``: not counted by position)."""
        record = self.score.routers.get(router)
        if record is None or record.counts is None:
            return None
        if from_position is None:
            return np.asarray(record.counts, dtype=np.int64), int(record.stats.tokens)
        by_position = self.score.positions.get(router)
        if by_position is None:
            return None
        first = _first_bucket(self.score.position_edges, from_position)
        counts = np.asarray(by_position, dtype=np.int64)[first:].sum(axis=0)
        return counts, int(counts.sum()) // max(1, record.router.top_k)

    def summary(self) -> dict[str, Any]:
        return {
            "set": self.set_name,
            "set_version": self.set_version,
            "digest": self.digest,
            "taken_at": self.taken_at,
            "router_version": self.router_version,
            "tokens": self.tokens,
            "prompts": len(self.score.losses),
            "seconds": round(self.seconds, 3),
            "perplexity": None if not math.isfinite(self.score.perplexity) else round(self.score.perplexity, 4),
            "reach": self.reach,
            "positions": self.positions(),
            "note": self.note,
            "long": self.long,
        }


def _first_bucket(edges: Sequence[int], start: int) -> int:
    """The first bucket that starts at or past ``start``."""
    starts = [0, *edges]
    return next((index for index, begin in enumerate(starts) if begin >= start), len(starts))


@dataclass(frozen=True)
class ReferenceBaseline:
    """A set's reading while the routers serving were known to be good: what its readings are compared with."""

    set_name: str
    digest: str
    router_version: int | None
    taken_at: float
    counts: Mapping[str, np.ndarray]  # router -> int64 counts
    tokens: Mapping[str, int]
    perplexity: float
    lengths: tuple[int, ...] | None = None  # the tokens read of each prompt (None: a file from before they were kept)
    positions: Mapping[str, np.ndarray] = field(default_factory=dict)  # router -> [buckets, slots] int64 counts
    position_edges: tuple[int, ...] = ()

    @classmethod
    def of(cls, reading: ReferenceReading) -> ReferenceBaseline:
        counts, tokens = {}, {}
        for name in reading.score.routers:
            found = reading.counts(name)
            if found is not None:
                counts[name], tokens[name] = found
        positions = {name: np.asarray(value, dtype=np.int64) for name, value in reading.score.positions.items()}
        return cls(
            reading.set_name,
            reading.digest,
            reading.router_version,
            reading.taken_at,
            counts,
            tokens,
            reading.score.perplexity,
            reading.lengths,
            positions,
            tuple(reading.score.position_edges),
        )

    def fits(self, reading: ReferenceReading) -> bool:
        """Whether ``reading`` read the prompts this baseline read, as far: the same set, each prompt cut alike."""
        if reading.digest != self.digest:
            return False
        if self.lengths is None:
            return reading.reach <= LEGACY_PROMPT_TOKENS
        return self.lengths == reading.lengths

    def counts_from(self, router: RouterInfo, from_position: int | None) -> tuple[np.ndarray, int] | None:
        """``router``'s counts, and tokens, over the whole baseline or from position ``from_position`` on."""
        counts = self.counts.get(router.name)
        if counts is None:
            return None
        if from_position is None:
            return counts, self.tokens[router.name]
        by_position = self.positions.get(router.name)
        if by_position is None:
            return None
        found = by_position[_first_bucket(self.position_edges, from_position) :].sum(axis=0)
        return found, int(found.sum()) // max(1, router.top_k)

    def to_json(self) -> dict[str, Any]:
        return {
            "set": self.set_name,
            "digest": self.digest,
            "router_version": self.router_version,
            "taken_at": self.taken_at,
            "perplexity": self.perplexity if math.isfinite(self.perplexity) else None,
            "routers": {
                name: {"counts": counts.tolist(), "tokens": self.tokens[name]} for name, counts in self.counts.items()
            },
            "lengths": None if self.lengths is None else list(self.lengths),
            "position_edges": list(self.position_edges),
            "positions": {name: value.tolist() for name, value in self.positions.items()},
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> ReferenceBaseline:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object with set, digest, router_version, taken_at, routers")
        set_name, digest, routers = data.get("set"), data.get("digest"), data.get("routers")
        if not isinstance(set_name, str) or not isinstance(digest, str) or not isinstance(routers, dict):
            raise ValueError(f"{where}: expected set and digest (strings) and routers (an object)")
        version, taken_at = data.get("router_version"), data.get("taken_at")
        if version is not None and not is_integer(version):
            raise ValueError(f"{where}.router_version: expected an integer or null")
        if not is_number(taken_at):
            raise ValueError(f"{where}.taken_at: expected a time (seconds since the epoch)")
        counts, tokens = {}, {}
        for name, entry in routers.items():
            values = entry.get("counts") if isinstance(entry, dict) else None
            n = entry.get("tokens") if isinstance(entry, dict) else None
            if (
                not isinstance(values, list)
                or not values
                or len(values) > 1_000_000
                or not all(is_integer(v) and v >= 0 for v in values)
                or not is_integer(n)
                or n < 0
            ):
                raise ValueError(f"{where}.routers[{name!r}]: expected counts (integers >= 0) and tokens")
            counts[str(name)], tokens[str(name)] = np.asarray(values, dtype=np.int64), n
        perplexity = data.get("perplexity")
        lengths, edges, positions = _read_positions(data, where, counts)
        return cls(
            set_name,
            digest,
            version,
            float(taken_at),
            counts,
            tokens,
            float(perplexity) if isinstance(perplexity, int | float) and not isinstance(perplexity, bool) else math.nan,
            lengths,
            positions,
            edges,
        )


def _read_positions(
    data: dict[str, Any], where: str, counts: Mapping[str, np.ndarray]
) -> tuple[tuple[int, ...] | None, tuple[int, ...], dict[str, np.ndarray]]:
    """A baseline's prompt lengths and counts by position (absent in a file from before they were kept)."""
    lengths = data.get("lengths")
    if lengths is not None and (
        not isinstance(lengths, list) or len(lengths) > 100_000 or not all(is_integer(n) and n >= 0 for n in lengths)
    ):
        raise ValueError(f"{where}.lengths: expected a list of token counts (integers >= 0) or null")
    edges = data.get("position_edges") or []
    if not isinstance(edges, list) or len(edges) > 64 or not all(is_integer(e) and e > 0 for e in edges):
        raise ValueError(f"{where}.position_edges: expected a list of positions (integers > 0)")
    positions: dict[str, np.ndarray] = {}
    found = data.get("positions") or {}
    if not isinstance(found, dict):
        raise ValueError(f"{where}.positions: expected an object: router -> counts per position bucket")
    for name, rows in found.items():
        whole = counts.get(str(name))
        try:
            array = np.asarray(rows, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            array = None
        if array is None or whole is None or array.shape != (len(edges) + 1, whole.shape[0]) or (array < 0).any():
            slots = "its router's" if whole is None else len(whole)
            raise ValueError(
                f"{where}.positions[{name!r}]: expected {len(edges) + 1} rows of {slots} counts "
                "(integers >= 0), one per position bucket"
            )
        positions[str(name)] = array
    return None if lengths is None else tuple(int(n) for n in lengths), tuple(int(e) for e in edges), positions


class ReferenceBaselines:
    """The healthy baseline of each reference set, kept in ``path`` (``None``: in memory only). A save the disk
    refuses keeps them in memory; :meth:`save_again` (at every reading) writes them once it can."""

    WHAT = "reference baseline file"

    def __init__(self, path: Path | None = None, *, writes: StateWrites | None = None) -> None:
        self.path = path
        self.writes = writes
        self._unsaved = False
        self._lock = threading.Lock()
        self._baselines: dict[str, ReferenceBaseline] = {}  # set name -> baseline (of its current digest)
        self.load_error: str | None = None
        self._load()

    def get(self, set_name: str, digest: str) -> ReferenceBaseline | None:
        baseline = self._baselines.get(set_name)
        return baseline if baseline is not None and baseline.digest == digest else None

    def of(self, reading: ReferenceReading) -> ReferenceBaseline | None:
        """The baseline ``reading`` is compared with: its set's, where it read the same prompts as far."""
        baseline = self._baselines.get(reading.set_name)
        return baseline if baseline is not None and baseline.fits(reading) else None

    def put(self, baseline: ReferenceBaseline) -> None:
        with self._lock:
            self._baselines[baseline.set_name] = baseline
        self._save()
        log.info(
            "reference prompts %s: healthy baseline learned on router version %s",
            baseline.set_name,
            baseline.router_version,
        )

    def all(self) -> list[ReferenceBaseline]:
        return list(self._baselines.values())

    def save_again(self) -> None:
        """Write the file if the last save was refused."""
        if self._unsaved:
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            document = {"format": REFERENCE_BASELINE_FORMAT, "sets": [b.to_json() for b in self._baselines.values()]}
        try:
            write_json(self.path, document, label=f"{self.WHAT} {self.path}")
        except OSError as error:
            self._unsaved = True
            if self.writes is not None:
                self.writes.failed(self.path, error, what=self.WHAT)
            else:
                log.error("%s", write_error(f"{self.WHAT} {self.path}", error))
            return
        self._unsaved = False
        if self.writes is not None:
            self.writes.written(self.path, what=self.WHAT)

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            if self.path.stat().st_size > _MAX_FILE_BYTES:
                raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
            document = json.loads(self.path.read_text())
            if not isinstance(document, dict) or document.get("format") != REFERENCE_BASELINE_FORMAT:
                raise ValueError(f"format: expected {REFERENCE_BASELINE_FORMAT!r}")
            sets = document.get("sets")
            if not isinstance(sets, list):
                raise ValueError("sets: expected a list")
            loaded = [ReferenceBaseline.from_json(entry, f"sets[{index}]") for index, entry in enumerate(sets)]
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
            self.load_error = f"{self.path}: {error}"
            try:
                aside = set_aside(self.path)
                log.error("the reference baselines are not used (%s); kept the file as %s", error, aside)
            except OSError:
                log.error("the reference baselines are not used (%s); kept in memory only from now on", error)
                self.path = None
            return
        self._baselines = {baseline.set_name: baseline for baseline in loaded}


@dataclass(frozen=True)
class RouterComparison:
    """One router's routing over the reference prompts against its healthy baseline (sets combined)."""

    router: str
    stats: RoutingStats  # over the reading; its js_divergence is from the baseline, where there is one
    baseline: RoutingStats | None  # over the baseline
    sets: tuple[str, ...]

    def changed(self, tolerance_bits: float) -> bool | None:
        """Whether the routing departed from the baseline by more than ``tolerance_bits`` (``None``: no baseline)."""
        js = self.stats.js_divergence
        return None if self.baseline is None or js is None else js > tolerance_bits


def compare(
    info: RouterInfo,
    readings: Sequence[ReferenceReading],
    baselines: Iterable[ReferenceBaseline | None],
    *,
    from_position: int | None = None,
) -> RouterComparison | None:
    """``info``'s routing over ``readings`` (summed) against their baselines (summed, only when every reading has
    one); from position ``from_position`` on only, where that is given (and the readings counted by position);
    ``None`` when no reading holds that router."""
    total, tokens = None, 0
    for reading in readings:
        found = reading.counts(info.name, from_position)
        if found is None:
            continue
        total = found[0] if total is None else total + found[0]
        tokens += found[1]
    if total is None:
        return None
    healthy, healthy_tokens, complete = None, 0, True
    for baseline in baselines:
        found = None if baseline is None else baseline.counts_from(info, from_position)
        if found is None or found[0].shape != total.shape:
            complete = False
            break
        healthy = found[0] if healthy is None else healthy + found[0]
        healthy_tokens += found[1]
    if not complete or healthy is None:
        healthy = None
    distinct = not info.hash_routed
    stats = compute_stats(
        total, kind=info.kind, top_k=info.top_k, tokens=tokens, baseline=healthy, distinct_picks=distinct
    )
    base = (
        None
        if healthy is None
        else compute_stats(healthy, kind=info.kind, top_k=info.top_k, tokens=healthy_tokens, distinct_picks=distinct)
    )
    return RouterComparison(info.name, stats, base, tuple(reading.set_name for reading in readings))
