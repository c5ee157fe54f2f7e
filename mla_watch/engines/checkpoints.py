"""Where the tensors of a safetensors checkpoint directory live: tensor name -> file, without reading a tensor."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

__all__ = ["INDEX_FILE", "checkpoint_files"]

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(directory: Path, label: str = "--reference-model") -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index file's map where there is one, else every
    ``*.safetensors`` file's names, read from its header). ``ValueError`` naming ``label`` (the option or
    argument that gave the directory) and the directory when neither can be read."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{label} {directory}: {INDEX_FILE} is unreadable: expected JSON with a "
                             f"\"weight_map\" object of tensor name -> file") from None
        files: dict[str, Path] = {}
        for name, file in weight_map.items():
            path = (directory / str(file)).resolve()
            if path.parent != directory.resolve():  # the index must not point outside the checkpoint
                raise ValueError(f"{label} {directory}: {INDEX_FILE} maps {str(name)[:200]!r} to a file "
                                 f"outside the directory: expected a file name in it")
            files[str(name)] = path
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{label} {directory}: no *.safetensors file: expected a checkpoint saved with "
                         f"save_pretrained (safetensors)")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as handle:
            names = handle.keys()  # the handle itself is not iterable
            files.update((name, shard) for name in names)
    return files
