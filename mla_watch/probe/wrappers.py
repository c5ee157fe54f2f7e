"""The callables a probe installs as the ``forward`` of the watched model and of each of its routers.

Routers and the model are watched by replacing the instance's ``forward`` with a small callable
(restored exactly on :meth:`Probe.detach`), not with module hooks: a module with hooks takes
``nn.Module``'s slow call path, which on a CPU cost more than the counting (each choice is a
measured cost; see bench/README.md).

The wrappers only hand their calls back to the probe (:class:`_Watcher`), except for a router's fast
path, which appends the router's picks to the watched pass it runs in.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from mla_watch.probe.discovery import RouterInfo, RouterSpec

__all__ = ["CountedRouter", "WatchedModel", "WatchedRouter", "call_argument", "tokens_argument"]


class CountedRouter:
    def __init__(self, index: int, module: nn.Module, info: RouterInfo, spec: RouterSpec, offset: int) -> None:
        self.index = index  # position among the probe's routers (a stable key for cached constants)
        self.module = module
        self.info = info
        self.spec = spec
        self.offset = offset
        self.expert = info.kind == "expert"
        self.watch: WatchedRouter | None = None


class _PassOutputs(Protocol):
    """What a router's wrapper adds to the watched pass it runs in (the deferral's ``WatchedPass``)."""

    outputs: list[tuple[CountedRouter, torch.Tensor, Any]]
    last_mask: Any
    mask_elements: int


class _Watcher(Protocol):
    """What the wrappers call back into: the probe that installed them."""

    @property
    def _current(self) -> _PassOutputs | None: ...

    def _model_call(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...

    def _router_call(self, watch: WatchedRouter, output: Any, args: tuple, kwargs: dict) -> bool: ...


class _WatchedForward:
    """Stands in for a module's ``forward`` while a probe is attached (subclasses say what a call does).

    A plain instance attribute keeps ``nn.Module.__call__`` on its fast path (no hooks).
    A deep copy of the watched module gets the original ``forward`` back, bound to the copy,
    so a copy (a re-tune's working model) computes like the original and is not counted.
    """

    __slots__ = ("__wrapped__", "had_own", "module", "original", "probe")

    def __init__(self, module: nn.Module, probe: _Watcher) -> None:
        self.module = module
        self.probe = probe
        self.had_own = "forward" in module.__dict__  # someone patched forward before us: restore theirs
        self.original = module.forward
        # inspect.signature follows __wrapped__: callers that read forward's parameters (generate()
        # asks whether the model takes logits_to_keep, position_ids, ...) must see the real ones, or
        # they change what the watched model computes.
        self.__wrapped__ = self.original

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.original, memo)

    def install(self) -> None:
        self.module.forward = cast(Callable[..., Any], self)  # the subclasses are callable

    def restore(self) -> None:
        current = self.module.__dict__.get("forward")
        if current is self:
            if self.had_own:
                self.module.forward = self.original
            else:
                del self.module.__dict__["forward"]
            return
        # Probes attached later wrapped this one (a shipping probe beside a local one): probes may be
        # detached in any order, so take this one out of the chain and leave theirs in place.
        while isinstance(current, _WatchedForward):
            if current.original is self:
                current.original = current.__wrapped__ = self.original
                current.had_own = self.had_own
                return
            current = current.original
        raise RuntimeError(
            f"mla_watch probe: the forward of {type(self.module).__name__} was replaced after attach(); "
            "detach() the probe before patching forward, or patch it before attach()"
        )


class WatchedModel(_WatchedForward):
    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.probe._model_call(self.original, args, kwargs)


class WatchedRouter(_WatchedForward):
    """A router's forward: runs it and, inside a watched pass, keeps a reference to its picks.

    This runs once per router per forward pass, between the model's own ops, where the interpreter's
    caches are cold: measured in a real generation, each line here costs several times what it costs
    in a loop. So it only reads the picks out of the output and appends them; checking shapes and
    grouping passes happen at the flush, for many passes at once (see :meth:`Probe._flush_pending_locked`).
    """

    __slots__ = ("mask_argument", "read", "router", "unchecked")

    def __init__(self, module: nn.Module, probe: _Watcher, router: CountedRouter) -> None:
        super().__init__(module, probe)
        self.router = router
        self.read = router.spec.indices
        self.mask_argument = None if router.expert else router.spec.mask_argument
        self.unchecked = True  # the first output goes through the slow path (spec checks, clear errors)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.original(*args, **kwargs)
        current = self.probe._current
        if (current is None or self.unchecked) and self.probe._router_call(self, output, args, kwargs):
            return output
        assert current is not None  # _router_call kept it only inside a watched pass
        if self.mask_argument is None:
            # The picks, not the output: a router's logits are many times the size of its choices.
            current.outputs.append((self.router, self.read(output), None))
        else:
            mask = call_argument(self.mask_argument, args, kwargs)
            current.outputs.append((self.router, self.read(output), mask))
            if mask is not current.last_mask:  # one mask object is usually handed to every layer
                current.last_mask = mask
                if isinstance(mask, torch.Tensor):
                    current.mask_elements += mask.numel()
        return output


def tokens_argument(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``[batch, seq, ...]`` tensor a model forward was called with (ids or embeddings); None if none."""
    tokens_input = kwargs.get("input_ids")
    if tokens_input is None and args:
        tokens_input = args[0]
    if tokens_input is None:
        tokens_input = kwargs.get("inputs_embeds")
    return tokens_input if isinstance(tokens_input, torch.Tensor) and tokens_input.dim() >= 2 else None


def call_argument(where: tuple[str, int] | None, args: tuple, kwargs: dict) -> Any:
    if where is None:
        return None
    name, position = where
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None
