"""Each engine's weight backend (:class:`~mla_watch.engines.swap.EngineWeights`), by the name ``serve --engine``
gives the engine: what re-tunes its routers in place and reads reference prompts through it.

The backends are imported when one is made: a sidecar that never swaps or scores loads neither.
"""

from __future__ import annotations

from collections.abc import Callable

from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.swap import EngineWeights

__all__ = ["SWAPPING_ENGINES", "engine_weights"]


def _vllm(
    url: str, timeout: float, geometry: EngineGeometry, api_key: str | None, admin_api_key: str | None
) -> EngineWeights:
    from mla_watch.engines.vllm_weights import VllmWeights

    return VllmWeights(url, timeout=timeout, geometry=geometry, api_key=api_key)  # one key: vLLM has no admin key


def _sglang(
    url: str, timeout: float, geometry: EngineGeometry, api_key: str | None, admin_api_key: str | None
) -> EngineWeights:
    from mla_watch.engines.sglang_weights import SglangWeights

    return SglangWeights(url, timeout=timeout, geometry=geometry, api_key=api_key, admin_api_key=admin_api_key)


_BACKENDS: dict[str, Callable[[str, float, EngineGeometry, str | None, str | None], EngineWeights]] = {
    "vllm": _vllm,
    "sglang": _sglang,
}
SWAPPING_ENGINES = tuple(_BACKENDS)  # the engines whose routers can be swapped and whose scores read


def engine_weights(
    engine: str,
    url: str,
    *,
    timeout: float,
    geometry: EngineGeometry,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> EngineWeights | None:
    """The weight backend of the engine ``serve --engine`` names, at ``url``; ``None`` for an engine without one
    (``none``, ``auto``: the swap endpoints differ between engines)."""
    backend = _BACKENDS.get(engine)
    return None if backend is None else backend(url, timeout, geometry, api_key, admin_api_key)
