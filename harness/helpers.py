"""Small shared test helpers: a fake clock, a rules-directory writer, routing-record and history builders, and
the outside tools (Prometheus, Alertmanager) run for real."""

from __future__ import annotations

import math
import subprocess
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from harness import processes
from harness.support import free_port
from mla_watch.history.store import HISTORY_FILE, HistoryStore
from mla_watch.routing.baselines import Baseline
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import RoutingStats
from mla_watch.routing.windows import ALL_LINES, RouterStats

GATE = "model.layers.1.mlp.gate"  # the router the record builders describe unless told otherwise
DAY = 86400.0

# --------------------------------------------------------------------------- the clock


class FakeClock:
    """An injectable clock: ``clock()`` returns ``clock.now``; a test sets ``now`` or calls ``advance``.

    ``now`` starts at a plausible wall-clock time unless given (pass ``0.0`` for a monotonic-style clock).
    ``tick``: seconds that pass at every reading, added before it is returned - for code that must see time
    move while it runs (a deadline that has passed by the next look at it, however fast the machine is).
    Reading and advancing are thread-safe.
    """

    def __init__(self, now: float = 1_700_000_000.0, *, tick: float = 0.0) -> None:
        self.now = now
        self.tick = tick
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            if self.tick:
                self.now += self.tick
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


# --------------------------------------------------------------------------- rules files


def write_rules(directory: Path, text: str | None = None, *, name: str = "routing.yaml", **example: Any) -> Path:
    """Write one rules file ``name`` into ``directory`` (made if missing) and return the directory, which is
    what ``--rules`` and ``load_rules_dir`` take.

    ``text`` is the file; without it, ``entropy_low_rules(**example)``: receiver ``oncall`` at
    ``${MLA_WATCH_ONCALL_URL}`` and one RoutingEntropyLow rule (``below``, ``resolve_above``, ``actions``,
    ``strategies``, ``annotations``, ...: see :func:`mla_watch.alerting.examples.entropy_low_rules`).
    """
    if text is None:
        from mla_watch.alerting.examples import entropy_low_rules

        text = entropy_low_rules(**example)
    elif example:
        raise TypeError(f"write_rules: {sorted(example)} build the example rules, but a text was given")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory


# --------------------------------------------------------------------------- routing records
# Typed, as every consumer takes them (RouterStats: a router, a line, its RoutingStats, the healthy baseline). The
# history keeps the metrics it is given and the router's geometry; the alert engine judges a window against its
# min_tokens and matches rules on geometry only when the record states it (``num_slots=...``).


def router_stats(
    *,
    name: str = GATE,
    layer: int = 1,
    kind: str = "expert",
    line: str | None = "code",
    num_slots: int | None = 64,
    top_k: int = 6,
    tokens: int = 4096,
    min_tokens: int = 256,
    baseline: Mapping[str, float] | None = None,
    hash_routed: bool = False,
    **values: Any,
) -> RouterStats:
    """One router's statistics over one line's window: a 64-slot top-6 router (2.585..6 bits) reading 5.9 bits
    unless ``values`` say otherwise (any :class:`RoutingStats` field: ``entropy_bits``, ``max_violation``, ...).
    ``too_small`` follows ``tokens < min_tokens``; ``baseline``: the healthy values of the series, if learned.
    ``num_slots=None``: a record that does not state its geometry (any ``slots`` selector matches it)."""
    fields: dict[str, Any] = {
        "kind": kind,
        "num_slots": num_slots,
        "top_k": top_k,
        "tokens": tokens,
        "selections": tokens * top_k,
        "entropy_bits": 5.9,
        "floor_bits": 2.585,
        "ceiling_bits": 6.0,
        "normalized_entropy": 0.97,
        "max_violation": 0.1,
        "dead_slots": 0,
        "js_divergence": None,
        "locality": None,
        "min_tokens": min_tokens,
        "too_small": tokens < min_tokens,
    }
    fields.update(values)
    info = RouterInfo(
        name=name,
        layer=layer,
        kind=kind,
        num_slots=num_slots or 64,  # type: ignore[arg-type]
        top_k=top_k,
        hash_routed=hash_routed,
    )
    healthy = (
        None
        if baseline is None
        else Baseline(
            router=name,
            business_line=line or ALL_LINES,
            counts=np.ones(info.num_slots, dtype=np.int64),
            tokens=int(baseline.get("tokens", tokens)),
            values={k: v for k, v in baseline.items() if k != "tokens"},
            taken_at=0.0,
            source="learned",
        )
    )
    return RouterStats(router=info, business_line=line, stats=RoutingStats(**fields), baseline=healthy)


