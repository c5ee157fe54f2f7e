"""Opt-in per-expert window counts, which Prometheus can sum across replicas (``serve --export-expert-counts``).

The routing gauges describe one sidecar's window as statistics (entropy, MaxVio, ...), which cannot be combined
across a fleet. These gauges are the window's counts themselves - selections of each expert slot, and tokens,
per router and business line - so that ``sum by (router, business_line, expert)`` over every replica is the
counts of the replicas' windows together, from which the fleet's own statistics follow exactly. They come from
the same snapshot as the routing gauges of the same scrape (:class:`mla_watch.server.metrics.RoutingCollector`
hands it over), so a replica's entropy gauge describes exactly the counts exported beside it.

A window's counts, not cumulative counters: Prometheus reads one sample per series to sum them, where counters
need each series' increase over a range (its sample a window ago, resets, series newer than the window), about
three reads per series and per evaluation, and a recorded copy of every replica's per-expert series.

Only expert routers (an indexer's slots are key positions, unbounded in number) and only business lines (never
the ``all`` aggregate, which a sum over lines would count twice). Every slot of an exported (router, line) pair
is exported, zeros included, so dead experts can be counted in PromQL.

Each pair costs ``num_slots + 1`` series; a budget bounds them. Admission is first come, first kept: a pair
once exported stays exported (no series flaps) until its source is gone (a remote worker dropped for
idleness); a pair the budget refuses stays refused, and its window's selections are reported apart.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_integer
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.series import (
    EXPERT,
    EXPERT_LABELS,
    EXPERT_OVERFLOW_SELECTIONS,
    EXPERT_SERIES,
    EXPERT_SERIES_BUDGET,
    EXPERT_WINDOW_SELECTIONS,
    EXPERT_WINDOW_TOKENS,
    SERIES_LABELS,
)
from mla_watch.routing.shards import RouterShard
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE, RouterStats
from mla_watch.server.exposition import PrewrittenFamily, sample_prefix

__all__ = [
    "BUDGET_FLAG",
    "DEFAULT_EXPERT_SERIES_BUDGET",
    "EXPORT_FLAG",
    "SELECTION_FORM",
    "ExpertCounts",
    "ExpertSelection",
    "pair_series",
]

EXPORT_FLAG = "--export-expert-counts"
BUDGET_FLAG = "--expert-series-budget"
# One business line of DeepSeek-V3 fits: 58 MoE layers x (256 experts + 1 token series) = 14,906 series.
DEFAULT_EXPERT_SERIES_BUDGET = 20_000
SELECTION_FORM = (
    "'all', or routers=GLOB[,GLOB...] and/or lines=LINE[,LINE...] joined by ';' "
    "(e.g. routers=*.mlp.gate;lines=code_assistant,doc_summary)"
)
_MAX_SELECTION_CHARS = 4096  # a selection is typed by an operator; anything longer is a mistake
_MAX_ITEMS = 256  # globs or lines in one clause

log = logging.getLogger("mla_watch.server")


@dataclass(frozen=True)
class ExpertSelection:
    """Which (router, business line) pairs export per-expert counts: routers matching any glob of ``routers``
    (every expert router when empty) and lines in ``lines`` (every business line when empty)."""

    routers: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: object, where: str = EXPORT_FLAG) -> ExpertSelection:
        """The selection ``text`` states; ``ValueError`` naming ``where`` (the flag or key; argparse names the
        flag itself, so ``""`` leaves it out), the value and :data:`SELECTION_FORM`."""

        def refuse(problem: str) -> ValueError:
            shown = f"{where} {describe_value(text)}" if where else describe_value(text)
            return ValueError(f"{shown}: {problem}; expected {SELECTION_FORM}")

        if not isinstance(text, str):
            raise refuse("not a string")
        if len(text) > _MAX_SELECTION_CHARS:
            raise refuse(f"longer than {_MAX_SELECTION_CHARS} characters")
        if text.strip() == "all":
            return cls()
        if not text.strip():
            raise refuse("empty")
        clauses: dict[str, tuple[str, ...]] = {}
        for clause in text.split(";"):
            key, sep, value = clause.partition("=")
            key = key.strip()
            if not sep or key not in ("routers", "lines"):
                raise refuse(f"clause {describe_value(clause.strip())} is neither routers=... nor lines=...")
            if key in clauses:
                raise refuse(f"{key}= given twice (list every value in one clause, separated by ',')")
            items = tuple(item.strip() for item in value.split(","))
            if not all(items):
                raise refuse(f"{key}= has an empty entry")
            if len(items) > _MAX_ITEMS:
                raise refuse(f"{key}= lists {len(items)} entries, more than {_MAX_ITEMS}")
            if key == "lines":
                for line in items:
                    if line == ALL_LINES:
                        raise refuse(
                            f"lines={ALL_LINES} is every line summed, which is not exported (a sum over "
                            "lines would count it twice); leave lines= out to export every line"
                        )
                    if not NAME_RE.fullmatch(line):
                        raise refuse(f"business line {describe_value(line)} is not a line name ({NAME_RULE})")
            clauses[key] = tuple(dict.fromkeys(items))
        return cls(routers=clauses.get("routers", ()), lines=clauses.get("lines", ()))

    def matches_router(self, name: str) -> bool:
        return not self.routers or any(fnmatch.fnmatchcase(name, glob) for glob in self.routers)

    def matches_line(self, line: str) -> bool:
        return line != ALL_LINES and (not self.lines or line in self.lines)

    def describe(self) -> str:
        """The selection in the flag's syntax."""
        clauses = [
            f"{key}={','.join(values)}" for key, values in (("routers", self.routers), ("lines", self.lines)) if values
        ]
        return ";".join(clauses) or "all"


