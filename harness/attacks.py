"""Hostile requests replayed against a live sidecar, with ``/healthz`` watched meanwhile: the attacks, their
plan and target, and the report (``replay()``, ``render()``).

``python -m bench.attacks`` replays them against ``mla-watch serve`` and prints the figures;
tests/test_reliability.py replays them (with :meth:`Plan.quick`) against a sidecar it starts itself.
"""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from harness.support import memory_kib
from mla_watch.routing.ingest import REMOTE_MAX_BUCKETS, IngestLimits

HEALTHZ_POLL_SECONDS = 0.02
MIN_ATTACK_SECONDS = 0.5  # a quick attack is repeated until it has lasted this long: /healthz is polled ~25 times
HEALTHZ_GOAL_MS = 50.0  # the goal: /healthz within 50 ms of its usual latency during any attack
GET_GROWTH_LIMIT_BYTES = 8192  # per unknown-line GET (RSS grows in steps of ~1 MB); once measured at 33 KB
LOCAL_ROUTER = "model.layers.2.mlp.gate"  # a router of the bundled model (64 experts, top-6)
RETUNABLE_ROUTER = "model.layers.1.mlp.gate"
MAX_BODY_BYTES = 1_000_000  # ServerConfig.max_body_bytes (serve has no flag for it)


# --------------------------------------------------------------------------- what to send


@dataclass(frozen=True)
class Plan:
    """How much of each attack to send."""

    routing_gets: int = 3000  # attack 1
    rounds: int = 5  # repetitions of each small attack (and concurrent trickling connections per endpoint)
    line_requests: int = 10  # attack 2: requests of ...
    lines_per_request: int = 2000  # ... this many new business lines each
    bucket_requests: int = 40  # attack 2: requests of 16 deltas x 4,096 slots into 16 wide windows
    sources: int = 40  # attack 2: distinct sources, one request each
    series_routers: int = 200  # attack 7: one source reporting this many routers ...
    series_lines: int = 16  # ... on this many business lines: (lines + 1) x routers records on /metrics
    rest_seconds: float = 3.0  # /healthz at rest, before the first attack

    @classmethod
    def quick(cls) -> Plan:
        """A version for the test suite: every attack, fewer repetitions."""
        return cls(
            routing_gets=1500,
            rounds=2,
            line_requests=2,
            bucket_requests=4,
            sources=20,
            series_routers=128,
            series_lines=8,
            rest_seconds=2.0,
        )


@dataclass(frozen=True)
class Target:
    """The sidecar under attack: its URL, its process (for RSS), its tokens and limits."""

    url: str
    pid: int
    admin_token: str
    ingest_token: str
    body_timeout: float
    limits: IngestLimits = field(default_factory=IngestLimits)


# --------------------------------------------------------------------------- measuring


@dataclass
class Latency:
    """/healthz round trips in a span of time, in milliseconds."""

    samples: int = 0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    max_ms: float = float("nan")
    failures: int = 0  # answers other than 200, and requests that failed

    @classmethod
    def of(cls, seconds: list[float], failures: int) -> Latency:
        if not seconds:
            return cls(failures=failures)
        ordered = sorted(seconds)
        return cls(
            len(ordered),
            statistics.median(ordered) * 1e3,
            ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
            ordered[-1] * 1e3,
            failures,
        )


class HealthPoller:
    """A thread polling ``/healthz`` on its own connection; :meth:`between` summarises a span."""

    def __init__(self, url: str, interval: float = HEALTHZ_POLL_SECONDS) -> None:
        self._url = url
        self._interval = interval
        self._samples: list[tuple[float, float, bool]] = []  # (sent at, seconds, answered 200)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="healthz-poller", daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    ok = client.get(self._url + "/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                with self._lock:
                    self._samples.append((sent, time.monotonic() - sent, ok))
                self._stop.wait(self._interval)

    def between(self, start: float, end: float) -> Latency:
        """The polls sent between ``start`` and ``end`` (``time.monotonic()`` values)."""
        return self.within([(start, end)])

    def within(self, spans: list[tuple[float, float]]) -> Latency:
        """The polls sent during any of ``spans`` (``time.monotonic()`` values)."""
        with self._lock:
            chosen = [
                (seconds, ok)
                for sent, seconds, ok in self._samples
                if any(start <= sent <= end for start, end in spans)
            ]
        return Latency.of([seconds for seconds, ok in chosen if ok], sum(1 for _, ok in chosen if not ok))


