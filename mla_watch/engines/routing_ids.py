"""One routing field's ids: decoded from the engines' encodings, checked against the model config, counted per
(MoE layer, expert), and encoded as the engines send them (numpy, no torch).

The encodings (the module docstring of :mod:`mla_watch.engines.formats` says where each sits in an answer):
vLLM >= 0.22's base64 ``.npy`` file, vLLM <= 0.21's nested JSON lists, SGLang's base64 of raw int32 ids.
Routing that does not fit the config raises :class:`DataError`, its reason one of :data:`DATA_ERRORS`.
:mod:`mla_watch.engines.formats` finds the fields in an answer and re-exports the public names here.
"""

from __future__ import annotations

import binascii
import io
import math
import threading
from typing import Any

import numpy as np
import pybase64  # what vLLM and SGLang encode with; SIMD, ~40x binascii on this machine

from mla_watch.engines.geometry import EngineGeometry

__all__ = [
    "DATA_ERRORS",
    "DataError",
    "describe_sent",
    "encode_npy",
    "encode_sglang",
    "encode_vllm",
    "every_layer",
    "moe_rows",
    "nested_list_ids",
    "raw_int32_ids",
    "refuse_duplicates",
    "routing_counts",
    "routing_position_counts",
    "sglang_routing_decoder",
    "vllm_routing_ids",
]


# Data-error reasons (a metric label): what was wrong with the routing an engine returned.
# duplicate_ids: one token's top-k names an expert twice, which no router can do (vLLM's capture
# returns all zeros when misconfigured, e.g. on CPU without --enforce-eager).
DATA_ERRORS = ("encoding", "shape", "expert_id", "duplicate_ids", "decoder")
_NPY_MAX_HEADER = 1 << 12  # numpy's own default is 10,000; a shape of three integers needs ~100 bytes


