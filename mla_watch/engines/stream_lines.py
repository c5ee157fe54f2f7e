"""An engine's server-sent-event stream cut into lines within bounds: a line of its own limit, one with routing
within the answer's.

Lines end at CR, LF or CRLF only (the SSE specification): text that is legal inside JSON, U+2028 or
U+0085, never splits a line. An engine names a chunk's routing before its megabytes (after the chunk's
ids and text), so a line may grow past the line limit, up to an answer's, only where ``"routed_experts"``
is within its first :data:`ROUTING_KEY_WINDOW` bytes.
"""

from __future__ import annotations

import re

__all__ = ["ROUTING_KEY", "ROUTING_KEY_WINDOW", "AnswerTooLarge", "EventLines"]

_EOL = re.compile(rb"\r\n?|\n")
ROUTING_KEY = b'"routed_experts"'
ROUTING_KEY_WINDOW = 64 << 10  # engines name it before the megabytes: after a chunk's ids and text


class AnswerTooLarge(Exception):
    """More than ``limit`` bytes (decompressed) in one answer or one stream line."""

    def __init__(self, limit: int, what: str) -> None:
        super().__init__(f"{what} is larger than {limit} bytes")
        self.limit = limit
        self.what = what


class EventLines:
    """Splits a stream's decoded bytes into lines at CR, LF or CRLF, none longer than ``limit`` bytes; one that
    names routing (``"routed_experts"`` within its first :data:`ROUTING_KEY_WINDOW` bytes) within ``routing_limit``."""

    def __init__(self, limit: int, *, routing_limit: int | None = None) -> None:
        self.limit = limit
        self.routing_limit = max(limit, routing_limit or limit)
        self._buffer = bytearray()
        self._scanned = 0  # no line end before this offset of the buffer: a long line is scanned once

    def feed(self, data: bytes) -> list[bytes]:
        if not self._buffer and data.endswith(b"\n") and len(data) <= self.limit:
            return data.splitlines()  # whole lines, as a stream's reads mostly are; none can be over the limit
        self._buffer += data
        lines, start = [], 0
        while (end := _EOL.search(self._buffer, max(start, self._scanned))) is not None:
            if end.group() == b"\r" and end.end() == len(self._buffer):
                break  # a CR last: its LF may be in the next read
            self._bound(start, end.start())  # a line that ends within this read is bounded too
            lines.append(bytes(memoryview(self._buffer)[start : end.start()]))  # one copy, not two
            start = end.end()
        del self._buffer[:start]
        self._scanned = max(0, len(self._buffer) - 1)
        self._bound(0, len(self._buffer))
        return lines

    def _bound(self, start: int, end: int) -> None:
        """Raises :class:`AnswerTooLarge` if the buffer's ``[start, end)``, one line, is over its limit."""
        if end - start <= self.limit:
            return
        if self._buffer.find(ROUTING_KEY, start, min(end, start + ROUTING_KEY_WINDOW)) < 0:
            raise AnswerTooLarge(self.limit, "a line of the stream")
        if end - start > self.routing_limit:
            raise AnswerTooLarge(self.routing_limit, "a line with routing of the stream")

    def finish(self) -> list[bytes]:
        """What is left when the stream ends: a last line without its line end."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        return [rest.rstrip(b"\r")] if rest else []
