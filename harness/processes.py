"""Every process the tests start, started one way and ended one way, so that none outlives the test run.

:func:`start` runs a command in a session (and process group) of its own and records it; :func:`stop` ends it with
everything it started: SIGTERM to all of them, a grace period, then SIGKILL to whatever is left, and an
interruption during the grace (Ctrl-C, a test's timeout) goes straight to the SIGKILL. :func:`running` is the two
as a ``with`` block, :func:`run` is ``subprocess.run`` on top of them. At the end of the pytest session
``tests/process_guard.py`` looks for :func:`strays`: processes of any recorded start still alive.

What a start "started" is found in ``/proc`` three ways, because each alone misses some:

* its process group and session: vLLM's engine core and resource tracker, Chromium's renderers (both rewrite their
  environment, so the next mark is gone from them);
* :data:`MARKER` in its environment, which every descendant inherits even after leaving the session: Chromium's
  crash handler forks twice into a session of its own and is re-parented to init;
* descent from a process found either way.

Linux only (``/proc``), as the suite is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "MLA_WATCH_TEST_PROCESS"  # in every started process's environment: "<run>-<number of the start>"
STOP_GRACE_S = 10.0  # from SIGTERM to SIGKILL, unless the caller says otherwise
KILL_WAIT_S = 10.0  # for SIGKILLed processes to be gone
SHOWN_CHARS = 400  # of a command line, in a report
# This interpreter's starts: a run id of its own, so that a nested test session's processes are told apart.
RUN = f"{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Seen:
    """One live process, as ``/proc`` showed it."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    command: str
    marker: str | None  # the MARKER value in its environment, if it is one of this run's


@dataclass
class Start:
    """One :func:`start`: the process and the command line it was given."""

    number: int
    process: subprocess.Popen
    command: str
    ended: bool = False  # seen with nothing left: from then on its pid may be another's, only its marker counts

    @property
    def marker(self) -> str:
        return f"{RUN}-{self.number}"


@dataclass(frozen=True)
class Stray:
    """A process a start left running: its pid, its command line, and the command it was started under."""

    pid: int
    pgid: int
    command: str
    started_as: str
    start: int  # the number of the start

    def describe(self) -> str:
        text = f"pid {self.pid} (process group {self.pgid}): {shown(self.command)}"
        if self.command != self.started_as:
            text += f"\n    started by: {shown(self.started_as)}"
        return text


_starts: list[Start] = []
_lock = threading.Lock()


def shown(command: str) -> str:
    return command if len(command) <= SHOWN_CHARS else command[:SHOWN_CHARS] + f"... ({len(command)} characters)"


