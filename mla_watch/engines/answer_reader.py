"""One engine answer on its way to the client: what the proxy asks of the engine, what the client gets, what is
counted.

The proxy (:mod:`mla_watch.server.proxy`) makes one :class:`AnswerReader` per request, of the engine's format
(:mod:`mla_watch.engines.reading` chooses it by the engine's name), and hands it bytes only: a whole answer to
:meth:`~AnswerReader.answer`, a stream's decoded reads to :meth:`~AnswerReader.feed`. What comes back is what the
client gets. Once the client has it, :meth:`~AnswerReader.finish` queues what is left to count, never waiting.
The reader never calls back into the server: it reads, strips, marks and counts on the way down.

Each format says what a stream's event carries (:meth:`AnswerReader.event`, its one abstract method); the rest
is shared: the client's prompt start taken out of the request, a whole answer stripped on the event loop or
read in a decoding process, mla_watch's object added to the first chunk, a stream cut into bounded lines.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mla_watch.common.describe import describe_value
from mla_watch.engines.count_queue import Capture, CountQueue
from mla_watch.engines.decoder import FILE_HANDOFF_BYTES, RoutingDecoder
from mla_watch.engines.formats import (
    PROMPT_START_FIELD,
    ROUTING_REQUEST_FIELD,
    SGLANG_START_FIELD,
    STRIP_ON_LOOP_BYTES,
    RoutingPlan,
    add_extra,
    strip_response,
)
from mla_watch.engines.replay import StreamReplayer
from mla_watch.engines.stream_lines import EventLines
from mla_watch.engines.watch import FOOTPRINT_TOKENS, EngineRouting

__all__ = [
    "START_FIELDS",
    "AnswerReader",
    "NotAnAnswer",
    "PlainReader",
    "ProxiedRequest",
    "ReadingParts",
    "RequestFieldError",
    "UnreadableAnswer",
]

START_FIELDS = (PROMPT_START_FIELD, SGLANG_START_FIELD)  # vLLM's and SGLang's spelling of one idea


class RequestFieldError(ValueError):
    """A field of the client's request that the engine's reader cannot take; ``param`` names it."""

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class NotAnAnswer(ValueError):
    """The engine's answer is no JSON object; ``size``: its bytes."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes that are no JSON object")
        self.size = size


class UnreadableAnswer(RuntimeError):
    """Nothing is left of the answer to relay (the decoding process died holding it); the message says why."""


@dataclass
class ProxiedRequest:
    """One request the proxy forwards, as its reader needs it."""

    payload: dict[str, Any]  # what the engine is sent: the reader takes fields out and asks for its own
    body: dict[str, Any]  # what the client sent: the fields it asked for itself
    kind: str  # "chat" or "completion"
    stream: bool
    model: str | None
    extra: dict[str, Any]  # mla_watch's object, added to the answer (or to a stream's first chunk)
    business_line: str
    client: str | None = None  # who sent it (mla_watch.routing.clients)
    headers: dict[str, str] = field(default_factory=dict)  # the request's headers to the engine (a replay's too)


@dataclass
class ReadingParts:
    """What the readers of one engine's answers share: the bounds, the decoding processes, and, where its routing
    is read, its routers' windows, the count queue, the stream replayer and the capture."""

    decoder: RoutingDecoder
    max_bytes: int  # an answer (and a line that carries routing)
    max_line_bytes: int  # a stream's line without routing
    routing: EngineRouting | None = None
    counter: CountQueue | None = None
    replayer: StreamReplayer | None = None
    capture: Capture | None = None  # serve --capture: where the token ids of answers go
    capturing: set[asyncio.Task[None]] = field(default_factory=set)  # captures still being written

    def capture_later(self, business_line: str, samples: list[tuple[list[int], int]], client: str | None) -> None:
        """Capture ``samples`` in a thread, without waiting (a stream's end: the client may have gone)."""
        assert self.capture is not None
        task = asyncio.ensure_future(asyncio.to_thread(self.capture, business_line, samples, client))
        self.capturing.add(task)  # held until done: a task nobody holds may be collected
        task.add_done_callback(self.capturing.discard)

    async def close(self) -> None:
        if self.capturing:
            await asyncio.gather(*self.capturing, return_exceptions=True)
        if self.replayer is not None:
            await self.replayer.close()
        if self.counter is not None:
            await self.counter.close()


