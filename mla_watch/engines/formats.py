"""Routing as vLLM and SGLang return it over HTTP: find it, decode it, count it, strip it (numpy, no torch).

Read from the engines' own source (the tests that pin each shape cite the files):

* **vLLM >= 0.22** (``--enable-return-routed-experts``, no per-request switch):
  ``choices[i].routed_experts`` is base64 of a ``.npy`` file (uint8 up to 256 experts, else
  uint16) of shape ``[prompt + generated - 1, num_hidden_layers, top_k]``: prompt rows
  first (prefix-cache hits included), then one row per forwarded generated token (the last
  sampled token never went through the model). Dense layers keep zero rows.
* **vLLM <= 0.21**: top-level ``prompt_routed_experts`` ``[prompt, moe_layers, top_k]`` and
  ``choices[i].routed_experts`` ``[generated - 1, moe_layers, top_k]``, nested JSON lists.
* vLLM never puts routing into a stream: streamed responses are counted as without routing.
* **SGLang 0.5.9 - 0.5.23** (``--enable-return-routed-experts`` and the request field
  ``return_routed_experts: true``): base64 of raw int32 ``[rows, num_hidden_layers, top_k]``, no
  dtype, shape or offset beside it (an unknown ``routed_experts_*`` sibling is an encoding error).
  The rows are positions ``[routed_experts_start_len, prompt + generated - 1)`` (the request's
  start, 0 by default): every row present is counted. It sits at top-level
  ``sglext.routed_experts`` (OpenAI endpoints, the first choice's only); in ``meta_info`` on
  ``/generate``; in every ``choices[i].meta_info`` of a chat answer asked ``return_meta_info``
  (then sglext has none; later choices count their generated rows only). A stream carries it
  in one extra chunk with ``choices: []`` after the last token, beside the other ``sglext``
  fields asked for. Dense layers are zero; a row of -1 at every MoE layer (SGLang's padded-row
  mark) is no token and is not counted.

A layer axis of ``num_hidden_layers`` rows is read at the MoE layers only; one of as many
rows as MoE layers is read as it is. Anything else - a shape the config does not explain,
an expert id out of range, a token whose top-k names one expert twice, a field that does
not decode - is a data error: the response's routing is not counted, and the error is
reported with its reason.

With ``n > 1`` vLLM gives every choice the same prompt rows; they are counted once per
response (the first ``usage.prompt_tokens`` rows of every choice after the first are
skipped). The proxy, not the client, decides ``routed_experts_prompt_start``: it asks for
every row, and a client that sent the field gets its routing trimmed as vLLM would have.

This module finds the fields in an answer and cuts them out; one field's ids are decoded, checked,
counted and encoded in :mod:`mla_watch.engines.routing_ids` (its public names are re-exported here).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import numpy as np

from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.routing_ids import (
    DATA_ERRORS,
    DataError,
    describe_sent,
    encode_npy,
    encode_sglang,
    encode_vllm,
    every_layer,
    moe_rows,
    nested_list_ids,
    raw_int32_ids,
    routing_counts,
    routing_position_counts,
    sglang_routing_decoder,
    vllm_routing_ids,
)

__all__ = [
    "DATA_ERRORS",
    "DROP_CHUNK",
    "ENGINES",
    "PROMPT_START_FIELD",
    "ROUTING_REQUEST_FIELD",
    "SGLANG_START_FIELD",
    "STRIP_ON_LOOP_BYTES",
    "DataError",
    "Decoded",
    "RoutingPlan",
    "add_extra",
    "answer_token_ids",
    "count_response",
    "decode_chunk",
    "decode_response",
    "encode_sglang",
    "encode_vllm",
    "every_layer",
    "routing_counts",
    "routing_strings",
    "strip_chunk",
    "strip_response",
    "strip_routing",
]

ENGINES = ("vllm", "sglang")
# SGLang's request field; a client that sends it wants the routing itself, on any engine.
ROUTING_REQUEST_FIELD = "return_routed_experts"
# vLLM's request field that drops the first N prompt rows from the routing it returns
# (vllm/entrypoints/openai/completion/protocol.py, `ge=0`; checked `<= prompt_len` in
# vllm/v1/engine/input_processor.py). Never forwarded: the proxy counts every row.
PROMPT_START_FIELD = "routed_experts_prompt_start"
# SGLang's (sglang/srt/managers/io_struct.py, `routed_experts_start_len`; checked in scheduler.py): the same.
SGLANG_START_FIELD = "routed_experts_start_len"
# A base64 routing string, cut out of the raw body before parsing (see _parse). Inside a JSON string
# every quote is escaped, so `s"` - and this pattern - can only match a key of the document.
_ROUTING_STRING = re.compile(rb'"routed_experts"\s*:\s*"')
_LIFTED = "\x00mla_watch:"  # stands in for a cut-out string: base64 and engines' text never hold NUL


@dataclass(frozen=True)
class RoutingPlan:
    """What a decode needs to know (sent to the decoding process, so plain data only)."""

    engine: str  # one of ENGINES, or "none": no routing is read, only ``extra`` added
    geometry: EngineGeometry | None
    keep: bool  # the client asked for the routing itself: leave it in the response
    extra: dict[str, Any] | None = None  # mla_watch's object, added to the body (or to the first chunk)
    prompt_start: int = 0  # the client's routed_experts_prompt_start: prompt rows cut from what it keeps
    # vLLM's token ids in the answer (the proxy asked for them to capture traffic): "chat" or "completion"
    # (where they sit), read into Decoded.samples; strip_token_ids: the client did not ask, so they go.
    token_ids: str | None = None
    strip_token_ids: bool = False
    # Routing by position (mla_watch.routing.positions): the buckets' end positions, or None to count no positions.
    position_edges: tuple[int, ...] | None = None
    # The expert footprint of a batch (mla_watch.routing.footprint): decode rows kept per choice, at most; 0: none.
    footprint_tokens: int = 0
    # The client's prompt length where the answer's own usage would not say it: a stream's replay sends its prompt
    # and generated tokens as one prompt, of which only the first prompt_tokens were the client's.
    prompt_tokens: int | None = None


@dataclass
class Decoded:
    """One response (or stream chunk) after decoding: what the client gets, and what was counted."""

    body: bytes | None  # None: drop this stream chunk (it carried nothing but routing the client did not ask for)
    counts: np.ndarray | None = None  # [moe_layers, num_experts] int64; None when there was no routing
    tokens: int = 0
    error: DataError | None = None
    not_json: bool = False  # the body was no JSON object: relayed as it came (a stream) or refused (a response)
    samples: list[tuple[list[int], int]] | None = None  # per choice: prompt + completion ids, the prompt's length
    # [moe_layers, position buckets, num_experts] of the prompt's rows, where positions count and the answer says its
    # prompt's length (prompt_tokens)
    position_counts: np.ndarray | None = None
    prompt_tokens: int | None = None
    footprint_rows: list[np.ndarray] | None = None  # per choice: decode rows [tokens, moe_layers, top_k], uint16

    @property
    def found(self) -> bool:
        return self.counts is not None or self.error is not None


def decode_response(plan: RoutingPlan, body: bytes) -> Decoded:
    """A whole (non-streamed) response body: count its routing, strip it unless kept, add ``extra``.

    A body that is not a JSON object is ``not_json`` (the proxy answers 502); nothing an engine
    sends makes this raise.
    """
    try:
        document, arrays, error, starts = _parse_and_take(plan, body)
    except (ValueError, RecursionError, MemoryError):
        return Decoded(body, not_json=True)
    try:
        return _finish(plan, document, arrays, error, plan.extra, starts=starts)
    except MemoryError:  # the decoding process's own limit, not the server's
        return Decoded(None, error=DataError("decoder", f"decoding a {len(body)}-byte answer ran out of memory"))


def decode_chunk(plan: RoutingPlan, data: str, *, first: bool) -> Decoded:
    """One server-sent event's ``data:`` payload (JSON); the first one gets ``extra``."""
    try:
        document, arrays, error, starts = _parse_and_take(plan, data.encode())
    except (ValueError, RecursionError, MemoryError):
        return Decoded(data.encode(), not_json=True)
    # SGLang's sglext chunk also carries what else the client asked for (cached_tokens_details, ..., input_ids;
    # serving_chat.py:2725-2760): dropped only where nothing but the routing was in it.
    if (
        (arrays or error is not None)
        and not plan.keep
        and document.get("choices") == []
        and not document.get("usage")
        and "sglext" not in document
    ):
        decoded = _finish(plan, document, arrays, error, None, starts=starts)
        decoded.body = None  # SGLang's routing-only chunk: the client did not ask for it
        return decoded
    return _finish(plan, document, arrays, error, plan.extra if first else None, starts=starts)


