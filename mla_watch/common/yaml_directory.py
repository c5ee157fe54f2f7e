"""Reading a directory of YAML files (rules, policies, reference prompts) with every file's errors collected.

Each format keeps its own validation (a function that reads one file or raises its
:class:`~mla_watch.common.directory_store.SettingsError`); walking the directory, refusing a missing or
empty one and gathering each file's problems is done here, once. A caller adds the problems it finds
across files and raises when there are any, so a :class:`~mla_watch.common.directory_store.DirectoryStore`
keeps the last good set in force.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from mla_watch.common.directory_store import config_files
from mla_watch.common.setting_errors import SettingsError

__all__ = ["DirectoryRead", "read_yaml_directory"]

T = TypeVar("T")


@dataclass
class DirectoryRead(Generic[T]):
    """What each file that loaded became (``loaded``, as ``(file, value)`` in file-name order) and every
    problem of the files that did not (``errors``, one complete message each)."""

    loaded: list[tuple[Path, T]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def read_yaml_directory(
    directory: Path,
    read_file: Callable[[Path], T],
    error: Callable[[list[str]], SettingsError],
    *,
    kind: str,
    at_least: str,
) -> DirectoryRead[T]:
    """Read each ``*.yaml`` / ``*.yml`` file of ``directory`` (hidden files skipped) with ``read_file``.

    A missing, unreadable or empty directory raises ``error`` at once (``kind`` names its files, e.g.
    ``"rule"``; ``at_least`` the smallest directory, e.g. ``"one, e.g. routing.yaml"``); a file's own
    :class:`SettingsError` is collected and the next file read.
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise error([f"{directory}: the {kind} directory {what}: expected a directory of *.yaml {kind} files"])
    try:
        files = config_files(directory)
    except OSError as exc:
        raise error(
            [
                f"{directory}: cannot list the directory ({exc.strerror or exc}): "
                f"expected a readable directory of *.yaml {kind} files"
            ]
        ) from None
    if not files:
        raise error([f"{directory}: no {kind} files (*.yaml, *.yml): expected at least {at_least}"])
    result: DirectoryRead[T] = DirectoryRead()
    for file in files:
        try:
            result.loaded.append((file, read_file(file)))
        except SettingsError as exc:
            result.errors.extend(exc.errors)
    return result
