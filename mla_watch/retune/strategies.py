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

One name, one class: a job inside a running engine (:mod:`mla_watch.retune.engine_retuning`) runs ``bias`` and
``restore`` through the same classes, by their engine methods (:meth:`Strategy.engine_unsupported_reason`,
:meth:`BiasStrategy.engine_step`, :meth:`RestoreStrategy.known_good`), on numpy arrays: this module imports no torch
until a strategy fits a model loaded here.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mla_watch.common.describe import describe_value
from mla_watch.common.tensor_files import as_array, to_torch
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.versions import RouterVersions
from mla_watch.routing.routers import CORRECTION_BIAS

if TYPE_CHECKING:  # torch is imported where a model loaded here is fitted: beside an engine there is none
    import torch

__all__ = [
    "STRATEGIES",
    "BiasSchedule",
    "Candidate",
    "FitContext",
    "Strategy",
    "bias_step",
    "get_strategy",
    "supported_strategies",
]


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

    def engine_unsupported_reason(self, state: Mapping[str, np.ndarray]) -> str | None:
        """``None`` when this strategy can re-tune a running engine's routers (``state``: their tensors); else why
        not. Most need the model's weights, which the engine holds."""
        return f"{self.name} needs the model's weights, which the engine holds (engine strategies: restore, bias)"

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
            raise ValueError(
                f"{where}: unknown option(s) [{shown}] for strategy "
                f"{self.name!r}; expected some of {sorted(self.options)}"
            )
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
                    raise ValueError(
                        f"{where}.{key}={describe_value(options.get(key))} is invalid: expected {expectation}"
                    )
            parsed[key] = value
        return parsed


