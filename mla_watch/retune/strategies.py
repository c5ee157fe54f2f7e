"""Re-tuning strategies: plugins chosen by name, each with one abstract method, :meth:`Strategy.fit`.

A strategy turns the job's training batches into a *candidate*: router tensors (named as in
:func:`mla_watch.retune.router_tensors.router_state`) that the gates judge before anything goes live.
No strategy ever writes into the live model.

* ``bias``: DeepSeek-V3's auxiliary-loss-free re-fit of ``e_score_correction_bias``
  (:func:`mla_watch.retune.bias.refit_bias`), gradient-free; for models that have the bias.
* ``router_finetune``: router weights only, language-modelling loss plus a load-balance term
  (:func:`mla_watch.retune.finetune.finetune_routers`); optionally LoRA on the router.
* ``restore``: a known-good router state; the instant fix when a bad deploy damaged a router.
  From the reference checkpoint (``serve --reference-model DIR``) when there is one, else the
  newest registry version an operator marked good, else the newest that passed its gates
  (version 0, the routers the server started with, only if it passed the start-up health check).
  The job says which.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mla_watch.common.describe import describe_value
from mla_watch.common.tensor_files import to_torch
from mla_watch.retune.bias import refit_bias, supports_bias
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.router_tensors import router_modules
from mla_watch.retune.versions import RouterVersions
from mla_watch.routing.routers import CORRECTION_BIAS

__all__ = ["STRATEGIES", "Candidate", "FitContext", "Strategy", "get_strategy", "supported_strategies"]


@dataclass
class FitContext:
    model: torch.nn.Module  # the live model: read it, never write it
    batches: Sequence[Mapping[str, torch.Tensor]]  # training batches (input_ids, attention_mask)
    routers: list[str]  # the routers the job may change
    versions: RouterVersions | None  # None outside the server (an external worker cannot restore)
    options: Mapping[str, Any] = field(default_factory=dict)
    reference: RouterReference | None = None  # the original checkpoint's routers (serve --reference-model)


@dataclass
class Candidate:
    tensors: dict[str, torch.Tensor]
    details: dict[str, Any]  # JSON-able: what the strategy did, for the manifest


class Strategy(abc.ABC):
    name: ClassVar[str]
    # Whether it fits on traffic (captured with --capture, or a dataset): an alert's job has no dataset.
    needs_traffic: ClassVar[bool] = True
    # option -> (type, default, check, expectation); options a job may set for this strategy
    options: ClassVar[dict[str, tuple[type, Any, Any, str]]] = {}

    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        """``None`` when this strategy can re-tune ``model``; else why not, in one sentence."""
        return None

    @abc.abstractmethod
    def fit(self, context: FitContext) -> Candidate:
        """Compute candidate router tensors for ``context.routers``."""

    def parse_options(self, options: Mapping[str, Any], where: str) -> dict[str, Any]:
        """``options`` checked and completed with defaults; ``ValueError`` names the bad one."""
        if not isinstance(options, Mapping):
            raise ValueError(f"{where} is invalid: expected a mapping of option -> value, got {type(options).__name__}")
        unknown = sorted(set(options) - set(self.options), key=str)
        if unknown:
            shown = ", ".join(describe_value(name, 40) for name in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise ValueError(f"{where}: unknown option(s) [{shown}] for strategy "
                             f"{self.name!r}; expected some of {sorted(self.options)}")
        parsed = {}
        for key, (kind, default, check, expectation) in self.options.items():
            value = options.get(key, default)
            if value is not None or default is not None:  # null means "absent" only where absent is allowed
                # ints are floats too (lr: 1), but a float is not an int (epochs: 1.5), nor is a bool
                acceptable = (int,) if kind is int else (int, float)
                try:
                    value = kind(value) if isinstance(value, acceptable) and not isinstance(value, bool) else None
                    valid = value is not None and (kind is int or math.isfinite(value)) and check(value)
                except OverflowError:  # an int too large for a float
                    valid = False
                if not valid:
                    raise ValueError(f"{where}.{key}={describe_value(options.get(key))} is invalid: "
                                     f"expected {expectation}")
            parsed[key] = value
        return parsed


class BiasStrategy(Strategy):
    name = "bias"
    options: ClassVar[dict[str, tuple[type, Any, Any, str]]] = {
        "gamma": (float, 0.05, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "steps": (int, 100, lambda v: 1 <= v <= 100_000, "an integer in [1, 100000]"),
    }

    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        if supports_bias(model):
            return None
        return f"{type(model).__name__} has no expert router with an {CORRECTION_BIAS}"

    def fit(self, context: FitContext) -> Candidate:
        capable = set(supports_bias(context.model))
        routers = [name for name in context.routers if name in capable]
        if not routers:
            raise ValueError(f"none of the routers {context.routers} has an {CORRECTION_BIAS}")
        options = self.parse_options(context.options, "bias")
        result = refit_bias(context.model, context.batches, routers=routers, gamma=options["gamma"],
                            steps=options["steps"])
        return Candidate(result.tensors, {**result.as_dict(), **options})


class RouterFinetuneStrategy(Strategy):
    name = "router_finetune"
    options: ClassVar[dict[str, tuple[type, Any, Any, str]]] = {
        "lr": (float, 1e-4, lambda v: 0 < v <= 1, "a learning rate in (0, 1]"),
        "epochs": (int, 2, lambda v: 1 <= v <= 100, "an integer in [1, 100]"),
        "balance_weight": (float, 0.1, lambda v: v >= 0, "a number >= 0"),
        "lora_rank": (int, None, lambda v: v >= 1, "an integer >= 1, or absent for full router weights"),
        "seed": (int, 0, lambda v: v >= 0, "an integer >= 0"),
    }

    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        modules = router_modules(model)
        if not modules:
            return f"{type(model).__name__} has no expert router"
        without = [name for name, module in modules.items()
                   if not isinstance(weight := getattr(module, "weight", None), torch.nn.Parameter)
                   or weight.dim() != 2]
        if without:
            return f"routers {without} have no 2-D weight parameter to train"
        return None

    def fit(self, context: FitContext) -> Candidate:
        from mla_watch.retune.finetune import finetune_routers

        options = self.parse_options(context.options, "router_finetune")
        result = finetune_routers(context.model, context.batches, routers=context.routers, lr=options["lr"],
                                  epochs=options["epochs"], balance_weight=options["balance_weight"],
                                  lora_rank=options["lora_rank"], seed=options["seed"])
        return Candidate(result.tensors, result.as_dict())


class RestoreStrategy(Strategy):
    name = "restore"
    needs_traffic = False  # puts back a known-good version: nothing to fit

    def fit(self, context: FitContext) -> Candidate:
        prefixes = tuple(f"{name}." for name in context.routers)
        if context.reference is not None:
            tensors = {name: tensor for name, tensor in context.reference.tensors.items() if name.startswith(prefixes)}
            if not tensors:
                raise ValueError(f"the {context.reference.label} holds no tensors of routers {context.routers}")
            return Candidate({name: to_torch(array) for name, array in tensors.items()},
                             {"reference": context.reference.label, "restored_from": None,
                              "routers": list(context.routers)})
        if context.versions is None:
            raise ValueError("restore needs the router registry of the server, or a --reference-model")
        version, tensors, why = context.versions.last_good_state(context.routers)
        if not tensors:
            raise ValueError(f"the registry holds no tensors of routers {context.routers}")
        return Candidate({name: to_torch(array) for name, array in tensors.items()},
                         {"reference": f"router version {version} ({why})", "restored_from": version,
                          "routers": list(context.routers)})


STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (BiasStrategy, RouterFinetuneStrategy,
                                                                     RestoreStrategy)}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"strategy={name!r} is unknown: expected one of {sorted(STRATEGIES)}") from None


def supported_strategies(model: torch.nn.Module, names: Sequence[str] | None = None) -> dict[str, str | None]:
    """``strategy -> None`` (supported) or the reason it is not, for ``model``."""
    return {name: get_strategy(name).unsupported_reason(model) for name in (names or STRATEGIES)}
