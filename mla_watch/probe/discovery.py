"""Find the routers of a model and describe them.

A *router* is a module whose forward pass chooses ``top_k`` of ``num_slots`` slots for every
token (or query):

* expert routers (MoE gates) - ``transformers`` 5.x ``*TopkRouter`` / ``*TopKRouter`` modules
  whose forward returns ``(logits, weights, indices)``;
* DSA indexers - ``*Indexer`` modules (DeepSeek-V3.2, GLM-MoE-DSA) whose forward returns the
  ``[batch, seq, index_topk]`` key positions each query attends to.

Anything else that looks like a router (a class named ``*Router`` or ``*Indexer`` that the
rules above cannot read) is an error rather than a silent gap in coverage; teach mla_watch
about it with :func:`register_router`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mla_watch.routing import KINDS, Kind
from mla_watch.windows import RouterInfo

__all__ = [
    "DEFAULT_REGISTRY",
    "Kind",
    "NoRoutersFoundError",
    "RouterInfo",
    "RouterRegistry",
    "RouterSpec",
    "UnknownRouterError",
    "discover_routers",
    "register_router",
]

REGISTER_HINT = (
    "register it with mla_watch.register_router(<class or class name>, kind='expert'|'indexer', "
    "num_slots=..., top_k=..., indices=...) before attach(), or pass ignore=[<class name>] to skip it"
)


class NoRoutersFoundError(ValueError):
    """The model has no module that mla_watch recognises as a router."""


class UnknownRouterError(ValueError):
    """A module looks like a router but no rule knows how to read it."""


def _last_of_tuple(output: Any) -> torch.Tensor:
    return output[-1] if isinstance(output, tuple | list) else output


@dataclass(frozen=True)
class RouterSpec:
    """How to read one class of router.

    ``num_slots`` and ``top_k`` take the module and the model config; ``indices`` takes the
    module's forward output and returns the integer tensor of chosen slots (``-1`` = none).
    ``mask_argument`` names the forward argument (and its position) holding the attention
    mask an indexer scored against, so that masked positions it was forced to return are not
    counted as choices. ``may_pad`` says the indices can hold ``-1`` or values beyond
    ``num_slots`` (dropped tokens), which then cost a range check per forward pass.
    """

    kind: Kind
    num_slots: Callable[[nn.Module, Any], int]
    top_k: Callable[[nn.Module, Any], int]
    indices: Callable[[Any], torch.Tensor] = _last_of_tuple
    mask_argument: tuple[str, int] | None = None
    may_pad: bool = False


def _expert_spec() -> RouterSpec:
    return RouterSpec(
        kind="expert",
        num_slots=lambda module, config: int(module.num_experts),
        top_k=lambda module, config: int(module.top_k),
    )


def _indexer_slots(module: nn.Module, config: Any) -> int:
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    if positions <= 0:
        raise UnknownRouterError(
            f"indexer {type(module).__name__}: config.max_position_embeddings={positions!r}; "
            "expected a positive context length to size the key-position counters"
        )
    return positions


def _indexer_spec(module: nn.Module) -> RouterSpec:
    return RouterSpec(
        kind="indexer",
        num_slots=_indexer_slots,
        top_k=lambda module, config: int(module.index_topk),
        indices=lambda output: output,
        mask_argument=("attention_mask", 3),
        # DeepSeek-V4's compressed-attention indexer pads its choices with -1.
        may_pad=hasattr(module, "compress_rate"),
    )


_EXPERT_CLASS = re.compile(r"Top[kK]Router$")
_INDEXER_CLASS = re.compile(r"Indexer$")
_LOOKS_LIKE_ROUTER = re.compile(r"(Router|Indexer)$")
_LAYER_IN_PATH = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)(?:\.|$)")


class RouterRegistry:
    """Maps router classes to the spec that reads them.

    Explicit registrations win over the built-in naming rules, so a custom spec can also
    override how a known family is read.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, RouterSpec] = {}

    def register(
        self,
        router_class: type[nn.Module] | str,
        *,
        kind: Kind,
        num_slots: Callable[[nn.Module, Any], int],
        top_k: Callable[[nn.Module, Any], int],
        indices: Callable[[Any], torch.Tensor] = _last_of_tuple,
        mask_argument: tuple[str, int] | None = None,
        may_pad: bool = True,
    ) -> RouterSpec:
        if kind not in KINDS:
            raise ValueError(f"register_router: kind={kind!r}; expected 'expert' or 'indexer'")
        name = router_class if isinstance(router_class, str) else router_class.__name__
        spec = RouterSpec(kind, num_slots, top_k, indices, mask_argument, may_pad)
        self._by_name[name] = spec
        return spec

    def copy(self) -> RouterRegistry:
        clone = RouterRegistry()
        clone._by_name = dict(self._by_name)
        return clone

    def spec_for(self, module: nn.Module) -> RouterSpec | None:
        """The spec for ``module``; ``None`` when it is not a router at all."""
        name = type(module).__name__
        if name in self._by_name:
            return self._by_name[name]
        if _EXPERT_CLASS.search(name) and hasattr(module, "num_experts") and hasattr(module, "top_k"):
            return _expert_spec()
        if _INDEXER_CLASS.search(name) and hasattr(module, "index_topk"):
            return _indexer_spec(module)
        if name.endswith("Router") and hasattr(module, "num_experts") and hasattr(module, "top_k"):
            # Routers outside the TopK naming (DeepSeek-V4's hash router) that keep the same contract.
            return _expert_spec()
        return None


