"""A known-good router reference read from the original checkpoint: router tensors only.

``serve --reference-model DIR`` names the checkpoint the served model came from (or any
checkpoint of the same architecture whose routers are known to be healthy). Only the router
tensors of the live model (:func:`mla_watch.retune.router_tensors.router_state`'s names) are read, each
with ``safetensors``' lazy ``safe_open`` (no pickle, no expert weight loaded); the shapes must
match the live ones. ``restore`` puts these back before any registry version. They are numpy arrays in the
live tensors' dtypes (bf16 as ``ml_dtypes.bfloat16``): reading them needs no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError

from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.common.tensor_files import as_array, read_tensors
from mla_watch.engines.checkpoints import checkpoint_files

__all__ = ["RouterReference", "load_reference_routers"]


@dataclass(frozen=True)
class RouterReference:
    label: str  # "reference model /models/v3-base": what a job record says it restored from
    tensors: dict[str, np.ndarray]


def load_reference_routers(directory: str | Path, live: Mapping[str, Any]) -> RouterReference:
    """The tensors named in ``live`` (the live router state: numpy arrays, or a torch model's tensors), read from
    the checkpoint in ``directory``, in the live tensors' dtypes.

    A :class:`~mla_watch.common.setting_errors.SettingsError` about ``reference_model`` naming the directory, the
    tensor and what was expected when one is missing or has another shape, or the checkpoint cannot be read.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise _problem(directory, "not a directory", "the checkpoint directory of the served model")
    try:
        files = checkpoint_files(directory, "reference_model")
        missing = sorted(name for name in live if name not in files)
        if missing:
            raise _problem(
                directory,
                f"router tensor {missing[0]} is not in the checkpoint ({len(missing)} of {len(live)} missing)",
                "a checkpoint of the served model",
            )
        served = {name: as_array(value) for name, value in live.items()}
        tensors: dict[str, np.ndarray] = {}
        by_file: dict[Path, list[str]] = {}
        for name in live:
            by_file.setdefault(files[name], []).append(name)
        for path, names in by_file.items():
            for name, tensor in read_tensors(path, names).items():
                if tuple(tensor.shape) != tuple(served[name].shape):
                    raise _problem(
                        directory,
                        f"{name} has shape {tuple(tensor.shape)} in {path.name}",
                        f"{tuple(served[name].shape)}, as served",
                    )
                tensors[name] = tensor.astype(served[name].dtype)
    except (OSError, SafetensorError) as error:
        raise _problem(
            directory,
            f"cannot read the checkpoint: {type(error).__name__}: {str(error)[:200]}",
            "a readable safetensors checkpoint",
        ) from None
    return RouterReference(label=f"reference model {directory}", tensors=tensors)


def _problem(directory: Path, problem: str, expected: str) -> SettingsError:
    return SettingsError([SettingProblem("reference_model", str(directory), expected, problem=problem)])