# --------------------------------------------------------------------------- results


@dataclass
class AttackReport:
    number: str  # the attack's number below (the module docstring)
    name: str
    expected: str  # the documented answer
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # a wrong status, error body or effect
    findings: list[str] = field(default_factory=list)  # figures past what the goal asks (not a wrong answer)
    notes: list[str] = field(default_factory=list)  # what was measured, in words
    figures: dict[str, float] = field(default_factory=dict)  # ... and as numbers (the JSON)
    seconds: float = 0.0
    healthz: Latency = field(default_factory=Latency)

    @property
    def ok(self) -> bool:
        return not self.problems and self.healthz.failures == 0


@dataclass
class Replay:
    rest: Latency
    attacks: list[AttackReport]
    final: dict[str, Any]

    def added_ms(self, report: AttackReport) -> tuple[float, float]:
        """/healthz p50 and p99 during the attack minus at rest."""
        return report.healthz.p50_ms - self.rest.p50_ms, report.healthz.p99_ms - self.rest.p99_ms

    def as_dict(self) -> dict[str, Any]:
        attacks = []
        for report in self.attacks:
            p50, p99 = self.added_ms(report)
            attacks.append(
                {
                    **asdict(report),
                    "statuses": {str(k): v for k, v in sorted(report.statuses.items())},
                    "ok": report.ok,
                    "healthz_added_ms": {"p50": p50, "p99": p99},
                }
            )
        return {"rest_ms": asdict(self.rest), "attacks": attacks, "final": self.final}


