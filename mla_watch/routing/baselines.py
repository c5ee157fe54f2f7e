"""Healthy baselines: what each router's routing looks like for each business line when all is well (no torch).

A threshold such as "MaxVio above 1.0" is a fact about one model's healthy balance, not a law: experts
specialise per business line, and a healthy line may load its busiest expert at two or three times the
mean. So the companion rules judge MaxVio, dead experts and drift against the values this router showed
for this line while healthy (``above: {baseline_times: 2.0, floor: 1.0}`` in a rule file).

A :class:`Baseline` is one series' healthy window: its counts (drift is the Jensen-Shannon divergence
from them) and the metrics read over them. :class:`Baselines` holds one per (router, business line),
learned or set:

* **learned**: :meth:`Baselines.learn` takes a series' first window that holds ``learn_tokens`` tokens,
  carries a signal (:attr:`~mla_watch.routing.RoutingStats.no_signal` is ``None``), is not the
  subject of an alert and, where the clients that sent it are seen here, is its line's traffic rather than
  one client's (:class:`~mla_watch.routing.client_mix.ClientGate`), once learning is trusted (the server
  trusts it once the routers it serves passed their start-up health check, or a quality gate). The baseline
  records those clients' shares; a window refused for its clients is reported (:meth:`Baselines.describe`,
  ``waiting``) until one is learned;
* **set**: :meth:`Baselines.replace` (``POST /admin/baseline``) makes the windows now the baseline of
  their series, replacing what was learned.

A learned baseline found not to be its line's traffic - its recorded clients fail the gate in force (at load),
or a later reading of the line's reference prompts says so (:mod:`mla_watch.references.representative`) - is
dropped, reported once (:meth:`Baselines.found_unrepresentative`) and learned again from the next window that
qualifies.

Persisted as JSON (``mla_watch.baseline/2``, written atomically) and loaded again at start, so a
restart neither forgets nor re-learns (a series' ``clients`` is an optional key: files written before it
load, their baselines' clients unknown). A save the disk refuses (full, read-only) keeps the baselines in
memory and is made again by :meth:`Baselines.save_again` (the server calls it with every routing
snapshot it takes), at most every few seconds, until the file is written. A file of the older
``mla_watch.baseline/1`` (one set of counts per router, for every line) still loads: its counts then serve
every line's drift.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.common.output_file import write_error
from mla_watch.common.setting_errors import SettingsError
from mla_watch.common.state_dir import set_aside
from mla_watch.common.state_writes import StateWrites
from mla_watch.common.values import is_number
from mla_watch.routing.baseline_file import (
    BASELINE_FORMAT,
    LEGACY_BASELINE_FORMAT,
    MAX_COUNTS,
    MAX_SERIES,
    Baseline,
    BaselineError,
    read_baseline_file,
    write_json,
)
from mla_watch.routing.client_mix import ClientGate, ClientMix
from mla_watch.routing.stats import BASELINE_METRICS

__all__ = [
    "ANY_LINE",
    "BASELINE_FORMAT",
    "BASELINE_METRICS",
    "BY_CLIENTS",
    "BY_REFERENCE",
    "DEFAULT_LEARN_TOKENS",
    "LEGACY_BASELINE_FORMAT",
    "Baseline",
    "BaselineError",
    "Baselines",
]

log = logging.getLogger("mla_watch.routing.baselines")

# Twice the shipped companion rules' 1024-token minimum: a baseline is read over more tokens than the windows
# judged against it, so its MaxVio and dead slots (which small windows overstate) err on the lenient side.
DEFAULT_LEARN_TOKENS = 2048
# The business line of a legacy baseline's counts: they serve every line that has none of its own.
ANY_LINE = "*"
SAVE_AGAIN_SECONDS = 5.0  # a save the disk refused is made again this long after, at the earliest
FOUND_KEPT = 256  # baselines found unrepresentative that GET /v1/baseline still shows (the latest)
FOUND_SHOWN = 64  # ... and GET /v1/status, for the status page
# Why a learned baseline was found not to be its line's traffic (a label of the counter of them).
BY_CLIENTS, BY_REFERENCE = "clients", "reference"
_WHAT = "baseline file"


class Baselines:
    """The healthy baseline of every (router, business line), learned or set, persisted at ``path``.

    ``learn_tokens``: how many tokens a series' window must hold before it is taken as that series'
    baseline; ``gate``: which windows' clients may make one; ``max_counts``: the selection counts held in all
    (default :data:`MAX_COUNTS`). Thread-safe; :attr:`version` changes whenever a baseline is added, replaced or
    dropped.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        learn_tokens: int = DEFAULT_LEARN_TOKENS,
        clock: Callable[[], float] = time.time,
        writes: StateWrites | None = None,
        gate: ClientGate | None = None,
        max_counts: int = MAX_COUNTS,
    ) -> None:
        if not isinstance(learn_tokens, int) or isinstance(learn_tokens, bool) or learn_tokens < 1:
            raise ValueError(f"learn_tokens = {learn_tokens!r}: expected an integer >= 1")
        self.gate = gate or ClientGate()
        if problems := self.gate.problems():
            raise SettingsError(problems)
        self.path = path
        self.learn_tokens = learn_tokens
        self.max_counts = max_counts
        self._clock = clock
        self.writes = writes
        self._unsaved = False  # the last save was refused: save again at the next learn() past _save_again_at
        self._save_again_at = 0.0
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], Baseline] = {}
        self._legacy: dict[str, np.ndarray] = {}  # router -> counts of a /1 file, for every line's drift
        self.version = 0
        self.not_learning: str | None = "learning has not started"  # why nothing is learned now, or None
        self.load_error: str | None = None
        # The latest learning round's windows refused for their clients: (line, keys seen) -> what GET /v1/baseline
        # shows under `waiting`.
        self._waiting: dict[tuple[str, int], dict[str, Any]] = {}
        self._said: set[tuple[str, int]] = set()  # ... of which the log said it, until the line learns one
        self._found: list[dict[str, Any]] = []  # baselines found unrepresentative, the latest FOUND_KEPT
        self._found_counts: dict[tuple[str, str], int] = {}  # (line, BY_CLIENTS | BY_REFERENCE) -> how many

    # ------------------------------------------------------------------ reading
    def get(self, router: str, business_line: str) -> Baseline | None:
        """The baseline of ``router`` for ``business_line`` (``"all"`` for every line summed), if any."""
        return self._series.get((router, business_line))

    def legacy_counts(self, router: str) -> np.ndarray | None:
        """The counts a ``mla_watch.baseline/1`` file gave ``router`` (for the drift of every line)."""
        return self._legacy.get(router)

    def __len__(self) -> int:
        return len(self._series)

    def describe(self) -> dict[str, Any]:
        """``GET /v1/baseline``: whether it learns, and each series' baseline (without counts)."""
        with self._lock:
            series = sorted(self._series.values(), key=lambda b: (b.router, b.business_line))
        return {
            **self.summary(),
            "learn_tokens": self.learn_tokens,
            "path": None if self.path is None else str(self.path),
            "load_error": self.load_error,
            "series": [{"router": b.router, "business_line": b.business_line, **b.as_dict()} for b in series],
        }

    def summary(self, *, brief: bool = False) -> dict[str, Any]:
        """Whether baselines are learned, and what is not and why: ``not_learning`` is why nothing is (learning not
        trusted), else what the latest round refused for its clients (``waiting``, per line and the tokens judged),
        else ``None``; ``unrepresentative``: the learned baselines found not to be their line's traffic (``brief``:
        the latest :data:`FOUND_SHOWN`, without their details and dropped baselines: what the status page polls)."""
        with self._lock:
            waiting = [dict(entry, routers=list(entry["routers"])) for entry in self._waiting.values()]
            found = list(self._found)
        if brief:
            found = [
                {key: entry[key] for key in ("router", "business_line", "reason", "why", "found_at")}
                for entry in found[-FOUND_SHOWN:]
            ]
        not_learning = self.not_learning
        if not_learning is None and waiting:
            not_learning = "; ".join(
                f"{entry['business_line']} ({len(entry['routers'])} router"
                f"{'s' if len(entry['routers']) != 1 else ''}): {entry['reason']}"
                for entry in waiting[:8]
            )
        return {
            "learning": self.not_learning is None,
            "not_learning": not_learning,
            **self.gate.as_dict(),
            "waiting": waiting,
            "unrepresentative": found,
        }

    # ------------------------------------------------------------------ learning and setting
    def trust(self, reason_not: str | None) -> None:
        """Learning goes ahead while ``reason_not`` is ``None``; otherwise it waits, and says why."""
        if reason_not != self.not_learning:
            log.info(
                "healthy baselines: %s",
                "learning from healthy traffic" if reason_not is None else f"not learning: {reason_not}",
            )
        self.not_learning = reason_not
        if reason_not is not None:
            with self._lock:
                self._waiting = {}

    def learn(
        self,
        records: Iterable[Any],
        *,
        excluded: Callable[[], set[tuple[str, str]]] | None = None,
        clients: Callable[[Any], ClientMix | None] | None = None,
    ) -> list[Baseline]:
        """Take each series' first healthy window of ``learn_tokens`` tokens as its baseline; the new ones.

        ``records`` are :class:`~mla_watch.windows.RouterStats`; ``excluded()``, asked only when a window
        qualifies, gives the (router, line) pairs an alert is pending or firing on: never learned from.
        ``clients(record)`` says whose tokens the record's window holds (``None``: not seen here); a window
        :attr:`gate` refuses is not learned, and the refusal is reported until one is.
        """
        self.save_again()
        if self.not_learning is not None:
            return []
        ready = [
            record
            for record in records
            if (record.router.name, record.line_label) not in self._series
            and record.stats.tokens >= self.learn_tokens
            and record.stats.no_signal is None
        ]
        waiting: dict[tuple[str, int], dict[str, Any]] = {}
        taken = []
        skip = excluded() if ready and excluded is not None else set()
        for record in ready:
            mix = clients(record) if clients is not None else None
            why_not = None if mix is None else self.gate.judge(mix)
            if why_not is not None:  # said whether or not an alert is pending on it too: whose window it is
                assert mix is not None
                entry = waiting.setdefault(
                    (record.line_label, mix.keys_seen),
                    {"business_line": record.line_label, "reason": why_not, "clients": mix.to_json(), "routers": []},
                )
                entry["routers"].append(record.router.name)
            elif (record.router.name, record.line_label) not in skip:
                taken.append(self._from_record(record, "learned", mix))
        if taken:
            taken = self._store(taken, replace=False)
        self._report_waiting(waiting, taken)
        if taken:
            log.info(
                "healthy baselines learned for %d series (%s ...)",
                len(taken),
                f"{taken[0].router} / {taken[0].business_line}",
            )
        return taken

    def _report_waiting(self, waiting: dict[tuple[str, int], dict[str, Any]], learned: Iterable[Baseline]) -> None:
        """Keep the round's refusals for GET /v1/baseline; say in the log once a line waits (again once it learned
        one: a window that comes and goes, as an indexer's signal does, is said once)."""
        with self._lock:
            self._waiting = waiting
            lines = {baseline.business_line for baseline in learned}
            self._said = {key for key in self._said if key[0] not in lines}
            new = [entry for key, entry in waiting.items() if key not in self._said]
            self._said.update(waiting)
        for entry in new:
            log.info(
                "healthy baselines of %s (%d router%s) not learned: %s",
                entry["business_line"],
                len(entry["routers"]),
                "s" if len(entry["routers"]) != 1 else "",
                entry["reason"],
            )

    def found_unrepresentative(
        self,
        found: Iterable[tuple[Baseline, str, str, Mapping[str, Any] | None]],
    ) -> list[Baseline]:
        """Each ``(baseline, reason, why, details)``: a learned baseline that is not its line's traffic. Drop it so
        that the series is learned again, and keep the finding for GET /v1/baseline and the metrics (``reason``:
        :data:`BY_CLIENTS` or :data:`BY_REFERENCE`; ``why`` in words). The ones dropped: not those whose series
        holds another baseline by now."""
        dropped = []
        with self._lock:
            now = float(self._clock())
            for baseline, reason, why, details in found:
                key = (baseline.router, baseline.business_line)
                if self._series.get(key) is not baseline or baseline.source != "learned":
                    continue
                del self._series[key]
                dropped.append(baseline)
                self._found.append(
                    {
                        "router": baseline.router,
                        "business_line": baseline.business_line,
                        "reason": reason,
                        "why": why,
                        "found_at": now,
                        "details": dict(details or {}),
                        "baseline": baseline.as_dict(),
                    }
                )
                counted = (baseline.business_line, reason)
                self._found_counts[counted] = self._found_counts.get(counted, 0) + 1
            if not dropped:
                return []
            del self._found[:-FOUND_KEPT]
            self.version += 1
            document = self._document()
        self._save(document)
        return dropped

    def found_counts(self) -> dict[tuple[str, str], int]:
        """How many learned baselines were found unrepresentative, per (line, reason), since this store was made."""
        with self._lock:
            return dict(self._found_counts)

    def save_again(self) -> None:
        """Save the baselines if the disk refused the last save (at most every ``SAVE_AGAIN_SECONDS``)."""
        if self._unsaved and self._clock() >= self._save_again_at:
            with self._lock:
                document = self._document()
            self._save(document)

    def replace(
        self,
        records: Iterable[Any],
        *,
        clients: Callable[[Any], ClientMix | None] | None = None,
    ) -> list[Baseline]:
        """The windows of ``records`` become their series' baselines now (``POST /admin/baseline``), whoever sent
        them (an operator's decision: ``clients(record)`` is only recorded)."""
        return self._store(
            [
                self._from_record(record, "set", clients(record) if clients is not None else None)
                for record in records
                if record.stats.selections > 0
            ],
            replace=True,
        )

    def _from_record(self, record: Any, source: str, clients: ClientMix | None = None) -> Baseline:
        stats = record.stats.as_dict()
        values = {key: float(stats[key]) for key in BASELINE_METRICS if is_number(stats.get(key), finite=True)}
        return Baseline(
            record.router.name,
            record.line_label,
            np.asarray(record.counts, dtype=np.int64),
            int(record.stats.tokens),
            values,
            float(self._clock()),
            source,
            clients,
        )

    def _store(self, taken: list[Baseline], *, replace: bool) -> list[Baseline]:
        """Keep ``taken`` within the bounds; the ones kept."""
        kept: list[Baseline] = []
        full: str | None = None
        with self._lock:
            held = sum(b.counts.size for b in self._series.values())
            for baseline in taken:
                key = (baseline.router, baseline.business_line)
                old = self._series.get(key)
                if old is not None and not replace:
                    continue
                grown = held + baseline.counts.size - (0 if old is None else old.counts.size)
                if (old is None and len(self._series) >= MAX_SERIES) or grown > self.max_counts:
                    full = (
                        f"the baselines are full ({len(self._series)} series, {held} counts; at most "
                        f"{MAX_SERIES} series and {self.max_counts} counts): {baseline.router} / "
                        f"{baseline.business_line} and the series after it are not kept"
                    )
                    continue
                self._series[key] = baseline
                kept.append(baseline)
                held = grown
            if kept:
                self.version += 1
                document = self._document()
        if full is not None and not replace:
            self.trust(full)  # learning stops rather than retry every round; POST /admin/baseline still sets
        elif full is not None:
            log.warning("healthy baselines: %s", full)
        if kept:
            self._save(document)
        return kept

    # ------------------------------------------------------------------ files
    def _document(self) -> dict[str, Any]:
        return {
            "format": BASELINE_FORMAT,
            "series": [b.to_json() for b in self._series.values()],
            **({"legacy": {name: counts.tolist() for name, counts in self._legacy.items()}} if self._legacy else {}),
        }

    def _save(self, document: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            write_json(self.path, document, label=f"{_WHAT} {self.path}")
        except OSError as error:  # kept in memory; learn() saves again
            self._unsaved, self._save_again_at = True, self._clock() + SAVE_AGAIN_SECONDS
            if self.writes is not None:
                self.writes.failed(self.path, error, what=_WHAT)
            else:
                log.error("%s", write_error(f"{_WHAT} {self.path}", error))
            return
        self._unsaved = False
        if self.writes is not None:
            self.writes.written(self.path, what=_WHAT)

    def load(self) -> None:
        """Read ``path`` (a missing file is an empty store). A file that cannot be used is moved aside to
        ``baseline.json.corrupt`` for an operator (as the alert state and the history are), the error kept in
        :attr:`load_error` and logged, and the store starts empty: what is learned or set next is saved."""
        if self.path is None or not self.path.exists():
            return
        try:
            series, legacy = read_baseline_file(self.path)
        except BaselineError as error:
            self.load_error = str(error)
            try:
                aside = set_aside(self.path)
                log.error("the saved baselines are not used: %s; kept the file as %s", error, aside)
            except OSError as moving:  # kept in memory only: never written over a file an operator must read
                log.error(
                    "the saved baselines are not used: %s; cannot move the file aside (%s): baselines are "
                    "kept in memory only",
                    error,
                    moving.strerror or type(moving).__name__,
                )
                self.path = None
            return
        self.adopt(series, legacy)
        self._judge_clients()

    def _judge_clients(self) -> None:
        """Drop the learned baselines whose recorded clients the gate in force refuses (learned under a looser one):
        each is reported once and learned again."""
        with self._lock:
            refused = [
                (baseline, why)
                for baseline in self._series.values()
                if baseline.source == "learned"
                and baseline.clients is not None
                and (why := self.gate.judge(baseline.clients)) is not None
            ]
        self.found_unrepresentative((baseline, BY_CLIENTS, why, None) for baseline, why in refused)
        if refused:
            lines = sorted({baseline.business_line for baseline, _ in refused})
            log.warning(
                "healthy baselines of %d series (%s) are not their line's traffic by the clients they were "
                "learned from (%s): learned again",
                len(refused),
                ", ".join(lines),
                refused[0][1],
            )

    def adopt(self, series: Iterable[Baseline], legacy: Mapping[str, np.ndarray] | None = None) -> None:
        """Hold exactly ``series`` (and a legacy file's counts) from now on, replacing everything held."""
        with self._lock:
            self._series = {(b.router, b.business_line): b for b in series}
            self._legacy = dict(legacy or {})
            self.version += 1
