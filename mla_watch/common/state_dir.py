"""The state directory holds tokenized customer traffic: owner-only directories (0700) and files (0600).

:func:`ensure_private_dir` creates a directory (and its missing parents) and makes it 0700,
tightening one that exists with a looser mode; :func:`ensure_private_file` does the same for a
file (0600), creating it empty when it does not exist. Files are written by
:func:`mla_watch.common.output_file.write_file` (``private=True``: 0600 from the first byte, replaced
atomically). :func:`set_aside` moves a file that cannot be read out of the way (``NAME.corrupt``), for an operator.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = [
    "DATASETS_DIR_NAME",
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "ensure_private_dir",
    "ensure_private_file",
    "set_aside",
]

log = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
DATASETS_DIR_NAME = "datasets"  # the re-tune datasets' directory inside the state directory (unless --dataset-dir)


def _tighten(path: Path, mode: int, what: str) -> None:
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & stat.S_ISVTX or path.resolve() == Path(path.resolve().anchor):  # /tmp or /: shared, never ours
        log.warning(
            "%s %s is shared (mode %o): expected a private %s of its own; leaving its mode alone",
            what,
            path,
            current,
            what,
        )
        return
    if current & ~mode:
        try:
            os.chmod(path, current & mode)
        except OSError as error:  # not ours (another user's directory): say so, and go on
            log.warning(
                "%s %s has mode %o, expected %o (owner only); cannot change it: [Errno %s] %s",
                what,
                path,
                current,
                mode,
                error.errno,
                error.strerror,
            )
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


def set_aside(path: str | os.PathLike[str]) -> Path:
    """Move a file that cannot be read to ``NAME.corrupt`` beside it (replacing an older one), so that a fresh one
    can take its place while an operator can still read it; returns where it went (``OSError`` if it cannot)."""
    path = Path(path)
    aside = path.with_name(path.name + ".corrupt")
    os.replace(path, aside)
    return aside