def start(
    command: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None, **popen: Any
) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen)`` in a session of its own, recorded; end it with :func:`stop`.

    ``env`` (default: this process's environment) is given :data:`MARKER`. ``start_new_session`` and
    ``process_group`` are this function's to set.
    """
    for taken in ("start_new_session", "process_group"):
        if taken in popen:
            raise TypeError(f"processes.start: {taken} is set by start itself (a session of its own)")
    argv = [os.fspath(part) for part in command]
    with _lock:
        if not _starts:
            atexit.register(_end_at_exit)
        number = len(_starts) + 1
        environment = {**(os.environ if env is None else env), MARKER: f"{RUN}-{number}"}
        process = subprocess.Popen(argv, env=environment, start_new_session=True, **popen)
        _starts.append(Start(number, process, shlex.join(argv)))
    return process


def stop(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """End ``process`` (from :func:`start`) and everything it started: SIGTERM, up to ``grace`` seconds for them
    to go, then SIGKILL (at once when ``grace`` is 0). An exception during the grace (Ctrl-C, a test's timeout)
    sends the SIGKILL before it goes on. ``RuntimeError`` naming what is still alive after the SIGKILL."""
    record = _record_of(process)
    gone = False
    try:
        if grace > 0:
            _signal(record, signal.SIGTERM, _live(record))
            gone = _wait_gone(record, grace)
    except BaseException:
        _kill(record)
        raise
    if not gone:
        left = _kill(record)
        if left:
            raise RuntimeError(
                f"still alive {KILL_WAIT_S:g} s after SIGKILL:\n" + "\n".join(stray.describe() for stray in left)
            )


@contextlib.contextmanager
def running(
    command: Sequence[str | os.PathLike[str]], *, grace: float = STOP_GRACE_S, **popen: Any
) -> Iterator[subprocess.Popen]:
    """:func:`start` for the ``with`` block, :func:`stop` after it, however it ends."""
    process = start(command, **popen)
    try:
        yield process
    finally:
        stop(process, grace)


def run(
    command: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    check: bool = False,
    capture_output: bool = False,
    input: str | bytes | None = None,
    grace: float = STOP_GRACE_S,
    **popen: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` through :func:`start`: a timeout (``subprocess.TimeoutExpired``, as there) or an
    interruption stops the whole session, not only the command, and whatever the command leaves running when it
    exits is stopped as well. ``timeout`` is required: nothing a test runs may hang the run."""
    if capture_output:
        if "stdout" in popen or "stderr" in popen:
            raise TypeError("processes.run: capture_output with stdout or stderr")
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    process = start(command, **popen)
    try:
        stdout, stderr = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process, grace)
        stdout = stderr = None
        with contextlib.suppress(subprocess.TimeoutExpired):  # a writer that escaped every mark holds the pipe
            stdout, stderr = process.communicate(timeout=KILL_WAIT_S)  # what it wrote before it was stopped
        raise subprocess.TimeoutExpired(process.args, timeout, output=stdout, stderr=stderr) from None
    except BaseException:
        stop(process, grace)
        raise
    stop(process, grace)
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def strays() -> list[Stray]:
    """Every live process of every start in this interpreter: what the tests left running."""
    with _lock:
        records = list(_starts)
    table = live_processes()
    members = _members(records, table)
    return [
        Stray(pid, table[pid].pgid, table[pid].command, record.command, record.number)
        for record in records
        for pid in members.get(record.number, ())
    ]


def end_strays(grace: float = 5.0) -> list[Stray]:
    """:func:`strays`, each ended (SIGTERM, ``grace`` seconds, SIGKILL); returns them as they were found."""
    found = strays()
    numbers = {stray.start for stray in found}
    with _lock:
        records = [record for record in _starts if record.number in numbers]
    for record in records:
        _signal(record, signal.SIGTERM, _live(record))
    deadline = time.monotonic() + grace
    for record in records:
        if not _wait_gone(record, max(0.0, deadline - time.monotonic())):
            _kill(record)
    return found


# --------------------------------------------------------------------------------------------- the process table
def live_processes() -> dict[int, Seen]:
    """Every live process (zombies are dead: they only wait to be reaped), and this run's marker in each."""
    table: dict[int, Seen] = {}
    prefix = f"{MARKER}={RUN}-".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone since the listing
            continue
        name, fields = stat[stat.index(b"(") + 1 : stat.rindex(b")")], stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            continue
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            environment = b""
        marker = next(
            (
                variable[len(MARKER) + 1 :].decode()
                for variable in environment.split(b"\0")
                if variable.startswith(prefix)
            ),
            None,
        )
        parts = argv.rstrip(b"\0").split(b"\0") if argv.strip(b"\0") else []
        command = shlex.join(part.decode(errors="replace") for part in parts)
        table[pid] = Seen(
            pid, int(fields[1]), int(fields[2]), int(fields[3]), command or f"[{name.decode(errors='replace')}]", marker
        )
    return table


def _members(records: Sequence[Start], table: Mapping[int, Seen]) -> dict[int, list[int]]:
    """The live processes of each start (by number): its group and session, its marker, their descendants."""
    own = _ancestors(table)
    by_marker = {record.marker: record.number for record in records}
    by_leader: dict[int, int] = {}
    for record in records:
        record.process.poll()
        leader = record.process.pid
        # Once the leader is reaped, a live process with its pid is another's, and its group had emptied before.
        if not record.ended and not (record.process.returncode is not None and leader in table):
            by_leader[leader] = record.number
    owner: dict[int, int | None] = {}
    for seen in table.values():
        if seen.pid in own:
            owner[seen.pid] = None
        elif seen.marker in by_marker:
            owner[seen.pid] = by_marker[seen.marker]
        elif seen.pgid in by_leader or seen.sid in by_leader:
            owner[seen.pid] = by_leader.get(seen.pgid, by_leader.get(seen.sid))

    def descent(pid: int) -> int | None:
        chain: list[int] = []
        while pid in table and pid not in owner and len(chain) < 256:
            chain.append(pid)
            pid = table[pid].ppid
        number = owner.get(pid)
        for link in chain:
            owner[link] = number
        return number

    members: dict[int, list[int]] = {}
    for pid in table:
        number = owner[pid] if pid in owner else descent(pid)
        if number is not None:
            members.setdefault(number, []).append(pid)
    for record in records:  # nothing left and the leader reaped: over for good
        if record.number not in members and record.process.returncode is not None:
            record.ended = True
    return members


def _ancestors(table: Mapping[int, Seen]) -> set[int]:
    """This process and its ancestors: never a member of what it started, whatever their marks say."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        pid = table[pid].ppid if pid in table else 0
    return found


# --------------------------------------------------------------------------------------------- ending a start
def _record_of(process: subprocess.Popen) -> Start:
    with _lock:
        for record in _starts:
            if record.process is process:
                return record
    raise ValueError(f"processes.stop: pid {process.pid} was not started by processes.start")


def _live(record: Start) -> list[int]:
    return _members([record], live_processes()).get(record.number, [])


def _signal(record: Start, sig: signal.Signals, pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    if pids and record.process.returncode is None:  # the group is surely its own until the leader is reaped:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # also what forked since the table was read
            os.killpg(record.process.pid, sig)


def _wait_gone(record: Start, timeout: float) -> bool:
    """Whether every process of ``record`` has gone within ``timeout`` seconds (the leader reaped)."""
    deadline, pause = time.monotonic() + timeout, 0.01
    while True:
        if not _live(record) and record.process.poll() is not None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)


def _kill(record: Start) -> list[Stray]:
    """SIGKILL to every process of ``record`` until none is left (or :data:`KILL_WAIT_S`); what is left."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        table = live_processes()
        pids = _members([record], table).get(record.number, [])
        if not pids and record.process.poll() is not None:
            return []
        if time.monotonic() > deadline:
            return [Stray(pid, table[pid].pgid, table[pid].command, record.command, record.number) for pid in pids]
        _signal(record, signal.SIGKILL, pids)
        time.sleep(0.02)


def _end_at_exit() -> None:
    """The last resort when no session guard ran (a script, an internal error): end what is left, say so."""
    left = end_strays()
    if left:
        print(
            "processes started and never stopped, ended at exit:\n" + "\n".join(s.describe() for s in left),
            file=sys.stderr,
        )
