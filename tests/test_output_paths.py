"""Paths an operator gives: what every command that writes a file does with a device, a directory, a FIFO, a
symlink, a full disk and a read-only one.

A regular file or a new path is replaced atomically; a device, a FIFO or a symlink to one is written through as it
is (``cp`` does the same); a directory is refused; every failure is one line naming the path, what went wrong in
words and what to do, with no traceback and no temporary file left behind. The device is a node made here (the
machine's own /dev/null is never touched); the full disk is a small tmpfs, the read-only one a bind mount (those
cases are skipped, saying why, where this process cannot mount).

``serve``'s state directory filling up is tests/test_state_directory_full.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness import processes
from harness.support import serve_app
from mla_watch.cli.main import main
from mla_watch.common.output_file import OutputError, write_file
from mla_watch.routing.positions import PositionCounts
from mla_watch.routing.routers import RouterInfo
from tests.mounts import fill, is_null_device, null_device, read_only, small_tmpfs

CLI = (sys.executable, "-m", "mla_watch.cli")
OLD = "old content, kept\n"


# --------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def fifo_reader(path: Path) -> Iterator[list[bytes]]:
    """A FIFO at ``path`` and a thread reading it to the end; what it read, once the block is left."""
    os.mkfifo(path)
    chunks: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as handle:  # waits for the writer, as a shell's `cat FIFO` would
            chunks.extend(iter(lambda: handle.read(65536), b""))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield chunks
    finally:
        if thread.is_alive():  # no writer came: open it once so that the reader's open returns
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        assert not thread.is_alive()


def leftovers(directory: Path) -> list[str]:
    """Temporary files a writer left behind (``.NAME.XXXX.tmp``, probes)."""
    return sorted(entry.name for entry in directory.iterdir() if entry.name.startswith("."))


def one_line(stderr: str, prog: str) -> str:
    """The one line a refused write prints; fails on a traceback or a second line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith(f"{prog}: ") and "cannot write it" in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# --------------------------------------------------------------------------------------------- the writer
def test_a_device_is_written_through_and_stays_a_device(tmp_path: Path) -> None:
    device = null_device(tmp_path / "null")
    assert write_file(device, "discarded\n", private=True) == device
    assert is_null_device(device) and leftovers(tmp_path) == []
    link = tmp_path / "to-null"
    link.symlink_to(device)
    write_file(link, b"discarded too\n")
    assert link.is_symlink() and is_null_device(device)


def test_a_fifo_is_written_through(tmp_path: Path) -> None:
    with fifo_reader(tmp_path / "fifo") as read:
        write_file(tmp_path / "fifo", "through the pipe\n")
    assert b"".join(read) == b"through the pipe\n"
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)


def test_a_regular_file_is_replaced_atomically_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text(OLD)
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert write_file(link, "new\n") == target
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # not private: an operator's file keeps its mode
    write_file(link, "private\n", private=True)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "made-through-the-link")
    write_file(dangling, "x")
    assert dangling.is_symlink() and (tmp_path / "made-through-the-link").read_text() == "x"
    assert leftovers(tmp_path) == []


def test_a_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    directory = tmp_path / "dir"
    directory.mkdir()
    with pytest.raises(OutputError) as refused:
        write_file(directory, "x", label=f"--out {directory}")
    assert str(refused.value) == (
        f"--out {directory}: cannot write it: is a directory; name a file (in that directory, say), not the directory"
    )
    assert list(directory.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "full", "256k") as disk:
        (disk / "out.json").write_text(OLD)
        fill(disk)
        with pytest.raises(OutputError) as refused:
            write_file(disk / "out.json", "x" * 200_000)
        assert str(refused.value) == (
            f"{disk / 'out.json'}: cannot write it: the disk is full; free space on its file system, or write elsewhere"
        )
        assert refused.value.problem == "the disk is full"
        assert (disk / "out.json").read_text() == OLD and leftovers(disk) == []


