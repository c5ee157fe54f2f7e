"""The state directory holds tokenized customer traffic: owner-only directories (0700) and files (0600).

:func:`ensure_private_dir` creates a directory (and its missing parents) and makes it 0700,
tightening one that exists with a looser mode; :func:`ensure_private_file` does the same for a
file (0600), creating it empty when it does not exist; :func:`write_private` writes a file that
is 0600 from its first byte (``os.open(..., 0o600)``, never a chmod after the fact), and
:func:`replace_private` does so atomically: a reader sees the old file or the new one, never half.
:func:`set_aside` moves a file that cannot be read out of the way (``NAME.corrupt``), for an operator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["DATASETS_DIR_NAME", "PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "ensure_private_dir", "ensure_private_file",
           "replace_private",
           "set_aside", "write_private"]

log = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
DATASETS_DIR_NAME = "datasets"  # the re-tune datasets' directory inside the state directory (unless --dataset-dir)


def _tighten(path: Path, mode: int, what: str) -> None:
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & stat.S_ISVTX or path.resolve() == Path(path.resolve().anchor):  # /tmp or /: shared, never ours
        log.warning("%s %s is shared (mode %o): expected a private %s of its own; leaving its mode alone",
                    what, path, current, what)
        return
    if current & ~mode:
        try:
            os.chmod(path, current & mode)
        except OSError as error:  # not ours (another user's directory): say so, and go on
            log.warning("%s %s has mode %o, expected %o (owner only); cannot change it: [Errno %s] %s",
                        what, path, current, mode, error.errno, error.strerror)
        else:
            log.info("%s %s had mode %o; now %o (owner only)", what, path, current, current & mode)


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) if needed and make it owner-only (0700); returns it.

    A directory that exists with a looser mode is tightened (group and other bits removed); one
    that cannot be changed is logged as a warning. Raises ``OSError`` when it cannot be created or
    is not a directory.
    """
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: expected a directory")
    _tighten(path, PRIVATE_DIR_MODE, "directory")
    return path


def ensure_private_file(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` empty (0600) if it does not exist, or tighten it to owner-only; returns it."""
    path = Path(path)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE))
    _tighten(path, PRIVATE_FILE_MODE, "file")
    return path


def write_private(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` as an owner-only file (0600 from creation; an existing file is truncated)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "wb") as handle:
            fd = -1
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    finally:
        if fd >= 0:
            os.close(fd)
    return path


def replace_private(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` atomically: a 0600 temporary file beside it (``mkstemp``), flushed to disk,
    then ``os.replace``-d over it. On any error the temporary file is removed and the old file is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def set_aside(path: str | os.PathLike[str]) -> Path:
    """Move a file that cannot be read to ``NAME.corrupt`` beside it (replacing an older one), so that a fresh one
    can take its place while an operator can still read it; returns where it went (``OSError`` if it cannot)."""
    path = Path(path)
    aside = path.with_name(path.name + ".corrupt")
    os.replace(path, aside)
    return aside
