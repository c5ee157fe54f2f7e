"""What a long command shows while it runs, and the libraries' own progress output kept out of it.

:class:`Progress` writes to stderr, so that what a command prints on stdout (a table, JSON) stays
whole: a line per phase ("loading the model"), then a bar with the time left while the work runs
on a terminal (rich), or, on a pipe, a plain line at each tenth of the work (at most one every
:data:`LINE_SECONDS`) and one at the end.
:func:`quiet_progress_bars` keeps transformers' and huggingface_hub's bars ("Loading weights:
100%|...") out of the output while a block runs; warnings and errors still pass.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, TextIO, TypeVar

__all__ = ["Progress", "quiet_progress_bars"]

T = TypeVar("T")
STEPS_PIPED = 10  # a piped run says how far it is at each tenth of the work ...
LINE_SECONDS = 2.0  # ... this long after its last line at least, and when it is done


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No transformers / huggingface_hub progress bar while the block runs.

    Both libraries keep the setting in a module global; it is put back as it was afterwards, so that
    a program that loads a model through mla_watch keeps its own progress bars as it had them.
    """
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    transformers_on = hf_logging.is_progress_bar_enabled()
    hub_off = hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # and huggingface_hub's
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()
        if hub_off:
            hub.disable_progress_bars()
        elif hub.are_progress_bars_disabled():
            hub.enable_progress_bars()


def _seconds(value: float) -> str:
    value = max(0.0, value)
    if value < 60:
        return f"{value:.0f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes} min {seconds:02d} s"


class Progress:
    """A command's phases and the progress of its long loops, on ``stream`` (stderr by default).

    ``live``: a rich bar (default: when ``stream`` is a terminal); otherwise plain lines, each
    starting with ``prog``.
    """

    def __init__(
        self,
        prog: str,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prog = prog
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)()) if live is None else live
        self.clock = clock

    def say(self, message: str) -> None:
        """One line that stays: a phase that starts, or what a phase found."""
        print(f"{self.prog}: {message}", file=self.stream, flush=True)

    def track(self, items: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
        """``items``, one at a time, with the progress shown; ``what`` names one item in the plural ("samples")."""
        count = total if total is not None else len(items) if isinstance(items, Sized) else 0
        if self.live:
            yield from self._bar(items, what, count)
            return
        started = last = self.clock()
        shown = 0
        done = 0
        for item in items:
            yield item
            done += 1
            now = self.clock()
            if count and done < count and done * STEPS_PIPED // count > shown and now - last >= LINE_SECONDS:
                shown, last = done * STEPS_PIPED // count, now
                elapsed = now - started
                self.say(
                    f"{done}/{count} {what} ({100 * done // count}%), {_seconds(elapsed)}, about "
                    f"{_seconds(elapsed / done * (count - done))} left"
                )
        self.say(f"{done} {what} in {_seconds(self.clock() - started)}")

    def _bar(self, items: Iterable[T], what: str, count: int) -> Iterator[T]:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        columns: list[Any] = [
            TextColumn(f"{self.prog}: {what}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
        ]
        with Bar(*columns, console=Console(file=self.stream), transient=True) as bar:
            task = bar.add_task(what, total=count or None)
            started = self.clock()
            done = 0
            for item in items:
                yield item
                done += 1
                bar.advance(task)
        self.say(f"{done} {what} in {_seconds(self.clock() - started)}")