def count_response(plan: RoutingPlan, body: bytes) -> Decoded:
    """The routing of a response body (or of one stream chunk's JSON) counted, nothing re-serialised
    (``body`` is ``None``): what the proxy runs after the client already has its answer."""
    try:
        document, arrays, error, starts = _parse_and_take(plan, body)
    except (ValueError, RecursionError, MemoryError):
        return Decoded(None, not_json=True)
    try:
        return _finish(plan, document, arrays, error, None, starts=starts, serialise=False)
    except MemoryError:
        return Decoded(None, error=DataError("decoder", f"counting a {len(body)}-byte answer ran out of memory"))


# Text (what is left of an answer once its routing strings are cut out) small enough to parse on the
# event loop: ~0.2 ms at most. Anything longer goes to a decoding process whole.
STRIP_ON_LOOP_BYTES = 64 << 10
DROP_CHUNK = b""  # strip_chunk: the chunk carried only routing the client did not ask for


def strip_response(plan: RoutingPlan, body: bytes) -> bytes | None:
    """What the client gets of ``body``: its routing cut out and mla_watch's object added, without decoding
    the routing; cheap enough for the event loop.

    ``None`` where this cannot be done cheaply or exactly: the client keeps the routing, the routing is
    not a base64 string (vLLM <= 0.21's lists), the rest of the answer is longer than
    :data:`STRIP_ON_LOOP_BYTES`, or the body is not a JSON object. Then :func:`decode_response` does it all.
    """
    cut = _without_routing(plan, body)
    if cut is None:
        return None
    document, _ = cut
    document["mla_watch"] = plan.extra
    return _compact(document)


