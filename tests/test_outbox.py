"""The durable outbox and its dispatcher, against real HTTP receivers on loopback (and a SIGKILLed process)."""

from __future__ import annotations

import email.utils
import json
import os
import queue
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness import processes
from harness.helpers import FakeClock
from harness.receivers import Reply, running_receiver, status
from harness.support import REPO, free_port
from mla_watch.alerting.notifiers import OutgoingRequest, group_key
from mla_watch.alerting.outbox import Dispatcher, Outbox, OutboxError, backoff_delay, parse_retry_after
from mla_watch.alerting.vocabulary import Alert, Notification, Receiver
from mla_watch.common.state_writes import StateWrites
from tests.mounts import fill, read_only, small_tmpfs

T0 = 1_800_000_000.0


class MaxRandom(random.Random):
    """Jitter that always picks the top of its range, to see the exponential ceiling itself."""

    def uniform(self, a: float, b: float) -> float:
        return b


def receiver(url: str | None, name: str = "oncall", **kw) -> Receiver:
    return Receiver(name=name, type="alertmanager_webhook", url=url, **kw)


def notification(router: str = "model.layers.3.mlp.gate", status_: str = "firing") -> Notification:
    gl = {"alertname": "RoutingEntropyLow", "router": router}
    alert = Alert(
        labels={**gl, "severity": "critical", "layer": "3"},
        annotations={"summary": "low"},
        status=status_,
        starts_at=T0,
        ends_at=None if status_ == "firing" else T0 + 60,
        value=4.0,
    )
    return Notification(receiver="oncall", group_key=group_key(gl), group_labels=gl, alerts=(alert,), status=status_)


def request(url: str, key: str = "k1", body: bytes = b'{"x": 1}') -> OutgoingRequest:
    return OutgoingRequest(url=url, body=body, headers={"Content-Type": "application/json"}, idempotency_key=key)


class Outcomes:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def __call__(self, name: str, outcome: str) -> None:
        self.items.append((name, outcome))

    @property
    def outcomes(self) -> list[str]:
        return [o for _, o in self.items]


def rows(db: Path, table: str = "outbox") -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT id, idempotency_key FROM {table} ORDER BY id").fetchall()


# -- the basic cycle ------------------------------------------------------------------------------


def test_row_is_committed_before_the_receiver_sees_the_request(tmp_path):
    db = tmp_path / "outbox.db"
    seen: list[list[tuple]] = []

    def look(received):  # runs inside the receiver, through its own SQLite connection
        seen.append(rows(db))

    with running_receiver(on_request=look) as rx:
        r = receiver(rx.url + "/hook")
        ob = Outbox(db)
        [item_id] = ob.submit(r, notification())
        results = Outcomes()
        assert Dispatcher(ob, {"oncall": r}, on_result=results).run_once() == 1
    assert not rx.errors
    key = rx.requests[0].header("Idempotency-Key")
    assert seen == [[(item_id, key)]]  # the row existed, committed, while the request was in flight
    assert rows(db) == []  # and is gone after the 2xx
    assert results.items == [("oncall", "delivered")]
    assert (
        json.loads(rx.requests[0].body)["groupKey"] == '{}:{alertname="RoutingEntropyLow", '
        'router="model.layers.3.mlp.gate"}'
    )


def test_500_then_200_is_delivered_after_a_retry_and_only_then_removed(tmp_path):
    clock = FakeClock(T0)
    db = tmp_path / "outbox.db"
    with running_receiver([status(500), status(502), status(200)]) as rx:
        r = receiver(rx.url, max_attempts=5)
        ob = Outbox(db, clock=clock)
        ob.submit(r, notification())
        results = Outcomes()
        d = Dispatcher(ob, {"oncall": r}, on_result=results, base_delay=1.0, max_delay=10.0, rng=random.Random(1))
        d.run_once()
        assert ob.pending() == 1 and len(rows(db)) == 1  # a 500 does not remove it
        for _ in range(10):
            if ob.pending() == 0:
                break
            clock.advance(20.0)
            d.run_once()
    assert results.outcomes == ["retry", "retry", "delivered"]
    assert len(rx.requests) == 3
    assert len({q.body for q in rx.requests}) == 1  # the same request each time
    assert ob.pending() == 0 and rows(db) == [] and ob.dead_letters() == []


def test_failed_attempts_are_counted_with_the_error(tmp_path):
    clock = FakeClock(T0)
    with running_receiver(default=Reply(status=503, body=b"overloaded")) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url)
        ob.submit(r, notification())
        Dispatcher(ob, {"oncall": r}, rng=random.Random(0)).run_once()
    clock.advance(1000)
    [item] = ob.due()
    assert item.attempts == 1
    assert "503" in item.last_error and "overloaded" in item.last_error


