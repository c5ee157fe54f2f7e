"""The router tensors of a torch model: which they are, reading them and writing them in place.

Only the direct parameters and buffers named in :data:`ROUTER_TENSOR_PATTERNS` of every *expert*
router that :func:`mla_watch.probe.discover_routers` finds are router tensors (gate weight, gate
bias, ``e_score_correction_bias``), named ``<router>.<leaf>``. Expert weights, indexers and
everything else are never read or written here.
"""

from __future__ import annotations

import contextlib
import fnmatch
import threading
from collections.abc import Mapping, Sequence

import torch

from mla_watch.probe.discovery import discover_routers
from mla_watch.routing.routers import CORRECTION_BIAS

__all__ = ["ROUTER_TENSOR_PATTERNS", "apply_router_tensors", "router_modules", "router_state"]

# Leaf names (fnmatch patterns) of the tensors of an expert-router module that are router state.
# Matched against the module's *direct* parameters and buffers only (recurse=False), so nothing
# below a router module -- and no expert weight -- can ever be taken.
ROUTER_TENSOR_PATTERNS: tuple[str, ...] = ("weight", "bias", CORRECTION_BIAS)


def router_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``name -> module`` of every expert router found by probe discovery, in module order."""
    return {info.name: module for module, info, _ in discover_routers(model) if info.kind == "expert"}


def _router_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for leaf, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if tensor is not None and any(fnmatch.fnmatchcase(leaf, p) for p in ROUTER_TENSOR_PATTERNS):
            found[leaf] = tensor
    return found


def _live_router_tensors(model: torch.nn.Module, routers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """``full name -> the model's own tensor`` (not a copy) for the router tensors of ``routers``."""
    modules = router_modules(model)
    if routers is not None:
        unknown = [name for name in routers if name not in modules]
        if unknown:
            raise ValueError(f"not expert routers of {type(model).__name__}: {unknown}; routers are {list(modules)}")
        modules = {name: modules[name] for name in routers}
    return {
        f"{name}.{leaf}": tensor for name, module in modules.items() for leaf, tensor in _router_tensors(module).items()
    }


def router_state(model: torch.nn.Module, routers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """``name -> detached CPU clone`` of every router tensor (optionally only of the named routers)."""
    return {
        name: tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in _live_router_tensors(model, routers).items()
    }


def apply_router_tensors(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], lock: threading.Lock | None = None
) -> None:
    """Copy ``tensors`` into the model's router tensors in place, holding ``lock`` only for the copy.

    Every name and shape is checked (and every tensor staged on the model's device and dtype)
    before anything is written, so a bad checkpoint changes nothing.
    """
    live = _live_router_tensors(model)
    problems = []
    for name, tensor in tensors.items():
        if name not in live:
            problems.append(f"{name} is not a router tensor of the model")
        elif tuple(tensor.shape) != tuple(live[name].shape):
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the model's is {tuple(live[name].shape)}")
    if problems:
        raise ValueError(f"cannot load router tensors into {type(model).__name__}: " + "; ".join(problems))
    staged = {name: tensor.to(device=live[name].device, dtype=live[name].dtype) for name, tensor in tensors.items()}
    with lock if lock is not None else contextlib.nullcontext(), torch.no_grad():
        for name, tensor in staged.items():
            live[name].data.copy_(tensor)
