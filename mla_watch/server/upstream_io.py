"""Reading an engine's answers within bounds: decompressed size and time.

An engine (or whatever answers at its address) decides how large its answers are. Nothing
it sends is held past ``limit`` bytes after decompression: inflating a read whole (as httpx's
decoders do) turns 1 MB of gzip into 1 GB in one call, so the proxy's client hands on the raw
bytes and they are inflated here, a bounded piece at a time. A stream's lines are cut, within
their own bounds, by what reads the engine's answer (:mod:`mla_watch.engines.stream_lines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import zlib
from collections.abc import Awaitable
from typing import TypeVar

# AnswerTooLarge: the inflater's bound is a stream line's too. EventLines, ROUTING_KEY and ROUTING_KEY_WINDOW moved to
# mla_watch.engines.stream_lines (a line's bound depends on the engine's format): re-exported until the next release.
from mla_watch.engines.stream_lines import ROUTING_KEY, ROUTING_KEY_WINDOW, AnswerTooLarge, EventLines
from mla_watch.server.http import by_deadline

__all__ = [
    "ROUTING_KEY",
    "ROUTING_KEY_WINDOW",
    "SUPPORTED_ENCODINGS",
    "AnswerTooLarge",
    "BoundedInflater",
    "EventLines",
    "LineDeadline",
    "UnsupportedEncoding",
]

T = TypeVar("T")

SUPPORTED_ENCODINGS = ("identity", "gzip", "deflate")
_PIECE_BYTES = 1 << 20


class UnsupportedEncoding(Exception):
    """A ``Content-Encoding`` other than :data:`SUPPORTED_ENCODINGS`."""


class BoundedInflater:
    """Turns an answer's raw bytes (``Content-Encoding`` as sent) into at most ``limit`` decoded bytes in all,
    or, for a stream relayed as it comes (``per_read``), at most ``limit`` from each read."""

    def __init__(
        self, content_encoding: str | None, limit: int, what: str = "the engine's answer", *, per_read: bool = False
    ) -> None:
        encoding = (content_encoding or "identity").strip().lower()
        if encoding not in SUPPORTED_ENCODINGS:
            raise UnsupportedEncoding(
                f"Content-Encoding {encoding[:40]!r}: expected one of "
                f"{', '.join(SUPPORTED_ENCODINGS)} (the sidecar asks for identity)"
            )
        # gzip: a gzip header; deflate: zlib's header as RFC 9110 says (raw deflate is told apart below).
        self._inflater = (
            None
            if encoding == "identity"
            else zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        )
        self._deflate = encoding == "deflate"
        self.limit = limit
        self.what = what
        self.per_read = per_read
        self.size = 0

    def feed(self, data: bytes) -> bytes:
        """The decoded bytes of ``data``; raises :class:`AnswerTooLarge` before holding more than ``limit``,
        :class:`zlib.error` for data that does not inflate."""
        if self.per_read:
            self.size = 0
        if self._inflater is None:
            return self._count(data)
        pieces: list[bytes] = []
        while data:
            # One byte past the limit tells "too large" from "exactly full"; pieces of at most 1 MiB keep
            # zlib's output buffers small whatever the cap.
            room = min(self.limit - self.size + 1, _PIECE_BYTES)
            try:
                piece = self._inflater.decompress(data, room)
            except zlib.error:
                if not (self._deflate and self.size == 0 and not pieces):
                    raise
                self._inflater, self._deflate = zlib.decompressobj(-zlib.MAX_WBITS), False  # raw deflate
                continue
            pieces.append(self._count(piece))
            data = self._inflater.unconsumed_tail
        return b"".join(pieces)

    def finish(self) -> bytes:
        return b"" if self._inflater is None else self._count(self._inflater.flush(self.limit - self.size + 1))

    def _count(self, piece: bytes) -> bytes:
        self.size += len(piece)
        if self.size > self.limit:
            raise AnswerTooLarge(self.limit, self.what)
        return piece


class LineDeadline:
    """How long each line of a stream may take, for the task that reads it: :meth:`read` raises
    :class:`asyncio.TimeoutError` once a line has taken ``seconds`` (:meth:`restart` when one ends).

    :func:`by_deadline` around every read would set and cancel a timer per read, and a stream is read
    a few hundred bytes at a time; this keeps one timer per stream, which a line's end merely moves
    (the timer, when it fires, looks at the deadline again). Only a read is ever cancelled: while the
    task relays what it read, the deadline may pass, and the next read raises at once.
    """

    def __init__(self, seconds: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.seconds = seconds
        self.deadline = self._loop.time() + seconds
        self._reading: asyncio.Task | None = None
        self._expired = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self.deadline, self._due)

    def restart(self) -> None:
        """A line has ended: the next one has ``seconds`` from now."""
        self.deadline = self._loop.time() + self.seconds
        if self._timer is None:
            self._timer = self._loop.call_at(self.deadline, self._due)

    async def read(self, awaitable: Awaitable[T]) -> T:
        if sys.version_info < (3, 11):  # no Task.uncancel() to tell this timeout from a cancellation
            return await by_deadline(self.deadline, awaitable)
        if self._loop.time() >= self.deadline:
            with contextlib.suppress(AttributeError):
                # never awaited: closed, without a warning (unused-ignore: checked as Python 3.10, mypy skips what
                # follows the return above)
                awaitable.close()  # type: ignore[attr-defined, unused-ignore]
            raise asyncio.TimeoutError
        task = asyncio.current_task()
        assert task is not None
        self._reading, cancelling = task, task.cancelling()
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._expired and task.uncancel() <= cancelling:  # this timeout's, not the task's own
                raise asyncio.TimeoutError from None
            raise
        finally:
            self._reading, self._expired = None, False

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if self._loop.time() < self.deadline:  # a line ended meanwhile
            self._timer = self._loop.call_at(self.deadline, self._due)
        elif self._reading is not None:
            self._expired = True
            self._reading.cancel()