def pair_series(info: RouterInfo) -> int:
    """Series one (router, line) pair exports: one per slot, and its tokens."""
    return info.num_slots + 1


@dataclass(frozen=True)
class _Admitted:
    """An exported pair's label sets and sample lines up to their values, built once at admission so a scrape makes
    no label dicts and formats no labels."""

    slot_labels: tuple[dict[str, str], ...]
    labels: dict[str, str]
    slot_prefixes: tuple[str, ...]
    prefix: str
    layer: int
    series: int


class ExpertCounts:
    """The per-expert families of one snapshot's records (:meth:`families`), within a budget of series.

    Not a collector of its own: the routing collector calls it with the records it exports, so that both
    describe one snapshot.
    """

    def __init__(self, selection: ExpertSelection, budget: int = DEFAULT_EXPERT_SERIES_BUDGET) -> None:
        if not is_integer(budget) or budget < 1:
            raise ValueError(f"{BUDGET_FLAG} {describe_value(budget)}: expected an integer >= 1")
        self._selection = selection
        self._budget = budget
        self._lock = threading.Lock()  # scrapes may overlap; admission must be decided once
        self._admitted: dict[tuple[str, str], _Admitted] = {}
        self._refused: set[tuple[str, str]] = set()
        self._used = 0
        self._warned = False

    @property
    def budget(self) -> int:
        return self._budget

    def families(self, records: Iterable[RouterStats], shard: RouterShard | None = None) -> list[Metric]:
        """The per-expert gauges of ``records`` (one snapshot's); of ``shard``'s routers only when given, and then
        without the budget's figures, which are no router's."""
        selections = PrewrittenFamily(
            EXPERT_WINDOW_SELECTIONS,
            "Selections of each expert slot by this router "
            "for this business line in its current window (sum across replicas).",
            EXPERT_LABELS,
        )
        tokens = PrewrittenFamily(
            EXPERT_WINDOW_TOKENS,
            "Tokens in this router's current window for this business "
            "line, exported with its per-expert selections (sum across replicas).",
            SERIES_LABELS,
        )
        overflow = 0
        with self._lock:
            seen: set[tuple[str, str]] = set()
            for record in records:
                info, line = record.router, record.business_line
                if (
                    line is None
                    or info.kind != "expert"
                    or record.counts is None
                    or not self._selection.matches_line(line)
                    or not self._selection.matches_router(info.name)
                ):
                    continue
                key = (info.name, line)
                if key in seen:
                    continue
                seen.add(key)
                pair = self._admitted.get(key)
                if pair is None:
                    pair = self._admit(key, info)
                    if pair is None:
                        overflow += record.stats.selections
                        continue
                if shard is not None and not shard.holds(pair.layer):
                    continue
                selections.write(pair.slot_labels, pair.slot_prefixes, record.counts.tolist())
                tokens.write((pair.labels,), (pair.prefix,), (record.stats.tokens,))
            self._forget_gone(seen)
            used = self._used
        if shard is not None:
            return [selections, tokens]
        series = GaugeMetricFamily(EXPERT_SERIES, "Per-expert series exported now (selections and tokens).", value=used)
        budget = GaugeMetricFamily(
            EXPERT_SERIES_BUDGET, f"The most per-expert series exported ({BUDGET_FLAG}).", value=self._budget
        )
        refused = GaugeMetricFamily(
            EXPERT_OVERFLOW_SELECTIONS,
            "Selections in the current windows of (router, business line) pairs the per-expert series budget left out.",
            value=overflow,
        )
        return [selections, tokens, series, budget, refused]

    def _admit(self, key: tuple[str, str], info: RouterInfo) -> _Admitted | None:
        """The pair admitted now, or ``None`` where it is (or was once) refused."""
        if key in self._refused:
            return None
        cost = pair_series(info)
        if self._used + cost > self._budget:
            self._refused.add(key)
            if not self._warned:
                self._warned = True
                log.warning(
                    "per-expert counts: router %r, business line %r left out: its %d series do not fit "
                    "the budget of %d (%d in use); its window's selections show in %s, and %s raises the "
                    "budget",
                    key[0],
                    key[1],
                    cost,
                    self._budget,
                    self._used,
                    EXPERT_OVERFLOW_SELECTIONS,
                    BUDGET_FLAG,
                )
            return None
        router, line = key
        labels = dict(zip(SERIES_LABELS, (router, str(info.layer), info.kind, line), strict=True))
        slot_labels = tuple({**labels, EXPERT: str(slot)} for slot in range(info.num_slots))
        prefixes = tuple(sample_prefix(EXPERT_WINDOW_SELECTIONS, each) for each in slot_labels)
        pair = _Admitted(slot_labels, labels, prefixes, sample_prefix(EXPERT_WINDOW_TOKENS, labels), info.layer, cost)
        self._admitted[key] = pair
        self._used += cost
        return pair

    def _forget_gone(self, seen: set[tuple[str, str]]) -> None:
        """Pairs whose windows are gone (a remote source dropped) give their series back to the budget."""
        if len(seen) == len(self._admitted) + len(self._refused):
            return
        for key in [key for key in self._admitted if key not in seen]:
            self._used -= self._admitted.pop(key).series
        self._refused.intersection_update(seen)
