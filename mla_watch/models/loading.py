"""Load the bundled model, or any ``save_pretrained`` directory of a supported architecture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from mla_watch.common.progress import quiet_progress_bars

__all__ = ["BUNDLED_DIR", "load_model", "resolve_device"]

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when there is one; ``cpu`` / ``cuda`` / ``cuda:N`` are taken as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine; use 'auto' or 'cpu'")
    return resolved


def load_model(
    name_or_path: str | Path = "bundled", device: str = "auto", attn_implementation: str = "eager"
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode; ``"bundled"`` is the shipped demo model.

    Loading never touches the network: a path must be a local ``save_pretrained`` directory.
    """
    path = BUNDLED_DIR if str(name_or_path) == "bundled" else Path(name_or_path)
    if not (path / "config.json").is_file():
        hint = " (run `python -m mla_watch.models.train` to build it)" if path == BUNDLED_DIR else ""
        raise FileNotFoundError(
            f"model {str(name_or_path)!r}: {path}/config.json not found; expected 'bundled' or a local "
            f"save_pretrained directory{hint}"
        )
    target = resolve_device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    with quiet_progress_bars():  # transformers' "Loading weights" bar: a library's output, not the caller's
        model = _load_weights(path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.to(target).eval()
    return model, tokenizer


def _model_classes(path: Path) -> list[tuple[str, Any]]:
    """Where a model without a causal-LM mapping can still be built from: ``(how, class)``, best first.

    The classes named in config.json's ``architectures`` (glm5_next's ``Glm5NextForConditionalGeneration``), then
    the image-text-to-text auto class (glm4v_moe): both take ``input_ids`` alone for text.
    """
    config_file = path / "config.json"
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        architectures = []
    found = [
        (f"{config_file}: architectures {name!r}", getattr(transformers, name))
        for name in architectures
        if isinstance(name, str) and hasattr(transformers, name)
    ]
    found.append(("AutoModelForImageTextToText", transformers.AutoModelForImageTextToText))
    return found


def _load_weights(path: Path, **kwargs: Any) -> Any:
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as causal_error:
        if "Unrecognized configuration class" not in str(causal_error):
            raise
        tried = []
        for how, model_class in _model_classes(path):
            try:
                return model_class.from_pretrained(path, **kwargs)
            except (ValueError, TypeError, AttributeError) as error:
                tried.append(f"{how}: {' '.join(str(error).split())[:200]}")
        config_file = path / "config.json"
        model_type = json.loads(config_file.read_text()).get("model_type")
        raise ValueError(
            f"{config_file}: model_type={model_type!r} has no AutoModelForCausalLM mapping in transformers "
            f"{transformers.__version__}, and no other class loads it (tried {'; '.join(tried) or 'nothing'}); "
            "expected a causal LM, or an architectures entry naming a transformers class that takes input_ids"
        ) from causal_error
