"""``serve`` with its state directory on a disk that fills up, or turns read-only, while it serves.

It keeps answering, counting and alerting; on-call is paged from memory while the outbox's file cannot take the
page; ``/readyz`` and ``/metrics`` name the files it cannot write; the log says so once per file, not once per
write; and once there is room again it writes them by itself and has lost nothing it still held. The full disk is
a small tmpfs; the read-only one is ext4 on a loop device that the kernel turns read-only after an error, as
``errors=remount-ro`` does in production (skipped, saying why, where this process cannot mount them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness import processes
from harness.receivers import OK, running_receiver, status
from harness.support import get_metrics, metric_value, running_sidecar, wait_until
from tests.mounts import fill, small_tmpfs

pytestmark = pytest.mark.slow

STORM = """
receivers:
  - name: %(name)s
    type: alertmanager_webhook
    url: %(url)s/hook
    timeout: 0.5
    max_attempts: 1000
    group_by: [alertname, router, layer, business_line]
    group_wait: 0s  # every alert of the storm notified at once, as it fires
    group_interval: 0s
rules:
  # Always true (64 experts top-6 read at most 6.0 bits): every expert router of every line fires at once.
  - alert: Storm_%(name)s
    metric: entropy_bits
    select: {kind: expert, business_line: "*"}
    below: 6.5
    resolve_above: 6.6
    for: 0s
    min_tokens: 4
    severity: warning
    actions: [notify]
    receivers: [%(name)s]
"""
LINES = ("customer_service", "doc_summary")


def firing(url: str, alertname: str) -> set[str]:
    alerts = httpx.get(url + "/v1/alerts", timeout=10).json()["alerts"]
    return {a["fingerprint"] for a in alerts if a["rule"] == alertname and a["state"] == "firing"}


def delivered(receiver) -> set[str]:
    """Fingerprints of the alerts a receiver answered 200 for."""
    return {
        alert["fingerprint"]
        for request in list(receiver.requests)
        if request.reply.status == 200
        for alert in request.json()["alerts"]
    }


def complete(url: str, line: str) -> int:
    return httpx.post(
        url + "/v1/completions",
        headers={"X-Business-Line": line},
        timeout=120,
        json={"prompt": "Customer: my parcel has not arrived", "max_tokens": 8, "seed": 1},
    ).status_code


def unwritable(url: str) -> dict[str, str]:
    ready = httpx.get(url + "/readyz", timeout=10)
    assert ready.status_code == 200, ready.text  # still serving: a full disk does not make it unready
    return {entry["file"]: entry["problem"] for entry in ready.json()["state_unwritable"]}


def stored(path: Path, sql: str) -> list[tuple]:
    """Rows of a state file, read through a connection of the test's own."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        return db.execute(sql).fetchall()


def test_serve_rides_out_a_full_state_directory_and_writes_again_once_there_is_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "base.yaml").write_text("rules: []\n")
    caplog.set_level(logging.INFO, logger="mla_watch")
    # 16 MB: room for what SQLite keeps in its WAL files before a checkpoint (up to 4 MB each) once room is back
    with (
        small_tmpfs(tmp_path / "state", "16m") as state,
        running_receiver(default=OK) as up,
        running_receiver(default=status(503)) as down,
        running_sidecar(
            rules=rules,
            alert_interval=0.2,
            attn_implementation="eager",
            state_dir=state,
            capture=True,
            history_interval_seconds=0.5,
        ) as (url, sidecar),
    ):
        sidecar.alerts.dispatcher.base_delay = 0.05  # retries of the receiver that is down: within the test
        sidecar.alerts.dispatcher.max_delay = 0.5
        for line in LINES:
            assert complete(url, line) == 200
        assert wait_until(lambda: stored(state / "history.sqlite", "SELECT COUNT(*) FROM points")[0][0] > 0)
        filler = fill(state)
        full_since = time.time()
        for name, receiver in (("up", up), ("down", down)):
            (rules / f"{name}.yaml").write_text(STORM % {"name": name, "url": receiver.url})

        # Alerting goes on, and on-call is paged from memory: the outbox's file cannot take the page.
        assert wait_until(lambda: len(firing(url, "Storm_up")) >= 2 * len(LINES), timeout=60)
        paged = firing(url, "Storm_up")
        assert wait_until(lambda: paged <= delivered(up), timeout=60), "the pages never reached on-call"
        held_for_down = firing(url, "Storm_down")
        assert wait_until(
            lambda: metric_value(get_metrics(url), "mla_watch_notifications_held") >= len(held_for_down), timeout=30
        )
        # Serving and counting go on, the capture aside.
        assert all(complete(url, line) == 200 for line in LINES)
        failing = unwritable(url)
        print(f"\nwhile the disk was full: /readyz state_unwritable {failing}")
        # (The history's small samples may still fit in the room its WAL file already has: tests/test_history_store.py
        # fills that too.)
        assert {"outbox.sqlite", "alerts.json", "capture.sqlite"} <= set(failing)
        assert set(failing.values()) == {"the disk is full"}
        metrics = get_metrics(url)
        for name in ("outbox.sqlite", "alerts.json", "capture.sqlite"):
            assert metric_value(metrics, "mla_watch_state_write_failing", file=name) == 1
        assert metric_value(metrics, "mla_watch_state_write_errors_total", file="outbox.sqlite") >= 2
        assert metric_value(metrics, "mla_watch_notifications_total", receiver="down", outcome="held") >= len(
            held_for_down
        )
        assert stored(state / "outbox.sqlite", "SELECT COUNT(*) FROM outbox")[0][0] == 0  # all of it in memory
        # Said once per file, however many writes failed.
        for name in ("outbox", "alert state file", "traffic capture"):
            said = [
                r
                for r in caplog.records
                if r.name == "mla_watch.state"
                and r.getMessage().startswith(f"{name} {state}")
                and "cannot write it: the disk is full" in r.getMessage()
            ]
            assert len(said) == 1, [r.getMessage() for r in said]

        filler.unlink()  # room again: everything is written by itself (the capture with the next request it records)
        assert all(complete(url, line) == 200 for line in LINES)
        assert wait_until(lambda: not unwritable(url), timeout=60), unwritable(url)
        still_held = stored(state / "outbox.sqlite", "SELECT receiver FROM outbox")
        assert still_held and {receiver for (receiver,) in still_held} == {"down"}  # in the file: survives a restart
        metrics = get_metrics(url)
        assert metric_value(metrics, "mla_watch_notifications_held") == 0
        assert metric_value(metrics, "mla_watch_state_write_failing", file="outbox.sqlite") == 0
        saved = json.loads((state / "alerts.json").read_text())
        assert {i["labels"]["alertname"] for i in saved["instances"] if i["state"] == "firing"} == {
            "Storm_up",
            "Storm_down",
        }
        written = stored(
            state / "history.sqlite", f"SELECT COUNT(*) FROM points WHERE tier = 'full' AND t > {full_since}"
        )[0][0]
        assert written > 0  # the samples taken while the disk was full, from memory
        assert any("is written again" in r.getMessage() for r in caplog.records if r.name == "mla_watch.state")
        # Nothing held was lost: the receiver that was down gets every page once it is back.
        down.default = OK
        assert wait_until(lambda: held_for_down <= delivered(down), timeout=60)
        assert wait_until(lambda: stored(state / "outbox.sqlite", "SELECT COUNT(*) FROM outbox")[0][0] == 0, timeout=30)


