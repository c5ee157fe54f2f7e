"""What the tests and the benches share to run sidecars and read them: loopback servers, free ports, waiting,
metrics, process memory, and ending a process.

Import it as ``from harness.support import ...``; the repository root is on ``sys.path`` (pytest's ``pythonpath``,
or ``python -m bench.NAME`` run from the root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn

from harness import processes

if TYPE_CHECKING:
    from mla_watch.server.app import Sidecar

REPO = Path(__file__).resolve().parents[1]
SHIPPED_POLICIES = REPO / "policies"


# --------------------------------------------------------------------------------------------- loopback servers
def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_app(app, *, host: str = "127.0.0.1", port: int = 0, tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a loopback port (a free one by default); yield its base URL.

    ``tls``: ``(certificate file, key file)`` to serve HTTPS instead.
    """
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only for sockets it knows are TCP (45 ms a request otherwise)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    certificates = {} if tls is None else {"ssl_certfile": str(tls[0]), "ssl_keyfile": str(tls[1])}
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, **certificates)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"{'http' if tls is None else 'https'}://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Whether ``predicate`` came true within ``timeout`` seconds (asked every ``interval`` and once at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --------------------------------------------------------------------------------------------- sidecars
@contextlib.contextmanager
def running_sidecar(*, sidecar_options: dict[str, Any] | None = None, **overrides) -> Iterator[tuple[str, Sidecar]]:
    """A Sidecar on the bundled model (or as configured: ``overrides`` are ServerConfig's fields), ready, with its
    own metrics registry; ``sidecar_options``: the Sidecar's own keyword arguments (its parts, injected)."""
    from mla_watch.server.app import ServerConfig, Sidecar

    given = overrides.pop("state_dir", None)
    state_dir = given or Path(tempfile.mkdtemp(prefix="mla-watch-state-"))
    config = ServerConfig(
        **{"device": "cpu", "policy_poll_seconds": None, "admin_token": None, "state_dir": state_dir, **overrides}
    )
    try:
        sidecar = Sidecar(config, **(sidecar_options or {}))
        with serve_app(sidecar.app) as url:
            if not sidecar.wait_ready(120):
                raise RuntimeError(f"the sidecar did not become ready: {sidecar.load_error}")
            yield url, sidecar
    finally:
        if given is None:
            shutil.rmtree(state_dir, ignore_errors=True)


SIDECAR_COMMAND: tuple[str, ...] = (sys.executable, "-m", "mla_watch.cli")


def start_sidecar(
    port: int,
    state: Path,
    *options: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    command: Sequence[str] = SIDECAR_COMMAND,
) -> subprocess.Popen:
    """``mla-watch serve`` on the bundled model as its own process, on 127.0.0.1:port; its output goes to ``log``.
    ``command``: the ``mla-watch`` to run (another install's console script, say)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MLA_WATCH_ONCALL_URL", "MLA_WATCH_ADMIN_TOKEN")}
    output = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    try:
        return processes.start(
            [
                *command,
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                "--state-dir",
                str(state),
                "--attn-implementation",
                "eager",
                *options,
            ],
            env={**environ, **(env or {})},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log is not None:
            output.close()


@contextlib.contextmanager
def sidecar_process(
    port: int,
    state: Path,
    *options: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    ready_path: str = "/readyz",
    command: Sequence[str] = SIDECAR_COMMAND,
) -> Iterator[subprocess.Popen]:
    """A ready sidecar process (``ready_path`` answers 200; ``/healthz`` for one whose upstream is nobody, which
    ``/readyz`` reports); killed (with everything it started) if the test left it running."""
    process = start_sidecar(port, state, *options, env=env, log=log, command=command)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert process.poll() is None, f"the sidecar exited with {process.returncode}"
            try:
                return httpx.get(url + ready_path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, timeout=180, interval=0.2), "the sidecar did not become ready"
        yield process
    finally:
        processes.stop(process, grace=0)


def wait_for_first_readings(url: str, timeout: float = 300.0) -> None:
    """Wait until every reference set has been read once (or failed): a sidecar reads them all at start, the long
    sets included, and a test that measures what requests cost must not count that reading's memory or time."""

    def read_once() -> bool:
        sets = httpx.get(url + "/v1/reference", timeout=10).json().get("sets", [])
        return all(entry["reading"] is not None or entry["last_failure"] is not None for entry in sets)

    assert wait_until(read_once, timeout=timeout, interval=0.5), "the reference sets were not all read"