def add_extra(body: bytes, extra: dict[str, Any] | None) -> bytes | None:
    """An answer (or stream chunk) that carries no routing to read, with mla_watch's object added; ``None`` where
    it is no JSON object. For bodies short enough for the event loop (:data:`STRIP_ON_LOOP_BYTES`).

    The object is parsed only to be checked: the engine's bytes go on as they came, the object written
    in before their closing brace (re-serialised only where that cannot be done exactly: an object that
    already has the key, or text that is not UTF-8 JSON).
    """
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    text = body.strip(b" \t\r\n")
    if "mla_watch" in document or not text.startswith(b"{") or not text.endswith(b"}"):
        document["mla_watch"] = extra
        return _compact(document)
    return b"".join((text[:-1], b',"mla_watch":' if document else b'"mla_watch":', _compact(extra), b"}"))


def strip_chunk(plan: RoutingPlan, data: bytes, *, first: bool) -> bytes | None:
    """:func:`strip_response` for one stream chunk's JSON (mla_watch's object only in the ``first``);
    :data:`DROP_CHUNK` where nothing but routing was in it (SGLang's routing-only chunk)."""
    cut = _without_routing(plan, data)
    if cut is None:
        return None
    document, found = cut
    if found and document.get("choices") == [] and not document.get("usage") and "sglext" not in document:
        return DROP_CHUNK
    if first:
        document["mla_watch"] = plan.extra
    return _compact(document)


def strip_routing(plan: RoutingPlan, data: bytes) -> bytes | None:
    """``data`` (an answer or a stream chunk) with its routing cut out, nothing else changed or added, nothing
    decoded; ``None`` where :func:`strip_response` could not (then :func:`decode_chunk` does it)."""
    cut = _without_routing(plan, data)
    return None if cut is None else _compact(cut[0])


def routing_strings(data: bytes) -> list[bytes]:
    """The base64 routing strings of an answer or stream chunk, undecoded and unparsed (a memchr over each)."""
    _, lifted = _lift(data, None)  # type: ignore[misc]
    return [bytes(value) for value in lifted.values()]