class BiasStrategy(Strategy):
    name = "bias"
    options: ClassVar[dict[str, tuple[type, Any, Any, str]]] = {
        "gamma": (float, 0.05, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "steps": (int, 100, lambda v: 1 <= v <= 100_000, "an integer in [1, 100000]"),
    }

    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        from mla_watch.retune.bias import supports_bias

        if supports_bias(model):
            return None
        return f"{type(model).__name__} has no expert router with an {CORRECTION_BIAS}"

    def engine_unsupported_reason(self, state: Mapping[str, np.ndarray]) -> str | None:
        if any(key.endswith(f".{CORRECTION_BIAS}") for key in state):
            return None
        return f"the engine's routers have no {CORRECTION_BIAS} (DeepSeek-V3's noaux_tc and kin have one)"

    def engine_step(
        self,
        state: Mapping[str, np.ndarray],
        loads: Mapping[str, np.ndarray | None],
        routers: Sequence[str],
        gamma: float,
    ) -> dict[str, np.ndarray]:
        """One step of the rule inside an engine, where no batch can be replayed: each router's bias moved by
        :func:`bias_step` from the loads the engine routed (``loads``: counts per expert, by router)."""
        tensors = {}
        for router in routers:
            load = loads.get(router)
            key = f"{router}.{CORRECTION_BIAS}"
            if key not in state:
                continue
            if load is None or float(np.sum(load)) <= 0:
                raise ValueError(
                    f"no routing of {router} is counted yet: the bias rule needs the engine's loads "
                    f"(the engine must return routing: vLLM --enable-return-routed-experts)"
                )
            tensors[key] = bias_step(state[key], load, gamma)
        if not tensors:
            raise ValueError(f"none of the routers {list(routers)} has an {CORRECTION_BIAS}")
        return tensors

    def fit(self, context: FitContext) -> Candidate:
        from mla_watch.retune.bias import refit_bias, supports_bias

        capable = set(supports_bias(context.model))
        routers = [name for name in context.routers if name in capable]
        if not routers:
            raise ValueError(f"none of the routers {context.routers} has an {CORRECTION_BIAS}")
        options = self.parse_options(context.options, "bias")
        result = refit_bias(
            context.model, context.batches, routers=routers, gamma=options["gamma"], steps=options["steps"]
        )
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
        import torch

        from mla_watch.retune.router_tensors import router_modules

        modules = router_modules(model)
        if not modules:
            return f"{type(model).__name__} has no expert router"
        without = [
            name
            for name, module in modules.items()
            if not isinstance(weight := getattr(module, "weight", None), torch.nn.Parameter) or weight.dim() != 2
        ]
        if without:
            return f"routers {without} have no 2-D weight parameter to train"
        return None

    def fit(self, context: FitContext) -> Candidate:
        from mla_watch.retune.finetune import finetune_routers

        options = self.parse_options(context.options, "router_finetune")
        result = finetune_routers(
            context.model,
            context.batches,
            routers=context.routers,
            lr=options["lr"],
            epochs=options["epochs"],
            balance_weight=options["balance_weight"],
            lora_rank=options["lora_rank"],
            seed=options["seed"],
        )
        return Candidate(result.tensors, result.as_dict())


class RestoreStrategy(Strategy):
    name = "restore"
    needs_traffic = False  # puts back a known-good version: nothing to fit

    def engine_unsupported_reason(self, state: Mapping[str, np.ndarray]) -> str | None:
        return None

    def known_good(
        self,
        routers: Sequence[str],
        *,
        reference: RouterReference | None,
        versions: RouterVersions | None,
        initial_if_none_good: bool = False,
    ) -> tuple[dict[str, np.ndarray], str, int | None]:
        """The known-good tensors of ``routers``, where they come from, and the router version they are (``None``
        for the reference checkpoint): the reference when there is one, else the newest good version, else (with
        ``initial_if_none_good``: an engine's) the checkpoint it was started from, version 0."""
        prefixes = tuple(f"{name}." for name in routers)
        if reference is not None:
            tensors = {
                name: as_array(tensor) for name, tensor in reference.tensors.items() if name.startswith(prefixes)
            }
            source, version = reference.label, None
        elif versions is None:
            raise ValueError("restore needs the router registry of the server, or a --reference-model")
        else:
            try:
                number, tensors, why = versions.last_good_state(list(routers))
                source, version = f"router version {number} ({why})", number
            except ValueError:
                if not initial_if_none_good:
                    raise
                tensors = {name: tensor for name, tensor in versions.load(0).items() if name.startswith(prefixes)}
                source, version = "the engine's checkpoint (router version 0)", 0
        if not tensors:
            raise ValueError(f"{source} holds no tensors of routers {list(routers)}")
        return tensors, source, version

    def fit(self, context: FitContext) -> Candidate:
        tensors, source, version = self.known_good(
            context.routers, reference=context.reference, versions=context.versions
        )
        return Candidate(
            {name: to_torch(array) for name, array in tensors.items()},
            {"reference": source, "restored_from": version, "routers": list(context.routers)},
        )


class BiasSchedule:
    """The engine ``bias`` strategy's steps: ``gamma * decay ** step``, at most ``steps`` swaps.

    A proportional step (:func:`bias_step`) undoes a large offset in one swap, where DeepSeek's sign rule
    moves every bias by the same small amount and takes one swap per ``gamma`` of offset; the geometric
    decay stops the oscillation a fixed proportional step keeps up around balance. Measured on the
    bundled model collapsed by +10 on six experts: 1.0 with decay 0.7 reads 2.585 -> 5.84 bits after one
    step and stays in the band after; a fixed 1.0 swings between 3.2 and 5.8 (bench/README.md).
    """

    def __init__(self, gamma: float = 1.0, decay: float = 0.7, steps: int = 8) -> None:
        self.gamma, self.decay, self.steps = gamma, decay, steps

    def gamma_at(self, step: int) -> float:
        return self.gamma * self.decay**step


def bias_step(bias: np.ndarray, loads: np.ndarray, gamma: float) -> np.ndarray:
    """DeepSeek's auxiliary-loss-free rule applied at inference, proportional: the bias of an expert loaded
    ``load_i`` against a mean of ``mean`` moves by ``gamma * min(1, 1 - load_i / mean)`` (an idle expert up
    by ``gamma``, an expert loaded ten times the mean down by ``9 gamma``). Computed in float32 and rounded to
    the bias's dtype (bf16: to nearest even), as the engine's own float32 arithmetic would."""
    bias = as_array(bias)
    loads = np.asarray(loads, dtype=np.float64)
    if loads.shape != tuple(bias.shape) or loads.sum() <= 0:
        raise ValueError(
            f"bias_step: loads of shape {list(loads.shape)} summing to {loads.sum():g}: expected one "
            f"positive count per expert ({list(bias.shape)})"
        )
    step = gamma * np.minimum(1.0, 1.0 - loads / loads.mean())
    return (bias.astype(np.float32) + step.astype(np.float32)).astype(bias.dtype)


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (BiasStrategy, RouterFinetuneStrategy, RestoreStrategy)
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"strategy={name!r} is unknown: expected one of {sorted(STRATEGIES)}") from None


def supported_strategies(model: torch.nn.Module, names: Sequence[str] | None = None) -> dict[str, str | None]:
    """``strategy -> None`` (supported) or the reason it is not, for ``model``."""
    return {name: get_strategy(name).unsupported_reason(model) for name in (names or STRATEGIES)}