def engine_clients_tokens(
    url: str, model: str, stop: threading.Event, *, clients: int = 4, timeout: float = 300.0
) -> int:
    """The completion tokens ``clients`` concurrent clients get from an engine's ``/v1/completions`` (32 each
    request, a fresh prompt every time) until ``stop`` is set: what a bench compares with and without other work."""
    done = [0]

    def client(index: int) -> None:
        with httpx.Client(timeout=timeout) as http:
            while not stop.is_set():
                answer = http.post(
                    f"{url}/v1/completions",
                    json={
                        "model": model,
                        "prompt": f"Client {index} asks where order {time.monotonic_ns()} is.",
                        "max_tokens": 32,
                        "ignore_eos": True,
                    },
                )
                done[0] += answer.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join()
    return done[0]


# --------------------------------------------------------------------------------------------- metrics
def get_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels`` (0.0 when there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def engine_answers(sidecar) -> int:
    """Engine answers (and streams) whose routing the sidecar has finished counting, in any outcome."""
    return sidecar.engine_routing.answers if sidecar.engine_routing is not None else 0


def answers_counted(url: str) -> float:
    """:func:`engine_answers` of a sidecar in another process: the sum of its mla_watch_engine_responses_total."""
    return metric_sum(get_metrics(url), "mla_watch_engine_responses_total")


def settled_over_http(url: str, answers: int, timeout: float = 30.0) -> None:
    assert wait_until(lambda: answers_counted(url) >= answers, timeout=timeout, interval=0.1), (
        f"{answers_counted(url):g} engine answers counted by {url} within {timeout:g} s, expected {answers}"
    )


def settled(sidecar, answers: int, timeout: float = 30.0) -> None:
    """Wait until ``answers`` engine answers are counted: the proxy counts after the client has its answer."""
    assert wait_until(lambda: engine_answers(sidecar) >= answers, timeout=timeout), (
        f"{engine_answers(sidecar)} engine answers counted within {timeout:g} s, expected {answers}"
    )


# --------------------------------------------------------------------------------------------- processes
def memory_kib(pid: int, field: str = "VmRSS") -> int:
    """A ``Vm*`` figure of /proc/PID/status, in KiB (``VmRSS``: resident now; ``VmHWM``: the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def process_tree_rss(pid: int) -> dict[int, int]:
    """The resident memory (KiB, VmRSS) of ``pid`` and of each of its descendants, by pid."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # /proc/PID/stat: "pid (comm) state ppid ...": comm may hold spaces and parentheses
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    rss: dict[int, int] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss[current] = int(line.split()[1])
        todo += children.get(current, [])
    return rss


def end_process(process: subprocess.Popen, grace: float = 30.0, kill_wait: float = 10.0) -> None:
    """SIGTERM, up to ``grace`` seconds to exit, then SIGKILL and up to ``kill_wait`` more
    (``subprocess.TimeoutExpired`` past that). For a plain ``subprocess.Popen``, as the benches start them; what
    :func:`harness.processes.start` started ends with :func:`harness.processes.stop`, its descendants included."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(kill_wait)


# --------------------------------------------------------------------------------------------- the disk
@contextlib.contextmanager
def tmpfs(directory: Path, options: str) -> Iterator[Path]:
    """A small tmpfs mounted on ``directory`` for the block: a read-only (``ro``) or full disk to test on.

    The tests run as root (CI does), where file permissions stop nothing; a mount is the one way to
    make a directory really read-only or full. Where mounting is impossible the test fails, saying so:
    a skip would let it pass without testing anything.
    """
    import pytest

    directory.mkdir()
    try:
        mounted = processes.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError:
        pytest.fail("no mount command: these tests need root with CAP_SYS_ADMIN to mount a tmpfs")
    if mounted.returncode != 0:
        pytest.fail(f"mounting a tmpfs failed ({mounted.stderr.strip()}): these tests need root with CAP_SYS_ADMIN")
    try:
        yield directory
    finally:  # lazily where a file is still open there (an in-process sidecar's outbox)
        if processes.run(["umount", str(directory)], capture_output=True, timeout=30, check=False).returncode != 0:
            processes.run(["umount", "-l", str(directory)], capture_output=True, timeout=30, check=False)


# --------------------------------------------------------------------------------------------- traffic
def long_texts(tokenizer, domain: str, count: int, tokens: int, seed: int) -> list[str]:
    """Corpus samples joined until each text holds ``tokens`` tokens, cut there (past the bundled model's trained
    256, say)."""
    from mla_watch.models import corpus

    texts, ids = [], []
    for sample in corpus.generate(domain, 60 * count, seed):
        ids += tokenizer(sample + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            texts.append(tokenizer.decode(ids[:tokens]))
            ids = []
            if len(texts) == count:
                return texts
    raise AssertionError("the corpus ran out")
