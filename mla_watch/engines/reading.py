"""How the proxy reads the answers of the engine behind it: the reader of each engine's format, chosen by name.

``serve --engine NAME`` names the format (a key of :data:`ANSWER_FORMATS`); ``auto`` finds it from the
``owned_by`` of the engine's ``/v1/models`` (:data:`ENGINE_OWNERS`), asked by the proxy on the first
request; ``none`` reads no routing. :class:`EngineReading` holds what every answer's reader shares (the
decoding processes, the count queue, the stream replayer, the capture) and makes one
:class:`~mla_watch.engines.answer_reader.AnswerReader` per request.
"""

from __future__ import annotations

from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.engines.answer_reader import AnswerReader, PlainReader, ProxiedRequest, ReadingParts
from mla_watch.engines.count_queue import COUNT_QUEUE_BYTES, Capture, CountQueue
from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.replay import ReplayBudget, Send, StreamReplayer
from mla_watch.engines.sglang_answers import SglangReader
from mla_watch.engines.vllm_answers import VllmReader
from mla_watch.engines.watch import EngineRouting

__all__ = ["ANSWER_FORMATS", "AUTO", "ENGINE_CHOICES", "ENGINE_OWNERS", "NO_ENGINE", "EngineReading", "reads_routing"]

# The engines' formats, by the name `serve --engine` gives them.
ANSWER_FORMATS: dict[str, type[AnswerReader]] = {cls.engine: cls for cls in (VllmReader, SglangReader)}
NO_ENGINE = PlainReader.engine  # no routing read: only mla_watch's object is added
AUTO = "auto"  # the format of the engine that owns the upstream's first model
ENGINE_CHOICES = (NO_ENGINE, *ANSWER_FORMATS, AUTO)
# `auto`: the format, by the `owned_by` of the upstream's /v1/models (an mla_watch sidecar serving with
# --return-routed-experts speaks vLLM's fields).
ENGINE_OWNERS = {owner: cls.engine for cls in ANSWER_FORMATS.values() for owner in cls.owners}


def reads_routing(engine: str) -> bool:
    """Whether ``serve --engine engine`` reads the engine's routing (any format, or ``auto``)."""
    return engine != NO_ENGINE


class EngineReading:
    """The readers of one engine's answers, and what they share (see the module docstring).

    ``routing``: the engine's routers' windows, where its routing is read (its ``engine`` names the format, or
    ``auto``); ``send_replay`` sends a stream's replay (the proxy's bounded exchange), ``replay`` bounds what
    replays cost; ``capture``: where the token ids of its answers go (``serve --capture``).
    """

    def __init__(
        self,
        decoder: RoutingDecoder,
        *,
        max_bytes: int,
        max_line_bytes: int,
        routing: EngineRouting | None = None,
        send_replay: Send | None = None,
        replay: ReplayBudget | None = None,
        count_queue_bytes: int = COUNT_QUEUE_BYTES,
        capture: Capture | None = None,
    ) -> None:
        self.parts = ReadingParts(decoder, max_bytes=max_bytes, max_line_bytes=max_line_bytes)
        self.format: type[AnswerReader] | None = PlainReader  # None: not known yet (auto)
        if routing is not None:
            if routing.engine != AUTO and routing.engine not in ANSWER_FORMATS:
                raise SettingsError(
                    [SettingProblem("engine", repr(routing.engine), f"one of {', '.join(ENGINE_CHOICES)}")]
                )
            # Routing is counted after the client has its answer; a vLLM stream's, by replaying it.
            counter = CountQueue(routing, decoder, max_bytes=count_queue_bytes, capture=capture)
            self.parts.routing, self.parts.counter, self.parts.capture = routing, counter, capture
            if replay is not None and send_replay is not None:
                self.parts.replayer = StreamReplayer(send_replay, counter, replay)
            self.format = ANSWER_FORMATS.get(routing.engine)

    @property
    def undetermined(self) -> bool:
        """Whether the format is still to be found (``--engine auto``, before the engine has said what it is)."""
        return self.format is None

    def found(self, owner: object) -> str | None:
        """The format of an engine whose models are ``owned_by`` ``owner``, read from now on; ``None`` where no
        format is known by that owner: then no routing is read (an unknown engine stays unknown)."""
        engine = ENGINE_OWNERS.get(owner) if isinstance(owner, str) else None
        if engine is None:
            self.format = PlainReader
            return None
        self.format = ANSWER_FORMATS[engine]
        self.parts.routing.engine = engine  # type: ignore[union-attr]  # undetermined only where routing is read
        return engine

    def reader(self, request: ProxiedRequest) -> AnswerReader:
        """The reader of one answer, the request made ready for it (the fields its engine needs asked for; the
        client's prompt start taken out: :class:`~mla_watch.engines.answer_reader.RequestFieldError` where it is
        not one). Before the format is found, answers are only marked."""
        return (self.format or PlainReader)(request, self.parts)

    async def close(self) -> None:
        """Wait for the captures being written; count what is queued, for a moment; stop replaying."""
        await self.parts.close()
