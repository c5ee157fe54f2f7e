"""Configuration directories: one reloading store for policies and alert rules alike.

A directory of ``*.yaml`` / ``*.yml`` files (dotfiles skipped) loads into one value - a
:class:`~mla_watch.policy.PolicySet`, a :class:`~mla_watch.alerting.vocabulary.RuleSet` - or fails
with a :class:`~mla_watch.common.setting_errors.SettingsError` (formerly ``ConfigError``) whose ``errors``
each name the file, the key, the value and what was expected. :class:`DirectoryStore` holds the value in
force; a reload that fails keeps it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from mla_watch.common.setting_errors import SettingsError

__all__ = ["CONFIG_SUFFIXES", "ConfigError", "DirectoryStore", "ReloadResult", "config_files"]

log = logging.getLogger(__name__)

CONFIG_SUFFIXES = (".yaml", ".yml")
T = TypeVar("T")


ConfigError = SettingsError
"""The former name of :class:`~mla_watch.common.setting_errors.SettingsError`, kept for one release."""


def config_files(directory: Path) -> list[Path]:
    """The configuration files of ``directory``: ``*.yaml`` / ``*.yml``, hidden files (editor droppings) skipped."""
    return sorted(
        p for p in directory.iterdir() if p.suffix in CONFIG_SUFFIXES and not p.name.startswith(".") and not p.is_dir()
    )


@dataclass(frozen=True)
class ReloadResult:
    """Outcome of one reload attempt."""

    ok: bool
    changed: bool
    errors: list[str]
    version: int

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "changed": self.changed, "errors": list(self.errors), "version": self.version}


_Fingerprint = tuple[tuple[str, int, int], ...]


def _fingerprint(directory: Path) -> _Fingerprint:
    try:
        files = config_files(directory)
    except OSError:
        return ()
    out = []
    for file in files:
        try:
            st = file.stat()
        except OSError:
            continue
        out.append((file.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


class DirectoryStore(Generic[T]):
    """Thread-safe holder of what a directory loads to, with reloads that never lose the last good value.

    ``load`` raises :class:`SettingsError` (at start-up that propagates). ``version`` starts at 1
    and increments on each successful reload that changed something. ``on_reload`` (optional) is
    called with the :class:`ReloadResult` of every attempt; its exceptions are logged, never raised.
    """

    def __init__(
        self,
        directory: Path,
        load: Callable[[Path], T],
        *,
        what: str,
        clock: Callable[[], float] = time.monotonic,
        on_reload: Callable[[ReloadResult], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.what = what
        self._load = load
        self._clock = clock
        self._on_reload = on_reload
        self._lock = threading.RLock()
        fingerprint = _fingerprint(self.directory)
        self._current = load(self.directory)
        self._fingerprint = fingerprint
        self._version = 1
        self._last_error: SettingsError | None = None
        self.loaded_at: float = clock()
        """Clock reading of the last successful load that changed the value."""
        self.checked_at: float = self.loaded_at
        """Clock reading of the last reload attempt."""

    @property
    def current(self) -> T:
        """The value in force."""
        return self._current

    @property
    def version(self) -> int:
        return self._version

    @property
    def last_error(self) -> SettingsError | None:
        """The error of the last reload attempt, or ``None`` if it succeeded."""
        return self._last_error

    def reload(self) -> ReloadResult:
        """Load the directory again; on failure keep the current value and record ``last_error``."""
        with self._lock:
            fingerprint = _fingerprint(self.directory)  # before reading: a later write shows up next check
            self._fingerprint = fingerprint
            self.checked_at = self._clock()
            try:
                new = self._load(self.directory)
            except SettingsError as exc:
                self._last_error = exc
                result = ReloadResult(ok=False, changed=False, errors=list(exc.errors), version=self._version)
                log.error(
                    "%s reload refused, version %d stays in force: %s", self.what, self._version, "; ".join(exc.errors)
                )
            else:
                self._last_error = None
                changed = new != self._current
                if changed:
                    self._current = new
                    self._version += 1
                    self.loaded_at = self.checked_at
                    log.info("%s reloaded from %s (version %d)", self.what, self.directory, self._version)
                result = ReloadResult(ok=True, changed=changed, errors=[], version=self._version)
        if self._on_reload is not None:
            try:
                self._on_reload(result)
            except Exception:
                log.exception("%s on_reload callback failed", self.what)
        return result

    def check_for_changes(self) -> ReloadResult | None:
        """Reload when the directory's (name, mtime_ns, size) list differs from the last attempt's.

        Returns ``None`` when nothing changed. A broken file is tried once, not on every
        check; the next edit triggers another attempt.
        """
        with self._lock:
            if _fingerprint(self.directory) == self._fingerprint:
                return None
            return self.reload()

    def watch(self, interval: float = 1.0) -> Callable[[], None]:
        """Call :meth:`check_for_changes` every ``interval`` seconds on a daemon thread.

        Returns a function that stops the thread and waits for it to end.
        """
        if interval <= 0:
            raise ValueError(f"interval = {interval!r}: expected a number of seconds > 0")
        stop_event = threading.Event()

        def run() -> None:
            while not stop_event.wait(interval):
                try:
                    self.check_for_changes()
                except Exception:  # never let the watcher die
                    log.exception("%s watcher: check failed", self.what)

        thread = threading.Thread(target=run, name=f"mla-watch-{self.what}:{self.directory}", daemon=True)
        thread.start()

        def stop() -> None:
            stop_event.set()
            if thread is not threading.current_thread():
                thread.join()

        return stop