# -- Retry-After ----------------------------------------------------------------------------------


def test_429_retry_after_seconds_is_honoured(tmp_path):
    clock = FakeClock(T0)
    with running_receiver([status(429, Retry_After="2"), status(200)]) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url)
        ob.submit(r, notification())
        results = Outcomes()
        d = Dispatcher(ob, {"oncall": r}, on_result=results, base_delay=0.01, max_delay=0.01)
        assert d.run_once() == 1
        clock.advance(1.99)
        assert ob.due() == [] and d.run_once() == 0  # not before 2 s ...
        clock.advance(0.01)
        assert len(ob.due()) == 1  # ... but at 2 s
        assert d.run_once() == 1
    assert results.outcomes == ["retry", "delivered"]
    assert len(rx.requests) == 2


def test_429_retry_after_http_date_is_honoured(tmp_path):
    clock = FakeClock(T0)
    when = email.utils.formatdate(T0 + 30, usegmt=True)
    with running_receiver([status(429, Retry_After=when)]) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url)
        ob.submit(r, notification())
        Dispatcher(ob, {"oncall": r}, base_delay=0.01, max_delay=0.01).run_once()
    clock.advance(29.5)
    assert ob.due() == []
    clock.advance(0.5)
    assert len(ob.due()) == 1


def test_parse_retry_after():
    assert parse_retry_after("2", 0.0) == 2.0
    assert parse_retry_after(" 0 ", 0.0) == 0.0
    assert parse_retry_after("-5", 0.0) == 0.0
    assert parse_retry_after(email.utils.formatdate(T0 + 7, usegmt=True), T0) == pytest.approx(7.0)
    assert parse_retry_after(email.utils.formatdate(T0 - 7, usegmt=True), T0) == 0.0  # in the past
    assert parse_retry_after("soon", 0.0) is None
    assert parse_retry_after(None, 0.0) is None


# -- permanent failures ---------------------------------------------------------------------------


def test_400_is_a_dead_letter_and_never_retried(tmp_path, caplog):
    clock = FakeClock(T0)
    with running_receiver(default=Reply(status=400, body=b"invalid_payload")) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url)
        ob.submit(r, notification())
        results = Outcomes()
        d = Dispatcher(ob, {"oncall": r}, on_result=results)
        assert d.run_once() == 1
        for _ in range(3):
            clock.advance(10_000)
            assert d.run_once() == 0
    assert len(rx.requests) == 1
    assert results.items == [("oncall", "failed")]
    assert ob.pending() == 0
    [dead] = ob.dead_letters()
    assert dead["receiver"] == "oncall" and "400" in dead["error"] and "invalid_payload" in dead["error"]
    assert dead["attempts"] == 1
    assert json.loads(dead["body"])["version"] == "4"
    assert "failed permanently" in caplog.text  # reported


def test_max_attempts_exhausted_is_a_dead_letter(tmp_path):
    clock = FakeClock(T0)
    with running_receiver(default=status(500)) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url, max_attempts=3)
        ob.submit(r, notification())
        results = Outcomes()
        d = Dispatcher(ob, {"oncall": r}, on_result=results, base_delay=1, max_delay=1)
        for _ in range(6):
            d.run_once()
            clock.advance(5)
    assert len(rx.requests) == 3
    assert results.outcomes == ["retry", "retry", "failed"]
    [dead] = ob.dead_letters()
    assert dead["attempts"] == 3 and "500" in dead["error"]


# -- slow and broken receivers --------------------------------------------------------------------


def test_slow_receiver_times_out_and_is_retried(tmp_path):
    clock = FakeClock(T0)
    with running_receiver([Reply(delay=1.5), status(200)]) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url, timeout_seconds=0.3)
        ob.submit(r, notification())
        results = Outcomes()
        d = Dispatcher(ob, {"oncall": r}, on_result=results, base_delay=1, max_delay=1)
        d.run_once()
        clock.advance(5)
        [item] = ob.due()
        assert item.last_error == "timeout"
        d.run_once()
    assert results.outcomes == ["retry", "delivered"]


def test_garbage_response_is_retried(tmp_path):
    clock = FakeClock(T0)
    with running_receiver([Reply(garbage=b"\x00\xffNOT HTTP AT ALL\r\n\r\n"), status(204)]) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url)
        ob.submit(r, notification())
        results = Outcomes()
        d = Dispatcher(ob, {"oncall": r}, on_result=results, base_delay=1, max_delay=1)
        d.run_once()
        clock.advance(5)
        d.run_once()
    assert results.outcomes == ["retry", "delivered"]
    assert ob.pending() == 0


