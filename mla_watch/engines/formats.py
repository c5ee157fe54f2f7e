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
* **SGLang >= 0.5.9** (``--enable-return-routed-experts`` and the request field
  ``return_routed_experts: true``): top-level ``sglext.routed_experts``, base64 of raw int32
  ``[prompt + generated - 1, num_hidden_layers, top_k]`` for the first choice only; a stream
  carries it in one extra chunk with ``choices: []`` after the last token.

A layer axis of ``num_hidden_layers`` rows is read at the MoE layers only; one of as many
rows as MoE layers is read as it is. Anything else - a shape the config does not explain,
an expert id out of range, a field that does not decode - is a data error: the response's
routing is not counted, and the error is reported with its reason.
"""

from __future__ import annotations

import binascii
import io
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pybase64  # what vLLM and SGLang encode with; SIMD, ~40x binascii on this machine

from mla_watch.engines.geometry import EngineGeometry

__all__ = ["ENGINES", "ROUTING_REQUEST_FIELD", "DataError", "Decoded", "RoutingPlan", "decode_chunk",
           "decode_response", "encode_sglang", "encode_vllm", "every_layer", "routing_counts"]

ENGINES = ("vllm", "sglang")
# SGLang's request field; a client that sends it wants the routing itself, on any engine.
ROUTING_REQUEST_FIELD = "return_routed_experts"
# Data-error reasons (a metric label): what was wrong with the routing an engine returned.
DATA_ERRORS = ("encoding", "shape", "expert_id")
# A base64 routing string, cut out of the raw body before parsing (see _parse). Inside a JSON string
# every quote is escaped, so `s"` - and this pattern - can only match a key of the document.
_ROUTING_STRING = re.compile(rb'"routed_experts"\s*:\s*"')
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

    engine: str
    geometry: EngineGeometry
    keep: bool  # the client asked for the routing itself: leave it in the response
    extra: dict[str, Any] | None = None  # mla_watch's object, added to the body (or to the first chunk)


@dataclass
class Decoded:
    """One response (or stream chunk) after decoding: what the client gets, and what was counted."""

    body: bytes | None  # None: drop this stream chunk (it carried nothing but routing the client did not ask for)
    counts: np.ndarray | None = None  # [moe_layers, num_experts] int64; None when there was no routing
    tokens: int = 0
    error: DataError | None = None
    notes: list[str] = field(default_factory=list)

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
    # One bincount over (layer, expert) pairs, written into a reused intp buffer: bincount takes it
    # as it is, and a fresh 8 MB array per response costs more in page faults than the count itself.
    offsets = (np.arange(moe, dtype=np.intp) * geometry.num_experts)[None, :, None]
    flat = _scratch(ids.size).reshape(ids.shape)
    np.add(ids, offsets, out=flat, casting="unsafe")
    counts = np.bincount(flat.reshape(-1), minlength=moe * geometry.num_experts).reshape(moe, geometry.num_experts)
    return counts, int(ids.shape[0])


_SCRATCH = threading.local()
SCRATCH_KEPT = 1 << 24  # ids: a buffer of up to 128 MB is kept for the next response of this thread


def _scratch(size: int) -> np.ndarray:
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, dtype=np.intp)
        if size <= SCRATCH_KEPT:
            _SCRATCH.buffer = buffer
    return buffer[:size]


def decode_response(plan: RoutingPlan, body: bytes) -> Decoded:
    """A whole (non-streamed) response body: count its routing, strip it unless kept, add ``extra``."""
    try:
        document, arrays, error = _parse_and_take(plan, body)
    except (ValueError, RecursionError):
        return Decoded(body)  # not ours to judge: the client gets what the engine said
    return _finish(plan, document, arrays, error, plan.extra)


def decode_chunk(plan: RoutingPlan, data: str, *, first: bool) -> Decoded:
    """One server-sent event's ``data:`` payload (JSON); the first one gets ``extra``."""
    try:
        document, arrays, error = _parse_and_take(plan, data.encode())
    except (ValueError, RecursionError):
        return Decoded(data.encode())
    if (arrays or error is not None) and not plan.keep and document.get("choices") == [] \
            and not document.get("usage"):
        decoded = _finish(plan, document, arrays, error, None)
        decoded.body = None  # SGLang's routing-only chunk: the client did not ask for it
        return decoded
    return _finish(plan, document, arrays, error, plan.extra if first else None)


