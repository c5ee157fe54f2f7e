"""One dump of SGLang's expert-distribution recorder, read and checked whole before any count is used.

A dump is the uncompressed zip ``torch.save`` writes, holding ``logical_count``: a dense, contiguous integer
tensor ``[passes, layers, experts]`` no larger than :data:`MAX_DUMP_PASSES` rows whose storage backs every
element it declares, and whose counts are those of forward passes (>= 0, within int32, every MoE layer of a
pass counting the same tokens x top-k, no expert more than once per token). A file that is none is a
:class:`DumpError` with its reason (one of :data:`REJECT_REASONS`); :mod:`mla_watch.engines.recorder` polls
the files and counts the dumps.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.engines.geometry import EngineGeometry

__all__ = [
    "MAX_COUNT",
    "MAX_DUMP_BYTES",
    "MAX_DUMP_PASSES",
    "MAX_PICKLE_BYTES",
    "REJECT_REASONS",
    "STAT_MODE",
    "Dump",
    "DumpError",
    "read_dump",
]

# A stat dump of 1000 passes x 61 layers x 256 experts is 62 MB; far past that it is not one. It bounds the
# file, and (checked before torch.load) the bytes its zip entries hold once read.
MAX_DUMP_BYTES = 1 << 30
# SGLang's default --expert-distribution-recorder-buffer-size is 1000 passes. A larger configured buffer, or an
# unbounded one (-1: every pass since the last dump), holds more; 100x the default covers an unbounded buffer
# dumped every 10 s at 10,000 forward passes a second. A tensor declaring more rows than this (or than the
# configured buffer, where that is larger) is no dump: the file size does not bound what a tensor declares (a
# stride-0 view of 64 stored counts may declare millions of rows), so it is refused before it is read.
MAX_DUMP_PASSES = 100_000
# torch.save's data.pkl of a dump is a few hundred bytes; unpickling builds objects from all of it.
MAX_PICKLE_BYTES = 1 << 20
# SGLang counts in int32. Bounding every count by it keeps every sum taken here within int64: at most
# rows x experts x MAX_COUNT <= (MAX_DUMP_BYTES / 1 byte) x 2^31 = 2^61 (checked again where summed).
MAX_COUNT = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1
# Why a file of outcome "error" was set aside: mla_watch_engine_recorder_rejected_total{reason}.
REJECT_REASONS = (
    "unreadable",
    "format",
    "not_dense",
    "dtype",
    "shape",
    "too_large",
    "negative",
    "overflow",
    "inconsistent",
    "unexpected",
)
_INTEGER_DTYPES = ("torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.uint8")
STAT_MODE = "--expert-distribution-recorder-mode stat"  # the SGLang flag whose dumps these are
_MAX_SHOWN_DIMS = 8  # a shape of more dimensions is reported by its count: the numbers would be a wall of text


class DumpError(ValueError):
    """A recorder file that can never be counted (it is set aside all the same), and why (one of REJECT_REASONS)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Dump:
    """A validated stat dump: what it adds to each MoE layer's window."""

    counts: np.ndarray  # int64 [moe_layers, experts], summed over the passes
    tokens: int  # tokens of those passes: every MoE layer of a pass counted the same tokens x top-k choices
    recorded: int  # passes with any count (rows never written are zero)
    rows: int  # rows of the file's ring buffer


