"""No process the tests start outlives them: harness/processes.py ends what it started, and tests/process_guard.py
fails a session that leaves one running, names it and ends it, whichever way the session ends.

The guard is checked from the outside: a small pytest session of its own (a subprocess, with the guard loaded as
the suite loads it) starts sleepers through the helper, leaves one running on purpose, and passes, is sent Ctrl-C
or SIGTERM, or times out. Every sleeper carries a token of its test in its command line, so that what is left can
be looked for in the process table afterwards. Some sleepers start a child in a session of their own first, as
Chromium's crash handler does, which a process group alone would miss.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from harness import processes
from harness.support import REPO, wait_until

TESTS = Path(__file__).resolve().parent
SAYS_READY = "print('ready', flush=True); "
IGNORES_SIGTERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
ESCAPES = (
    "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
    "sys.argv[1] + '-escaped'], start_new_session=True); "
)
SLEEPS = "import time; time.sleep(600)"

# What every inner session's test file starts with; GUARD_TOKEN and GUARD_READY come from the outer test.
INNER = """
import contextlib, os, pathlib, subprocess, time
import pytest
from harness import processes
from tests.test_processes import sleeper

TOKEN = os.environ["GUARD_TOKEN"]


def start(name, **options):
    \"\"\"processes.start of the sleeper TOKEN-name, once it is ready.\"\"\"
    process = processes.start(sleeper(f"{TOKEN}-{name}", **options), stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


@contextlib.contextmanager
def running(name, grace=processes.STOP_GRACE_S, **options):
    \"\"\"processes.running of the sleeper TOKEN-name, once it is ready.\"\"\"
    with processes.running(sleeper(f"{TOKEN}-{name}", **options), stdout=subprocess.PIPE, text=True,
                           grace=grace) as process:
        assert process.stdout.readline().strip() == "ready"
        yield process


def ready():
    pathlib.Path(os.environ["GUARD_READY"]).write_text("ready")
"""


def sleeper(name: str, *, escapes: bool = False, ignores_sigterm: bool = False) -> list[str]:
    """A Python process named ``name`` (its last argument) that prints "ready" once it is, then sleeps.
    ``escapes``: it first starts a child ``name-escaped`` in a session of its own; ``ignores_sigterm``: as it says."""
    code = (IGNORES_SIGTERM if ignores_sigterm else "") + (ESCAPES if escapes else "") + SAYS_READY + SLEEPS
    return [sys.executable, "-c", code, name]


def alive(token: str) -> list[str]:
    """The command lines of live processes that carry ``token``."""
    return [seen.command for seen in processes.live_processes().values() if token in seen.command]


def inner_session(tmp_path: Path, token: str, source: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a pytest session on ``source`` in ``tmp_path``, the guard loaded."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: none of the suite's settings
    (tmp_path / "test_inner.py").write_text(INNER + source)
    environment = {
        **os.environ,
        "GUARD_TOKEN": token,
        "GUARD_READY": str(tmp_path / "ready"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "tests.process_guard",
        "-p",
        "no:cacheprovider",
        "test_inner.py",
        *args,
    ]
    return command, environment


def named(output: str) -> list[str]:
    """The sleepers the guard named in ``output``, sorted (each line: ``pid N (process group G): COMMAND``)."""
    return sorted(line.rsplit(" ", 1)[1] for line in output.splitlines() if line.startswith("pid "))


@pytest.fixture
def token() -> str:
    return f"mla-watch-guard-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------- the helper
def test_stop_ends_what_the_process_started_in_a_session_of_its_own(token) -> None:
    process = processes.start(sleeper(token, escapes=True), stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        assert wait_until(lambda: len(alive(token)) == 2, timeout=30)  # the sleeper and its escaped child
    finally:
        processes.stop(process)
        process.stdout.close()
    assert process.returncode == -signal.SIGTERM
    assert alive(token) == []


def test_stop_kills_what_ignores_sigterm_once_its_grace_is_over(token) -> None:
    with processes.running(
        sleeper(token, ignores_sigterm=True), stdout=subprocess.PIPE, text=True, grace=0.5
    ) as process:
        assert process.stdout.readline().strip() == "ready"
    process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    assert alive(token) == []


def test_run_answers_as_subprocess_run_does(token) -> None:
    done = processes.run(
        [sys.executable, "-c", "import sys; print(sys.argv[1]); sys.exit(3)", token],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, token + "\n", "")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        processes.run([sys.executable, "-c", "raise SystemExit(3)"], timeout=60, check=True)
    assert failed.value.returncode == 3


def test_run_ends_the_whole_session_at_its_timeout(token) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        processes.run(sleeper(token, escapes=True), capture_output=True, text=True, timeout=5)
    assert expired.value.output == "ready\n"  # the escaped child was running when the timeout came
    assert alive(token) == []


def test_stop_refuses_a_process_it_did_not_start() -> None:
    with (
        subprocess.Popen([sys.executable, "-c", "pass"]) as process,
        pytest.raises(ValueError, match=rf"pid {process.pid} was not started by processes.start"),
    ):
        processes.stop(process)


def test_the_tests_start_processes_only_through_the_helper() -> None:
    """A process started any other way is in no session of its own and escapes the session's guard."""
    direct = re.compile(
        r"\bsubprocess\.(Popen|run|call|check_call|check_output|getoutput|getstatusoutput)\(|"
        r"\bos\.(fork|forkpty|system|popen|posix_spawnp?|spawn[lv]p?e?|exec[lv]p?e?)\(|"
        r"\bmultiprocessing\b|\bcreate_subprocess_(exec|shell)\b"
    )
    # the helper, and this file (a Popen made to be refused); harness/ is what the tests share with the benches
    exempt = {REPO / "harness" / "processes.py", Path(__file__).resolve()}
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted([*TESTS.glob("*.py"), *(REPO / "harness").glob("*.py")])
        if path.resolve() not in exempt
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == [], "start these with harness/processes.py (start, running or run):\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------- the session guard
LEAKS = """
def test_stops_its_server():
    with running("stopped", escapes=True):
        pass


def test_leaves_one_running():
    start("left", escapes=True)
"""


def test_a_passing_session_that_leaves_a_process_running_fails_naming_it_and_ends_it(tmp_path, token) -> None:
    command, environment = inner_session(tmp_path, token, LEAKS)
    done = processes.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "2 passed" in output and "processes left running" in output, output
    assert named(output) == [f"{token}-left", f"{token}-left-escaped"], output
    assert f"{token}-stopped" not in output
    assert alive(token) == []


STOPS_AT_A_FAILURE = """
@pytest.fixture(scope="module")
def server():
    with running("fixture", escapes=True) as server:
        yield server


def test_leaves_one_running(server):
    start("left", escapes=True)


def test_fails(server):
    assert False, "on purpose"


def test_never_runs(server):
    start("never")
"""


def test_a_session_stopped_by_its_first_failure_ends_every_process(tmp_path, token) -> None:
    command, environment = inner_session(tmp_path, token, STOPS_AT_A_FAILURE, "-x")
    done = processes.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "1 failed, 1 passed" in output and "stopping after 1 failures" in output, output
    assert named(output) == [f"{token}-left", f"{token}-left-escaped"], output  # not the module fixture's
    assert alive(token) == []


INTERRUPTED = """
@pytest.fixture(scope="module")
def server():
    with running("fixture", escapes=True, grace=60) as server:
        yield server


def test_interrupted(server):
    start("left")
    ready()
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_session_ends_every_process_and_names_what_a_test_left(tmp_path, token, sig) -> None:
    command, environment = inner_session(tmp_path, token, INTERRUPTED)
    with processes.running(
        command, env=environment, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as session:
        assert wait_until(lambda: (tmp_path / "ready").exists() or session.poll() is not None, timeout=120)
        assert session.poll() is None, session.stdout.read()
        if sig == signal.SIGINT:
            os.killpg(session.pid, sig)  # as a terminal sends Ctrl-C: to the foreground process group
        else:
            os.kill(session.pid, sig)
        output, _ = session.communicate(timeout=120)
    assert session.returncode == pytest.ExitCode.INTERRUPTED, output
    assert ("Terminated: SIGTERM" if sig == signal.SIGTERM else "KeyboardInterrupt") in output, output
    assert named(output) == [f"{token}-left"], output  # the fixture's server was ended by the fixture
    assert alive(token) == []


TIMES_OUT = """
@pytest.fixture
def server():
    with running("server", escapes=True) as server:
        yield server


@pytest.fixture
def stubborn():
    # Ignores SIGTERM: only the timeout can cut its stop's grace short, and then SIGKILL ends it.
    with running("stubborn", ignores_sigterm=True, grace=600) as server:
        yield server


@pytest.mark.timeout(10)
def test_hangs(server):
    start("left")
    time.sleep(600)


@pytest.mark.timeout(10)
def test_its_teardown_hangs(stubborn):
    pass
"""


@pytest.mark.slow
def test_a_session_whose_tests_time_out_ends_every_process(tmp_path, token) -> None:
    command, environment = inner_session(tmp_path, token, TIMES_OUT)
    # Far less than the stubborn server's grace: the session ends only if the timeout cut it short.
    done = processes.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "FAILED test_inner.py::test_hangs - Failed: Timeout" in output, output
    assert "ERROR test_inner.py::test_its_teardown_hangs - Failed: Timeout" in output, output
    assert named(output) == [f"{token}-left"], output
    assert alive(token) == []
