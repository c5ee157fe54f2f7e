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
"""

from __future__ import annotations

import binascii
import io
import json
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64  # what vLLM and SGLang encode with; SIMD, ~40x binascii on this machine

from mla_watch.engines.geometry import EngineGeometry

__all__ = ["DATA_ERRORS", "DROP_CHUNK", "ENGINES", "PROMPT_START_FIELD", "ROUTING_REQUEST_FIELD", "SGLANG_START_FIELD",
           "STRIP_ON_LOOP_BYTES", "DataError", "Decoded", "RoutingPlan", "answer_token_ids", "count_response",
           "decode_chunk",
           "decode_response", "encode_sglang", "encode_vllm", "every_layer", "routing_counts", "strip_chunk",
           "strip_response"]

ENGINES = ("vllm", "sglang")
# SGLang's request field; a client that sends it wants the routing itself, on any engine.
ROUTING_REQUEST_FIELD = "return_routed_experts"
# vLLM's request field that drops the first N prompt rows from the routing it returns
# (vllm/entrypoints/openai/completion/protocol.py, `ge=0`; checked `<= prompt_len` in
# vllm/v1/engine/input_processor.py). Never forwarded: the proxy counts every row.
PROMPT_START_FIELD = "routed_experts_prompt_start"
# SGLang's (sglang/srt/managers/io_struct.py, `routed_experts_start_len`; checked in scheduler.py): the same.
SGLANG_START_FIELD = "routed_experts_start_len"
# Data-error reasons (a metric label): what was wrong with the routing an engine returned.
# duplicate_ids: one token's top-k names an expert twice, which no router can do (vLLM's capture
# returns all zeros when misconfigured, e.g. on CPU without --enforce-eager).
DATA_ERRORS = ("encoding", "shape", "expert_id", "duplicate_ids", "decoder")
# A base64 routing string, cut out of the raw body before parsing (see _parse). Inside a JSON string
# every quote is escaped, so `s"` - and this pattern - can only match a key of the document.
_ROUTING_STRING = re.compile(rb'"routed_experts"\s*:\s*"')
_NPY_MAX_HEADER = 1 << 12  # numpy's own default is 10,000; a shape of three integers needs ~100 bytes
_LIFTED = "\x00mla_watch:"  # stands in for a cut-out string: base64 and engines' text never hold NUL


class DataError(ValueError):
    """Routing that does not fit the model config; ``reason`` is one of :data:`DATA_ERRORS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple:  # it travels back from the decoding process
        return (DataError, (self.reason, str(self)))


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


@dataclass
class Decoded:
    """One response (or stream chunk) after decoding: what the client gets, and what was counted."""

    body: bytes | None  # None: drop this stream chunk (it carried nothing but routing the client did not ask for)
    counts: np.ndarray | None = None  # [moe_layers, num_experts] int64; None when there was no routing
    tokens: int = 0
    error: DataError | None = None
    not_json: bool = False  # the body was no JSON object: relayed as it came (a stream) or refused (a response)
    samples: list[tuple[list[int], int]] | None = None  # per choice: prompt + completion ids, the prompt's length

    @property
    def found(self) -> bool:
        return self.counts is not None or self.error is not None


def routing_counts(ids: np.ndarray, geometry: EngineGeometry) -> tuple[np.ndarray, int]:
    """Selections per (MoE layer, expert) of ``ids`` ``[tokens, layers, top_k]``, and the tokens; vectorised."""
    if ids.ndim != 3 or ids.shape[2] != geometry.top_k:
        raise DataError("shape", f"routing of shape {list(ids.shape)}: expected [tokens, layers, {geometry.top_k}] "
                                 f"(top_k {geometry.top_k} from the model config)")
    moe = len(geometry.moe_layers)
    if ids.shape[1] == geometry.num_hidden_layers and ids.shape[1] != moe:
        first, last = geometry.moe_layers[0], geometry.moe_layers[-1]
        contiguous = last - first + 1 == moe  # DeepSeek's dense-first layers: a view, not a copy
        ids = ids[:, first:last + 1, :] if contiguous else ids[:, list(geometry.moe_layers), :]
    elif ids.shape[1] != moe:
        raise DataError("shape", f"routing has {ids.shape[1]} layers: expected {geometry.num_hidden_layers} "
                                 f"(every layer) or {moe} (MoE layers) from the model config")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= geometry.num_experts):
        raise DataError("expert_id", f"routing holds expert ids in [{int(ids.min())}, {int(ids.max())}]: expected "
                                     f"[0, {geometry.num_experts - 1}] ({geometry.num_experts} experts)")
    _refuse_duplicates(ids)
    # One bincount over (layer, expert) pairs, written into a reused intp buffer: bincount takes it
    # as it is, and a fresh 8 MB array per response costs more in page faults than the count itself.
    offsets = (np.arange(moe, dtype=np.intp) * geometry.num_experts)[None, :, None]
    flat = _scratch(ids.size).reshape(ids.shape)
    np.add(ids, offsets, out=flat, casting="unsafe")
    counts = np.bincount(flat.reshape(-1), minlength=moe * geometry.num_experts).reshape(moe, geometry.num_experts)
    return counts, int(ids.shape[0])


_SCRATCH = threading.local()
SCRATCH_KEPT = 1 << 24  # ids: a buffer of up to 128 MB is kept for the next response of this thread


_PAIRWISE_TOP_K = 16


def _refuse_duplicates(ids: np.ndarray) -> None:
    """A token's top-k holds ``k`` distinct experts; one named twice is no routing at all."""
    top_k = ids.shape[2]
    if top_k < 2 or not ids.size:
        return
    if top_k <= _PAIRWISE_TOP_K:  # k(k-1)/2 compares of contiguous [tokens, layers]: ~20x faster than sorting
        columns = np.moveaxis(ids, 2, 0).copy()
        repeated = np.zeros(ids.shape[:2], dtype=bool)
        equal = np.empty(ids.shape[:2], dtype=bool)
        for first in range(top_k - 1):
            for second in range(first + 1, top_k):
                repeated |= np.equal(columns[first], columns[second], out=equal)
    else:
        ordered = np.sort(ids, axis=2)
        repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if repeated.any():
        tokens = int(repeated.any(axis=1).sum())
        token, layer = (int(i) for i in np.argwhere(repeated)[0])
        chosen = ids[token, layer].tolist()
        expert = next(e for e in chosen if chosen.count(e) > 1)
        raise DataError("duplicate_ids", f"routing of {tokens} of {ids.shape[0]} tokens names one expert twice "
                                         f"in its top-{ids.shape[2]} (first: token {token}, MoE layer {layer}, "
                                         f"expert {expert}): expected {ids.shape[2]} distinct experts per token; "
                                         "all-zero routing is what vLLM's capture returns when misconfigured "
                                         "(without --enforce-eager on CPU, for one)")


def _scratch(size: int) -> np.ndarray:
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, dtype=np.intp)
        if size <= SCRATCH_KEPT:
            _SCRATCH.buffer = buffer
    return buffer[:size]


def decode_response(plan: RoutingPlan, body: bytes) -> Decoded:
    """A whole (non-streamed) response body: count its routing, strip it unless kept, add ``extra``.

    A body that is not a JSON object is ``not_json`` (the proxy answers 502); nothing an engine
    sends makes this raise.
    """
    try:
        document, arrays, error = _parse_and_take(plan, body)
    except (ValueError, RecursionError, MemoryError):
        return Decoded(body, not_json=True)
    try:
        return _finish(plan, document, arrays, error, plan.extra)
    except MemoryError:  # the decoding process's own limit, not the server's
        return Decoded(None, error=DataError("decoder", f"decoding a {len(body)}-byte answer ran out of memory"))


def decode_chunk(plan: RoutingPlan, data: str, *, first: bool) -> Decoded:
    """One server-sent event's ``data:`` payload (JSON); the first one gets ``extra``."""
    try:
        document, arrays, error = _parse_and_take(plan, data.encode())
    except (ValueError, RecursionError, MemoryError):
        return Decoded(data.encode(), not_json=True)
    # SGLang's sglext chunk also carries what else the client asked for (cached_tokens_details, ..., input_ids;
    # serving_chat.py:2725-2760): dropped only where nothing but the routing was in it.
    if (arrays or error is not None) and not plan.keep and document.get("choices") == [] \
            and not document.get("usage") and "sglext" not in document:
        decoded = _finish(plan, document, arrays, error, None)
        decoded.body = None  # SGLang's routing-only chunk: the client did not ask for it
        return decoded
    return _finish(plan, document, arrays, error, plan.extra if first else None)


def count_response(plan: RoutingPlan, body: bytes) -> Decoded:
    """The routing of a response body (or of one stream chunk's JSON) counted, nothing re-serialised
    (``body`` is ``None``): what the proxy runs after the client already has its answer."""
    try:
        document, arrays, error = _parse_and_take(plan, body)
    except (ValueError, RecursionError, MemoryError):
        return Decoded(None, not_json=True)
    try:
        return _finish(plan, document, arrays, error, None, serialise=False)
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
        if valid and _token_ids(prompt) and _token_ids(completion) \
                and len(prompt) + len(completion) <= MAX_CAPTURED_TOKENS:
            samples.append(([*prompt, *completion], len(prompt)))
        else:
            valid = False
    return samples if valid else []


MAX_CAPTURED_TOKENS = 1 << 20  # per choice; the capture keeps far fewer (--capture's own bound)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(i) is int and 0 <= i < 1 << 31 for i in value)


def _compact(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------------- writing (the embedded server)
def every_layer(ids: np.ndarray, layers: list[int], num_hidden_layers: int) -> np.ndarray:
    """``[tokens, moe_routers, top_k]`` spread on an axis of every decoder layer, dense ones zero (as the
    engines return it)."""
    spread = np.zeros((ids.shape[0], num_hidden_layers, ids.shape[2]), dtype=np.int32)
    spread[:, layers, :] = ids
    return spread


def encode_vllm(ids: np.ndarray, num_experts: int) -> str:
    """vLLM >= 0.22's ``routed_experts``: base64 of a ``.npy`` file, uint8 up to 256 experts, else uint16."""
    return _encode_npy(ids.astype(np.uint8 if num_experts <= 256 else np.uint16))


def encode_sglang(ids: np.ndarray) -> str:
    """SGLang's ``sglext.routed_experts``: base64 of the raw little-endian int32 ids."""
    return pybase64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")


# ---------------------------------------------------------------------- internals
def _finish(plan: RoutingPlan, document: dict[str, Any], arrays: list[np.ndarray], error: DataError | None,
            extra: dict[str, Any] | None, *, serialise: bool = True) -> Decoded:
    decoded = Decoded(b"", error=error)
    if plan.token_ids is not None:
        decoded.samples = answer_token_ids(document, plan.token_ids, strip=plan.strip_token_ids)
    if arrays and error is None:
        try:
            totals = [routing_counts(ids, plan.geometry) for ids in arrays]
        except DataError as failure:
            decoded.error = failure
        else:
            decoded.counts = sum(counts for counts, _ in totals)
            decoded.tokens = sum(tokens for _, tokens in totals)
    if extra is not None:
        document["mla_watch"] = extra
    decoded.body = json.dumps(document, separators=(",", ":")).encode() if serialise else None
    return decoded


def _parse_and_take(plan: RoutingPlan, body: bytes) -> tuple[dict[str, Any], list[np.ndarray], DataError | None]:
    """The document and its routing arrays; raises ValueError when the body is not a JSON object."""
    document, lifted = _parse(body, lift=True)
    if isinstance(document, dict):
        arrays, error, claimed = _take(plan, document, lifted)
        if claimed == len(lifted):
            return document, arrays, error
        # A routing string where the engine's format has none: parse again, nothing cut out.
        document, lifted = _parse(body, lift=False)
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    arrays, error, _ = _take(plan, document, lifted)
    return document, arrays, error


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


def _take(plan: RoutingPlan, document: dict[str, Any],
          lifted: dict[str, memoryview]) -> tuple[list[np.ndarray], DataError | None, int]:
    """The routing arrays of ``document``, removed from it unless the plan keeps them; and how many
    cut-out strings were found in their place."""
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
                if decode is _npy_or_lists:
                    kept.append((container, key, ids, _encode_npy))
                elif plan.engine == "sglang":
                    kept.append((container, key, _raw_int32(value, plan.geometry), encode_sglang))
    if plan.engine == "sglang" and not plan.keep and document.get("sglext") == {}:
        del document["sglext"]
    if error is None and repeated_prompt and len(arrays) > 1:
        try:
            prompt = _prompt_rows(document, arrays)
        except DataError as failure:
            error = failure
        else:
            arrays = [arrays[0], *(ids[prompt:] for ids in arrays[1:])]
    for container, key, ids, encode in kept:  # as the engine would have returned them to this client
        container[key] = encode(ids[plan.prompt_start:])
    return arrays, error, claimed


def _prompt_rows(document: dict[str, Any], arrays: list[np.ndarray]) -> int:
    """How many leading rows of each choice are the prompt's, which every choice repeats."""
    usage = document.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    shortest = min(ids.shape[0] if ids.ndim else 0 for ids in arrays)
    if type(prompt) is not int or not 0 <= prompt <= shortest:
        raise DataError("shape", f"{len(arrays)} choices carry routing and usage.prompt_tokens is "
                                 f"{_describe(prompt)}: expected the prompt's length, at most {shortest} (the rows "
                                 "of the shortest choice), to count the prompt rows every choice repeats once")
    return prompt


def _describe(value: Any) -> str:
    """A value an engine sent, for a message: a short number as it is, anything else by its type alone
    (unlike :func:`mla_watch.describe.describe_value`, which encodes the whole value first: an engine's may
    be megabytes)."""
    if isinstance(value, bool) or value is None or (isinstance(value, int | float) and len(repr(value)) <= 24):
        return repr(value)
    return f"a {type(value).__name__}"


_Field = tuple[dict[str, Any], str, Any]


def _vllm_fields(document: dict[str, Any]) -> list[_Field]:
    fields: list[_Field] = []
    if "prompt_routed_experts" in document:
        fields.append((document, "prompt_routed_experts", _nested_lists))
    choices = document.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if isinstance(choice, dict) and "routed_experts" in choice:
            fields.append((choice, "routed_experts", _npy_or_lists))
    return fields


def _sglang_fields(document: dict[str, Any]) -> list[_Field]:
    """Where SGLang (0.5.9 - 0.5.23) puts routing: ``sglext`` (OpenAI endpoints), the answer's own ``meta_info``
    (``/generate``), or every choice's ``meta_info`` (chat with ``return_meta_info``)."""
    fields: list[_Field] = []
    for container in (document.get("sglext"), document.get("meta_info")):
        if isinstance(container, dict) and "routed_experts" in container:
            fields.append((container, "routed_experts", _sglang_decoder(container)))
    response_level = bool(fields)
    choices = document.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        meta = choice.get("meta_info") if isinstance(choice, dict) else None
        if isinstance(meta, dict) and "routed_experts" in meta:
            # serving_chat.py:2857-2860 leaves sglext's routing out when choices carry meta_info; both would
            # count choice 0 twice. Each choice is its own request over the same prompt (n > 1): the rows
            # after the first choice's are counted from the generated ones only.
            fields.append((meta, "routed_experts", _sglang_decoder(meta, generated_only=len(fields) > 0,
                                                                   conflict=response_level)))
    return fields


_FIELDS = {"vllm": _vllm_fields, "sglang": _sglang_fields, "none": lambda document: []}


def _npy_or_lists(value: Any, geometry: EngineGeometry) -> np.ndarray:
    return _npy(value, geometry) if isinstance(value, str | bytes | memoryview) else _nested_lists(value, geometry)


def _b64(value: Any) -> bytes:
    if not isinstance(value, str | bytes | memoryview):
        raise DataError("encoding", f"routing is a {type(value).__name__}: expected a base64 string")
    try:
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise DataError("encoding", f"routing is not base64: {error}") from None


def _npy(value: str | bytes | memoryview, geometry: EngineGeometry) -> np.ndarray:
    """A ``.npy`` file's integer array, read in place; its header must describe exactly the bytes that follow
    (``np.load`` would first allocate whatever shape a header claims)."""
    raw = _b64(value)
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = reader(stream, max_header_size=_NPY_MAX_HEADER)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as error:
        raise DataError("encoding", f"routing is not a .npy array: {type(error).__name__}") from None
    if dtype.hasobject or dtype.kind not in "iu":
        raise DataError("encoding", f"routing has dtype {dtype.str}: expected integers")
    if len(shape) != 3:
        raise DataError("shape", f"routing has {len(shape)} dimensions: expected [tokens, layers, "
                                 f"{geometry.top_k}]")
    elements = math.prod(shape)
    payload = len(raw) - stream.tell()
    if elements * dtype.itemsize != payload:
        raise DataError("encoding", f"routing's .npy header declares shape {list(shape)} of {dtype.str} "
                                    f"({elements * dtype.itemsize} bytes) over {payload} bytes: expected them equal")
    ids = np.frombuffer(raw, dtype=dtype, count=elements, offset=stream.tell())
    return ids.reshape(shape, order="F" if fortran_order else "C")


def _encode_npy(ids: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    return pybase64.b64encode(buffer.getvalue()).decode("ascii")


def _raw_int32(value: Any, geometry: EngineGeometry) -> np.ndarray:
    """SGLang's headerless int32 bytes, shaped ``[tokens, layers, top_k]`` by the model config."""
    raw = _b64(value)
    if len(raw) % 4:
        raise DataError("encoding", f"routing has {len(raw)} bytes: expected whole int32 values")
    ids = np.frombuffer(raw, dtype="<i4")
    for layers in (geometry.num_hidden_layers, len(geometry.moe_layers)):
        if ids.size % (layers * geometry.top_k) == 0:
            return ids.reshape(-1, layers, geometry.top_k)
    raise DataError("shape", f"routing holds {ids.size} ids: expected a multiple of layers x top_k = "
                             f"{geometry.num_hidden_layers} x {geometry.top_k} from the model config")


# SGLang sends the ids alone: no dtype, shape or offset beside them (SglExt, protocol.py:470-483; meta_info,
# tokenizer_manager.py:2602-2609), always int32 (state_capturer/base.py:38-42, 68-72). A sibling named like one
# is a format this decoder does not know: its ids are not read as int32 on a guess.
_SGLANG_SIBLING = "routed_experts_"


def _sglang_decoder(container: dict[str, Any], *, generated_only: bool = False, conflict: bool = False) -> Any:
    """The decode of one SGLang routing field, which reads the fields beside it in ``container``."""
    def decode(value: Any, geometry: EngineGeometry) -> np.ndarray:
        if conflict:
            raise DataError("shape", "routing is both at the response level and in choices[].meta_info: SGLang "
                                     "sends one or the other; which rows repeat is not guessed")
        for key in container:
            if isinstance(key, str) and key.startswith(_SGLANG_SIBLING):
                sibling = container[key]  # a dtype's name is short: shown as it is, anything else by its type
                shown = repr(sibling) if isinstance(sibling, str) and len(sibling) <= 24 else _describe(sibling)
                raise DataError("encoding", f"routing comes with {key[:40]}={shown}: a field SGLang (up to "
                                            "0.5.23) does not send; ids of a dtype or offset it may name are not "
                                            "guessed")
        ids = _raw_int32(value, geometry)
        if generated_only:
            ids = ids[ids.shape[0] - _sglang_generated_rows(container, ids.shape[0]):]
        return _without_padding_rows(ids, geometry)
    return decode


def _sglang_generated_rows(meta: dict[str, Any], rows: int) -> int:
    """How many of a choice's ``rows`` are its generated tokens': the last ``completion_tokens - 1`` (the rows
    are positions ``[routed_experts_start_len, prompt + completion - 1)``, batch_result_processor.py:154-163;
    completion_tokens is ``len(output_ids_through_stop)``, output_streamer.py:490, 522-526). Counted from the
    end, the prompt's length and the start the request set are not needed."""
    completion = meta.get("completion_tokens")
    if type(completion) is not int or not 0 <= completion <= rows + 1:
        raise DataError("shape", f"a later choice's routing has {rows} rows and meta_info.completion_tokens is "
                                 f"{_describe(completion)}: expected an integer in [0, {rows + 1}], to count the "
                                 "generated rows only (the prompt's rows repeat the first choice's)")
    return max(completion - 1, 0)


def _without_padding_rows(ids: np.ndarray, geometry: EngineGeometry) -> np.ndarray:
    """``ids`` less the rows whose every MoE entry is -1: SGLang's mark for a padded row, which is no token
    (topk.py:1913-1934 ``_mask_topk_ids_padded_region``). 0.5.23 captures real tokens only (base.py:204-211), so
    none reaches an answer; where one does, it is not counted. A -1 among real ids stays an ``expert_id`` error."""
    if not ids.size or int(ids.min()) != -1:  # the usual answer: one pass, no copy
        return ids
    moe = ids[:, list(geometry.moe_layers)] if ids.shape[1] == geometry.num_hidden_layers else ids
    padding = (moe == -1).all(axis=(1, 2))
    return ids[~padding] if padding.any() else ids


def _nested_lists(value: Any, geometry: EngineGeometry) -> np.ndarray:
    try:
        ids = np.asarray(value)
    except ValueError:  # ragged
        raise DataError("shape", "routing is a ragged list: expected [tokens, layers, top_k]") from None
    if ids.size and ids.dtype.kind not in "iu":
        raise DataError("encoding", f"routing holds {ids.dtype} values: expected integers")
    return ids.astype(np.int64, copy=False)