# --------------------------------------------------------------------------------------------- read-only
@contextlib.contextmanager
def ext4(directory: Path, size_mb: int = 24) -> Iterator[tuple[Path, Path]]:
    """ext4 on a loop device, mounted ``errors=remount-ro`` on ``directory``; yields it and the file that makes the
    kernel report an error on it (after which it is read-only, as after a real disk error)."""
    image = directory.with_suffix(".img")
    with image.open("wb") as handle:
        handle.truncate(size_mb << 20)
    made = (
        processes.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True, timeout=60, check=False
        )
        if _has("mkfs.ext4")
        else None
    )
    if made is None or made.returncode != 0:
        pytest.skip(f"no ext4 image can be made here ({'no mkfs.ext4' if made is None else made.stderr.strip()})")
    directory.mkdir()
    mounted = processes.run(
        ["mount", "-o", "loop,errors=remount-ro", str(image), str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting an ext4 image on a loop device is not permitted here: {mounted.stderr.strip()}")
    try:
        device = next(
            line.split()[0]
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1] == str(directory)
        )
        trigger = Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"this kernel has no {trigger}: an ext4 error cannot be made on purpose")
        yield directory, trigger
    finally:
        if processes.run(["umount", str(directory)], capture_output=True, timeout=30, check=False).returncode:
            processes.run(["umount", "-l", str(directory)], capture_output=True, timeout=30, check=False)
        image.unlink(missing_ok=True)


def _has(command: str) -> bool:
    try:
        return processes.run([command, "-V"], capture_output=True, timeout=30, check=False).returncode in (0, 1)
    except (FileNotFoundError, subprocess.SubprocessError):
        return False


def test_serve_rides_out_a_state_directory_that_turns_read_only(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "base.yaml").write_text("rules: []\n")
    with (
        ext4(tmp_path / "state") as (state, trigger),
        running_receiver(default=OK) as up,
        running_sidecar(
            rules=rules, alert_interval=0.2, attn_implementation="eager", state_dir=state, history_interval_seconds=0.5
        ) as (url, _),
    ):
        for line in LINES:
            assert complete(url, line) == 200
        trigger.write_text("mla-watch test: the disk failed\n")  # the kernel makes it read-only, as for a real error
        options = next(line for line in Path("/proc/mounts").read_text().splitlines() if str(state) in line).split()[3]
        assert {"ro", "emergency_ro"} & set(options.split(",")), options
        (rules / "up.yaml").write_text(STORM % {"name": "up", "url": up.url})
        assert wait_until(lambda: len(firing(url, "Storm_up")) >= 2 * len(LINES), timeout=60)
        paged = firing(url, "Storm_up")
        assert wait_until(lambda: paged <= delivered(up), timeout=60), "the pages never reached on-call"
        assert all(complete(url, line) == 200 for line in LINES)
        failing = unwritable(url)
        print(f"\nonce the disk turned read-only: /readyz state_unwritable {failing}")
        assert {"outbox.sqlite", "alerts.json", "history.sqlite"} <= set(failing)
        assert set(failing.values()) <= {
            "read-only file system",
            "an input/output error: the disk or its file system failed",
        }
        assert failing["alerts.json"] == "read-only file system"
        metrics = get_metrics(url)
        assert metric_value(metrics, "mla_watch_state_write_failing", file="outbox.sqlite") == 1
        assert metric_value(metrics, "mla_watch_notifications_total", receiver="up", outcome="held") >= len(paged)
