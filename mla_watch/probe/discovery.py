"""Find the routers of a model and describe them.

A *router* is a module whose forward pass chooses ``top_k`` of ``num_slots`` slots for every
token (or query):

* expert routers (MoE gates) - ``transformers`` 5.x ``*TopkRouter`` / ``*TopKRouter`` modules
  whose forward returns ``(logits, weights, indices)``;
* DSA indexers - ``*Indexer`` modules (DeepSeek-V3.2, GLM-MoE-DSA) whose forward returns the
  ``[batch, seq, index_topk]`` key positions each query attends to.

Routers outside that contract have built-in specs (:data:`BUILTIN_SPECS`): Llama-4 (chosen
experts recovered from its logits), Zaya (skip expert as a slot of its own), DBRX (top-k taken
outside the router), HunYuan-MoE, JetMoE, LongCat-Flash (zero-compute experts as slots of their
own), Inkling, Gemma-4, DeepSeek-V4's hash router (flagged ``hash_routed``), and the indexers
that pad their picks with ``-1`` (GLM-5-Next, MiniMax-M3, Qwen4's QSA indexer).

Anything else that looks like a router (a class named ``*Router``, ``*Indexer`` or ``*Gating``,
or ``*Gate`` with an expert count, that the rules above cannot read) is an error rather than a
silent gap in coverage; teach mla_watch about it with :func:`register_router`. So is a spec
whose ``indices`` does not return what the probe counts: every router is run once at attach
time on a two-token dummy input (or, when its forward needs more than hidden states, checked on
its first real output) and refused, with the class and the ``register_router`` call named,
unless ``indices(output)`` is an integer tensor of shape ``[..., top_k]`` with values below
``num_slots``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mla_watch.probe.family_specs import (
    BUILTIN_SPECS,
    RouterSpec,
    UnknownRouterError,
    expert_spec,
    indexer_spec,
    last_of_tuple,
)
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import KINDS, Kind

__all__ = [
    "BUILTIN_SPECS",
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


_EXPERT_CLASS = re.compile(r"Top[kK]Router$")
_INDEXER_CLASS = re.compile(r"Indexer$")
_LOOKS_LIKE_ROUTER = re.compile(r"(Router|Indexer|Gating)$")
# A *Gate is a router when it has an expert count (HunYuan's MoE gate), not when it gates a residual or a state.
_GATE_CLASS = re.compile(r"Gate$")
_EXPERT_COUNT_ATTRIBUTES = ("num_experts", "n_experts", "num_local_experts", "n_routed_experts")
_LAYER_IN_PATH = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)(?:\.|$)")


def _looks_like_router(module: nn.Module) -> bool:
    name = type(module).__name__
    if _LOOKS_LIKE_ROUTER.search(name):
        return True
    return bool(_GATE_CLASS.search(name)) and any(hasattr(module, key) for key in _EXPERT_COUNT_ATTRIBUTES)


class RouterRegistry:
    """Maps router classes to the spec that reads them.

    Explicit registrations win over the built-in specs and naming rules, so a custom spec can
    also override how a known family is read.
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
        indices: Callable[[Any], torch.Tensor] = last_of_tuple,
        mask_argument: tuple[str, int] | None = None,
        may_pad: bool = True,
        zero_slots: Callable[[nn.Module, Any], Sequence[int]] | None = None,
        hash_routed: bool = False,
    ) -> RouterSpec:
        if kind not in KINDS:
            raise ValueError(f"register_router: kind={kind!r}; expected 'expert' or 'indexer'")
        name = router_class if isinstance(router_class, str) else router_class.__name__
        spec = RouterSpec(kind, num_slots, top_k, indices, mask_argument, may_pad, zero_slots, hash_routed)
        self._by_name[name] = spec
        return spec

    def copy(self) -> RouterRegistry:
        clone = RouterRegistry()
        clone._by_name = dict(self._by_name)
        return clone

    def spec_for(self, module: nn.Module, config: Any = None) -> RouterSpec | None:
        """The spec for ``module`` (``config``: the model's); ``None`` when it is not a router at all."""
        name = type(module).__name__
        if name in self._by_name:
            return self._by_name[name]
        if name in BUILTIN_SPECS:
            return BUILTIN_SPECS[name](module, config)
        if _EXPERT_CLASS.search(name) and hasattr(module, "num_experts") and hasattr(module, "top_k"):
            return expert_spec()
        if _INDEXER_CLASS.search(name) and hasattr(module, "index_topk"):
            return indexer_spec(module)
        if name.endswith("Router") and hasattr(module, "num_experts") and hasattr(module, "top_k"):
            # Routers outside the TopK naming that keep the same contract; attach-time validation refuses
            # those that do not (Llama-4's returned (scores, logits) and crashed every forward pass).
            return expert_spec()
        return None