def render(replay: Replay) -> str:
    """The per-attack table, then every problem and finding."""
    rest = replay.rest
    lines = [
        f"/healthz at rest: p50 {rest.p50_ms:.1f} ms, p99 {rest.p99_ms:.1f} ms, max {rest.max_ms:.1f} ms "
        f"({rest.samples} polls)"
    ]
    header = (
        "#",
        "attack",
        "requests",
        "statuses",
        "expected",
        "healthz p50/p99 ms",
        "added p50/p99 ms",
        f"p99 within {HEALTHZ_GOAL_MS:g} ms",
        "max ms",
        "polls",
    )
    rows = [header]
    for report in replay.attacks:
        p50, p99 = replay.added_ms(report)
        statuses = ", ".join(f"{status or 'no answer'} x{count}" for status, count in sorted(report.statuses.items()))
        rows.append(
            (
                report.number,
                report.name,
                str(report.requests),
                statuses,
                report.expected,
                f"{report.healthz.p50_ms:.1f} / {report.healthz.p99_ms:.1f}",
                f"{p50:+.1f} / {p99:+.1f}",
                "yes" if p99 <= HEALTHZ_GOAL_MS else "NO",
                f"{report.healthz.max_ms:.0f}",
                str(report.healthz.samples)
                + (f" ({report.healthz.failures} failed)" if report.healthz.failures else ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    for report in replay.attacks:
        lines += [f"  [{report.number} {report.name}] {text}" for text in report.notes]
    for report in replay.attacks:
        lines += [f"  FINDING [{report.number} {report.name}]: {text}" for text in report.findings]
        lines += [
            f"  PROBLEM [{report.number} {report.name}]: {text}" + (f" (x{count})" if count > 1 else "")
            for text, count in Counter(report.problems).items()
        ]
        if report.healthz.failures:
            lines.append(f"  PROBLEM [{report.number} {report.name}]: /healthz failed {report.healthz.failures} times")
    lines.append("after the attacks: " + ", ".join(f"{key} {value}" for key, value in replay.final.items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------- request bodies


def snapshot(source: str = "attacker", line: str = "probe-line") -> dict[str, Any]:
    """A valid ingestion body: one 8-slot top-2 router, one delta."""
    return {
        "source": source,
        "routers": [{"name": "gate", "layer": 1, "kind": "expert", "num_slots": 8, "top_k": 2}],
        "deltas": [{"router": "gate", "business_line": line, "slots": [0, 1], "counts": [3, 1], "tokens": 2}],
    }


def changed(path: tuple[str | int, ...], value: Any, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """``body`` (default: :func:`snapshot`) with the value at ``path`` replaced."""
    body = copy.deepcopy(body if body is not None else snapshot())
    node: Any = body
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return body


def refused_part_way() -> dict[str, Any]:
    """A valid first delta, then an invalid one: nothing of it may be applied."""
    body = snapshot(line="partial-line")
    body["deltas"].append(
        {"router": "gate", "business_line": "partial-line-2", "slots": [0], "counts": [2**64], "tokens": 1}
    )
    return body


# (what, body, documented status, the param its error names)
MALFORMED: list[tuple[str, Callable[[], dict[str, Any] | bytes], int, str | None]] = [
    ("num_slots 10**12", lambda: changed(("routers", 0, "num_slots"), 10**12), 400, "routers[0].num_slots"),
    ("num_slots 2**64", lambda: changed(("routers", 0, "num_slots"), 2**64), 400, "routers[0].num_slots"),
    ("top_k 10**9", lambda: changed(("routers", 0, "top_k"), 10**9), 400, "routers[0].top_k"),
    (
        "count 2**63 - 1 (wraps int64 when summed)",
        lambda: changed(("deltas", 0, "counts"), [2**63 - 1, 1]),
        400,
        "deltas[0].counts",
    ),
    ("count 2**64", lambda: changed(("deltas", 0, "counts"), [2**64, 1]), 400, "deltas[0].counts"),
    ("negative count", lambda: changed(("deltas", 0, "counts"), [-1, 1]), 400, "deltas[0].counts"),
    ("float count", lambda: changed(("deltas", 0, "counts"), [1.5, 1]), 400, "deltas[0].counts"),
    ("string count", lambda: changed(("deltas", 0, "counts"), ["3", 1]), 400, "deltas[0].counts"),
    ("boolean count", lambda: changed(("deltas", 0, "counts"), [True, 1]), 400, "deltas[0].counts"),
    ("counts over tokens x top_k", lambda: changed(("deltas", 0, "counts"), [4, 1]), 400, "deltas[0].counts"),
    ("tokens 2**64", lambda: changed(("deltas", 0, "tokens"), 2**64), 400, "deltas[0].tokens"),
    ("float tokens", lambda: changed(("deltas", 0, "tokens"), 2.0), 400, "deltas[0].tokens"),
    ("slots and counts of different lengths", lambda: changed(("deltas", 0, "counts"), [1]), 400, "deltas[0].counts"),
    ("a slot listed twice", lambda: changed(("deltas", 0, "slots"), [0, 0]), 400, "deltas[0].slots"),
    ("a slot past num_slots", lambda: changed(("deltas", 0, "slots"), [0, 8]), 400, "deltas[0].slots"),
    ("unknown top-level field", lambda: {**snapshot(), "priority": 1}, 400, "priority"),
    ("unknown delta field", lambda: changed(("deltas", 0, "weight"), 1), 400, "deltas[0].weight"),
    (
        "business line with a newline",
        lambda: changed(("deltas", 0, "business_line"), "line\n"),
        400,
        "deltas[0].business_line",
    ),
    ("source with a separator", lambda: changed(("source",), "../etc"), 400, "source"),
    (
        "router named with the source separator",
        lambda: changed(("routers", 0, "name"), "w/gate", changed(("deltas", 0, "router"), "w/gate")),
        400,
        "routers[0].name",
    ),
    ("refused part-way", refused_part_way, 400, "deltas[1].counts"),
    (
        "body over 1 MB",
        lambda: json.dumps({**snapshot(), "source": "x" * (MAX_BODY_BYTES + 200_000)}).encode(),
        413,
        None,
    ),
]


WIDE_SLOTS = 16_384  # 16 windows of it stay inside the default --ingest-max-window-slots


def wide_window_bodies(count: int, seed: int = 11) -> list[bytes]:
    """Bodies of 16 deltas (one per line) of 4,096 distinct slots at 1 token each, into a 16,384-slot router."""
    rng = np.random.default_rng(seed)
    router = {"name": "wide", "layer": 1, "kind": "expert", "num_slots": WIDE_SLOTS, "top_k": 4096}
    bodies = []
    for _ in range(count):
        deltas = [
            {
                "router": "wide",
                "business_line": f"bucket-{line}",
                "slots": sorted(rng.choice(WIDE_SLOTS, 4096, replace=False).tolist()),
                "counts": [1] * 4096,
                "tokens": 1,
            }
            for line in range(16)
        ]
        bodies.append(json.dumps({"source": "bucket-attacker", "routers": [router], "deltas": deltas}).encode())
    return bodies


# --------------------------------------------------------------------------- the replay


class Attacker:
    """Sends the attacks of one replay, recording what each got."""

    def __init__(self, target: Target, plan: Plan, poller: HealthPoller) -> None:
        self.target = target
        self.plan = plan
        self.poller = poller
        self.http = httpx.Client(base_url=target.url, timeout=120)
        self.ingest_auth = {"Authorization": f"Bearer {target.ingest_token}", "Content-Type": "application/json"}
        self.admin_auth = {"Authorization": f"Bearer {target.admin_token}", "Content-Type": "application/json"}
        self.report: AttackReport | None = None
        self._window: list[float] = []

    # -- bookkeeping
    @contextlib.contextmanager
    def attack(self, number: str, name: str, expected: str) -> Iterator[AttackReport]:
        """An attack's report; what it sends inside :meth:`sending` is timed and watched."""
        self.report = AttackReport(number, name, expected)
        self._window = []
        try:
            yield self.report
        except (httpx.HTTPError, OSError) as error:
            self.report.problems.append(f"{type(error).__name__}: {error}")
        if self._window:
            start, end = self._window
            self.report.seconds = end - start
            self.report.healthz = self.poller.between(start, end)

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """The span /healthz is measured in (bodies are built before it)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self._window = [start, time.monotonic()]

    def expect(
        self,
        response: httpx.Response,
        statuses: set[int],
        what: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        """Count the answer; a wrong status, or a 4xx without the OpenAI error body naming ``param``, is a problem."""
        report = self.report
        assert report is not None
        report.requests += 1
        report.statuses[response.status_code] += 1
        if response.status_code not in statuses:
            report.problems.append(
                f"{what}: {response.status_code} (expected {sorted(statuses)}): {response.text[:160]}"
            )
            return
        if 400 <= response.status_code < 500:
            try:
                error = response.json()["error"]
                shaped = (
                    set(error) == {"message", "type", "param", "code"}
                    and isinstance(error["message"], str)
                    and error["message"].strip() != ""
                )
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not shaped:
                report.problems.append(f"{what}: {response.status_code} without the error body: {response.text[:160]}")
                return
            if param is not None and error["param"] != param:
                report.problems.append(f"{what}: param {error['param']!r}, expected {param!r}")
            if code is not None and error["code"] != code:
                report.problems.append(f"{what}: code {error['code']!r}, expected {code!r}")

    def repeats(self, minimum: int | None = None) -> Iterator[int]:
        """At least ``minimum`` (default ``plan.rounds``) repetitions, more until :data:`MIN_ATTACK_SECONDS`
        have passed (at most 20 x that): /healthz must be polled during an attack refused quickly."""
        least = self.plan.rounds if minimum is None else minimum
        start, count = time.monotonic(), 0
        while count < least or (time.monotonic() - start < MIN_ATTACK_SECONDS and count < 20 * least):
            yield count
            count += 1

    def problem(self, text: str) -> None:
        assert self.report is not None
        self.report.problems.append(text)

    def ingest(self, body: dict[str, Any] | bytes) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post("/v1/routing/ingest", content=content, headers=self.ingest_auth)

    def routing(self, line: str | None = None) -> httpx.Response:
        return self.http.get("/v1/routing", params={} if line is None else {"business_line": line})

    # -- 1
    def unknown_lines(self) -> None:
        with self.attack("1", "unknown business lines, GET /v1/routing", "404") as report:
            names = [f"nobody-{secrets.token_hex(6)}" for _ in range(self.plan.routing_gets + 50)]
            for name in names[:50]:  # warm-up, not counted
                self.http.get("/v1/routing", params={"business_line": name})
            before = memory_kib(self.target.pid)
            with self.sending():
                for name in names[50:]:
                    self.expect(
                        self.routing(name), {404}, f"business_line={name}", param="business_line", code="not_found"
                    )
            growth = (memory_kib(self.target.pid) - before) * 1024 / self.plan.routing_gets
            report.notes.append(f"sidecar RSS growth {growth:+.0f} B/request over {self.plan.routing_gets} requests")
            report.figures["rss_growth_bytes_per_request"] = round(growth, 1)
            if growth > GET_GROWTH_LIMIT_BYTES:
                self.problem(f"the sidecar's RSS grew {growth:.0f} B per request (limit {GET_GROWTH_LIMIT_BYTES})")

    # -- 2
    def malformed_ingestion(self) -> None:
        with self.attack("2", "malformed ingestion bodies", "400 naming the field; 413 over 1 MB"):
            bodies = [(what, build(), status, param) for what, build, status, param in MALFORMED]
            with self.sending():
                for _ in self.repeats():
                    for what, body, status, param in bodies:
                        self.expect(self.ingest(body), {status}, what, param=param)
            for line in ("partial-line", "partial-line-2", "probe-line"):
                answer = self.routing(line)
                if answer.status_code != 404:  # nothing of a refused request may be applied
                    self.problem(f"after refused requests, business_line={line} answers {answer.status_code}")

    def many_lines(self) -> None:
        count = self.plan.lines_per_request
        with self.attack("2", f"{count:,} business lines per ingestion request", "429 too_many_lines") as report:
            body = snapshot(source="lines-attacker")
            body["deltas"] = [{**body["deltas"][0], "business_line": f"flood-{i}"} for i in range(count)]
            content = json.dumps(body).encode()
            with self.sending():
                for _ in self.repeats(self.plan.line_requests):
                    self.expect(
                        self.ingest(content), {429}, "many lines", param="deltas.business_line", code="too_many_lines"
                    )
            metrics = self.http.get("/metrics")
            report.notes.append(f"/metrics afterwards: {metrics.status_code}, {len(metrics.content):,} bytes")
            if metrics.status_code != 200 or b"flood-" in metrics.content:
                self.problem("the refused business lines reached /metrics")

    def wide_windows(self) -> None:
        requests = self.plan.bucket_requests
        with self.attack("2", "16 deltas x 4,096 slots per request into 16 wide windows", "200") as report:
            bodies = wide_window_bodies(requests)
            before = memory_kib(self.target.pid)
            with self.sending():
                for body in bodies:
                    self.expect(self.ingest(body), {200}, "wide windows")
            growth_mib = (memory_kib(self.target.pid) - before) / 1024
            dense_mib = 16 * WIDE_SLOTS * 8 / 2**20  # what --ingest-max-window-slots accounts for these windows
            # ... and what their buckets can hold at most: REMOTE_MAX_BUCKETS of 16 bytes a slot each
            bucket_mib = 16 * WIDE_SLOTS * 16 * REMOTE_MAX_BUCKETS / 2**20
            report.notes.append(
                f"sidecar RSS growth {growth_mib:+.1f} MiB over {requests} requests of {len(bodies[0]) / 1e3:.0f} kB "
                f"({growth_mib * 1024 / requests:+.0f} KiB/request); the windows' counts are {dense_mib:.0f} MiB"
            )
            report.figures["rss_growth_kib_per_request"] = round(growth_mib * 1024 / requests, 1)
            if growth_mib > dense_mib + bucket_mib + 16:
                report.findings.append(
                    f"RSS grew {growth_mib:.0f} MiB, past the {dense_mib + bucket_mib:.0f} MiB the window-slot cap "
                    "and the bucket cap allow these windows"
                )

    def many_sources(self) -> None:
        limit = self.target.limits.max_sources
        with self.attack("2", f"{self.plan.sources} sources, one request each", "200 up to the cap, then 429"):
            bodies = [
                json.dumps(snapshot(source=f"src-{i:04d}", line="default")).encode() for i in range(self.plan.sources)
            ]
            with self.sending():
                for body in bodies:
                    response = self.ingest(body)
                    self.expect(
                        response,
                        {200, 429},
                        "many sources",
                        param="source" if response.status_code == 429 else None,
                        code="too_many_sources" if response.status_code == 429 else None,
                    )
            accepted = self.report.statuses[200] if self.report else 0
            if accepted > limit:
                self.problem(f"{accepted} new sources accepted; --ingest-max-sources is {limit}")
            if self.plan.sources > limit and self.report and self.report.statuses[429] == 0:
                self.problem(f"{self.plan.sources} sources and no 429: the cap of {limit} was not applied")

    # -- 4
    def namesake_router(self) -> None:
        remote = f"worker-1/{LOCAL_ROUTER}"
        with self.attack("4", "remote router named like a local one", "200, watched as <source>/<router>"):
            local_before = {r["name"]: r["tokens"] for r in self.routing().json()["routers"]}
            body = {
                "source": "worker-1",
                "routers": [{"name": LOCAL_ROUTER, "layer": 2, "kind": "expert", "num_slots": 64, "top_k": 6}],
                "deltas": [
                    {
                        "router": LOCAL_ROUTER,
                        "business_line": "namesake-line",
                        "slots": list(range(6)),
                        "counts": [1000] * 6,
                        "tokens": 1000,
                    }
                ],
            }  # collapsed: always the same 6 experts
            with self.sending():
                for _ in self.repeats():
                    self.expect(self.ingest(body), {200}, "namesake")
            by_name = {r["name"]: r for r in self.routing("namesake-line").json()["routers"]}
            if not by_name.get(remote, {}).get("tokens", 0) >= 1000:  # the window keeps the last ~4,096 tokens
                self.problem(f"the shipped counts are not watched as {remote}")
            if by_name.get(LOCAL_ROUTER, {}).get("tokens"):
                self.problem(f"the shipped counts reached the local {LOCAL_ROUTER}")
            local_after = {r["name"]: r["tokens"] for r in self.routing().json()["routers"]}
            if local_after.get(LOCAL_ROUTER) != local_before.get(LOCAL_ROUTER):
                self.problem(
                    f"the local {LOCAL_ROUTER} changed: {local_before.get(LOCAL_ROUTER)} -> "
                    f"{local_after.get(LOCAL_ROUTER)} tokens"
                )

    # -- 5
    def outside_datasets(self) -> None:
        with (
            self.attack("5", "re-tune dataset outside the dataset directory", "400, the same for any path"),
            tempfile.TemporaryDirectory(prefix="att") as directory,
        ):
            marker = f"SECRET-{secrets.token_hex(8)}"
            existing = Path(directory) / "data.jsonl"
            existing.write_text(json.dumps({"text": marker}) + "\n")
            missing = Path(directory + "x") / "data.jsonl"
            answers = {}
            with self.sending():
                for _ in self.repeats():
                    for path in (existing, missing, Path(directory) / ".." / existing.parent.name / "data.jsonl"):
                        response = self.http.post(
                            "/admin/retune",
                            headers=self.admin_auth,
                            json={"routers": [RETUNABLE_ROUTER], "strategy": "bias", "dataset": str(path)},
                        )
                        self.expect(response, {400}, f"dataset={path}", param="dataset")
                        answers[path] = response.text.replace(json.dumps(str(path))[1:-1], "<path>").replace(
                            str(path), "<path>"
                        )
            if len(set(answers.values())) != 1:
                self.problem(f"the answers differ by path (an existence oracle): {sorted(set(answers.values()))}")
            for where in ("/v1/retune/jobs", "/v1/status"):
                if marker in self.http.get(where).text:
                    self.problem(f"{where} shows the file's content")
            if any(marker in answer for answer in answers.values()):
                self.problem("an answer quotes the file's content")

    # -- 7
    def huge_prompt(self) -> None:
        with self.attack("7", "~1 MB prompt", "400 prompt_too_long"):
            text = "hello world " * 82_000  # 984,000 characters
            completion = json.dumps({"prompt": text, "max_tokens": 4}).encode()
            chat = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
            headers = {"Content-Type": "application/json"}
            with self.sending():
                for _ in self.repeats():
                    self.expect(
                        self.http.post("/v1/completions", content=completion, headers=headers),
                        {400},
                        "prompt",
                        param="prompt",
                        code="prompt_too_long",
                    )
                    self.expect(
                        self.http.post("/v1/chat/completions", content=chat, headers=headers),
                        {400},
                        "one huge message",
                        param="messages",
                        code="prompt_too_long",
                    )

    def many_messages(self) -> None:
        with self.attack("7", "28k chat messages", "400 naming messages"):
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 28_000, "max_tokens": 4}).encode()
            with self.sending():
                for _ in self.repeats():
                    self.expect(
                        self.http.post(
                            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
                        ),
                        {400},
                        "28k messages",
                        param="messages",
                    )

    def many_series(self) -> None:
        routers, lines = self.plan.series_routers, self.plan.series_lines
        with self.attack("7", f"/metrics with {routers} routers x {lines + 1} lines", "200") as report:
            body = {
                "source": "series-attacker",
                "routers": [
                    {"name": f"r{i}", "layer": i, "kind": "expert", "num_slots": 1, "top_k": 1} for i in range(routers)
                ],
                "deltas": [
                    {"router": "r0", "business_line": f"series-{line}", "slots": [0], "counts": [1], "tokens": 1}
                    for line in range(lines)
                ],
            }
            durations, responses = [], []
            with self.sending():
                self.expect(self.ingest(body), {200}, "series ingestion")
                for _ in self.repeats():
                    start = time.monotonic()
                    responses.append(self.http.get("/metrics"))
                    durations.append(time.monotonic() - start)
            for response in responses:  # read after the measured span: the client's work stays out of it
                self.expect(response, {200}, "/metrics")
            sizes = [len(response.content) for response in responses]
            series = sum(1 for line in responses[-1].text.splitlines() if line and not line.startswith("#"))
            report.notes.append(
                f"/metrics: {series:,} series, {max(sizes) / 1e6:.1f} MB, built in "
                f"{statistics.median(durations):.2f} s (median of {len(durations)}) from a "
                f"{len(json.dumps(body)) / 1e3:.0f} kB request"
            )
            report.figures["metrics_series"] = series
            report.figures["metrics_bytes"] = max(sizes)
            report.figures["metrics_seconds"] = round(statistics.median(durations), 3)
            records = routers * (lines + 1)
            if records > self.target.limits.max_records:
                report.findings.append(
                    f"one request made /metrics export {records:,} router records ({series:,} series), over "
                    f"--ingest-max-records {self.target.limits.max_records}"
                )

    # -- 8
    def deep_json(self) -> None:
        with self.attack("8", "JSON nested 50k deep", "400 invalid_json"):
            body = b"[" * 50_000 + b"]" * 50_000
            with self.sending():
                for _ in self.repeats():
                    for path, headers in (
                        ("/v1/completions", {"Content-Type": "application/json"}),
                        ("/v1/routing/ingest", self.ingest_auth),
                        ("/admin/retune", self.admin_auth),
                    ):
                        self.expect(
                            self.http.post(path, content=body, headers=headers), {400}, path, code="invalid_json"
                        )

    def admin_values(self) -> None:
        with self.attack("8", "admin values that used to end in 500", "400 naming the field"):
            retune = {"routers": [RETUNABLE_ROUTER], "strategy": "bias"}
            cases = [
                ("/admin/retune/promote", {"version": 10**300}, "version"),
                ("/admin/retune", {**retune, "dataset": "a" * 300 + ".jsonl"}, "dataset"),
                ("/admin/retune", {**retune, "business_line": "code_assistant\n"}, "business_line"),
                (
                    "/admin/retune",
                    {**retune, "options": {"no_such_strategy": {"steps": 1}}},
                    "options.no_such_strategy",
                ),
                ("/admin/retune", {**retune, "strategy": "no_such_strategy"}, "strategy"),
            ]
            with self.sending():
                for _ in self.repeats():
                    for path, body, param in cases:
                        self.expect(
                            self.http.post(path, json=body, headers=self.admin_auth),
                            {400},
                            f"{path} {param}",
                            param=param,
                        )

    def trickling_bodies(self) -> None:
        timeout = self.target.body_timeout
        endpoints = [
            ("/v1/completions", ""),
            ("/v1/routing/ingest", f"Authorization: Bearer {self.target.ingest_token}"),
            ("/admin/retune", f"Authorization: Bearer {self.target.admin_token}"),
        ]
        with self.attack("8", "request bodies trickling in", f"408 after --body-timeout {timeout:g} s") as report:
            results: list[tuple[str, int | None, float]] = []
            lock = threading.Lock()

            def connection(path: str, header: str) -> None:
                status, seconds = trickle(self.target.url, path, header, interval=timeout / 8, give_up=timeout + 10)
                with lock:
                    results.append((path, status, seconds))

            threads = [
                threading.Thread(target=connection, args=endpoint, daemon=True)
                for endpoint in endpoints
                for _ in range(self.plan.rounds)
            ]
            with self.sending():
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(timeout + 30)
            for path, status, seconds in sorted(results, key=lambda result: result[0]):
                report.requests += 1
                report.statuses[status if status is not None else 0] += 1
                if status != 408:
                    answer = f"{status}" if status is not None else f"no answer within {seconds:.0f} s"
                    self.problem(f"{path}: {answer} (expected 408 after {timeout:g} s)")
            by_path: dict[str, list[float]] = {}
            for path, status, seconds in results:
                if status == 408:
                    by_path.setdefault(path, []).append(seconds)
            report.notes.append(
                "408 after " + ", ".join(f"{max(values):.2f} s on {path}" for path, values in sorted(by_path.items()))
            )


def trickle(url: str, path: str, header: str, *, interval: float, give_up: float) -> tuple[int | None, float]:
    """POST a body one byte per ``interval`` over a raw socket; the status answered (None: none) and when."""
    parts = urlsplit(url)
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Content-Length: 100000",
        *([header] if header else []),
    ]
    started = time.monotonic()
    received = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=give_up) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + b"{")
        sock.settimeout(interval)
        while time.monotonic() - started < give_up:
            try:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                received += chunk
                if b"\r\n" in received:
                    break
            except TimeoutError:
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
    seconds = time.monotonic() - started
    first = received.split(b"\r\n", 1)[0].split()
    return (int(first[1]) if len(first) >= 2 and first[1].isdigit() else None), seconds


def replay(target: Target, plan: Plan, *, progress: Callable[[str], None] = lambda text: None) -> Replay:
    """Every attack in turn, /healthz polled throughout; the order keeps the caps' state apart."""
    with HealthPoller(target.url) as poller:
        attacker = Attacker(target, plan, poller)
        start = time.monotonic()
        time.sleep(plan.rest_seconds)
        rest = poller.between(start, time.monotonic())
        reports = []
        steps = [
            attacker.unknown_lines,
            attacker.malformed_ingestion,
            attacker.many_lines,
            attacker.namesake_router,
            attacker.outside_datasets,
            attacker.huge_prompt,
            attacker.many_messages,
            attacker.deep_json,
            attacker.admin_values,
            attacker.trickling_bodies,
            attacker.wide_windows,
            attacker.many_series,
            attacker.many_sources,
        ]  # many_sources last: it fills every source place
        for step in steps:
            step()
            report = attacker.report
            assert report is not None
            added_p99 = report.healthz.p99_ms - rest.p99_ms
            if added_p99 > HEALTHZ_GOAL_MS:
                report.findings.append(
                    f"/healthz p99 {report.healthz.p99_ms:.0f} ms, {added_p99:+.0f} ms over rest "
                    f"(goal: within {HEALTHZ_GOAL_MS:g} ms)"
                )
            reports.append(report)
            progress(
                f"attack {report.number} {report.name}: {dict(sorted(report.statuses.items()))} in "
                f"{report.seconds:.1f} s"
            )
        final = {
            "/healthz": attacker.http.get("/healthz").status_code,
            "/readyz": attacker.http.get("/readyz").status_code,
            "/metrics": attacker.http.get("/metrics").status_code,
            "/v1/routing": attacker.routing().status_code,
            "sidecar RSS": f"{memory_kib(target.pid) / 1024:.0f} MiB",
        }
        attacker.http.close()
    return Replay(rest, reports, final)
