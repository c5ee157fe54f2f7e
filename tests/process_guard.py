"""A pytest plugin: the session ends with no process the tests started still running, whichever way it ends.

* SIGTERM is raised as :class:`Terminated`, a ``KeyboardInterrupt``: pytest then ends every fixture as after a
  Ctrl-C, where by default it dies on the spot and leaves every server the tests started running.
* At the session's end, after every fixture has ended, anything :func:`processes.strays` still finds fails the
  run: each is named by its command line, then ended. A Ctrl-C or SIGTERM meanwhile does not cut that short.

Loaded by ``tests/conftest.py``; ``-p tests.process_guard`` (the repository root on ``sys.path``) loads it elsewhere.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Generator
from types import FrameType

import pytest

from harness import processes

_previous: dict[str, object] = {}


class Terminated(KeyboardInterrupt):
    """The run was sent SIGTERM."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _previous.get("pid"):  # a forked copy of the test process: die as it would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    signal.signal(signal.SIGTERM, _unheeded)  # once: a second one must not cut the fixtures' ending short
    raise Terminated("SIGTERM: the test run was asked to stop")


def _unheeded(signum: int, frame: FrameType | None) -> None:
    """Not SIG_IGN, which a process started meanwhile would inherit (and then ignore SIGTERM from its stop)."""


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread() and "handler" not in _previous:
        _previous.update(pid=os.getpid(), handler=signal.signal(signal.SIGTERM, _on_sigterm))


def pytest_unconfigure(config: pytest.Config) -> None:
    if "handler" in _previous and os.getpid() == _previous["pid"]:
        signal.signal(signal.SIGTERM, _previous.pop("handler"))  # type: ignore[arg-type]


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, None, None]:
    # A wrapper, run after pytest's own pytest_sessionfinish has ended the fixtures, even when one of them raised.
    try:
        return (yield)
    finally:
        _check(session)


def _check(session: pytest.Session) -> None:
    signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    quiet = {sig: signal.signal(sig, _unheeded) for sig in signals}
    try:
        left = processes.end_strays()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    if not left:
        return
    lines = [stray.describe() for stray in left]
    lines.append(
        f"{len(left)} process(es) the tests started were still running when the session ended "
        "(now ended): end them in the fixture or test that starts them (harness/processes.py)."
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")  # the progress line ends here (pytest's summary comes after this)
        reporter.write_sep("=", "processes left running", red=True, bold=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("processes left running:\n" + "\n".join(lines), file=sys.stderr)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
