"""Writing a file: one way for every command and every file of the state directory, and one line when it fails.

:func:`write_file` decides by what the path is *now*, following symbolic links the way ``cp`` does:

* a regular file, or a path that does not exist yet: replaced atomically. The data goes to a temporary
  file beside it (beside a symlink's target, so the link stays a link), flushed to disk, then renamed
  over it: a reader sees the old file or the new one, never half of either;
* a character or block device, or a FIFO: written through as it is (``--out /dev/null`` discards the
  output; ``--out /dev/stdout`` prints it). Such a path is never replaced: it is not the command's to
  replace;
* a directory (or anything else, a socket): refused, naming it.

Every failure is an :class:`OutputError`: an ``OSError`` whose message is one line naming the path, what
went wrong in words ("the disk is full", "read-only file system", "not allowed", "is a directory") and
what to do; the temporary file is gone by then. :func:`write_error` words any ``OSError`` or SQLite error
that way, for the writers that cannot go through :func:`write_file` (SQLite files, directories of
versions); :func:`write_stdout` does the same for a command's standard output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import sys
import tempfile
from pathlib import Path

from mla_watch.common.state_dir import PRIVATE_FILE_MODE

__all__ = [
    "OutputError",
    "check_output_dir",
    "check_output_file",
    "problem_words",
    "write_error",
    "write_file",
    "write_stdout",
]

# errno -> (what went wrong, what to do)
_WORDS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free space on its file system, or write elsewhere"),
    errno.EDQUOT: ("the disk quota is used up", "free space or raise the quota, or write elsewhere"),
    errno.EROFS: ("read-only file system", "remount it read-write, or write elsewhere"),
    errno.EACCES: ("not allowed", "check the owner and mode of the file and of its directory, or write elsewhere"),
    errno.EPERM: (
        "not allowed",
        "check the owner, mode and attributes of the file and of its directory, or write elsewhere",
    ),
    errno.EISDIR: ("is a directory", "name a file (in that directory, say), not the directory"),
    errno.ENOTDIR: ("a part of the path is not a directory", "check the path"),
    errno.ENOENT: ("its directory does not exist", "create the directory first, or check the path"),
    errno.EIO: (
        "an input/output error: the disk or its file system failed",
        "check the disk and the kernel log (dmesg)",
    ),
    errno.EPIPE: ("the reader at the other end went away", "keep the reader open until everything is written"),
    errno.ENXIO: ("no device or reader behind it", "check the path"),
    errno.EFBIG: ("too large for its file system", "write elsewhere"),
    errno.ELOOP: ("too many symbolic links", "check where the links point"),
    errno.ENAMETOOLONG: ("the name is too long", "use a shorter path"),
    errno.ETXTBSY: ("a running program's file", "write elsewhere"),
    errno.EBADF: ("not open for writing", "give a path that can be written"),
}
# SQLite's result codes (its error's sqlite_errorname) -> the errno whose words say the same
_SQLITE: dict[str, int] = {
    "SQLITE_FULL": errno.ENOSPC,
    "SQLITE_READONLY": errno.EROFS,
    "SQLITE_IOERR": errno.EIO,
    "SQLITE_PERM": errno.EACCES,
    "SQLITE_CANTOPEN": errno.EACCES,
}
_SQLITE_WORDS: dict[str, tuple[str, str]] = {
    "SQLITE_CORRUPT": ("the file is damaged", "move it aside and start again"),
    "SQLITE_NOTADB": ("not an SQLite file", "move it aside and start again"),
    "SQLITE_BUSY": ("another process holds it locked", "stop the other process that uses it"),
    "SQLITE_LOCKED": ("another process holds it locked", "stop the other process that uses it"),
}


class OutputError(OSError):
    """A file could not be written: ``str()`` is one line naming the path (or ``label``), what went wrong and what
    to do. ``problem`` is the words alone ("the disk is full"), ``errno`` the error's where there is one."""

    def __init__(self, label: str, problem: str, advice: str, code: int | None = None) -> None:
        super().__init__(code or 0, problem)
        self.label = label
        self.problem = problem
        self.advice = advice

    def __str__(self) -> str:
        return f"{self.label}: cannot write it: {self.problem}; {self.advice}"


def _root_error(error: BaseException) -> BaseException:
    """The OSError or SQLite error behind ``error`` (a store's own error wraps SQLite's as its cause)."""
    seen = error
    while not isinstance(seen, OSError | sqlite3.Error) and seen.__cause__ is not None:
        seen = seen.__cause__
    return seen


def _words(error: BaseException) -> tuple[str, str, int | None]:
    error = _root_error(error)
    if isinstance(error, OutputError):
        return error.problem, error.advice, error.errno or None
    if isinstance(error, OSError):
        code = error.errno
        if code in _WORDS:
            return (*_WORDS[code], code)
        name = errno.errorcode.get(code or 0)
        text = error.strerror or (str(error) if error.args else "") or type(error).__name__
        return (f"{text.lower()} ({name})" if name else text), "check the path and its file system", code
    if isinstance(error, sqlite3.Error):
        name = str(getattr(error, "sqlite_errorname", "") or "")
        base = "_".join(name.split("_")[:2])  # SQLITE_IOERR_WRITE: an SQLITE_IOERR
        if base in _SQLITE:
            return (*_WORDS[_SQLITE[base]], _SQLITE[base])
        if base in _SQLITE_WORDS:
            return (*_SQLITE_WORDS[base], None)
        return str(error) or type(error).__name__, "check the file and its file system", None
    return str(error) or type(error).__name__, "check the path", None


def problem_words(error: BaseException) -> str:
    """What went wrong, in words: "the disk is full", "read-only file system", "not allowed", ..."""
    return _words(error)[0]