class AnswerReader(abc.ABC):
    """The reader of one answer in an engine's format (see the module docstring). Subclasses set ``engine``, the
    name ``serve --engine`` gives the format, and ``owners``, the ``owned_by`` of ``/v1/models`` that says an
    engine answers in it (``--engine auto``)."""

    engine: ClassVar[str]
    owners: ClassVar[tuple[str, ...]] = ()
    reads_routing: ClassVar[bool] = True  # False: only mla_watch's object is added

    def __init__(self, request: ProxiedRequest, parts: ReadingParts) -> None:
        """Takes the client's prompt start out of the request (the proxy counts every row): raises
        :class:`RequestFieldError` where it is not one."""
        self.request = request
        self.parts = parts
        prompt_start = _prompt_start(request.payload)
        self.plan = self._plan(prompt_start)
        self.first = True  # no chunk has carried mla_watch's object yet
        self.counted = False  # a stream's routing was counted (or queued to be) from one of its chunks
        self.line_ended = False  # the last feed ended a line: the next has the whole line timeout
        self._lines = EventLines(parts.max_line_bytes, routing_limit=parts.max_bytes)
        self._unstreamed: bytes | None = None  # an answer whose routing is still to count

    def _plan(self, prompt_start: int) -> RoutingPlan:
        routing = self.parts.routing
        assert routing is not None  # a reader of routing is made only where it is read
        body = self.request.body
        # A client that sets vLLM's prompt start wants routing: it gets the rows it asked for.
        keep = body.get(ROUTING_REQUEST_FIELD) is True or any(name in body for name in START_FIELDS)
        return RoutingPlan(
            self.engine,
            routing.geometry,
            keep=keep,
            extra=self.request.extra,
            prompt_start=prompt_start,
            position_edges=routing.position_edges,
            footprint_tokens=FOOTPRINT_TOKENS,
        )

    # ------------------------------------------------------------------ a whole answer
    async def answer(self, content: bytes) -> bytes:
        """What the client gets of a whole answer: its routing cut out (unless the client asked for it) and
        mla_watch's object added. Raises :class:`NotAnAnswer` or :class:`UnreadableAnswer`."""
        plan = self.plan
        if not self.reads_routing and len(content) < STRIP_ON_LOOP_BYTES:
            # No routing to read: checked and marked here, in ~0.1 ms; only a long answer goes to a decoding process.
            marked = add_extra(content, plan.extra)
            if marked is None:
                raise NotAnAnswer(len(content))
            return marked
        stripped = strip_response(plan, content)  # the routing's base64 cut out, not decoded: ~0.1 ms
        if stripped is not None:
            if self.reads_routing:
                self._unstreamed = content  # counted once the client has the answer (finish)
            return stripped
        # Kept routing, lists, a long answer: the decoding process reads it whole and counts it on the way.
        decoded = await self.parts.decoder.response(plan, content)
        del content  # the caller handed it over: the megabytes go as soon as they are read
        if decoded.not_json:
            raise NotAnAnswer(len(decoded.body or b""))
        request, parts = self.request, self.parts
        if self.reads_routing:
            parts.routing.count(  # type: ignore[union-attr]
                request.business_line,
                decoded,
                streamed=False,
                client=request.client,
            )
        if decoded.samples and parts.capture is not None:
            await asyncio.to_thread(parts.capture, request.business_line, decoded.samples, request.client)
        if decoded.body is None:  # the decoding process died holding it: nothing is left to relay
            raise UnreadableAnswer(str(decoded.error))
        return decoded.body

    @property
    def pending(self) -> bool:
        """Whether :meth:`finish` has anything to do for a whole answer."""
        return self._unstreamed is not None

    # ------------------------------------------------------------------ a stream
    async def feed(self, data: bytes) -> bytes:
        """What the client gets of one decoded read of a stream (``b""``: nothing yet). Raises
        :class:`~mla_watch.engines.stream_lines.AnswerTooLarge` for a line over its bound."""
        lines = self._lines.feed(data)
        self.line_ended = bool(lines)
        return await self._relay(lines) if lines else b""

    async def end(self) -> bytes:
        """What the client gets of the stream's last line, where it had no line end."""
        rest = self._lines.finish()
        return await self._relay(rest) if rest else b""

    async def _relay(self, lines: list[bytes]) -> bytes:
        relayed = []
        for line in lines:
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                out = await self.event(line, line[5:])
                if out is not None:
                    relayed.append(out)
            else:
                relayed.append(line)
        # The lines of one read in one write: a write per line costs the client's latency.
        return b"\n".join(relayed) + b"\n" if relayed else b""

    @abc.abstractmethod
    async def event(self, line: bytes, data: bytes) -> bytes | None:
        """What the client gets of one event's ``line`` (``data``: its JSON, after ``data:``); ``None``: nothing."""

    async def mark_first(self, line: bytes, data: bytes) -> bytes:
        """``line`` with mla_watch's object added, where no chunk has carried it yet and this one is a JSON object."""
        if not self.first:
            return line
        if len(line) >= FILE_HANDOFF_BYTES:  # parsing megabytes would hold the event loop
            decoded = await self.parts.decoder.chunk(
                RoutingPlan("none", None, keep=True, extra=self.plan.extra), data, first=True
            )
            if decoded.not_json or decoded.body is None:
                return line
            self.first = False
            return b"data: " + decoded.body
        marked = add_extra(data, self.plan.extra)
        if marked is None:  # not a JSON object: relayed as it came, the next chunk carries the object
            return line
        self.first = False
        return b"data: " + marked

    # ------------------------------------------------------------------ after the client has it
    def finish(self) -> None:
        """Queue what is left to count, once the client has the answer, or the stream has ended (or the client
        left: then it runs cancelled, so it never waits)."""
        if not self.reads_routing:
            return
        if self.request.stream:
            self.stream_ended()
        elif self._unstreamed is not None:
            content, self._unstreamed = self._unstreamed, None
            request = self.request
            self.parts.counter.submit(  # type: ignore[union-attr]
                request.business_line,
                self.plan,
                content,
                streamed=False,
                client=request.client,
            )

    def stream_ended(self) -> None:
        """What a stream leaves to count once it has ended: one whose chunks carried no routing counts as an answer
        without any."""
        if not self.counted:
            self.parts.routing.count(self.request.business_line, None, streamed=True)  # type: ignore[union-attr]


class PlainReader(AnswerReader):
    """An answer whose routing is not read (no ``--engine``, or an engine not yet known): mla_watch's object
    added, nothing counted."""

    engine = "none"
    reads_routing = False

    def _plan(self, prompt_start: int) -> RoutingPlan:
        return RoutingPlan(self.engine, None, keep=True, extra=self.request.extra)

    async def event(self, line: bytes, data: bytes) -> bytes | None:
        return line if not self.first else await self.mark_first(line, data)


def _prompt_start(payload: dict[str, Any]) -> int:
    """The client's prompt start (either engine's field), taken out of what the engine is sent."""
    given = {name: payload.pop(name) for name in START_FIELDS if name in payload}
    for name, value in given.items():
        if type(value) is not int or value < 0:
            raise RequestFieldError(
                f"{name}={describe_value(value, 40)} is invalid: expected an integer >= 0 "
                "(prompt tokens left out of the routing returned)",
                param=name,
                code="invalid_value",
            )
    if len(set(given.values())) > 1:
        raise RequestFieldError(
            f"{PROMPT_START_FIELD} and {SGLANG_START_FIELD} disagree; send one",
            param=SGLANG_START_FIELD,
            code="conflict",
        )
    return next(iter(given.values()), 0)