DEFAULT_REGISTRY = RouterRegistry()


def register_router(
    router_class: type[nn.Module] | str,
    *,
    kind: Kind,
    num_slots: Callable[[nn.Module, Any], int],
    top_k: Callable[[nn.Module, Any], int],
    indices: Callable[[Any], torch.Tensor] = last_of_tuple,
    mask_argument: tuple[str, int] | None = None,
    may_pad: bool = True,
    zero_slots: Callable[[nn.Module, Any], Sequence[int]] | None = None,
    hash_routed: bool = False,
) -> RouterSpec:
    """Teach mla_watch to read a custom router class (process-wide registry).

    Example, for a gate whose forward returns ``(weights, indices)``::

        mla_watch.register_router(
            "MyMoEGate", kind="expert",
            num_slots=lambda gate, config: gate.n_experts,
            top_k=lambda gate, config: gate.k,
            indices=lambda output: output[1],
        )

    ``zero_slots`` (module, config -> slot numbers) names zero-compute expert slots;
    ``hash_routed=True`` marks a router that looks its choice up from the token id.
    """
    return DEFAULT_REGISTRY.register(
        router_class,
        kind=kind,
        num_slots=num_slots,
        top_k=top_k,
        indices=indices,
        mask_argument=mask_argument,
        may_pad=may_pad,
        zero_slots=zero_slots,
        hash_routed=hash_routed,
    )


def layer_of(path: str) -> int:
    """The decoder-layer index in a module path (``model.layers.3.mlp.gate`` -> 3); -1 if none."""
    match = _LAYER_IN_PATH.search(path)
    return int(match.group(1)) if match else -1


# ------------------------------------------------------------------ validation
def _register_call(class_name: str, info: RouterInfo) -> str:
    return (
        f"mla_watch.register_router({class_name!r}, kind={info.kind!r}, num_slots=lambda module, config: ..., "
        f"top_k=lambda module, config: ..., indices=lambda output: <the [..., top_k] integer tensor of chosen "
        f"slots>) before attach(), or attach(model, ignore=[{class_name!r}]) to skip it"
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(item) for item in value[:5])})"
    return f"a {type(value).__name__}"


def indices_problem(chosen: Any, info: RouterInfo, may_pad: bool, check_values: bool = True) -> str | None:
    """Why ``chosen`` (a spec's ``indices(output)``) cannot be counted for ``info``; ``None`` when it can.

    ``check_values`` reads the tensor's range (one host synchronisation): only at attach time.
    """
    if (
        not isinstance(chosen, torch.Tensor)
        or chosen.dtype.is_floating_point
        or chosen.dtype.is_complex
        or chosen.dtype == torch.bool
    ):
        return f"indices(output) returned {_describe(chosen)}; expected an integer tensor of chosen slots"
    if chosen.dim() < (1 if info.kind == "expert" else 2):
        dims = 1 if info.kind == "expert" else 2
        return f"indices(output) returned {_describe(chosen)}; expected at least {dims} dims"
    # An indexer may pick fewer keys than index_topk on a short context, or append a tail pool: any width.
    if info.kind == "expert" and chosen.shape[-1] != info.top_k:
        return (
            f"indices(output) returned {_describe(chosen)}; expected the last dim to be top_k={info.top_k} "
            "(one slot per pick)"
        )
    if check_values and chosen.numel():
        low, high = int(chosen.min()), int(chosen.max())
        lowest = -1 if may_pad else 0
        if low < lowest or (high >= info.num_slots and not (may_pad and info.kind == "indexer")):
            return (
                f"indices(output) holds values in [{low}, {high}]; expected slots in [{lowest}, "
                f"{info.num_slots}) (num_slots={info.num_slots})"
            )
    return None


