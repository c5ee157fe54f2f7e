"""Opt-in per-expert counters, which Prometheus can sum across replicas (``serve --export-expert-counts``).

The routing gauges describe one sidecar's own rolling window and cannot be combined across a fleet. These
counters are cumulative - selections of each expert slot and tokens routed, per router and business line,
since the sidecar started - so ``sum by (layer, expert) (rate(...))`` over every replica is meaningful.

Only expert routers (an indexer's slots are key positions, unbounded in number) and only business lines (never
the ``all`` aggregate, which a sum over lines would count twice). Every slot of an exported (router, line) pair
is exported, zeros included, so dead experts can be counted in PromQL.

Each pair costs ``num_slots + 1`` series; a budget bounds them. Admission is first come, first kept: a pair
once exported stays exported (no series flaps) until its source is gone (a remote worker dropped for
idleness); a pair the budget refuses stays refused, and its selections count into an overflow counter.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_integer
from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.series import (
    EXPERT,
    EXPERT_LABELS,
    EXPERT_OVERFLOW_SELECTIONS,
    EXPERT_SELECTIONS,
    EXPERT_TOKENS,
    PREFIX,
    SERIES_LABELS,
    total_name,
)
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE, RouterWindows

__all__ = ["BUDGET_FLAG", "DEFAULT_EXPERT_SERIES_BUDGET", "EXPORT_FLAG", "SELECTION_FORM", "ExpertCountsCollector",
           "ExpertSelection", "pair_series"]

EXPORT_FLAG = "--export-expert-counts"
BUDGET_FLAG = "--expert-series-budget"
# One business line of DeepSeek-V3 fits: 58 MoE layers x (256 experts + 1 token series) = 14,906 series.
DEFAULT_EXPERT_SERIES_BUDGET = 20_000
SELECTION_FORM = ("'all', or routers=GLOB[,GLOB...] and/or lines=LINE[,LINE...] joined by ';' "
                  "(e.g. routers=*.mlp.gate;lines=code_assistant,doc_summary)")
_MAX_SELECTION_CHARS = 4096  # a selection is typed by an operator; anything longer is a mistake
_MAX_ITEMS = 256  # globs or lines in one clause

log = logging.getLogger("mla_watch.server")


@dataclass(frozen=True)
class ExpertSelection:
    """Which (router, business line) pairs export per-expert counters: routers matching any glob of ``routers``
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
                        raise refuse(f"lines={ALL_LINES} is every line summed, which is not exported (a sum over "
                                     "lines would count it twice); leave lines= out to export every line")
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
        clauses = [f"{key}={','.join(values)}" for key, values in (("routers", self.routers), ("lines", self.lines))
                   if values]
        return ";".join(clauses) or "all"


def pair_series(info: RouterInfo) -> int:
    """Series one (router, line) pair exports: one per slot, and its tokens."""
    return info.num_slots + 1


@dataclass(frozen=True)
class _Admitted:
    """An exported pair's label sets, built once at admission so a scrape makes no label dicts."""

    slot_labels: tuple[dict[str, str], ...]
    labels: dict[str, str]
    series: int


