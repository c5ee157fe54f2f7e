"""Router re-tuning: versioned router checkpoints and gradient-free bias re-fits."""

from mla_watch.retune.bias import BIAS_NAME, BiasRefitResult, refit_bias, supports_bias
from mla_watch.retune.registry import ROUTER_TENSOR_PATTERNS, RouterVersions, router_modules, router_state

__all__ = [
    "BIAS_NAME",
    "ROUTER_TENSOR_PATTERNS",
    "BiasRefitResult",
    "RouterVersions",
    "refit_bias",
    "router_modules",
    "router_state",
    "supports_bias",
]