def _without_routing(plan: RoutingPlan, body: bytes) -> tuple[dict[str, Any], int] | None:
    """The document with its routing fields removed, and how many there were (none decoded)."""
    if plan.keep:
        return None
    cut = _lift(body, STRIP_ON_LOOP_BYTES)
    if cut is None:
        return None
    text, lifted = cut
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    claimed = 0
    for container, key, _ in _FIELDS[plan.engine](document):
        value = container.pop(key)
        if isinstance(value, str) and value in lifted:
            claimed += 1
        elif value is not None:  # routing as lists: decode_response reads them
            return None
    if claimed != len(lifted):  # a routing string where the engine's format has none
        return None
    if plan.engine == "sglang" and document.get("sglext") == {}:
        del document["sglext"]
    if plan.strip_token_ids and plan.token_ids is not None:
        answer_token_ids(document, plan.token_ids, strip=True)
    return document, claimed


def answer_token_ids(document: dict[str, Any], kind: str, *, strip: bool) -> list[tuple[list[int], int]]:
    """The token ids of an unstreamed vLLM answer asked for with ``return_token_ids``: per choice, prompt plus
    completion and the prompt's length (``[]`` where any is missing or not ids); taken out with ``strip``.

    Chat carries the prompt's ids once, at the top (chat_completion/protocol.py ``prompt_token_ids``);
    completions, per choice (completion/protocol.py); both carry a choice's own in ``token_ids``.
    """
    take = dict.pop if strip else dict.get
    shared = take(document, "prompt_token_ids", None) if kind == "chat" else None
    samples = []
    valid = True
    choices = document.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        prompt = take(choice, "prompt_token_ids", None) if kind == "completion" else shared
        completion = take(choice, "token_ids", None)
        if (
            valid
            and _token_ids(prompt)
            and _token_ids(completion)
            and len(prompt) + len(completion) <= MAX_CAPTURED_TOKENS
        ):
            samples.append(([*prompt, *completion], len(prompt)))
        else:
            valid = False
    return samples if valid else []


MAX_CAPTURED_TOKENS = 1 << 20  # per choice; the capture keeps far fewer (--capture's own bound)


def _token_ids(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(i) is int and 0 <= i < 1 << 31 for i in value)


def _compact(document: dict[str, Any] | None) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------------- internals
def _finish(
    plan: RoutingPlan,
    document: dict[str, Any],
    arrays: list[np.ndarray],
    error: DataError | None,
    extra: dict[str, Any] | None,
    *,
    starts: list[int] | None = None,
    serialise: bool = True,
) -> Decoded:
    decoded = Decoded(b"", error=error)
    if plan.token_ids is not None:
        decoded.samples = answer_token_ids(document, plan.token_ids, strip=plan.strip_token_ids)
    if arrays and error is None:
        assert plan.geometry is not None  # arrays were read: the plan reads routing
        try:
            totals = [routing_counts(ids, plan.geometry) for ids in arrays]
        except DataError as failure:
            decoded.error = failure
        else:
            decoded.counts = cast(np.ndarray, sum(counts for counts, _ in totals))  # arrays: never the empty 0
            decoded.tokens = sum(tokens for _, tokens in totals)
            prompt = plan.prompt_tokens if plan.prompt_tokens is not None else _prompt_tokens(document)
            if plan.position_edges is not None and starts is not None and prompt is not None:
                # The prompt's rows only: a generated token's routing follows what the model writes, not where.
                decoded.prompt_tokens = prompt
                decoded.position_counts = cast(
                    np.ndarray,
                    sum(
                        routing_position_counts(ids, plan.geometry, plan.position_edges, start, stop=prompt)
                        for ids, start in zip(arrays, starts, strict=True)
                    ),
                )
            if plan.footprint_tokens and starts is not None:
                decoded.footprint_rows = _decode_rows(document, arrays, starts, plan)
    if extra is not None:
        document["mla_watch"] = extra
    decoded.body = json.dumps(document, separators=(",", ":")).encode() if serialise else None
    return decoded


def _prompt_tokens(document: dict[str, Any]) -> int | None:
    """The answer's prompt length (``usage.prompt_tokens``), or ``None`` where it does not say."""
    usage = document.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return prompt if type(prompt) is int and prompt >= 0 else None