def test_connection_refused_is_retried(tmp_path):
    port = free_port()
    clock = FakeClock(T0)
    ob = Outbox(tmp_path / "o.db", clock=clock)
    r = receiver(f"http://127.0.0.1:{port}/hook")
    ob.submit(r, notification())
    results = Outcomes()
    Dispatcher(ob, {"oncall": r}, on_result=results).run_once()
    assert results.outcomes == ["retry"] and ob.pending() == 1


def test_enqueue_never_waits_for_a_slow_receiver(tmp_path):
    arrived, release = threading.Event(), threading.Event()

    def hold(_request) -> None:
        arrived.set()
        release.wait(30)

    with running_receiver(on_request=hold) as rx:
        ob = Outbox(tmp_path / "o.db")
        r = receiver(rx.url, timeout_seconds=30)
        ob.submit(r, notification("r0"))
        d = Dispatcher(ob, {"oncall": r})
        d.start(interval=0.01)
        try:
            assert arrived.wait(5)  # the dispatcher is now stuck in the held request
            submitted: list = []
            submitter = threading.Thread(target=lambda: submitted.append(ob.submit(r, notification("r1"))))
            submitter.start()
            submitter.join(10)
            assert not submitter.is_alive() and submitted[0]  # enqueued while the receiver still holds r0
            assert not release.is_set()
        finally:
            release.set()
            d.stop()
    assert ob.pending() <= 1  # r0 delivered once released; r1 delivered or still waiting


# -- backoff --------------------------------------------------------------------------------------


def test_backoff_full_jitter_bounds_and_growth():
    rng = random.Random(42)
    for n in range(12):
        bound = min(30.0, 0.5 * 2**n)
        samples = [backoff_delay(n, 0.5, 30.0, rng) for _ in range(200)]
        assert all(0.0 <= s <= bound for s in samples)
        assert max(samples) > 0.8 * bound  # the whole range is used (full jitter) ...
        assert min(samples) < 0.2 * bound  # ... down to zero
    ceilings = [backoff_delay(n, 0.5, 30.0, MaxRandom()) for n in range(10)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_dispatcher_backoff_grows_exponentially(tmp_path):
    clock = FakeClock(T0)
    with running_receiver(default=status(500)) as rx:
        ob = Outbox(tmp_path / "o.db", clock=clock)
        r = receiver(rx.url, max_attempts=20)
        ob.submit(r, notification())
        delays = []
        for rng, label in ((MaxRandom(), "max"), (random.Random(7), "jitter")):
            d = Dispatcher(ob, {"oncall": r}, base_delay=1.0, max_delay=16.0, rng=rng)
            seq = []
            for _ in range(7):
                assert d.run_once() == 1
                nxt = ob.next_due_at()
                seq.append(nxt - clock())
                clock.advance(nxt - clock())
            delays.append((label, seq))
    _, maxed = delays[0]
    assert maxed == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    _, jittered = delays[1]
    for k, delay in enumerate(jittered):
        n = 7 + k  # failures already counted when this attempt failed
        assert 0.0 <= delay <= min(16.0, 2.0**n)
    assert jittered != [16.0] * 7  # jitter, not the ceiling
    assert len(rx.requests) == 14


# -- dedup, disabled receivers, start-up errors -----------------------------------------------------


def test_identical_pending_keys_are_enqueued_once(tmp_path):
    ob = Outbox(tmp_path / "o.db")
    url = "http://127.0.0.1:9/x"
    first = ob.enqueue("oncall", request(url, "same"))
    assert isinstance(first, int)
    assert ob.enqueue("oncall", request(url, "same")) is None
    assert ob.enqueue("other", request(url, "same")) is not None  # dedup is per receiver
    assert ob.enqueue("oncall", request(url, "different")) is not None
    assert ob.pending() == 3
    r = receiver(url)
    assert ob.submit(r, notification()) != [] and ob.submit(r, notification()) == []
    ob.delivered(first)
    again = ob.enqueue("oncall", request(url, "same"))  # no longer pending: a new notification
    assert again is not None and again != first


def test_disabled_receiver_enqueues_nothing(tmp_path):
    ob = Outbox(tmp_path / "o.db")
    assert ob.submit(receiver(None), notification()) == []
    assert ob.pending() == 0


def test_items_for_a_receiver_that_went_away_are_dead_lettered(tmp_path):
    ob = Outbox(tmp_path / "o.db")
    ob.submit(receiver("http://127.0.0.1:9/x"), notification())
    ob.submit(receiver("http://127.0.0.1:9/y", name="gone"), notification())
    results = Outcomes()
    assert Dispatcher(ob, {"oncall": receiver(None)}, on_result=results).run_once() == 2
    assert sorted(results.items) == [("gone", "failed"), ("oncall", "failed")]
    assert {d["receiver"] for d in ob.dead_letters()} == {"oncall", "gone"}
    assert all(d["attempts"] == 0 for d in ob.dead_letters())


def test_missing_state_directory_is_a_clear_error(tmp_path):
    path = tmp_path / "nope" / "outbox.db"
    with pytest.raises(OutboxError) as err:
        Outbox(path)
    assert str(path.parent) in str(err.value)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutboxError, match="file"):
        Outbox(blocker / "outbox.db")


