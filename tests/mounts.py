"""Paths that are hard to write to, made for real: a full tmpfs, a read-only bind mount, a device node, a FIFO.

The mounts need root with CAP_SYS_ADMIN. :func:`mount_refusal` really tries a mount once per run and says why it
failed; a test that needs one is skipped with that reason where it cannot mount, and every mount is undone when
its block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import processes


def _mount(*arguments: str) -> subprocess.CompletedProcess:
    try:
        return processes.run(["mount", *arguments], capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(["mount"], 127, "", "no mount command")


def _umount(directory: Path) -> None:
    # lazily where a file is still open there (an in-process sidecar's SQLite files)
    if processes.run(["umount", str(directory)], capture_output=True, timeout=30, check=False).returncode != 0:
        processes.run(["umount", "-l", str(directory)], capture_output=True, timeout=30, check=False)


@functools.cache
def mount_refusal() -> str | None:
    """Why this process cannot mount a tmpfs (tried for real, once), or ``None`` when it can."""
    with tempfile.TemporaryDirectory(prefix="mla-watch-mount-probe-") as probe:
        mounted = _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", probe)
        if mounted.returncode != 0:
            return (
                f"mounting is not permitted here (mount -t tmpfs: {mounted.stderr.strip() or mounted.returncode}): "
                "this case needs root with CAP_SYS_ADMIN"
            )
        _umount(Path(probe))
    return None


def _need_mounts() -> None:
    refusal = mount_refusal()
    if refusal is not None:
        pytest.skip(refusal)


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` on ``directory`` (created) for the block."""
    _need_mounts()
    directory.mkdir(parents=True, exist_ok=True)
    mounted = _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory))
    if mounted.returncode != 0:
        pytest.fail(f"mounting a tmpfs on {directory} failed: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        _umount(directory)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """``directory`` (created) bind-mounted read-only onto itself for the block."""
    _need_mounts()
    directory.mkdir(parents=True, exist_ok=True)
    mounted = _mount("--bind", "-o", "ro", str(directory), str(directory))
    if mounted.returncode != 0:
        pytest.fail(f"a read-only bind mount of {directory} failed: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        _umount(directory)


def fill(directory: Path) -> Path:
    """Write zeros into DIRECTORY/filler until its file system is full; the filler (remove it to make room)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * 65536)
    with open(filler, "ab", buffering=0) as handle, contextlib.suppress(OSError):
        while True:  # the last blocks a bigger write did not fit in
            handle.write(b"\0" * 512)
    return filler


def null_device(path: Path) -> Path:
    """A character device node at ``path`` that discards what is written, as /dev/null does (major 1, minor 3): the
    machine's own /dev/null is never a test's to touch."""
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return path


def is_null_device(path: Path) -> bool:
    """Whether ``path`` is still the character device :func:`null_device` made."""
    found = os.lstat(path)
    return stat.S_ISCHR(found.st_mode) and found.st_rdev == os.makedev(1, 3)