def read_dump(handle: Any, path: Path, geometry: EngineGeometry, *, max_passes: int | None = None) -> Dump:
    """A stat dump's counts, checked whole before any is used; :class:`DumpError` (with its reason) if it is none.

    ``max_passes`` bounds the rows a tensor may declare (default :data:`MAX_DUMP_PASSES`).
    """
    import torch  # only here: the sidecar imports this module whether or not a recorder is polled

    limit = MAX_DUMP_PASSES if max_passes is None else max_passes
    _check_archive(handle, path)
    handle.seek(0)
    try:
        data = torch.load(handle, map_location="cpu", weights_only=True)  # a shared volume: no arbitrary pickles
    except Exception as error:  # torch raises pickle, zip, EOF and runtime errors alike
        # The type only: torch's messages may quote the pickle (a key, a global's name) back.
        raise DumpError(
            "unreadable",
            f"{path}: cannot be read by torch.load(weights_only=True) "
            f"({type(error).__name__}); expected a recorder dump written by {STAT_MODE}",
        ) from None
    layers, moe, experts = geometry.num_hidden_layers, len(geometry.moe_layers), geometry.num_experts
    expected = f"[passes, {layers}, {experts}]"
    if moe != layers:
        expected += f" (every hidden layer) or [passes, {moe}, {experts}] (MoE layers only)"
    expected = f"an integer tensor of shape {expected} for {geometry.describe()}"
    if not isinstance(data, dict) or "logical_count" not in data:
        found = f"a dict of {len(data)} keys" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise DumpError(
            "format",
            f"{path}: key 'logical_count' missing ({found}); expected a dict holding {expected}, as {STAT_MODE} writes",
        )
    tensor = data["logical_count"]
    if not isinstance(tensor, torch.Tensor):
        raise DumpError("format", f"{path}: key 'logical_count' is a {type(tensor).__name__}; expected {expected}")
    if tensor.layout != torch.strided:  # sparse COO/CSR pass weights_only, and numpy() cannot take them
        raise DumpError(
            "not_dense",
            f"{path}: key 'logical_count' is a {tensor.layout} tensor; expected a dense "
            f"(torch.strided) one, {expected}",
        )
    if str(tensor.dtype) not in _INTEGER_DTYPES:
        raise DumpError("dtype", f"{path}: key 'logical_count' is a {tensor.dtype} tensor; expected {expected}")
    shape = list(tensor.shape)
    if len(shape) != 3 or shape[1] not in (layers, moe) or shape[2] != experts:
        found = f"shape {shape}" if len(shape) <= _MAX_SHOWN_DIMS else f"{len(shape)} dimensions"
        raise DumpError("shape", f"{path}: key 'logical_count' has {found}; expected {expected}")
    # All of the below reads the tensor's metadata only: nothing is materialised until every check passed.
    rows, itemsize = shape[0], tensor.element_size()
    if rows > limit or tensor.numel() * itemsize > MAX_DUMP_BYTES:
        raise DumpError(
            "too_large",
            f"{path}: key 'logical_count' declares {rows} passes ({tensor.numel()} counts "
            f"of {itemsize} bytes); expected at most {limit} passes and {MAX_DUMP_BYTES} bytes",
        )
    needed = (tensor.storage_offset() + tensor.numel()) * itemsize
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() < needed:
        raise DumpError(
            "not_dense",
            f"{path}: key 'logical_count' has strides {list(tensor.stride())} over "
            f"{tensor.untyped_storage().nbytes()} stored bytes; expected a contiguous tensor whose "
            f"storage holds all {tensor.numel()} counts it declares ({needed} bytes), as torch.save "
            "writes the recorder's buffer",
        )
    array = tensor.detach().numpy()
    if shape[1] == layers and moe != layers:
        array = array[:, list(geometry.moe_layers), :]
    if array.size == 0:
        return Dump(np.zeros((moe, experts), dtype=np.int64), 0, 0, rows)
    lowest, highest = int(array.min()), int(array.max())
    if lowest < 0:
        raise DumpError(
            "negative",
            f"{path}: key 'logical_count' holds negative counts (lowest {lowest}); expected counts of tokens, >= 0",
        )
    if highest > MAX_COUNT or rows * experts * highest > _INT64_MAX:
        raise DumpError(
            "overflow",
            f"{path}: key 'logical_count' holds a count of {highest}; expected at most "
            f"{MAX_COUNT}, as the recorder's int32 counts, so that the sums over {rows} passes fit int64",
        )
    choices = array.sum(axis=2, dtype=np.int64)  # [passes, moe layers]: expert choices of each layer in each pass
    _check_passes(path, array, choices, geometry)
    counts = array.sum(axis=0, dtype=np.int64)
    recorded = int(np.count_nonzero(choices[:, 0]))  # every MoE layer of a pass counts the same: the first tells
    return Dump(counts, int(choices[:, 0].sum()) // geometry.top_k, recorded, rows)


def _check_archive(handle: Any, path: Path) -> None:
    """The uncompressed zip torch.save writes: else its entries could inflate far past the file's size."""
    try:
        with zipfile.ZipFile(handle) as archive:  # a file object: closing the archive leaves it open
            entries = archive.infolist()
    except Exception as error:  # zipfile raises BadZipFile, struct, unicode and OS errors alike
        raise DumpError(
            "unreadable",
            f"{path}: not the zip archive torch.save writes ({type(error).__name__}); "
            f"expected a recorder dump written by {STAT_MODE}",
        ) from None
    total = 0
    for number, entry in enumerate(entries):
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != entry.compress_size:
            raise DumpError(
                "unreadable",
                f"{path}: zip entry #{number} is compressed ({entry.compress_size} bytes "
                f"for {entry.file_size}); expected the stored entries torch.save writes",
            )
        total += entry.file_size
        if entry.filename.rsplit("/", 1)[-1] == "data.pkl" and entry.file_size > MAX_PICKLE_BYTES:
            raise DumpError(
                "too_large",
                f"{path}: its pickle (zip entry #{number}) is {entry.file_size} bytes; "
                f"expected at most {MAX_PICKLE_BYTES}, a recorder dump's is a few hundred",
            )
    if total > MAX_DUMP_BYTES:
        raise DumpError("too_large", f"{path}: its zip entries hold {total} bytes; expected at most {MAX_DUMP_BYTES}")


def _check_passes(path: Path, array: np.ndarray, choices: np.ndarray, geometry: EngineGeometry) -> None:
    """Counts of forward passes: in each pass every MoE layer saw the same tokens, each choosing top-k distinct
    experts, and every rank's share was summed into the row (so a multiple of top_k, the same in each layer)."""
    top_k, layers = geometry.top_k, geometry.moe_layers
    where = f"{path}: key 'logical_count'"
    bad = np.argwhere(choices % top_k != 0)
    if bad.size:
        p, j = (int(v) for v in bad[0])
        raise DumpError(
            "inconsistent",
            f"{where}, pass {p}, layer {layers[j]}: {int(choices[p, j])} expert choices; "
            f"expected a multiple of top-{top_k}, {top_k} for each token",
        )
    bad = np.argwhere(choices != choices[:, :1])
    if bad.size:
        p, j = (int(v) for v in bad[0])
        raise DumpError(
            "inconsistent",
            f"{where}, pass {p}: layer {layers[j]} has {int(choices[p, j])} expert "
            f"choices, layer {layers[0]} {int(choices[p, 0])}; expected the same tokens x top-{top_k} in "
            "every MoE layer of a forward pass",
        )
    busiest = array.max(axis=2).astype(np.int64)  # [passes, moe layers]; <= MAX_COUNT, so x top_k fits int64
    bad = np.argwhere(busiest * top_k > choices)
    if bad.size:
        p, j = (int(v) for v in bad[0])
        raise DumpError(
            "inconsistent",
            f"{where}, pass {p}, layer {layers[j]}: an expert chosen {int(busiest[p, j])} "
            f"times by {int(choices[p, j]) // top_k} tokens; expected at most once per token (a token's "
            f"top-{top_k} experts are distinct)",
        )
