"""Where the routers being re-tuned live: a model in this process, or a running engine.

The registry and the re-tune service read and write routers only through a :class:`RouterHost`:

* :class:`ModelRouters`: the model mla_watch serves itself; tensors are copied in place under
  the model lock the decode loop holds around each forward pass (torch, imported only by it).
* :class:`mla_watch.retune.engine_retuning.EngineRouters`: the routers of a vLLM (or SGLang) beside the
  sidecar; a swap writes a router-only checkpoint and has the engine reload it in place.

Either way the tensors cross a host as numpy arrays (:mod:`mla_watch.common.tensor_files`: bf16 as
``ml_dtypes.bfloat16``), so that the registry and the engine path run without torch.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from mla_watch.common.tensor_files import from_torch, is_torch_tensor, to_torch
from mla_watch.routing.routers import RouterInfo

if TYPE_CHECKING:
    import torch

__all__ = ["ModelRouters", "RouterHost", "as_host"]


class RouterHost(abc.ABC):
    """The expert routers of one served model, read and written as tensors named ``<router>.<leaf>``."""

    @abc.abstractmethod
    def routers(self) -> list[RouterInfo]:
        """The expert routers, in layer order."""

    @abc.abstractmethod
    def state(self, routers: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the router tensors serving now (optionally only those of ``routers``)."""

    @abc.abstractmethod
    def apply(self, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Serve ``tensors`` from now on (every name and shape checked before anything changes); what it took
        (JSON-able: seconds, and what the engine answered)."""

    def router_names(self) -> list[str]:
        return [info.name for info in self.routers()]

    def describe(self) -> str:
        return type(self).__name__


class ModelRouters(RouterHost):
    """The routers of a torch model served in this process."""

    def __init__(self, model: torch.nn.Module, lock: threading.Lock | Any | None = None) -> None:
        self.model = model
        self.lock = lock

    def routers(self) -> list[RouterInfo]:
        from mla_watch.probe.discovery import discover_routers

        return [info for _, info, _ in discover_routers(self.model) if info.kind == "expert"]

    def state(self, routers: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        from mla_watch.retune.router_tensors import router_state

        with self.lock if self.lock is not None else contextlib.nullcontext():
            return {name: from_torch(tensor) for name, tensor in router_state(self.model, routers).items()}

    def apply(self, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        from mla_watch.retune.router_tensors import apply_router_tensors

        # a torch tensor a local caller passes goes in as it is
        staged = {
            name: cast("torch.Tensor", value) if is_torch_tensor(value) else to_torch(np.asarray(value))
            for name, value in tensors.items()
        }
        apply_router_tensors(self.model, staged, self.lock)
        return {}

    def describe(self) -> str:
        return type(self.model).__name__


def as_host(target: torch.nn.Module | RouterHost, lock: threading.Lock | Any | None = None) -> RouterHost:
    """``target`` itself when it is a host, else its routers as a :class:`ModelRouters`."""
    return target if isinstance(target, RouterHost) else ModelRouters(target, lock)
