"""Shared fixtures: real servers on loopback port 0, started in a thread and stopped after use."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import processes
import pytest
import uvicorn

# Fails the run naming any process the tests started that is still running at its end (tests/processes.py).
pytest_plugins = ["process_guard"]

REPO = Path(__file__).resolve().parents[1]
SHIPPED_POLICIES = REPO / "policies"


@contextmanager
def serve_app(app, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a loopback port (a free one by default); yield its base URL."""
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only for sockets it knows are TCP (45 ms a request otherwise)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def tmpfs(directory: Path, options: str) -> Iterator[Path]:
    """A small tmpfs mounted on ``directory`` for the block: a read-only (``ro``) or full disk to test on.

    The tests run as root (CI does), where file permissions stop nothing; a mount is the one way to
    make a directory really read-only or full. Where mounting is impossible the test fails, saying so:
    a skip would let it pass without testing anything.
    """
    directory.mkdir()
    try:
        mounted = processes.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                                capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        pytest.fail("no mount command: these tests need root with CAP_SYS_ADMIN to mount a tmpfs")
    if mounted.returncode != 0:
        pytest.fail(f"mounting a tmpfs failed ({mounted.stderr.strip()}): these tests need root with CAP_SYS_ADMIN")
    try:
        yield directory
    finally:  # lazily where a file is still open there (an in-process sidecar's outbox)
        if processes.run(["umount", str(directory)], capture_output=True, timeout=30, check=False).returncode != 0:
            processes.run(["umount", "-l", str(directory)], capture_output=True, timeout=30, check=False)


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextmanager
def running_sidecar(**overrides) -> Iterator[tuple[str, object]]:
    """A Sidecar on the bundled model (or as configured), ready, with its own metrics registry."""
    from mla_watch.server.app import ServerConfig, Sidecar

    given = overrides.pop("state_dir", None)
    state_dir = given or Path(tempfile.mkdtemp(prefix="mla-watch-state-"))
    config = ServerConfig(**{"device": "cpu", "policy_poll_seconds": None, "admin_token": None,
                             "state_dir": state_dir, **overrides})
    try:
        sidecar = Sidecar(config)
        with serve_app(sidecar.app) as url:
            if not sidecar.wait_ready(120):
                raise RuntimeError(f"the sidecar did not become ready: {sidecar.load_error}")
            yield url, sidecar
    finally:
        if given is None:
            shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def sidecar():
    with running_sidecar() as running:
        yield running


@pytest.fixture()
def policies_copy(tmp_path: Path) -> Path:
    target = tmp_path / "policies"
    shutil.copytree(SHIPPED_POLICIES, target)
    return target


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def get_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def engine_answers(sidecar) -> int:
    """Engine answers (and streams) whose routing the sidecar has finished counting, in any outcome."""
    return sidecar.engine_routing.answers if sidecar.engine_routing is not None else 0


def answers_counted(url: str) -> float:
    """:func:`engine_answers` of a sidecar in another process: the sum of its mla_watch_engine_responses_total."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(get_metrics(url))
               for sample in family.samples if sample.name == "mla_watch_engine_responses_total")


def settled_over_http(url: str, answers: int, timeout: float = 30.0) -> None:
    assert wait_until(lambda: answers_counted(url) >= answers, timeout=timeout, interval=0.1), (
        f"{answers_counted(url):g} engine answers counted by {url} within {timeout:g} s, expected {answers}")


def settled(sidecar, answers: int, timeout: float = 30.0) -> None:
    """Wait until ``answers`` engine answers are counted: the proxy counts after the client has its answer."""
    assert wait_until(lambda: engine_answers(sidecar) >= answers, timeout=timeout), (
        f"{engine_answers(sidecar)} engine answers counted within {timeout:g} s, expected {answers}")


def pytest_terminal_summary(terminalreporter) -> None:
    """The log lists every MoE family the sweep ran (tests/test_family_sweep.py), by outcome."""
    marker = "test_family_sweep.py::test_family_counts_exactly_and_detaches_bit_identically["
    by_outcome: dict[str, set[str]] = {}
    for outcome in ("passed", "failed", "xfailed", "xpassed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if marker in nodeid:
                by_outcome.setdefault(outcome, set()).add(nodeid.split("[", 1)[1].rstrip("]"))
    if by_outcome:
        total = len(set().union(*by_outcome.values()))
        terminalreporter.write_sep("-", f"MoE family sweep: {total} families read from transformers")
        for outcome, families in by_outcome.items():
            terminalreporter.write_line(f"{outcome} ({len(families)}): {', '.join(sorted(families))}")