def write_error(label: str | os.PathLike[str], error: BaseException, *, advice: str | None = None) -> OutputError:
    """``error`` (an ``OSError``, an SQLite error, or a store's error caused by one) as one line about ``label``
    (a path, or ``"--out PATH"``); ``advice`` replaces what the line says to do."""
    if isinstance(error, OutputError) and advice is None and error.label == str(label):
        return error
    problem, default, code = _words(error)
    return OutputError(str(label), problem, advice or default, code)


def _kind(mode: int) -> str:
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a regular file"
        if stat.S_ISREG(mode)
        else "a special file"
    )


def _umask() -> int:
    """The process' umask, read without changing it (other threads may be creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_file(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    private: bool = False,
    parents: bool = False,
    label: str | None = None,
) -> Path:
    """Write ``data`` to ``path`` (see the module docstring); returns the path written (a link's target).

    ``private``: a file created or replaced is owner-only (0600) from its first byte; otherwise a new file gets
    0666 less the umask and a replaced one keeps its mode. ``parents``: create missing directories first.
    ``label`` names the path in messages (``"--out PATH"``; default the path). Raises :class:`OutputError`.
    """
    path = Path(path)
    label = label or str(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        try:  # every link followed, /dev/stdout's to a pipe included (which realpath cannot name)
            found: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            found = None
        if found is not None and not stat.S_ISREG(found.st_mode):
            if stat.S_ISCHR(found.st_mode) or stat.S_ISBLK(found.st_mode) or stat.S_ISFIFO(found.st_mode):
                _write_through(path, payload)
                return path
            if stat.S_ISDIR(found.st_mode):
                raise OutputError(
                    label, "is a directory", "name a file (in that directory, say), not the directory", errno.EISDIR
                )
            raise OutputError(label, f"is {_kind(found.st_mode)}", "name a regular file, a device or a FIFO")
        target = Path(os.path.realpath(path))  # the file a link points to (a dangling one: where it points)
        if parents:
            target.parent.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
        mode = PRIVATE_FILE_MODE if private else stat.S_IMODE(found.st_mode) if found is not None else 0o666 & ~_umask()
        _replace(target, payload, mode)
        return target
    except OutputError:
        raise
    except OSError as error:
        raise write_error(label, error) from None


def _write_through(target: Path, payload: bytes) -> None:
    """A device or a FIFO: open it as it is (a FIFO waits for its reader, as ``cp`` does) and write."""
    fd = os.open(target, os.O_WRONLY | os.O_NOCTTY)
    try:
        _write_all(fd, payload)
    finally:
        os.close(fd)


def _replace(target: Path, payload: bytes, mode: int) -> None:
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable; a directory that cannot be opened: no matter
        directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def check_output_file(path: str | os.PathLike[str], *, label: str | None = None, parents: bool = False) -> None:
    """Refuse now, before a long command runs, a ``path`` that :func:`write_file` would refuse later: a
    directory, a socket, a missing or read-only directory to create it in. Nothing is written; what only the
    write can tell (a full disk) it says then. :class:`OutputError` in one line."""
    path = Path(path)
    label = label or str(path)
    try:
        target = Path(os.path.realpath(path))
        try:
            found: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            found = None
        if found is not None:
            if stat.S_ISDIR(found.st_mode):
                raise OutputError(
                    label, "is a directory", "name a file (in that directory, say), not the directory", errno.EISDIR
                )
            if not (
                stat.S_ISREG(found.st_mode)
                or stat.S_ISCHR(found.st_mode)
                or stat.S_ISBLK(found.st_mode)
                or stat.S_ISFIFO(found.st_mode)
            ):
                raise OutputError(label, f"is {_kind(found.st_mode)}", "name a regular file, a device or a FIFO")
            if stat.S_ISREG(found.st_mode) and not os.access(target.parent, os.W_OK | os.X_OK):
                raise OSError(errno.EROFS if _read_only(target.parent) else errno.EACCES, "")
            return
        directory = target.parent
        while parents and not directory.exists() and directory != directory.parent:
            directory = directory.parent
        if not directory.is_dir():
            raise OSError(errno.ENOENT if not directory.exists() else errno.ENOTDIR, "")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise OSError(errno.EROFS if _read_only(directory) else errno.EACCES, "")
    except OutputError:
        raise
    except OSError as error:
        raise write_error(label, error) from None


def _read_only(directory: Path) -> bool:
    with contextlib.suppress(OSError):
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    return False


def check_output_dir(path: str | os.PathLike[str], *, label: str | None = None, room: int = 0) -> Path:
    """Make sure ``path`` is (or can be created as) a directory that takes files, before a long command writes its
    outputs there; ``room``: bytes its outputs will need, written to a probe file (and removed) so that a full disk
    is said now. Returns the directory; :class:`OutputError` otherwise."""
    path = Path(path)
    label = label or str(path)
    try:
        if path.exists() and not path.is_dir():
            raise OutputError(
                label,
                f"is {_kind(os.stat(path).st_mode)}, not a directory",
                "name a directory for the outputs (it is created if missing)",
                errno.ENOTDIR,
            )
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        try:
            try:
                _write_all(fd, b"\0" * room)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OutputError:
        raise
    except OSError as error:
        raise write_error(label, error) from None
    return path


def write_stdout(text: str) -> None:
    """Write ``text`` to standard output and flush it; a failure (a full disk, a closed pipe) is an
    :class:`OutputError` about standard output, and nothing is flushed there again at exit."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as error:
        # What is still buffered would fail again when Python flushes at exit, with a message of its own.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        raise write_error("standard output", error) from None
