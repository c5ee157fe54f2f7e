"""Fixtures and hooks only; the helpers the tests share with the benches are in the harness package
(harness/support.py, ...)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.support import SHIPPED_POLICIES, running_sidecar

# Fails the run naming any process the tests started that is still running at its end (harness/processes.py).
pytest_plugins = ["tests.process_guard"]


@pytest.fixture(scope="module")
def make_sidecar() -> Iterator[Callable[..., tuple[str, object]]]:
    """Starts in-process sidecars for a module: ``make_sidecar(**overrides)`` is a ready
    :func:`harness.support.running_sidecar` with those ``ServerConfig`` overrides, as ``(url, sidecar)``; every
    sidecar it started stops when the module's tests are done (after the fixtures that asked for them)."""
    with contextlib.ExitStack() as started:
        yield lambda **overrides: started.enter_context(running_sidecar(**overrides))


@pytest.fixture(scope="module")
def sidecar(make_sidecar) -> tuple[str, object]:
    """A sidecar on the bundled model with the defaults, shared by the module's tests."""
    return make_sidecar()


@pytest.fixture(scope="module")
def bundled():
    """The bundled model and its tokenizer, loaded once per module."""
    import mla_watch

    return mla_watch.load_model("bundled", device="cpu")


@pytest.fixture()
def policies_copy(tmp_path: Path) -> Path:
    target = tmp_path / "policies"
    shutil.copytree(SHIPPED_POLICIES, target)
    return target


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


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL cluster for the session (harness/postgres.py); each test takes a database of its own."""
    from harness.postgres import running_cluster

    with running_cluster() as cluster:
        yield cluster


@pytest.fixture()
def fleet_url(postgres) -> str:
    """An empty database of the session's cluster: one fleet's store."""
    return postgres.create_database()