class ExpertCountsCollector(Collector):
    """Exports ``expert_selections_total`` and ``expert_tokens_total`` of the windows ``windows()`` lists,
    within a budget of series, at scrape time."""

    def __init__(self, windows: Callable[[], Iterable[RouterWindows]], selection: ExpertSelection,
                 budget: int = DEFAULT_EXPERT_SERIES_BUDGET) -> None:
        if not is_integer(budget) or budget < 1:
            raise ValueError(f"{BUDGET_FLAG} {describe_value(budget)}: expected an integer >= 1")
        self._windows = windows
        self._selection = selection
        self._budget = budget
        self._lock = threading.Lock()  # scrapes may overlap; admission must be decided once
        self._admitted: dict[tuple[str, str], _Admitted] = {}
        self._used = 0
        # Refused pairs: the windows' serial and the selections already counted into the overflow counter.
        self._refused: dict[tuple[str, str], tuple[int, int]] = {}
        self._overflow = 0
        self._warned = False

    @property
    def budget(self) -> int:
        return self._budget

    def collect(self) -> Iterable[Metric]:
        selections = CounterMetricFamily(EXPERT_SELECTIONS, "Selections of each expert slot by this router "
                                         "for this business line since the sidecar started (sum across replicas).",
                                         labels=list(EXPERT_LABELS))
        tokens = CounterMetricFamily(EXPERT_TOKENS, "Tokens this router routed for this business line since "
                                     "the sidecar started (sum across replicas).", labels=list(SERIES_LABELS))
        selections_name, tokens_name = total_name(EXPERT_SELECTIONS), total_name(EXPERT_TOKENS)
        sources = list(self._windows())
        with self._lock:
            seen: set[tuple[str, str]] = set()
            for windows in sources:
                routers = {info.name: info for info in windows.routers
                           if info.kind == "expert" and self._selection.matches_router(info.name)}
                if not routers:
                    continue
                for key, total in windows.cumulative_totals().items():
                    info = routers.get(key[0])
                    if info is None or key in seen or not self._selection.matches_line(key[1]):
                        continue
                    seen.add(key)
                    pair = self._admitted.get(key)
                    if pair is None:
                        pair = self._admit(key, info, windows.serial, total)
                        if pair is None:
                            continue
                    selections.samples.extend(map(Sample, repeat(selections_name), pair.slot_labels,
                                                  total.counts.tolist()))
                    tokens.samples.append(Sample(tokens_name, pair.labels, total.tokens))
            self._forget_gone(seen)
            used, overflow = self._used, self._overflow
        series = GaugeMetricFamily(PREFIX + "expert_series", "Per-expert series exported now (selections and tokens).",
                                   value=used)
        budget = GaugeMetricFamily(PREFIX + "expert_series_budget", "The most per-expert series exported "
                                   f"({BUDGET_FLAG}).", value=self._budget)
        refused = CounterMetricFamily(EXPERT_OVERFLOW_SELECTIONS, "Selections counted for (router, business "
                                      "line) pairs the per-expert series budget left out.", value=overflow)
        return [selections, tokens, series, budget, refused]

    def describe(self) -> Iterable[Metric]:
        return []

    def _admit(self, key: tuple[str, str], info: RouterInfo, serial: int, total: CountDelta) -> _Admitted | None:
        """The pair admitted now, or ``None`` where it is (or was once) refused; its selections then count into
        the overflow counter."""
        refused = self._refused.get(key)
        selected = int(total.counts.sum())
        if refused is not None:
            last_serial, counted = refused
            # New windows under the same name (a worker that came back) start from zero again.
            self._overflow += selected - counted if last_serial == serial and selected >= counted else selected
            self._refused[key] = (serial, selected)
            return None
        cost = pair_series(info)
        if self._used + cost > self._budget:
            self._refused[key] = (serial, selected)
            self._overflow += selected
            if not self._warned:
                self._warned = True
                log.warning("per-expert counters: router %r, business line %r left out: its %d series do not fit "
                            "the budget of %d (%d in use); its selections count into %s, and %s raises the budget",
                            key[0], key[1], cost, self._budget, self._used, total_name(EXPERT_OVERFLOW_SELECTIONS),
                            BUDGET_FLAG)
            return None
        router, line = key
        labels = dict(zip(SERIES_LABELS, (router, str(info.layer), info.kind, line), strict=True))
        pair = _Admitted(tuple({**labels, EXPERT: str(slot)} for slot in range(info.num_slots)), labels, cost)
        self._admitted[key] = pair
        self._used += cost
        return pair

    def _forget_gone(self, seen: set[tuple[str, str]]) -> None:
        """Pairs whose windows are gone (a remote source dropped) give their series back to the budget."""
        if len(seen) == len(self._admitted) + len(self._refused):
            return
        for key in [key for key in self._admitted if key not in seen]:
            self._used -= self._admitted.pop(key).series
        for key in [key for key in self._refused if key not in seen]:
            del self._refused[key]
