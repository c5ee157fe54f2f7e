"""vLLM's answers read on their way to the client: routing cut out of whole answers, a stream's counted by replay.

vLLM returns routing in every whole answer (``--enable-return-routed-experts``, no per-request switch). A
stream carries none, unless its last chunk does (vLLM's RFC #56745): a stream without routing is replayed
once it has ended (:mod:`mla_watch.engines.replay`), from the token ids the proxy asked for
(``return_token_ids``, taken out of what the client receives unless it asked for them itself). With
``serve --capture`` whole answers are asked for their token ids too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from mla_watch.engines.answer_reader import AnswerReader, ProxiedRequest, ReadingParts
from mla_watch.engines.decoder import DecoderDied
from mla_watch.engines.formats import (
    DROP_CHUNK,
    STRIP_ON_LOOP_BYTES,
    DataError,
    Decoded,
    RoutingPlan,
    routing_strings,
    strip_routing,
)
from mla_watch.engines.replay import TOKEN_IDS_FIELD, StreamTokens, read_chunk, read_chunk_apart
from mla_watch.engines.stream_lines import ROUTING_KEY

__all__ = ["VllmReader", "stream_answer"]


@dataclass
class _StreamReplay:
    """A stream to count by replay: its token ids as they pass (``None``: sampled out)."""

    tokens: StreamTokens | None
    model: str | None
    replay: bool = True  # False: its ids are read for the capture only (sampled out of replays)


@dataclass
class _CarriedRouting:
    """The routing a stream's own chunks carried (base64, undecoded): counted together once the stream has ended,
    so that the prompt rows each choice repeats are counted once, as in a whole answer."""

    strings: list[bytes] = field(default_factory=list)
    size: int = 0  # past the answer's bound: nothing of the stream is counted
    prompt_tokens: int | None = None  # usage.prompt_tokens of a chunk that carried routing


class VllmReader(AnswerReader):
    """One answer of vLLM (or of an mla_watch sidecar serving with ``--return-routed-experts``)."""

    engine = "vllm"
    owners = ("vllm", "mla_watch")

    def __init__(self, request: ProxiedRequest, parts: ReadingParts) -> None:
        super().__init__(request, parts)
        self.replay = self._stream_tokens() if request.stream else None
        self.carried = _CarriedRouting()
        if parts.capture is not None and not request.stream:  # serve --capture: the answer's token ids
            self.plan = replace(
                self.plan, token_ids=request.kind, strip_token_ids=request.body.get(TOKEN_IDS_FIELD) is not True
            )
            request.payload[TOKEN_IDS_FIELD] = True

    def _stream_tokens(self) -> _StreamReplay | None:
        """For a stream to be replayed or captured: ask for its token ids, and what will read them."""
        parts, request = self.parts, self.request
        if parts.replayer is None and parts.capture is None:
            return None
        sampled = parts.replayer is not None and parts.replayer.sampled()
        if not sampled and parts.capture is None:  # counted as sampled out once the stream has ended
            return _StreamReplay(None, request.model, replay=False)
        client_asked = request.body.get(TOKEN_IDS_FIELD) is True
        request.payload[TOKEN_IDS_FIELD] = True
        return _StreamReplay(StreamTokens(request.kind, strip=not client_asked), request.model, replay=sampled)

    async def event(self, line: bytes, data: bytes) -> bytes | None:
        if ROUTING_KEY in data:
            carried = await self._routing_chunk(data)
            if carried is None:
                return None
            data = carried
            line = b"data: " + data
        tokens = self.replay.tokens if self.replay is not None else None
        if tokens is None:
            return line if not self.first else await self.mark_first(line, data)
        extra = self.plan.extra if self.first else None
        if len(data) < STRIP_ON_LOOP_BYTES:
            body = read_chunk(tokens, data, extra)
        else:  # a long prompt's ids: parsed in a decoding process, not on the event loop
            try:
                body, part = await self.parts.decoder.offload(
                    read_chunk_apart, bytes(data), tokens.kind, tokens.strip, extra
                )
            except DecoderDied:
                tokens.unreadable = "the process reading a chunk of it died"
                return line
            tokens.merge(part)
        if body == DROP_CHUNK:
            return None
        if body is not None and extra is not None:
            self.first = False
        return line if body is None else b"data: " + body

    async def _routing_chunk(self, data: bytes) -> bytes | None:
        """A chunk whose choice carries its routing (the terminal chunk of the stream that vLLM's RFC #56745
        proposes; ``GenerateResponseStreamChoice.routed_experts``): the strings are held to be counted once the
        stream has ended, and the chunk goes on without them (with them, trimmed to its prompt start, where the
        client asked). ``None``: nothing is left of it to relay."""
        plan, carried, bound = self.plan, self.carried, self.parts.max_bytes
        strings = routing_strings(data)
        held = carried.size + sum(map(len, strings))
        if held > bound:  # bounded as one answer is: past it, nothing of this stream is counted
            carried.strings.clear()
            carried.size = bound + 1
        else:
            carried.strings += strings
            carried.size = held
        if plan.keep and not plan.prompt_start:
            return data
        stripped = None if plan.keep else strip_routing(plan, data)
        if stripped is None:  # kept and trimmed, lists, or a long chunk: the decoding process, off the event loop
            decoded = await self.parts.decoder.chunk(replace(plan, extra=None), data, first=False)
            if decoded.not_json:
                return data
            stripped = decoded.body
        if (
            stripped is not None
            and carried.prompt_tokens is None
            and b'"prompt_tokens"' in stripped
            and len(stripped) < STRIP_ON_LOOP_BYTES
        ):
            carried.prompt_tokens = _prompt_tokens(stripped)
        return stripped

    def stream_ended(self) -> None:
        parts, request, replay = self.parts, self.request, self.replay
        routing = parts.routing
        assert routing is not None  # a reader of routing is made only where it is read
        if replay is not None and replay.tokens is not None and parts.capture is not None:
            samples = replay.tokens.samples()
            if samples:
                parts.capture_later(request.business_line, samples, request.client)
        if self.carried.size and parts.counter is not None:  # the stream carried its routing: no replay
            self._count_carried()
        elif replay is None:
            routing.count(request.business_line, None, streamed=True)
        elif replay.tokens is None or not replay.replay:
            if parts.replayer is not None:
                parts.replayer.skipped(request.business_line, "sampled_out")
            else:
                routing.count(request.business_line, None, streamed=True)
        else:
            parts.replayer.after_stream(  # type: ignore[union-attr]
                request.business_line,
                self.plan,
                replay.model,
                request.headers,
                replay.tokens,
                client=request.client,
            )

    def _count_carried(self) -> None:
        """What the stream's chunks carried, counted as a whole answer's choices are."""
        parts, request, carried = self.parts, self.request, self.carried
        if carried.size > parts.max_bytes:
            too_much = DataError(
                "decoder", f"the routing a stream carried exceeds {parts.max_bytes} bytes (--upstream-max-bytes)"
            )
            parts.routing.count(  # type: ignore[union-attr]
                request.business_line,
                Decoded(None, error=too_much),
                streamed=True,
                client=request.client,
            )
            return
        prompt = carried.prompt_tokens
        tokens = self.replay.tokens if self.replay is not None else None
        if prompt is None and tokens is not None:
            prompt = tokens.prompt_length()
        plan = RoutingPlan(self.engine, self.plan.geometry, keep=False)
        parts.counter.submit(  # type: ignore[union-attr]
            request.business_line,
            plan,
            stream_answer(carried.strings, prompt),
            streamed=True,
            client=request.client,
        )


def stream_answer(strings: list[bytes], prompt_tokens: int | None) -> bytes:
    """The whole answer a stream's routing makes: one choice per string (base64, as the chunks carried it), and the
    prompt's length where known. Written as bytes: the megabytes of base64 are not decoded to be encoded again."""
    choices = b",".join(b'{"routed_experts":"' + text + b'"}' for text in strings)
    usage = b"" if prompt_tokens is None else b',"usage":{"prompt_tokens":' + str(prompt_tokens).encode() + b"}"
    return b'{"choices":[' + choices + b"]" + usage + b"}"


def _prompt_tokens(chunk: bytes) -> int | None:
    """A chunk's ``usage.prompt_tokens`` (``None`` where it is no JSON object or does not say)."""
    try:
        document = json.loads(chunk)
    except (ValueError, RecursionError):
        return None
    usage = document.get("usage") if isinstance(document, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return tokens if type(tokens) is int and tokens >= 0 else None
