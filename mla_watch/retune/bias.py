"""DeepSeek-V3's auxiliary-loss-free re-fit of ``e_score_correction_bias``, without gradients.

Each step forwards one batch, counts every expert router's loads with an mla_watch probe and
moves the bias of each selected router by ``b_i += gamma * sign(mean_load - load_i)``
(:func:`mla_watch.models.balance.sign_step`, the training-time rule, with a γ for the job:
0.05 undoes a +10 collapse in ~100 batches, the training value 0.001 would take ~10,000).

The re-fit runs on a **deep copy** of the model (its hooks left behind; a probe's forward
wrappers copy as the original forwards), so the live
model's tensors never change and live traffic is never routed by a half-fitted bias. The copy
costs one model's memory for the duration of the call. The biases are accumulated in float32
(a bfloat16 bias near 10 cannot move by 0.05) and returned as float32 CPU tensors named as in
:func:`mla_watch.retune.router_tensors.router_state`, ready for :meth:`RouterVersions.save`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from mla_watch.models.balance import sign_step
from mla_watch.probe import attach, discover_routers
from mla_watch.quality.local_model import copy_without_hooks
from mla_watch.retune.router_tensors import router_modules
from mla_watch.routing.routers import CORRECTION_BIAS as BIAS_NAME
from mla_watch.routing.stats import entropy_bits

__all__ = ["BIAS_NAME", "BiasRefitResult", "refit_bias", "supports_bias"]


def supports_bias(model: torch.nn.Module) -> list[str]:
    """Names of the expert routers of ``model`` that have an ``e_score_correction_bias``."""
    return [
        name
        for name, module in router_modules(model).items()
        if isinstance(getattr(module, BIAS_NAME, None), torch.Tensor)
    ]


@dataclass
class BiasRefitResult:
    routers: list[str]
    steps: int
    before_bits: dict[str, float]  # entropy of every expert router over the batches, before
    after_bits: dict[str, float]  # ... and with the re-fitted biases
    tensors: dict[str, torch.Tensor] = field(repr=False)  # "<router>.e_score_correction_bias" -> float32 CPU

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able summary (no tensors), e.g. for a registry manifest."""
        return {
            "routers": list(self.routers),
            "steps": self.steps,
            "before_bits": dict(self.before_bits),
            "after_bits": dict(self.after_bits),
        }


def _forward(model: torch.nn.Module, batch: Any) -> None:
    if isinstance(batch, torch.Tensor):
        # a transformers model's device: torch's types know it only as Tensor | Module
        model(input_ids=batch.to(cast(torch.device, model.device)) if hasattr(model, "device") else batch)
    elif isinstance(batch, Mapping):
        device = getattr(model, "device", None)
        model(
            **{
                key: value.to(device) if isinstance(value, torch.Tensor) and device is not None else value
                for key, value in batch.items()
                if key != "loss_mask"
            }
        )  # loss_mask is for losses, not the model
    else:
        raise TypeError(f"batch: expected input_ids [B, T] or a mapping of model inputs, got {type(batch).__name__}")


def _entropies(
    model: torch.nn.Module, probe: Any, batches: Sequence[Any], line: str, experts: Sequence[str]
) -> dict[str, float]:
    probe.reset()
    with probe.attribute(line):
        for batch in batches:
            _forward(model, batch)
    counts = probe.counts(line)
    probe.reset()
    return {name: round(entropy_bits(load), 4) for name, load in counts.items() if name in experts}


@torch.no_grad()
def refit_bias(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    routers: Sequence[str] | None = None,
    gamma: float = 0.05,
    steps: int = 100,
    business_line: str = "retune",
) -> BiasRefitResult:
    """Re-fit the correction biases of ``routers`` (default: every router that has one).

    ``batches`` are ``input_ids`` tensors ``[B, T]`` (or mappings of model inputs, e.g. with
    an ``attention_mask``), cycled for ``steps`` steps; before/after entropies are measured on
    one pass over the same batches. The live ``model`` is left untouched.
    """
    capable = supports_bias(model)
    if not capable:
        raise ValueError(
            f"{type(model).__name__} has no expert router with an {BIAS_NAME}; "
            "a bias re-fit needs DeepSeek-V3-style aux-loss-free routers"
        )
    selected = list(capable if routers is None else routers)
    unknown = [name for name in selected if name not in capable]
    if unknown:
        raise ValueError(f"routers {unknown} of {type(model).__name__} have no {BIAS_NAME}; routers that do: {capable}")
    if not selected:
        raise ValueError("refit_bias(): routers is empty")
    if gamma <= 0 or steps < 0:
        raise ValueError(f"refit_bias(): expected gamma > 0 and steps >= 0, got gamma={gamma}, steps={steps}")
    batches = list(batches)
    if not batches:
        raise ValueError("refit_bias(): no batches")

    work = copy_without_hooks(model).eval()
    modules = router_modules(work)
    biases = {name: getattr(modules[name], BIAS_NAME) for name in selected}
    fitted = {name: bias.detach().to(torch.float32, copy=True) for name, bias in biases.items()}
    # Count expert routers only: indexers are not re-fitted and counting them costs time.
    indexers = {type(module).__name__ for module, info, _ in discover_routers(work) if info.kind != "expert"}
    probe = attach(work, window_tokens=None, ignore=sorted(indexers))
    try:
        before = _entropies(work, probe, batches, business_line, list(modules))
        for batch in itertools.islice(itertools.cycle(batches), steps):
            with probe.attribute(business_line):
                _forward(work, batch)
            counts = probe.counts(business_line)
            probe.reset()
            for name in selected:
                load = torch.as_tensor(counts[name], dtype=torch.float32, device=fitted[name].device)
                fitted[name] += sign_step(load, gamma)
                biases[name].copy_(fitted[name])
        after = _entropies(work, probe, batches, business_line, list(modules))
    finally:
        probe.detach()
    del work
    return BiasRefitResult(
        routers=selected,
        steps=steps,
        before_bits=before,
        after_bits=after,
        tensors={f"{name}.{BIAS_NAME}": fitted[name].cpu().contiguous() for name in selected},
    )
