"""A known-good router reference read from the original checkpoint: router tensors only.

``serve --reference-model DIR`` names the checkpoint the served model came from (or any
checkpoint of the same architecture whose routers are known to be healthy). Only the router
tensors of the live model (:func:`mla_watch.retune.router_tensors.router_state`'s names) are read, each
with ``safetensors``' lazy ``safe_open`` (no pickle, no expert weight loaded); the shapes must
match the live ones. ``restore`` puts these back before any registry version.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

if TYPE_CHECKING:  # checkpoint_files lists files; only load_reference_routers reads tensors (framework "pt")
    import torch

__all__ = ["RouterReference", "checkpoint_files", "load_reference_routers"]

_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class RouterReference:
    label: str  # "reference model /models/v3-base": what a job record says it restored from
    tensors: dict[str, torch.Tensor]


def checkpoint_files(directory: Path, label: str = "--reference-model") -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index file's map where there is one, else every
    ``*.safetensors`` file's names, read from its header). ``ValueError`` naming ``label`` (the option or
    argument that gave the directory) and the directory when neither can be read."""
    index = directory / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{label} {directory}: {_INDEX_FILE} is unreadable: expected JSON with a "
                             f"\"weight_map\" object of tensor name -> file") from None
        files: dict[str, Path] = {}
        for name, file in weight_map.items():
            path = (directory / str(file)).resolve()
            if path.parent != directory.resolve():  # the index must not point outside the checkpoint
                raise ValueError(f"{label} {directory}: {_INDEX_FILE} maps {str(name)[:200]!r} to a file "
                                 f"outside the directory: expected a file name in it")
            files[str(name)] = path
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{label} {directory}: no *.safetensors file: expected a checkpoint saved with "
                         f"save_pretrained (safetensors)")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            names = handle.keys()  # the handle itself is not iterable
            files.update((name, shard) for name in names)
    return files


def load_reference_routers(directory: str | Path, live: Mapping[str, torch.Tensor]) -> RouterReference:
    """The tensors named in ``live`` (the live router state), read from the checkpoint in ``directory``.

    ``ValueError`` naming the directory, the tensor and what was expected when one is missing or
    has another shape, or the checkpoint cannot be read.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--reference-model {directory}: not a directory: expected the checkpoint directory of "
                         f"the served model")
    try:
        files = checkpoint_files(directory)
        missing = sorted(name for name in live if name not in files)
        if missing:
            raise ValueError(f"--reference-model {directory}: router tensor {missing[0]} is not in the checkpoint "
                             f"({len(missing)} of {len(live)} missing): expected a checkpoint of the served model")
        tensors: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for name in live:
            by_file.setdefault(files[name], []).append(name)
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    if tuple(tensor.shape) != tuple(live[name].shape):
                        raise ValueError(f"--reference-model {directory}: {name} has shape {tuple(tensor.shape)} in "
                                         f"{path.name}: expected {tuple(live[name].shape)}, as served")
                    tensors[name] = tensor.to(live[name].dtype)
    except (OSError, SafetensorError) as error:
        raise ValueError(f"--reference-model {directory}: cannot read the checkpoint: {type(error).__name__}: "
                         f"{str(error)[:200]}") from None
    return RouterReference(label=f"reference model {directory}", tensors=tensors)