def test_read_only_state_directory_is_a_clear_error(tmp_path):
    with read_only(tmp_path / "state") as state, pytest.raises(OutboxError) as err:  # root ignores modes: a mount
        Outbox(state / "outbox.db")
    message = str(err.value)
    assert str(state) in message
    assert "not writable" in message and "Errno" in message and "Read-only" in message


def test_outbox_file_is_private_and_in_wal_mode(tmp_path):
    db = tmp_path / "o.db"
    Outbox(db)
    assert (db.stat().st_mode & 0o777) == 0o600
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_background_thread_delivers_and_stops(tmp_path):
    with running_receiver() as rx:
        ob = Outbox(tmp_path / "o.db")
        r = receiver(rx.url)
        d = Dispatcher(ob, {"oncall": r})
        d.start(interval=0.02)
        try:
            ob.submit(r, notification("a"))
            ob.submit(r, notification("b"))
            assert rx.wait_for(2, timeout=5)
        finally:
            d.stop()
        assert d._thread is None
    deadline = time.monotonic() + 5
    while ob.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ob.pending() == 0


# -- crash: SIGKILL with undelivered notifications -------------------------------------------------


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mla_watch.alerting.vocabulary import Alert, Notification, Receiver
    from mla_watch.alerting.notifiers import group_key
    from mla_watch.alerting.outbox import Dispatcher, Outbox

    db, port, count, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    r = Receiver(name="oncall", type="alertmanager_webhook", url=f"http://127.0.0.1:{port}/hook",
                 timeout_seconds=timeout, max_attempts=1000)
    ob = Outbox(Path(db))
    for i in range(count):
        gl = {"alertname": "RoutingEntropyLow", "router": f"model.layers.{i}.mlp.gate"}
        a = Alert(labels={**gl, "severity": "critical", "layer": str(i)}, annotations={}, status="firing",
                  starts_at=1.8e9, ends_at=None, value=4.0)
        ob.submit(r, Notification(receiver="oncall", group_key=group_key(gl), group_labels=gl, alerts=(a,),
                                  status="firing"))
    print("enqueued", ob.pending(), flush=True)
    d = Dispatcher(ob, {"oncall": r}, base_delay=0.02, max_delay=0.1,
                   on_result=lambda name, outcome: print(outcome, flush=True))
    d.start(interval=0.02)
    time.sleep(120)
