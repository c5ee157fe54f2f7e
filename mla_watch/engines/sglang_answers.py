"""SGLang's answers read on their way to the client: routing asked for, cut out, counted after.

SGLang returns routing only to a request that asks (``return_routed_experts: true``), which the proxy
does for every request; a client that did not ask gets it cut out. A stream carries it in one chunk of
its own after the last token (``choices: []``), which is counted and, unless the client asked, dropped.
"""

from __future__ import annotations

from mla_watch.engines.answer_reader import AnswerReader, ProxiedRequest, ReadingParts
from mla_watch.engines.formats import DROP_CHUNK, ROUTING_REQUEST_FIELD, strip_chunk
from mla_watch.engines.stream_lines import ROUTING_KEY

__all__ = ["SglangReader"]


class SglangReader(AnswerReader):
    """One answer of SGLang."""

    engine = "sglang"
    owners = ("sglang",)

    def __init__(self, request: ProxiedRequest, parts: ReadingParts) -> None:
        super().__init__(request, parts)
        request.payload[ROUTING_REQUEST_FIELD] = True  # SGLang returns routing only to requests that ask

    async def event(self, line: bytes, data: bytes) -> bytes | None:
        if ROUTING_KEY in data:
            return await self._routing_chunk(data)
        return line if not self.first else await self.mark_first(line, data)

    async def _routing_chunk(self, data: bytes) -> bytes | None:
        """The chunk with the stream's routing: cut out here, counted after (kept, where the client asked)."""
        plan, parts, request = self.plan, self.parts, self.request
        stripped = strip_chunk(plan, data, first=self.first)
        if stripped is None:  # kept routing, or too long a chunk: the decoding process reads it, on the way
            decoded = await parts.decoder.chunk(plan, data, first=self.first)
            if decoded.found and parts.routing is not None:
                parts.routing.count(request.business_line, decoded, streamed=True, client=request.client)
                self.counted = True
            self.first = False
            return None if decoded.body is None else b"data: " + decoded.body
        if parts.counter is not None:
            parts.counter.submit(request.business_line, plan, bytes(data), streamed=True, client=request.client)
            self.counted = True
        if stripped == DROP_CHUNK:
            return None
        self.first = False
        return b"data: " + stripped