_TOKENS = 2  # tokens of the attach-time dummy input


def _dummy_arguments(module: nn.Module, hidden: int, info: RouterInfo, shape: tuple[int, ...]) -> list[Any] | None:
    """Positional arguments for a call on ``shape``-shaped zeros; ``None`` when the forward wants what we cannot
    make up (indexers: masks, caches, rotary embeddings)."""
    parameter = next(module.parameters(), None)
    dtype = parameter.dtype if parameter is not None and parameter.dtype.is_floating_point else torch.float32
    device = parameter.device if parameter is not None else torch.device("cpu")
    if device.type == "meta":
        return None
    arguments: list[Any] = [torch.zeros((*shape, hidden), dtype=dtype, device=device)]
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return None
    for name, spec in list(signature.parameters.items())[2:]:  # after self and hidden_states
        if spec.kind in (spec.VAR_POSITIONAL, spec.VAR_KEYWORD) or spec.default is not spec.empty:
            continue
        if name == "input_ids":  # hash routers look their experts up by token id
            arguments.append(torch.zeros(shape, dtype=torch.int64, device=device))
        elif name.endswith("bias"):  # score-correction biases handed in by the MoE block
            arguments.append(torch.zeros(info.num_slots, dtype=torch.float32, device=device))
        else:
            return None
    return arguments


def _hidden_size(module: nn.Module, config: Any) -> int | None:
    for child in module.modules():
        if isinstance(child, nn.Linear):
            return int(child.in_features)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[-1])
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else None


@contextlib.contextmanager
def _state_kept(module: nn.Module) -> Iterator[None]:
    """Undo what a forward may change: buffers (running statistics, load-balancing biases) and the RNG."""
    saved = {name: buffer.clone() for name, buffer in module.named_buffers()}
    devices = sorted({tensor.device.index for tensor in module.parameters() if tensor.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices, enabled=True), torch.no_grad():
        try:
            yield
        finally:
            for name, buffer in module.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])


def _dummy_output(module: nn.Module, config: Any, info: RouterInfo) -> tuple[bool, Any]:
    """``(True, output)`` of the router's forward on a two-token dummy input; ``(False, None)`` when it cannot be
    called that way. The class's own forward is called, bypassing hooks and any forward a probe already
    attached to this model installed on the instance, so no probe ever counts the dummy tokens."""
    hidden = _hidden_size(module, config)
    if hidden is None:
        return False, None
    for shape in ((1, _TOKENS), (_TOKENS,)):  # [batch, seq, hidden] first, then flat tokens (Llama-4)
        arguments = _dummy_arguments(module, hidden, info, shape)
        if arguments is None:
            return False, None
        try:
            with _state_kept(module):
                return True, type(module).forward(module, *arguments)
        except Exception:  # any failure means "not callable like this": try the next shape
            continue
    return False, None


def _check_at_attach(
    module: nn.Module, config: Any, info: RouterInfo, spec: RouterSpec, path: str, checked: dict[tuple, bool]
) -> bool:
    """Run the router once on a dummy input and refuse a spec whose indices cannot be counted.

    Returns ``False`` when the router cannot be called on a dummy input (its first real output is checked then).
    Done once per class and geometry: layers of one class share their output contract.
    """
    key = (type(module), info.kind, info.num_slots, info.top_k, spec.indices)
    if key in checked:
        return checked[key]
    callable_, output = _dummy_output(module, config, info)
    if callable_:
        class_name = type(module).__name__
        try:
            chosen = spec.indices(output)
        except Exception as error:  # the spec itself failed on the module's real output type
            problem: str | None = f"indices(output) raised {type(error).__name__}: {error} on {_describe(output)}"
        else:
            problem = indices_problem(chosen, info, spec.may_pad)
        if problem is not None:
            raise UnknownRouterError(
                f"module {path!r} is a {class_name} whose output mla_watch cannot count: {problem} "
                f"(forward returned {_describe(output)}); teach it with {_register_call(class_name, info)}"
            )
    checked[key] = callable_
    return callable_


