"""mla_watch: a monitoring and guardrail sidecar for MLA/MoE language models.

The public API is imported lazily, so that ``import mla_watch.routing.stats`` (pure numpy) does
not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "mla_watch.models.loading",
    "attach": "mla_watch.probe",
    "register_router": "mla_watch.probe",
    "Probe": "mla_watch.probe",
    "RouterInfo": "mla_watch.probe",
    "NoRoutersFoundError": "mla_watch.probe",
    "UnknownRouterError": "mla_watch.probe",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

if TYPE_CHECKING:  # names for type checkers and IDEs; at run time __getattr__ imports them
    from mla_watch.models.loading import load_model  # noqa: F401
    from mla_watch.probe import (  # noqa: F401
        NoRoutersFoundError,
        Probe,
        RouterInfo,
        UnknownRouterError,
        attach,
        register_router,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mla_watch' has no attribute {name!r}")