""")


def run_child_until(db: Path, port: int, count: int, timeout: float, stop_when) -> list[str]:
    """Start the child, feed its output lines to ``stop_when`` until it says stop, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = processes.start(
        [sys.executable, "-c", CHILD, str(db), str(port), str(count), str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(REPO),
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline and not stop_when(seen):
            try:
                seen.append(lines.get(timeout=0.1))
            except queue.Empty:
                if proc.poll() is not None:
                    break
        assert stop_when(seen), f"child never got there: {seen[-5:]} {proc.poll()} {proc.stderr.read()[-2000:]}"
    finally:
        processes.stop(proc, grace=0)  # SIGKILL: the crash under test
    assert proc.returncode == -signal.SIGKILL
    return seen


def deliver_all(ob: Outbox, r: Receiver, rx, expected: int) -> None:
    d = Dispatcher(ob, {"oncall": r}, base_delay=0.01, max_delay=0.05)
    deadline = time.monotonic() + 10
    while ob.pending() and time.monotonic() < deadline:
        d.run_once()
        time.sleep(0.02)
    assert ob.pending() == 0
    assert rx.wait_for(expected, timeout=5)


def check_duplicates_share_keys(rx) -> dict[str, list]:
    by_group: dict[str, list] = {}
    for q in rx.requests:
        by_group.setdefault(q.json()["groupKey"], []).append(q)
    for reqs in by_group.values():
        assert len({q.header("Idempotency-Key") for q in reqs}) == 1
        assert len({q.body for q in reqs}) == 1
    return by_group


def test_crash_with_receiver_down_loses_nothing(tmp_path):
    db = tmp_path / "state" / "outbox.db"
    db.parent.mkdir()
    port = free_port()  # nothing listens here while the child runs
    seen = run_child_until(db, port, 5, 0.5, lambda s: s.count("retry") >= 10)
    assert seen[0] == "enqueued 5" and "delivered" not in seen
    with running_receiver(port=port) as rx:
        ob = Outbox(db)
        assert ob.pending() == 5  # all survived the SIGKILL
        r = receiver(f"http://127.0.0.1:{port}/hook")
        deliver_all(ob, r, rx, 5)
    by_group = check_duplicates_share_keys(rx)
    assert sorted(by_group) == sorted(
        group_key({"alertname": "RoutingEntropyLow", "router": f"model.layers.{i}.mlp.gate"}) for i in range(5)
    )
    assert ob.dead_letters() == []


def test_crash_mid_delivery_resends_with_the_same_key(tmp_path):
    db = tmp_path / "outbox.db"
    hold = threading.Event()
    with running_receiver(default=Reply(delay=0.0)) as rx:
        # the receiver accepts the first request but never answers it before the child dies
        rx.script = [Reply(delay=3.0)]
        rx.on_request = lambda received: hold.set()
        port = int(rx.url.rsplit(":", 1)[1])
        run_child_until(db, port, 3, 10.0, lambda s: hold.is_set())
        ob = Outbox(db)
        assert ob.pending() == 3  # the one in flight was not marked delivered
        r = receiver(rx.url + "/hook")
        deliver_all(ob, r, rx, 4)
    by_group = check_duplicates_share_keys(rx)
    assert len(by_group) == 3
    assert sorted(len(v) for v in by_group.values()) == [1, 1, 2]  # exactly one resent, identically


# -- a disk that refuses the file -------------------------------------------------------------------


def test_what_a_full_disk_refuses_is_held_within_a_bound_and_written_once_there_is_room(tmp_path):
    """Requests the file cannot take are held in memory (the oldest dropped past the bound, counted), delivered
    from there, and written to the file with the outcomes it could not record once the disk has room: a restart
    then finds everything still undelivered."""
    clock = FakeClock(T0)
    holds = Outcomes()
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        writes = StateWrites(disk)
        ob = Outbox(disk / "outbox.sqlite", clock=clock, writes=writes, max_held=3, on_hold=holds)
        stored = ob.enqueue("rx", request("http://127.0.0.1:9/a", key="a"))
        assert stored is not None and stored > 0
        filler = fill(disk)
        held = [ob.enqueue("rx", request("http://127.0.0.1:9/b", key=key)) for key in "bcde"]
        assert all(item_id is not None and item_id < 0 for item_id in held)
        assert ob.enqueue("rx", request("http://127.0.0.1:9/b", key="e")) is None  # pending already, in memory
        assert ob.held == 3 and ob.dropped == 1 and holds.outcomes == ["held"] * 4 + ["dropped"]
        assert [entry["file"] for entry in writes.failing()] == ["outbox.sqlite"]
        due = ob.due()
        assert [item.request.idempotency_key for item in due] == ["a", "c", "d", "e"]  # "b" was the oldest held
        ob.delivered(stored)  # the file cannot record it: memory does, and it is not sent again
        ob.retry_later(held[1], 30.0, "HTTP 503")  # "c"
        ob.delivered(held[2])  # "d"
        assert [item.request.idempotency_key for item in ob.due()] == ["e"]
        assert ob.pending() == 2 and rows(disk / "outbox.sqlite") == [(stored, "a")]
        filler.unlink()
        assert [item.request.idempotency_key for item in ob.due()] == ["e"]  # and the file holds what memory did
        assert ob.held == 0 and writes.failing() == []
        assert [key for _, key in rows(disk / "outbox.sqlite")] == ["c", "e"]
        ob.close()
        reopened = Outbox(disk / "outbox.sqlite", clock=clock)
        clock.advance(31.0)
        assert [(item.request.idempotency_key, item.attempts, item.last_error) for item in reopened.due()] == [
            ("e", 0, None),
            ("c", 1, "HTTP 503"),
        ]  # oldest due first
        reopened.close()
