"""Router tensors as numpy arrays, and their safetensors files, without torch.

Beside an engine the sidecar holds router tensors (bf16, f16, f32) it never runs: numpy with ``ml_dtypes``'
``bfloat16`` holds them, and safetensors reads and writes them byte for byte as torch does (the same header,
the same dtype names). Where a torch model is served in this process, :func:`from_torch` and :func:`to_torch`
cross between the two; only they import torch, and only when called.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes  # gives numpy the bfloat16 that safetensors' numpy framework reads and writes
import numpy as np
from safetensors import deserialize, safe_open
from safetensors.numpy import load_file, save

from mla_watch.common.output_file import write_file

if TYPE_CHECKING:
    import torch

__all__ = [
    "BFLOAT16",
    "as_array",
    "as_arrays",
    "from_torch",
    "is_floating",
    "is_torch_tensor",
    "load_tensors",
    "read_tensors",
    "router_digest",
    "save_tensors",
    "tensors_from_bytes",
    "tensors_to_bytes",
    "to_torch",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def is_floating(dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds floats: numpy's own, or ``bfloat16`` (which numpy files under kind ``V``)."""
    return dtype.kind == "f" or dtype == BFLOAT16


def is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (torch never imported: it cannot be one)."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.Tensor)


def from_torch(tensor: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy of ``tensor``, of its dtype (``bfloat16`` as ``ml_dtypes.bfloat16``)."""
    import torch

    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.dtype == torch.bfloat16:  # numpy has no bf16 of its own: the same 16 bits, read by ml_dtypes
        return cpu.view(torch.int16).numpy().view(BFLOAT16).copy()
    return cpu.numpy().copy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor holding a copy of ``array``, of its dtype (``ml_dtypes.bfloat16`` as ``torch.bfloat16``)."""
    import torch

    contiguous = np.ascontiguousarray(array)
    if contiguous.dtype == BFLOAT16:
        return torch.from_numpy(contiguous.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(contiguous.copy())


def as_array(value: Any) -> np.ndarray:
    """``value`` as a numpy array: a torch tensor copied (:func:`from_torch`), anything else as numpy reads it."""
    return from_torch(value) if is_torch_tensor(value) else np.asarray(value)


def as_arrays(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Each of ``tensors`` as a contiguous numpy array of its own (:func:`as_array`), in the same order."""
    return {name: np.array(as_array(value), copy=True, order="C") for name, value in tensors.items()}


def save_tensors(tensors: Mapping[str, np.ndarray], path: str | Path) -> None:
    """``tensors`` written as one safetensors file (each contiguous, in its dtype), by
    :func:`~mla_watch.common.output_file.write_file` (an ``OutputError`` in one line when the disk refuses)."""
    write_file(path, save({name: np.ascontiguousarray(array) for name, array in tensors.items()}))


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file ``path``."""
    return load_file(str(path))


def read_tensors(path: str | Path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The tensors ``names`` of the safetensors file ``path``, read lazily: no other tensor is loaded."""
    with safe_open(str(path), framework="numpy") as handle:
        return {name: handle.get_tensor(name) for name in names}


def tensors_to_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    """``tensors`` as the bytes of one safetensors file (what :func:`save_tensors` writes)."""
    return save({name: np.ascontiguousarray(array) for name, array in tensors.items()})


# safetensors' dtype names as numpy reads them (its numpy loader of bytes knows no BF16; its file loader does).
_SAFETENSORS_DTYPES = {
    "BF16": BFLOAT16,
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}


def tensors_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of the safetensors bytes ``data`` (``ValueError`` for a dtype a router tensor never has)."""
    out = {}
    for name, entry in deserialize(data):
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {entry['dtype']} is not one of {sorted(_SAFETENSORS_DTYPES)}")
        out[name] = np.frombuffer(bytes(entry["data"]), dtype=dtype).reshape(entry["shape"]).copy()
    return out


def router_digest(tensors: Mapping[str, Any]) -> str:
    """A content hash of router tensors: sha256 over each tensor's name, dtype, shape and bytes, in name order.

    Two replicas serving the same router values read the same digest whatever their file layout or the order the
    tensors were applied in; a single changed value changes it."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(as_array(tensors[name]))
        digest.update(f"{name}\0{array.dtype.name}\0{array.shape}\0".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
