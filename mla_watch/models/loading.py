"""Load the bundled model, or any ``save_pretrained`` directory of a supported architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def load_model(name_or_path: str | Path = "bundled", device: str = "auto",
               attn_implementation: str = "eager") -> tuple[Any, Any]:
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
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.to(target).eval()
    return model, tokenizer