def _decode_rows(
    document: dict[str, Any], arrays: list[np.ndarray], starts: list[int], plan: RoutingPlan
) -> list[np.ndarray]:
    """Each choice's decode steps' rows (past the prompt, whose rows a prefill routed), at most
    ``plan.footprint_tokens`` evenly spaced ones, MoE layers only; a choice without any gives its prompt's."""
    usage = document.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    kept = []
    for ids, start in zip(arrays, starts, strict=True):
        rows = moe_rows(ids, plan.geometry)  # type: ignore[arg-type]
        cut = max(0, prompt - start) if type(prompt) is int else 0
        if cut < rows.shape[0]:
            rows = rows[cut:]
        if rows.shape[0] > plan.footprint_tokens:
            rows = rows[np.linspace(0, rows.shape[0] - 1, plan.footprint_tokens).astype(np.intp)]
        if rows.shape[0]:
            kept.append(rows.astype(np.uint16))
    return kept


def _parse_and_take(
    plan: RoutingPlan, body: bytes
) -> tuple[dict[str, Any], list[np.ndarray], DataError | None, list[int] | None]:
    """The document, its routing arrays and each array's first position (``None``: not known); raises ValueError
    when the body is not a JSON object."""
    document, lifted = _parse(body, lift=True)
    if isinstance(document, dict):
        arrays, error, claimed, starts = _take(plan, document, lifted)
        if claimed == len(lifted):
            return document, arrays, error, starts
        # A routing string where the engine's format has none: parse again, nothing cut out.
        document, lifted = _parse(body, lift=False)
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    arrays, error, _, starts = _take(plan, document, lifted)
    return document, arrays, error, starts


def _parse(body: bytes, *, lift: bool) -> tuple[Any, dict[str, memoryview]]:
    """``json.loads``, with each base64 routing string cut out first (``lift``): the JSON scanner reads a
    5 MB string slower than pybase64 decodes it."""
    if not lift:
        return json.loads(body), {}
    text, lifted = _lift(body, None)  # type: ignore[misc]
    return json.loads(text), lifted


def _lift(body: bytes, budget: int | None) -> tuple[bytes, dict[str, memoryview]] | None:
    """``body`` with each unescaped base64 routing string replaced by a short name, and the strings by name;
    ``None`` once more than ``budget`` bytes of it are not routing (then it is not worth cutting here)."""
    lifted: dict[str, memoryview] = {}
    pieces: list[bytes] = []
    position = kept = 0
    while True:
        # Where the budget is spent, the key must begin before it does: the search never reads past that.
        end_of_search = len(body) if budget is None else min(len(body), position + budget - kept + 64)
        match = _ROUTING_STRING.search(body, position, end_of_search)
        if match is None:
            break
        start = match.end()
        end = body.find(b'"', start)  # memchr over the string: the regex never scans its megabytes
        if end < 0:
            break
        if body.find(b"\\", start, end) >= 0:  # an escaped string is left to the parser
            pieces.append(body[position:end])
            kept += end - position
        else:
            name = f"{_LIFTED}{len(lifted)}"
            lifted[name] = memoryview(body)[start:end]  # no copy of the megabytes
            pieces += [body[position:start], json.dumps(name)[1:-1].encode()]
            kept += start - position
        position = end
        if budget is not None and kept > budget:
            return None
    if budget is not None and kept + len(body) - position > budget:
        return None
    if not lifted:
        return body, lifted
    pieces.append(body[position:])
    return b"".join(pieces), lifted