def _checked_on_first_output(spec: RouterSpec, info: RouterInfo, path: str, class_name: str) -> RouterSpec:
    """A spec whose ``indices`` checks the first real output's dtype and shape (no host synchronisation, so no
    value range) and raises a clear :class:`UnknownRouterError` instead of a failure deep in the counting."""
    inner = spec.indices
    pending = [True]

    def indices(output: Any) -> torch.Tensor:
        chosen = inner(output)
        if pending:
            problem = indices_problem(chosen, info, spec.may_pad, check_values=False)
            if problem is not None:
                raise UnknownRouterError(
                    f"module {path!r} is a {class_name} whose output mla_watch cannot count: {problem}; "
                    f"detach the probe and teach it with {_register_call(class_name, info)}"
                )
            pending.clear()
        return chosen

    # __wrapped__ alone (no name or docstring copied): what the probe reads once the first output passed
    functools.update_wrapper(indices, inner, assigned=(), updated=())
    return replace(spec, indices=indices)


def _router_info(
    path: str, module: nn.Module, spec: RouterSpec, config: Any, max_indexer_slots: int | None
) -> RouterInfo:
    class_name = type(module).__name__
    num_slots = int(spec.num_slots(module, config))
    if spec.kind == "indexer" and max_indexer_slots is not None:
        num_slots = min(num_slots, max_indexer_slots)
    top_k = int(spec.top_k(module, config))
    if num_slots < 1 or top_k < 1:
        raise UnknownRouterError(
            f"module {path!r} ({class_name}): num_slots={num_slots}, top_k={top_k}; expected both >= 1"
        )
    zero_slots = tuple(sorted(int(slot) for slot in spec.zero_slots(module, config))) if spec.zero_slots else ()
    if any(not 0 <= slot < num_slots for slot in zero_slots):
        raise UnknownRouterError(
            f"module {path!r} ({class_name}): zero_slots={list(zero_slots)}; expected slots in [0, {num_slots})"
        )
    return RouterInfo(
        path, layer_of(path), spec.kind, num_slots, top_k, zero_slots=zero_slots, hash_routed=spec.hash_routed
    )


def discover_routers(
    model: nn.Module,
    *,
    registry: RouterRegistry | None = None,
    ignore: Sequence[str] = (),
    max_indexer_slots: int | None = None,
    validate: bool = True,
) -> Iterator[tuple[nn.Module, RouterInfo, RouterSpec]]:
    """Yield ``(module, info, spec)`` for every router of ``model``, in module order.

    Raises :class:`UnknownRouterError` for a module named like a router that no rule reads, or
    whose spec's ``indices`` does not return what the probe counts (``validate``: checked on a
    dummy forward here, or on the router's first real output when it cannot be called alone),
    and :class:`NoRoutersFoundError` when the model has no routers at all.
    """
    registry = registry or DEFAULT_REGISTRY
    config = getattr(model, "config", None)
    checked: dict[tuple, bool] = {}
    found = 0
    for path, module in model.named_modules():
        class_name = type(module).__name__
        if class_name in ignore:
            continue
        spec = registry.spec_for(module, config)
        if spec is None:
            if _looks_like_router(module):
                raise UnknownRouterError(
                    f"module {path!r} is a {class_name}, which looks like a router but mla_watch "
                    f"cannot read it (expected attributes num_experts/top_k for an expert router or "
                    f"index_topk for an indexer); {REGISTER_HINT}"
                )
            continue
        info = _router_info(path, module, spec, config, max_indexer_slots)
        if validate and not _check_at_attach(module, config, info, spec, path, checked):
            spec = _checked_on_first_output(spec, info, path, class_name)
        found += 1
        yield module, info, spec
    if not found:
        raise NoRoutersFoundError(
            f"no routers found in {type(model).__name__}: mla_watch recognises expert routers "
            "(classes named *TopkRouter/*TopKRouter with num_experts and top_k) and DSA indexers "
            f"(classes named *Indexer with index_topk); for another router class, {REGISTER_HINT}"
        )
