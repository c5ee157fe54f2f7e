"""A router-only checkpoint for an engine: its router tensors read from a model's checkpoint, written with a copy of
the engine's config.json into a directory of their own, and checked before an engine loads them.

vLLM's ``reload_weights`` and SGLang's weight update load such a directory in place of the routers
(:mod:`mla_watch.engines.vllm_weights`, :mod:`mla_watch.engines.sglang_weights`); a load that fails part-way
strands or stops the engine, so :func:`checked_router_dir` checks the directory first. The empty checkpoint
:func:`empty_checkpoint` writes finishes a failed reload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from mla_watch.common.tensor_files import as_array, is_floating, is_torch_tensor, read_tensors, save_tensors
from mla_watch.engines.checkpoints import checkpoint_files
from mla_watch.engines.geometry import MAX_CONFIG_BYTES, GeometryError, parse_geometry
from mla_watch.engines.swap import SwapError
from mla_watch.routing.routers import CORRECTION_BIAS

__all__ = [
    "ROUTER_TENSOR",
    "checked_router_dir",
    "empty_checkpoint",
    "read_router_tensors",
    "write_router_checkpoint",
]

ROUTER_TENSOR = re.compile(rf"^model\.layers\.(\d+)\.mlp\.gate\.(weight|{CORRECTION_BIAS})$")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DIRECTORY_MODE = 0o755  # the engine (maybe another user in the pod) reads them; they hold no customer data
FILE_MODE = 0o644
ROLLBACK_PREFIX = ".mla-watch-rollback-"


def read_router_tensors(checkpoint_dir: Path, layers: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The router tensors (:data:`ROUTER_TENSOR`) of the safetensors checkpoint in ``checkpoint_dir``, of the
    decoder ``layers`` given (all by default), read lazily: no other tensor is loaded. Numpy arrays in the
    checkpoint's dtypes (bf16 as ``ml_dtypes.bfloat16``). ``ValueError`` naming the directory and what was
    expected when it has none, or cannot be read."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise ValueError(f"checkpoint_dir {directory}: not a directory: expected a safetensors checkpoint")
    wanted = None if layers is None else {int(layer) for layer in layers}
    try:
        files = checkpoint_files(directory, "checkpoint_dir")
        by_file: dict[Path, list[str]] = {}
        for name, path in files.items():
            match = ROUTER_TENSOR.match(name)
            if match and (wanted is None or int(match[1]) in wanted):
                by_file.setdefault(path, []).append(name)
        tensors: dict[str, np.ndarray] = {}
        for path, names in by_file.items():
            tensors.update(read_tensors(path, names))
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"checkpoint_dir {directory}: cannot read the checkpoint: {type(error).__name__}: {str(error)[:200]}"
        ) from None
    if not tensors:
        which = "" if wanted is None else f" of layers {sorted(wanted)}"
        raise ValueError(
            f"checkpoint_dir {directory}: no router tensor{which}: expected "
            f"model.layers.N.mlp.gate.weight (and .{CORRECTION_BIAS}) in a MoE checkpoint"
        )
    return dict(sorted(tensors.items(), key=lambda item: _sort_key(item[0])))


def write_router_checkpoint(directory: Path, tensors: Mapping[str, np.ndarray], config_json: Path) -> Path:
    """``directory`` made anew, atomically, holding ``model.safetensors`` (these router tensors only,
    contiguous, in their dtype: numpy arrays, a torch tensor copied to one) and a copy of ``config_json`` (the
    engine's config): what an engine's swap loads. ``ValueError`` for a tensor that is no router's, one
    that does not fit the config, or a directory that exists.

    A router is written whole: a layer's bias without its weight, or a bias for some layers and not others,
    is refused (vLLM fills what a layer's load left out with uninitialised memory, ``reload/layerwise.py:273-275``).
    """
    directory = Path(directory)
    config_json = Path(config_json)
    if not tensors:
        raise ValueError("tensors: empty: expected the router tensors to write")
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        if not ROUTER_TENSOR.match(str(name)):
            raise ValueError(
                f"tensors: {str(name)[:200]!r} is no router tensor: expected names "
                f"model.layers.N.mlp.gate.weight or .{CORRECTION_BIAS} (a router checkpoint "
                "holds router tensors only)"
            )
        if not isinstance(tensor, np.ndarray) and not is_torch_tensor(tensor):
            raise ValueError(f"tensors: {name} is a {type(tensor).__name__}: expected a numpy array")
        array = arrays[name] = as_array(tensor)
        if not is_floating(array.dtype) or not bool(np.isfinite(array).all()):
            raise ValueError(f"tensors: {name} ({array.dtype}) is not all finite floats: expected router values")
    config = _read_config(config_json, "config_json")
    shapes = {name: tuple(array.shape) for name, array in arrays.items()}
    _check_routers(shapes, config, f"tensors for {config_json}")
    if directory.exists() or directory.is_symlink():
        raise ValueError(f"directory {directory}: exists: expected a new path (a router checkpoint is written once)")
    if not directory.parent.is_dir():
        raise ValueError(f"directory {directory}: its parent is not a directory: expected an existing one")
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        save_tensors(dict(sorted(arrays.items(), key=lambda item: _sort_key(item[0]))), staging / WEIGHTS_FILE)
        shutil.copyfile(config_json, staging / CONFIG_FILE)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            os.chmod(staging / name, FILE_MODE)
            _fsync(staging / name)
        os.chmod(staging, DIRECTORY_MODE)  # mkdtemp makes it 0700
        _fsync(staging)
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync(directory.parent)
    return directory


def _sort_key(name: str) -> tuple[int, str]:
    match = ROUTER_TENSOR.match(name)
    return (int(match[1]), match[2]) if match else (-1, name)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _read_config(path: Path, label: str) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{label} {path}: larger than {MAX_CONFIG_BYTES} bytes: expected a model's config.json")
        data = json.loads(path.read_bytes())
    except OSError as error:
        raise ValueError(
            f"{label} {path}: cannot be read ({error.strerror or type(error).__name__}): expected "
            "the config.json of the engine's model"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{label} {path}: not JSON: expected the config.json of the engine's model") from None
    if not isinstance(data, dict):
        raise ValueError(f"{label} {path}: not a JSON object: expected the config.json of the engine's model")
    return data


def _check_routers(shapes: Mapping[str, tuple[int, ...]], config: dict[str, Any], where: str) -> None:
    """Each name a router tensor of a MoE layer of ``config``, of its shape; every router whole."""
    try:
        geometry = parse_geometry(config)
    except GeometryError as error:
        raise ValueError(f"{where}: the config does not describe MoE routers: {str(error)[:300]}") from None
    text = config.get("text_config") if "num_hidden_layers" not in config else config
    hidden = text.get("hidden_size") if isinstance(text, dict) else None
    kinds: dict[int, set[str]] = {}
    for name, shape in shapes.items():
        match = ROUTER_TENSOR.match(name)
        if match is None:
            raise ValueError(f"{where}: {name[:200]!r} is no router tensor: expected router tensors only")
        layer, kind = int(match[1]), match[2]
        if layer not in geometry.moe_layers:
            raise ValueError(
                f"{where}: {name} is of layer {layer}: expected a MoE layer of the config ({list(geometry.moe_layers)})"
            )
        expected: tuple[int | None, ...] = (
            (geometry.num_experts, hidden) if kind == "weight" else (geometry.num_experts,)
        )
        if len(shape) != len(expected) or any(
            want is not None and got != want for got, want in zip(shape, expected, strict=True)
        ):
            shown = "x".join("?" if want is None else str(want) for want in expected)
            raise ValueError(
                f"{where}: {name} has shape {list(shape)}: expected [{shown}] (experts x hidden size from the config)"
            )
        kinds.setdefault(layer, set()).add(kind)
    without_weight = sorted(layer for layer, found in kinds.items() if "weight" not in found)
    if without_weight:
        raise ValueError(
            f"{where}: layer {without_weight[0]} has {CORRECTION_BIAS} without its gate weight: expected whole routers"
        )
    with_bias = sorted(layer for layer, found in kinds.items() if CORRECTION_BIAS in found)
    if with_bias and len(with_bias) != len(kinds):
        missing = sorted(set(kinds) - set(with_bias))
        raise ValueError(
            f"{where}: layer {missing[0]} has no {CORRECTION_BIAS} while layer {with_bias[0]} "
            "has one: expected whole routers (every layer's bias, or none)"
        )


def _checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in ``directory``'s safetensors, read from the headers (no data is loaded; a file
    shorter than its header says does not open)."""
    shapes: dict[str, tuple[int, ...]] = {}
    files = checkpoint_files(directory, "weights_path")
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="numpy") as handle:
            for name in names:
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def empty_checkpoint(parent: Path) -> Path:
    """A checkpoint with no tensor beside the swapped one: reloading it finishes a failed reload
    (:mod:`mla_watch.engines.vllm_weights`)."""
    directory = Path(tempfile.mkdtemp(prefix=ROLLBACK_PREFIX, dir=parent))
    try:
        save_tensors({}, directory / WEIGHTS_FILE)  # no tensor: the same file whichever framework writes it
        os.chmod(directory / WEIGHTS_FILE, FILE_MODE)
        os.chmod(directory, DIRECTORY_MODE)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def checked_router_dir(weights_path: Path, engine: str) -> Path:
    """``weights_path`` as ``engine`` will read it, checked here first (a load that fails part-way strands or stops
    the engine): absolute, a directory, router tensors only, of the shapes its config.json gives."""
    path = Path(weights_path)
    if not path.is_absolute():
        raise SwapError(
            f"weights_path {path}: relative: expected an absolute path ({engine} takes a path that is "
            "not a directory for a Hugging Face repo id)"
        )
    if not path.is_dir():
        raise SwapError(
            f"weights_path {path}: not a directory here: expected the directory "
            "write_router_checkpoint wrote, at the path the engine sees it too"
        )
    try:
        config = _read_config(path / CONFIG_FILE, "weights_path")
        _check_routers(_checkpoint_shapes(path), config, f"weights_path {path}")
    except (OSError, SafetensorError) as error:
        raise SwapError(
            f"weights_path {path}: cannot read the checkpoint: {type(error).__name__}: {str(error)[:200]}"
        ) from None
    except ValueError as error:
        raise SwapError(str(error)) from None
    return path