def test_a_read_only_disk_is_one_line_and_leaves_the_old_file(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    (directory / "out.json").write_text(OLD)
    with read_only(directory):
        with pytest.raises(OutputError) as refused:
            write_file(directory / "out.json", "new")
        assert str(refused.value) == (
            f"{directory / 'out.json'}: cannot write it: read-only file system; remount "
            "it read-write, or write elsewhere"
        )
        assert (directory / "out.json").read_text() == OLD


# --------------------------------------------------------------------------------------------- the commands
# Each case: a path made in tmp_path (and the mounts it needs), and what must hold of it afterwards.
Case = Callable[[Path, contextlib.ExitStack], tuple[Path, Callable[[], None]]]


def _device(tmp: Path, _: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    device = null_device(tmp / "null")
    return device, lambda: None if is_null_device(device) else pytest.fail("the device was replaced")


def _link_to_device(tmp: Path, _: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    device = null_device(tmp / "null")
    (tmp / "link").symlink_to(device)
    return (
        tmp / "link",
        lambda: (
            None
            if (tmp / "link").is_symlink() and is_null_device(device)
            else pytest.fail("the link or its device was replaced")
        ),
    )


def _link_to_file(tmp: Path, _: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    (tmp / "real").write_text(OLD)
    (tmp / "link").symlink_to(tmp / "real")

    def check() -> None:
        assert (tmp / "link").is_symlink() and (tmp / "real").read_text() != OLD  # written through the link
        assert leftovers(tmp) == []

    return tmp / "link", check


def _full(tmp: Path, stack: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    disk = stack.enter_context(small_tmpfs(tmp / "full", "256k"))
    (disk / "out").write_text(OLD)
    fill(disk)

    def check() -> None:
        assert (disk / "out").read_text() == OLD and leftovers(disk) == []

    return disk / "out", check


def _read_only(tmp: Path, stack: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    directory = tmp / "ro"
    directory.mkdir()
    (directory / "out").write_text(OLD)
    stack.enter_context(read_only(directory))
    return directory / "out", lambda: None if (directory / "out").read_text() == OLD else pytest.fail("rewritten")


def _directory(tmp: Path, _: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    (tmp / "dir").mkdir()
    return tmp / "dir", lambda: None if list((tmp / "dir").iterdir()) == [] else pytest.fail("written into")


WRITTEN: dict[str, Case] = {
    "device": _device,
    "symlink to a device": _link_to_device,
    "symlink to a regular file": _link_to_file,
}
REFUSED: dict[str, tuple[Case, str]] = {
    "directory": (_directory, "is a directory"),
    "full disk": (_full, "the disk is full"),
    "read-only disk": (_read_only, "read-only file system"),
}


@pytest.mark.parametrize("case", list(WRITTEN))
def test_rules_export_writes_through_a_device_or_a_symlink(tmp_path: Path, case: str) -> None:
    with contextlib.ExitStack() as stack:
        path, check = WRITTEN[case](tmp_path, stack)
        run = processes.run([*CLI, "rules", "export", "--out", str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
        assert f"to {path}" in run.stderr
        check()


def test_rules_export_writes_into_a_fifo(tmp_path: Path) -> None:
    with fifo_reader(tmp_path / "fifo") as read:
        run = processes.run(
            [*CLI, "rules", "export", "--out", str(tmp_path / "fifo")], capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "groups:" in b"".join(read).decode()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)


def test_rules_export_to_dev_stdout_prints_it_through_a_pipe() -> None:
    """/dev/stdout is a link to the process' own standard output, here a pipe: written through, as cp would."""
    run = processes.run([*CLI, "rules", "export", "--out", "/dev/stdout"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "groups:" in run.stdout and "to /dev/stdout" in run.stderr


@pytest.mark.parametrize("case", list(REFUSED))
def test_rules_export_refuses_in_one_line(tmp_path: Path, case: str) -> None:
    make, words = REFUSED[case]
    with contextlib.ExitStack() as stack:
        path, check = make(tmp_path, stack)
        run = processes.run([*CLI, "rules", "export", "--out", str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 1
        line = one_line(run.stderr, "mla-watch rules export")
        assert line.startswith(f"mla-watch rules export: --out {path}: cannot write it: {words}; "), line
        check()


def _baseline(path: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``mla-watch baseline --out PATH`` in this process (the model loads in a second once torch is imported)."""
    capsys.readouterr()
    try:
        code = main(["baseline", "--domain", "code", "--samples", "1", "--out", str(path)])
    except SystemExit as stopped:
        code = int(stopped.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(WRITTEN))
def test_baseline_writes_through_a_device_or_a_symlink(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    with contextlib.ExitStack() as stack:
        path, check = WRITTEN[case](tmp_path, stack)
        code, err = _baseline(path, capsys)
        assert code == 0 and "Traceback" not in err, err[-3000:]
        check()
        if case == "symlink to a regular file":
            assert json.loads((tmp_path / "real").read_text())["format"] == "mla_watch.baseline/2"


def test_baseline_writes_into_a_fifo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with fifo_reader(tmp_path / "fifo") as read:
        code, err = _baseline(tmp_path / "fifo", capsys)
    assert code == 0, err[-3000:]
    assert json.loads(b"".join(read))["format"] == "mla_watch.baseline/2"


@pytest.mark.parametrize("case", list(REFUSED))
def test_baseline_refuses_in_one_line(tmp_path: Path, case: str, capsys: pytest.CaptureFixture) -> None:
    make, words = REFUSED[case]
    with contextlib.ExitStack() as stack:
        path, check = make(tmp_path, stack)
        code, err = _baseline(path, capsys)
        assert code == 1
        line = one_line(err, "mla-watch baseline")
        assert line.startswith(f"mla-watch baseline: --out {path}: cannot write it: {words}; "), line
        check()
        # What the path itself tells is refused before the model loads; a full disk only the write can tell.
        assert ("loading the model" in err) == (case == "full disk"), err


def test_a_full_disk_stops_baseline_in_one_line_as_a_process(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "full", "256k") as disk:
        fill(disk)
        run = processes.run(
            [*CLI, "baseline", "--domain", "code", "--samples", "1", "--out", str(disk / "b.json")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 1
        assert one_line(run.stderr, "mla-watch baseline") == (
            f"mla-watch baseline: --out {disk / 'b.json'}: cannot write it: the disk is full; free space on its "
            "file system, or write elsewhere"
        )
        assert leftovers(disk) == [] and not (disk / "b.json").exists()


def _regular_file(tmp: Path, _: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    (tmp / "file").write_text(OLD)
    return tmp / "file", lambda: None if (tmp / "file").read_text() == OLD else pytest.fail("rewritten")


def _full_directory(tmp: Path, stack: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    disk = stack.enter_context(small_tmpfs(tmp / "full", "256k"))
    fill(disk)
    return disk, lambda: None


def _read_only_directory(tmp: Path, stack: contextlib.ExitStack) -> tuple[Path, Callable[[], None]]:
    return stack.enter_context(read_only(tmp / "ro")), lambda: None


DEMO_REFUSED: dict[str, tuple[Case, str]] = {
    "device": (_device, "is a character device, not a directory"),
    "symlink to a device": (_link_to_device, "is a character device, not a directory"),
    "regular file": (_regular_file, "is a regular file, not a directory"),
    "full disk": (_full_directory, "the disk is full"),
    "read-only disk": (_read_only_directory, "read-only file system"),
}


@pytest.mark.parametrize("case", [*DEMO_REFUSED, "fifo"])
def test_demo_refuses_an_out_that_cannot_take_its_outputs_before_it_runs(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    """``demo --out`` names a directory (summary.json and timeline.png go in it; tests/test_demo.py runs it):
    anything else, or one that cannot take the outputs, is refused in one line before the demo starts."""
    with contextlib.ExitStack() as stack:
        if case == "fifo":
            os.mkfifo(tmp_path / "fifo")
            path, check, words = tmp_path / "fifo", (lambda: None), "is a FIFO, not a directory"
        else:
            make, words = DEMO_REFUSED[case]
            path, check = make(tmp_path, stack)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            main(["demo", "--out", str(path), "--no-live"])
        assert stopped.value.code == 1
        err = capsys.readouterr().err
        line = one_line(err, "mla-watch demo")
        assert line.startswith(f"mla-watch demo: --out {path}: cannot write it: {words}; "), line
        check()
        assert "status page" not in capsys.readouterr().out  # nothing ran
        if path.is_dir():
            assert leftovers(path) == []


@contextlib.contextmanager
def routing_by_position() -> Iterator[str]:
    """A loopback server answering ``GET /v1/routing`` with routing by position, as a sidecar does."""
    routers = [RouterInfo(f"model.layers.{layer}.mlp.gate", layer, "expert", 64, 6) for layer in (1, 2, 3)]
    counts = PositionCounts(routers, 1024)
    rng = np.random.default_rng(3)
    for info in routers:
        counts.add(info.name, "doc_summary", rng.integers(0, 500, size=(len(counts.buckets), 64)))
    body = {"positions": counts.as_dict("doc_summary")}
    app = Starlette(routes=[Route("/v1/routing", lambda request: JSONResponse(body), methods=["GET"])])
    with serve_app(app) as url:
        yield url


def _context(url: str, stdout: int) -> subprocess.CompletedProcess:
    return processes.run(
        [*CLI, "context", "--url", url, "--business-line", "doc_summary", "--json"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )


def test_context_json_goes_through_a_device_a_symlink_and_a_fifo(tmp_path: Path) -> None:
    """``context --json`` writes to its standard output: whatever the shell opened there is written as it is."""
    device = null_device(tmp_path / "null")
    (tmp_path / "link").symlink_to(device)
    with routing_by_position() as url:
        for path in (device, tmp_path / "link"):
            fd = os.open(path, os.O_WRONLY)
            try:
                run = _context(url, fd)
            finally:
                os.close(fd)
            assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]
        assert is_null_device(device) and (tmp_path / "link").is_symlink()
        with fifo_reader(tmp_path / "fifo") as read:
            fd = os.open(tmp_path / "fifo", os.O_WRONLY)  # the reader is there: opens at once
            try:
                run = _context(url, fd)
            finally:
                os.close(fd)
        assert run.returncode == 0, run.stderr
        assert json.loads(b"".join(read))["business_line"] == "doc_summary"


def test_context_json_on_a_full_or_read_only_disk_is_one_line(tmp_path: Path) -> None:
    """A full disk fails the write; a read-only one cannot even be opened for writing by the shell, so standard
    output is the file opened for reading there (a write is refused the same way); a directory no shell opens."""
    with routing_by_position() as url, small_tmpfs(tmp_path / "full", "256k") as disk:
        fd = os.open(disk / "out.json", os.O_WRONLY | os.O_CREAT, 0o600)
        fill(disk)
        try:
            run = _context(url, fd)
        finally:
            os.close(fd)
        assert run.returncode == 1
        assert one_line(run.stderr, "mla-watch context") == (
            "mla-watch context: standard output: cannot write it: the disk is full; free space on its file system, "
            "or write elsewhere"
        )
        directory = tmp_path / "ro"
        directory.mkdir()
        (directory / "out.json").write_text(OLD)
        with read_only(directory):
            fd = os.open(directory / "out.json", os.O_RDONLY)
            try:
                run = _context(url, fd)
            finally:
                os.close(fd)
        assert run.returncode == 1
        assert one_line(run.stderr, "mla-watch context").startswith(
            "mla-watch context: standard output: cannot write it: not open for writing; "
        )
        assert (directory / "out.json").read_text() == OLD
