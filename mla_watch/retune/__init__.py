"""Router re-tuning: versioned router checkpoints and gradient-free bias re-fits.

Imported lazily, so that the torch-free parts (``retune.jobs``, ``retune.capture``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BIAS_NAME": "mla_watch.retune.bias",
    "BiasRefitResult": "mla_watch.retune.bias",
    "refit_bias": "mla_watch.retune.bias",
    "supports_bias": "mla_watch.retune.bias",
    "ROUTER_TENSOR_PATTERNS": "mla_watch.retune.router_tensors",
    "RouterVersions": "mla_watch.retune.versions",
    "router_modules": "mla_watch.retune.router_tensors",
    "router_state": "mla_watch.retune.router_tensors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from mla_watch.retune.bias import BIAS_NAME, BiasRefitResult, refit_bias, supports_bias  # noqa: F401
    from mla_watch.retune.router_tensors import ROUTER_TENSOR_PATTERNS, router_modules, router_state  # noqa: F401
    from mla_watch.retune.versions import RouterVersions  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mla_watch.retune' has no attribute {name!r}")