def history_record(
    name: str = GATE,
    line: str | None = "code",
    bits: float | None = 5.0,
    tokens: int = 200,
    too_small: bool = False,
    *,
    kind: str = "expert",
    layer: int = 1,
) -> RouterStats:
    """A routing record as the history samples it: a 64-slot router (2.585..6 bits) whose metrics follow
    ``bits`` (normalized entropy, bits below the ceiling; ``None``: NaN, no value) or are fixed (max violation, dead
    slots, locality)."""
    return router_stats(
        name=name,
        line=line,
        kind=kind,
        layer=layer,
        tokens=tokens,
        too_small=too_small,
        entropy_bits=math.nan if bits is None else bits,
        normalized_entropy=math.nan if bits is None else bits / 6.0,
        max_violation=1.5,
        dead_slots=2,
        locality=0.25,
    )


def prefill_history(state: Path, end: float, days: float = 3.0, interval: float = 60.0) -> None:
    """A durable history in ``state`` holding ``days`` of samples up to ``end``: entropy 5 + the day number / 10
    on "code", 4.0 summed."""
    state.mkdir(parents=True, exist_ok=True)
    clock = FakeClock(end - days * DAY)
    store = HistoryStore(state / HISTORY_FILE, interval_seconds=interval, clock=clock)
    summed = router_stats(name=GATE, line=None, tokens=900, entropy_bits=4.0)
    by_day = [
        router_stats(name=GATE, line="code", tokens=500, entropy_bits=5.0 + day / 10, dead_slots=1)
        for day in range(math.ceil(days) + 1)
    ]
    while clock.now < end:
        day = int((clock.now - (end - days * DAY)) // DAY)
        store.record([by_day[day], summed])
        clock.now += interval
    store.close()


def engine_record(
    value: float | None = 5.9,
    *,
    metric: str = "entropy_bits",
    name: str = GATE,
    layer: int = 1,
    kind: str = "expert",
    line: str | None = "code",
    tokens: int = 4096,
    min_tokens: int = 256,
    num_slots: int | None = None,
    **extra: Any,
) -> RouterStats:
    """A routing record as the alert engine judges it: ``metric`` reads ``value`` (entropy 5.9 bits otherwise),
    ``too_small`` follows ``tokens < min_tokens``; ``extra`` adds or overrides fields (``baseline``, ...). Its
    geometry is unstated unless ``num_slots`` is given."""
    return router_stats(
        name=name,
        layer=layer,
        kind=kind,
        line=line,
        tokens=tokens,
        min_tokens=min_tokens,
        num_slots=num_slots,
        **{metric: value, **extra},
    )


# --------------------------------------------------------------------------- outside tools
# Prometheus, promtool and Alertmanager come from Debian's packages, which `.ci/run` installs.


def binary(name: str) -> str:
    """The path of an outside tool the tests run for real; a failure naming the package where it is missing."""
    import shutil

    path = shutil.which(name)
    assert path, f"{name} is not installed: .ci/run installs Debian's prometheus and prometheus-alertmanager"
    return path


@contextmanager
def running_tool(name: str, tmp_path: Path, config: str, *flags: str) -> Iterator[str]:
    """``prometheus`` or ``prometheus-alertmanager`` with ``config`` (the YAML text), on a free loopback port,
    ready for the ``with`` block, stopped after it; yields its base URL. Its log is ``tmp_path / <name>.log``."""
    import time

    import httpx

    port = free_port()
    config_file, log = tmp_path / f"{name}.yml", tmp_path / f"{name}.log"
    config_file.write_text(config)
    data = "--storage.path" if name == "prometheus-alertmanager" else "--storage.tsdb.path"
    command = [
        binary(name),
        f"--config.file={config_file}",
        f"{data}={tmp_path / (name + '-data')}",
        f"--web.listen-address=127.0.0.1:{port}",
        *flags,
    ]
    url = f"http://127.0.0.1:{port}"
    with (
        log.open("w") as output,
        processes.running(command, stdout=output, stderr=subprocess.STDOUT, grace=15) as process,
    ):
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        yield url