def _take(
    plan: RoutingPlan, document: dict[str, Any], lifted: dict[str, memoryview]
) -> tuple[list[np.ndarray], DataError | None, int, list[int] | None]:
    """The routing arrays of ``document``, removed from it unless the plan keeps them; how many cut-out strings
    were found in their place; and the position of each array's first row (``None`` for vLLM 0.21's separate
    prompt rows, whose choices' rows are not tied to them here)."""
    fields = _FIELDS[plan.engine](document)
    repeated_prompt = plan.engine == "vllm" and "prompt_routed_experts" not in document  # vLLM <= 0.21 sent it once
    arrays: list[np.ndarray] = []
    # Fields the client keeps, to trim to its prompt start: vLLM's .npy and SGLang's int32 (every row of it).
    kept: list[tuple[dict[str, Any], str, np.ndarray, Callable[[np.ndarray], str]]] = []
    error: DataError | None = None
    claimed = 0
    for container, key, decode in fields:
        value = container[key] if plan.keep else container.pop(key)
        if isinstance(value, str) and value in lifted:
            claimed += 1
            value = lifted[value]
            if plan.keep:
                container[key] = bytes(value).decode("ascii", errors="replace")
        if value is None:
            continue
        if error is None:
            try:
                ids = decode(value, plan.geometry)
            except DataError as failure:
                error = failure
                continue
            arrays.append(ids)
            if plan.keep and plan.prompt_start and not isinstance(value, list):
                if decode is vllm_routing_ids:
                    kept.append((container, key, ids, encode_npy))
                elif plan.engine == "sglang":
                    assert plan.geometry is not None  # routing decoded: the plan reads it
                    kept.append((container, key, raw_int32_ids(value, plan.geometry), encode_sglang))
    if plan.engine == "sglang" and not plan.keep and document.get("sglext") == {}:
        del document["sglext"]
    # Every row from the sequence's first position (the proxy asks for every row): a choice repeats the prompt.
    starts: list[int] | None = [0 for _ in arrays] if repeated_prompt or plan.engine == "sglang" else None
    if error is None and repeated_prompt and len(arrays) > 1:
        try:
            prompt = _prompt_rows(document, arrays)
        except DataError as failure:
            error = failure
        else:
            arrays = [arrays[0], *(ids[prompt:] for ids in arrays[1:])]
            starts = [0, *(prompt for _ in arrays[1:])]
    for container, key, ids, encode in kept:  # as the engine would have returned them to this client
        container[key] = encode(ids[plan.prompt_start :])
    return arrays, error, claimed, starts


def _prompt_rows(document: dict[str, Any], arrays: list[np.ndarray]) -> int:
    """How many leading rows of each choice are the prompt's, which every choice repeats."""
    usage = document.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    shortest = min(ids.shape[0] if ids.ndim else 0 for ids in arrays)
    if type(prompt) is not int or not 0 <= prompt <= shortest:
        raise DataError(
            "shape",
            f"{len(arrays)} choices carry routing and usage.prompt_tokens is "
            f"{describe_sent(prompt)}: expected the prompt's length, at most {shortest} (the rows "
            "of the shortest choice), to count the prompt rows every choice repeats once",
        )
    return prompt


_Field = tuple[dict[str, Any], str, Any]


def _vllm_fields(document: dict[str, Any]) -> list[_Field]:
    fields: list[_Field] = []
    if "prompt_routed_experts" in document:
        fields.append((document, "prompt_routed_experts", nested_list_ids))
    choices = document.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if isinstance(choice, dict) and "routed_experts" in choice:
            fields.append((choice, "routed_experts", vllm_routing_ids))
    return fields


def _sglang_fields(document: dict[str, Any]) -> list[_Field]:
    """Where SGLang (0.5.9 - 0.5.23) puts routing: ``sglext`` (OpenAI endpoints), the answer's own ``meta_info``
    (``/generate``), or every choice's ``meta_info`` (chat with ``return_meta_info``)."""
    fields: list[_Field] = []
    for container in (document.get("sglext"), document.get("meta_info")):
        if isinstance(container, dict) and "routed_experts" in container:
            fields.append((container, "routed_experts", sglang_routing_decoder(container)))
    response_level = bool(fields)
    choices = document.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        meta = choice.get("meta_info") if isinstance(choice, dict) else None
        if isinstance(meta, dict) and "routed_experts" in meta:
            # serving_chat.py:2857-2860 leaves sglext's routing out when choices carry meta_info; both would
            # count choice 0 twice. Each choice is its own request over the same prompt (n > 1): the rows
            # after the first choice's are counted from the generated ones only.
            fields.append(
                (
                    meta,
                    "routed_experts",
                    sglang_routing_decoder(meta, generated_only=len(fields) > 0, conflict=response_level),
                )
            )
    return fields


_FIELDS = {"vllm": _vllm_fields, "sglang": _sglang_fields, "none": lambda document: []}