class DataError(ValueError):
    """Routing that does not fit the model config; ``reason`` is one of :data:`DATA_ERRORS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple:  # it travels back from the decoding process
        return (DataError, (self.reason, str(self)))


def describe_sent(value: Any) -> str:
    """A value an engine sent, for a message: a short number as it is, anything else by its type alone
    (unlike :func:`mla_watch.describe.describe_value`, which encodes the whole value first: an engine's may
    be megabytes)."""
    if isinstance(value, bool) or value is None or (isinstance(value, int | float) and len(repr(value)) <= 24):
        return repr(value)
    return f"a {type(value).__name__}"


def routing_counts(ids: np.ndarray, geometry: EngineGeometry) -> tuple[np.ndarray, int]:
    """Selections per (MoE layer, expert) of ``ids`` ``[tokens, layers, top_k]``, and the tokens; vectorised."""
    if ids.ndim != 3 or ids.shape[2] != geometry.top_k:
        raise DataError(
            "shape",
            f"routing of shape {list(ids.shape)}: expected [tokens, layers, {geometry.top_k}] "
            f"(top_k {geometry.top_k} from the model config)",
        )
    moe = len(geometry.moe_layers)
    if ids.shape[1] == geometry.num_hidden_layers and ids.shape[1] != moe:
        ids = moe_rows(ids, geometry)
    elif ids.shape[1] != moe:
        raise DataError(
            "shape",
            f"routing has {ids.shape[1]} layers: expected {geometry.num_hidden_layers} "
            f"(every layer) or {moe} (MoE layers) from the model config",
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= geometry.num_experts):
        raise DataError(
            "expert_id",
            f"routing holds expert ids in [{int(ids.min())}, {int(ids.max())}]: expected "
            f"[0, {geometry.num_experts - 1}] ({geometry.num_experts} experts)",
        )
    refuse_duplicates(ids)
    # One bincount over (layer, expert) pairs, written into a reused intp buffer: bincount takes it
    # as it is, and a fresh 8 MB array per response costs more in page faults than the count itself.
    offsets = (np.arange(moe, dtype=np.intp) * geometry.num_experts)[None, :, None]
    flat = _scratch(ids.size).reshape(ids.shape)
    np.add(ids, offsets, out=flat, casting="unsafe")
    counts = np.bincount(flat.reshape(-1), minlength=moe * geometry.num_experts).reshape(moe, geometry.num_experts)
    return counts, int(ids.shape[0])


def moe_rows(ids: np.ndarray, geometry: EngineGeometry) -> np.ndarray:
    """``ids`` ``[tokens, layers, top_k]`` of every layer (or of the MoE layers already) cut to the MoE layers."""
    moe = len(geometry.moe_layers)
    if ids.shape[1] == moe:
        return ids
    first, last = geometry.moe_layers[0], geometry.moe_layers[-1]
    contiguous = last - first + 1 == moe  # DeepSeek's dense-first layers: a view, not a copy
    return ids[:, first : last + 1, :] if contiguous else ids[:, list(geometry.moe_layers), :]


def routing_position_counts(
    ids: np.ndarray, geometry: EngineGeometry, edges: tuple[int, ...], start: int = 0, stop: int | None = None
) -> np.ndarray:
    """Selections per (MoE layer, position bucket, expert) of ``ids`` ``[tokens, layers, top_k]`` whose first row is
    the token at position ``start`` (row ``t``: position ``start + t``), rows at positions before ``stop`` only (the
    prompt's; ``None``: every row); ``edges`` are the buckets' end positions (a last bucket holds every position past
    them). Called on ids :func:`routing_counts` accepted."""
    moe = len(geometry.moe_layers)
    ids = moe_rows(ids, geometry)
    if stop is not None:
        ids = ids[: max(0, stop - start)]
    buckets = len(edges) + 1
    bucket = np.searchsorted(np.asarray(edges), start + np.arange(ids.shape[0]), side="right")  # [tokens]
    flat = (
        np.arange(moe, dtype=np.intp)[None, :, None] * buckets + bucket[:, None, None]
    ) * geometry.num_experts + ids.astype(np.intp, copy=False)
    counts = np.bincount(flat.reshape(-1), minlength=moe * buckets * geometry.num_experts)
    return counts.reshape(moe, buckets, geometry.num_experts)


_SCRATCH = threading.local()
SCRATCH_KEPT = 1 << 24  # ids: a buffer of up to 128 MB is kept for the next response of this thread


_PAIRWISE_TOP_K = 16


def refuse_duplicates(ids: np.ndarray) -> None:
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
        raise DataError(
            "duplicate_ids",
            f"routing of {tokens} of {ids.shape[0]} tokens names one expert twice "
            f"in its top-{ids.shape[2]} (first: token {token}, MoE layer {layer}, "
            f"expert {expert}): expected {ids.shape[2]} distinct experts per token; "
            "all-zero routing is what vLLM's capture returns when misconfigured "
            "(without --enforce-eager on CPU, for one)",
        )


def _scratch(size: int) -> np.ndarray:
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, dtype=np.intp)
        if size <= SCRATCH_KEPT:
            _SCRATCH.buffer = buffer
    return buffer[:size]


# ---------------------------------------------------------------------- reading (one field)
def vllm_routing_ids(value: Any, geometry: EngineGeometry) -> np.ndarray:
    """The ids of one vLLM ``routed_experts`` field: >= 0.22's base64 ``.npy`` file, or <= 0.21's nested lists."""
    return _npy(value, geometry) if isinstance(value, str | bytes | memoryview) else nested_list_ids(value, geometry)


def _b64(value: Any) -> bytes:
    if not isinstance(value, str | bytes | memoryview):
        raise DataError("encoding", f"routing is a {type(value).__name__}: expected a base64 string")
    try:
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise DataError("encoding", f"routing is not base64: {error}") from None


# numpy parses a .npy header with ast.literal_eval, and CPython 3.11 (3.11.7 here) can fail two such parses running
# in threads at once with "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905, seen
# reading reference prompts 4 at a time through vLLM). One header at a time; the arrays are still read in parallel.
_NPY_HEADER_LOCK = threading.Lock()


def _npy(value: str | bytes | memoryview, geometry: EngineGeometry) -> np.ndarray:
    """A ``.npy`` file's integer array, read in place; its header must describe exactly the bytes that follow
    (``np.load`` would first allocate whatever shape a header claims)."""
    raw = _b64(value)
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        with _NPY_HEADER_LOCK:
            shape, fortran_order, dtype = reader(stream, max_header_size=_NPY_MAX_HEADER)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as error:
        raise DataError("encoding", f"routing is not a .npy array: {type(error).__name__}") from None
    if dtype.hasobject or dtype.kind not in "iu":
        raise DataError("encoding", f"routing has dtype {dtype.str}: expected integers")
    if len(shape) != 3:
        raise DataError("shape", f"routing has {len(shape)} dimensions: expected [tokens, layers, {geometry.top_k}]")
    elements = math.prod(shape)
    payload = len(raw) - stream.tell()
    if elements * dtype.itemsize != payload:
        raise DataError(
            "encoding",
            f"routing's .npy header declares shape {list(shape)} of {dtype.str} "
            f"({elements * dtype.itemsize} bytes) over {payload} bytes: expected them equal",
        )
    ids = np.frombuffer(raw, dtype=dtype, count=elements, offset=stream.tell())
    return ids.reshape(shape, order="F" if fortran_order else "C")


def encode_npy(ids: np.ndarray) -> str:
    """``ids`` as base64 of a ``.npy`` file, in their own dtype (what vLLM returns, trimmed to a prompt start)."""
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    return pybase64.b64encode(buffer.getvalue()).decode("ascii")


def raw_int32_ids(value: Any, geometry: EngineGeometry) -> np.ndarray:
    """SGLang's headerless int32 bytes, shaped ``[tokens, layers, top_k]`` by the model config."""
    raw = _b64(value)
    if len(raw) % 4:
        raise DataError("encoding", f"routing has {len(raw)} bytes: expected whole int32 values")
    ids = np.frombuffer(raw, dtype="<i4")
    for layers in (geometry.num_hidden_layers, len(geometry.moe_layers)):
        if ids.size % (layers * geometry.top_k) == 0:
            return ids.reshape(-1, layers, geometry.top_k)
    raise DataError(
        "shape",
        f"routing holds {ids.size} ids: expected a multiple of layers x top_k = "
        f"{geometry.num_hidden_layers} x {geometry.top_k} from the model config",
    )


# SGLang sends the ids alone: no dtype, shape or offset beside them (SglExt, protocol.py:470-483; meta_info,
# tokenizer_manager.py:2602-2609), always int32 (state_capturer/base.py:38-42, 68-72). A sibling named like one
# is a format this decoder does not know: its ids are not read as int32 on a guess.
_SGLANG_SIBLING = "routed_experts_"


def sglang_routing_decoder(container: dict[str, Any], *, generated_only: bool = False, conflict: bool = False) -> Any:
    """The decode of one SGLang routing field, which reads the fields beside it in ``container``."""

    def decode(value: Any, geometry: EngineGeometry) -> np.ndarray:
        if conflict:
            raise DataError(
                "shape",
                "routing is both at the response level and in choices[].meta_info: SGLang "
                "sends one or the other; which rows repeat is not guessed",
            )
        for key in container:
            if isinstance(key, str) and key.startswith(_SGLANG_SIBLING):
                sibling = container[key]  # a dtype's name is short: shown as it is, anything else by its type
                shown = repr(sibling) if isinstance(sibling, str) and len(sibling) <= 24 else describe_sent(sibling)
                raise DataError(
                    "encoding",
                    f"routing comes with {key[:40]}={shown}: a field SGLang (up to "
                    "0.5.23) does not send; ids of a dtype or offset it may name are not "
                    "guessed",
                )
        ids = raw_int32_ids(value, geometry)
        if generated_only:
            ids = ids[ids.shape[0] - _sglang_generated_rows(container, ids.shape[0]) :]
        return _without_padding_rows(ids, geometry)

    return decode


def _sglang_generated_rows(meta: dict[str, Any], rows: int) -> int:
    """How many of a choice's ``rows`` are its generated tokens': the last ``completion_tokens - 1`` (the rows
    are positions ``[routed_experts_start_len, prompt + completion - 1)``, batch_result_processor.py:154-163;
    completion_tokens is ``len(output_ids_through_stop)``, output_streamer.py:490, 522-526). Counted from the
    end, the prompt's length and the start the request set are not needed."""
    completion = meta.get("completion_tokens")
    if type(completion) is not int or not 0 <= completion <= rows + 1:
        raise DataError(
            "shape",
            f"a later choice's routing has {rows} rows and meta_info.completion_tokens is "
            f"{describe_sent(completion)}: expected an integer in [0, {rows + 1}], to count the "
            "generated rows only (the prompt's rows repeat the first choice's)",
        )
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


def nested_list_ids(value: Any, geometry: EngineGeometry) -> np.ndarray:
    """vLLM <= 0.21's routing, nested JSON lists ``[tokens, layers, top_k]``, as an int64 array."""
    try:
        ids = np.asarray(value)
    except ValueError:  # ragged
        raise DataError("shape", "routing is a ragged list: expected [tokens, layers, top_k]") from None
    if ids.size and ids.dtype.kind not in "iu":
        raise DataError("encoding", f"routing holds {ids.dtype} values: expected integers")
    return ids.astype(np.int64, copy=False)


# ---------------------------------------------------------------------- writing (the embedded server)
def every_layer(ids: np.ndarray, layers: list[int], num_hidden_layers: int) -> np.ndarray:
    """``[tokens, moe_routers, top_k]`` spread on an axis of every decoder layer, dense ones zero (as the
    engines return it)."""
    spread = np.zeros((ids.shape[0], num_hidden_layers, ids.shape[2]), dtype=np.int32)
    spread[:, layers, :] = ids
    return spread


def encode_vllm(ids: np.ndarray, num_experts: int) -> str:
    """vLLM >= 0.22's ``routed_experts``: base64 of a ``.npy`` file, uint8 up to 256 experts, else uint16."""
    return encode_npy(ids.astype(np.uint8 if num_experts <= 256 else np.uint16))


def encode_sglang(ids: np.ndarray) -> str:
    """SGLang's ``sglext.routed_experts``: base64 of the raw little-endian int32 ids."""
    return pybase64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")
