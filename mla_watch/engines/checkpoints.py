"""Where the tensors of a safetensors checkpoint directory live: tensor name -> file, without reading a tensor."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from mla_watch.common.setting_errors import SettingProblem, SettingsError

__all__ = ["INDEX_FILE", "checkpoint_files"]

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(directory: Path, field: str = "reference_model") -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index file's map where there is one, else every
    ``*.safetensors`` file's names, read from its header). A :class:`SettingsError` naming ``field`` (the
    setting or argument that gave the directory) and the directory when neither can be read."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise _problem(
                field,
                directory,
                f"{INDEX_FILE} is unreadable",
                'JSON with a "weight_map" object of tensor name -> file',
            ) from None
        files: dict[str, Path] = {}
        for name, file in weight_map.items():
            path = (directory / str(file)).resolve()
            if path.parent != directory.resolve():  # the index must not point outside the checkpoint
                raise _problem(
                    field,
                    directory,
                    f"{INDEX_FILE} maps {str(name)[:200]!r} to a file outside the directory",
                    "a file name in it",
                )
            files[str(name)] = path
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise _problem(
            field, directory, "no *.safetensors file", "a checkpoint saved with save_pretrained (safetensors)"
        )
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as handle:
            names = handle.keys()  # the handle itself is not iterable
            files.update((name, shard) for name in names)
    return files


def _problem(field: str, directory: Path, problem: str, expected: str) -> SettingsError:
    return SettingsError([SettingProblem(field, str(directory), expected, problem=problem)])