# ---------------------------------------------------------------------- writing (the embedded server)
def every_layer(ids: np.ndarray, layers: list[int], num_hidden_layers: int) -> np.ndarray:
    """``[tokens, moe_routers, top_k]`` spread on an axis of every decoder layer, dense ones zero (as the
    engines return it)."""
    spread = np.zeros((ids.shape[0], num_hidden_layers, ids.shape[2]), dtype=np.int32)
    spread[:, layers, :] = ids
    return spread


def encode_vllm(ids: np.ndarray, num_experts: int) -> str:
    """vLLM >= 0.22's ``routed_experts``: base64 of a ``.npy`` file, uint8 up to 256 experts, else uint16."""
    buffer = io.BytesIO()
    np.save(buffer, ids.astype(np.uint8 if num_experts <= 256 else np.uint16), allow_pickle=False)
    return pybase64.b64encode(buffer.getvalue()).decode("ascii")


def encode_sglang(ids: np.ndarray) -> str:
    """SGLang's ``sglext.routed_experts``: base64 of the raw little-endian int32 ids."""
    return pybase64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")


# ---------------------------------------------------------------------- internals
def _finish(plan: RoutingPlan, document: dict[str, Any], arrays: list[np.ndarray], error: DataError | None,
            extra: dict[str, Any] | None) -> Decoded:
    decoded = Decoded(b"", error=error)
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
    decoded.body = json.dumps(document, separators=(",", ":")).encode()
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
    lifted: dict[str, memoryview] = {}
    if not lift:
        return json.loads(body), lifted
    pieces: list[bytes] = []
    position = 0
    while (match := _ROUTING_STRING.search(body, position)) is not None:
        start = match.end()
        end = body.find(b'"', start)  # memchr over the string: the regex never scans its megabytes
        if end < 0:
            break
        if body.find(b"\\", start, end) >= 0:  # an escaped string is left to the parser
            pieces.append(body[position:end])
        else:
            name = f"{_LIFTED}{len(lifted)}"
            lifted[name] = memoryview(body)[start:end]  # no copy of the megabytes
            pieces += [body[position:start], json.dumps(name)[1:-1].encode()]
        position = end
    if not lifted:
        return json.loads(body), lifted
    pieces.append(body[position:])
    return json.loads(b"".join(pieces)), lifted


def _take(plan: RoutingPlan, document: dict[str, Any],
          lifted: dict[str, memoryview]) -> tuple[list[np.ndarray], DataError | None, int]:
    """The routing arrays of ``document``, removed from it unless the plan keeps them; and how many
    cut-out strings were found in their place."""
    fields = _vllm_fields(document) if plan.engine == "vllm" else _sglang_fields(document)
    arrays: list[np.ndarray] = []
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
                arrays.append(decode(value, plan.geometry))
            except DataError as failure:
                error = failure
    if plan.engine == "sglang" and not plan.keep and document.get("sglext") == {}:
        del document["sglext"]
    return arrays, error, claimed


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
    ext = document.get("sglext")
    if isinstance(ext, dict) and "routed_experts" in ext:
        return [(ext, "routed_experts", _raw_int32)]
    return []


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
    try:
        ids = np.load(io.BytesIO(_b64(value)), allow_pickle=False)
    except DataError:
        raise
    except (ValueError, OSError, EOFError) as error:
        raise DataError("encoding", f"routing is not a .npy array: {type(error).__name__}") from None
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        raise DataError("encoding", f"routing has dtype {getattr(ids, 'dtype', '?')}: expected integers")
    return ids


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


def _nested_lists(value: Any, geometry: EngineGeometry) -> np.ndarray:
    try:
        ids = np.asarray(value)
    except ValueError:  # ragged
        raise DataError("shape", "routing is a ragged list: expected [tokens, layers, top_k]") from None
    if ids.size and ids.dtype.kind not in "iu":
        raise DataError("encoding", f"routing holds {ids.dtype} values: expected integers")
    return ids.astype(np.int64, copy=False)