DEFAULT_REGISTRY = RouterRegistry()


def register_router(
    router_class: type[nn.Module] | str,
    *,
    kind: Kind,
    num_slots: Callable[[nn.Module, Any], int],
    top_k: Callable[[nn.Module, Any], int],
    indices: Callable[[Any], torch.Tensor] = _last_of_tuple,
    mask_argument: tuple[str, int] | None = None,
    may_pad: bool = True,
) -> RouterSpec:
    """Teach mla_watch to read a custom router class (process-wide registry).

    Example, for a gate whose forward returns ``(weights, indices)``::

        mla_watch.register_router(
            "MyMoEGate", kind="expert",
            num_slots=lambda gate, config: gate.n_experts,
            top_k=lambda gate, config: gate.k,
            indices=lambda output: output[1],
        )
    """
    return DEFAULT_REGISTRY.register(
        router_class,
        kind=kind,
        num_slots=num_slots,
        top_k=top_k,
        indices=indices,
        mask_argument=mask_argument,
        may_pad=may_pad,
    )


def layer_of(path: str) -> int:
    """The decoder-layer index in a module path (``model.layers.3.mlp.gate`` -> 3); -1 if none."""
    match = _LAYER_IN_PATH.search(path)
    return int(match.group(1)) if match else -1


def discover_routers(
    model: nn.Module,
    *,
    registry: RouterRegistry | None = None,
    ignore: Sequence[str] = (),
    max_indexer_slots: int | None = None,
) -> Iterator[tuple[nn.Module, RouterInfo, RouterSpec]]:
    """Yield ``(module, info, spec)`` for every router of ``model``, in module order.

    Raises :class:`UnknownRouterError` for a module named like a router that no rule reads,
    and :class:`NoRoutersFoundError` when the model has no routers at all.
    """
    registry = registry or DEFAULT_REGISTRY
    config = getattr(model, "config", None)
    found = 0
    for path, module in model.named_modules():
        class_name = type(module).__name__
        if class_name in ignore:
            continue
        spec = registry.spec_for(module)
        if spec is None:
            if _LOOKS_LIKE_ROUTER.search(class_name):
                raise UnknownRouterError(
                    f"module {path!r} is a {class_name}, which looks like a router but mla_watch "
                    f"cannot read it (expected attributes num_experts/top_k for an expert router or "
                    f"index_topk for an indexer); {REGISTER_HINT}"
                )
            continue
        num_slots = int(spec.num_slots(module, config))
        if spec.kind == "indexer" and max_indexer_slots is not None:
            num_slots = min(num_slots, max_indexer_slots)
        top_k = int(spec.top_k(module, config))
        if num_slots < 1 or top_k < 1:
            raise UnknownRouterError(
                f"module {path!r} ({class_name}): num_slots={num_slots}, top_k={top_k}; "
                "expected both >= 1"
            )
        found += 1
        yield module, RouterInfo(path, layer_of(path), spec.kind, num_slots, top_k), spec
    if not found:
        raise NoRoutersFoundError(
            f"no routers found in {type(model).__name__}: mla_watch recognises expert routers "
            "(classes named *TopkRouter/*TopKRouter with num_experts and top_k) and DSA indexers "
            f"(classes named *Indexer with index_topk); for another router class, {REGISTER_HINT}"
        )
