"""Router-only fine-tuning: gradient steps on the gate weights, everything else frozen.

When the bias re-fit (:mod:`mla_watch.retune.bias`) is not enough -- the *weights* of a router
drifted or were damaged, or the traffic moved so far that no per-expert offset can fix the
routing -- teams fine-tune the routers themselves on recent traffic. The recipe here is the
usual one:

* **Router-only.** Every parameter of the model is frozen except ``weight`` of the selected
  expert routers (default: all of them). A router is ``N x H`` numbers; retraining only it
  cannot change what any expert computes, so the change is small, cheap to store in the
  router registry and exactly reversible by :meth:`RouterVersions.rollback`.
* **Loss = LM loss + balance term.** Next-token cross-entropy (padding excluded) keeps the
  routing useful for the model's own predictions; ``balance_weight`` times DeepSeek-V3's
  sequence/batch-wise auxiliary loss ``N * sum_i f_i * P_i`` (``f_i`` the fraction of the
  top-k selections that chose expert ``i``, ``P_i`` the mean normalised score of expert ``i``)
  keeps the LM loss from buying a few points by collapsing onto a handful of experts. The
  term is 1 for a perfectly balanced router and grows as it collapses.
* **lr 1e-4, 2 epochs** are the defaults teams use for a router touch-up with AdamW (no weight
  decay: decaying a router towards zero flattens its scores). A damaged router needs a larger
  lr and is only partly repaired by a short run: after N(0, 0.5) noise on a bundled-model gate
  (perplexity 1.66 -> 2.03 on 64 code samples), 2 epochs over them give back 2.01 at 1e-3 and
  1.94 at 1e-2; weights damaged like that are better rolled back from the router registry.
* **LoRA, optionally.** With ``lora_rank=r`` the weight is frozen and a delta
  ``(alpha / r) * B @ A`` is trained instead (``A`` small and random, ``B`` zero, so training
  starts from the unchanged router), limiting the change to rank ``r``. The merged full weight
  is what is returned, so promoting it needs nothing LoRA-aware.

As with the bias re-fit, training runs on a **deep copy** of the model made without its
forward hooks, so the live model's tensors never change, a live probe counts nothing of the
training passes, and live traffic is never routed by a half-trained gate. The copy costs one
model's memory for the duration of the call (plus gradients and activations of one batch).
The run is deterministic: the epoch order and the LoRA init come from a generator seeded with
``seed``, never from the global RNG. The trained weights are returned as float32 CPU tensors
named as in :func:`mla_watch.retune.router_tensors.router_state`, ready for :meth:`RouterVersions.save`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils import parametrize

from mla_watch.models.loss import next_token_loss
from mla_watch.quality.local_model import copy_without_hooks, score_model
from mla_watch.retune.router_tensors import router_modules
from mla_watch.routing.routers import CORRECTION_BIAS

__all__ = ["FinetuneResult", "finetune_routers"]


@dataclass
class FinetuneResult:
    routers: list[str]  # routers trained
    epochs: int
    steps: int  # optimizer steps taken
    lr: float
    balance_weight: float
    lora_rank: int | None
    loss_before: float  # mean LM loss per token over all batches, before (no grad)
    loss_after: float  # ... after
    before_bits: dict[str, float]  # entropy of every expert router over the batches, before
    after_bits: dict[str, float]  # ... after
    tensors: dict[str, torch.Tensor] = field(repr=False)  # "<router>.weight" -> float32 CPU, trained routers only
    lora_alpha: float | None = None  # the alpha used (rank when not given); None without LoRA
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able summary (no tensors), e.g. for a registry manifest."""
        return {
            "routers": list(self.routers),
            "epochs": self.epochs,
            "steps": self.steps,
            "lr": self.lr,
            "balance_weight": self.balance_weight,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "seed": self.seed,
            "loss_before": self.loss_before,
            "loss_after": self.loss_after,
            "before_bits": dict(self.before_bits),
            "after_bits": dict(self.after_bits),
        }


class _LowRankDelta(torch.nn.Module):
    """``weight -> weight + scale * B @ A``, for :func:`torch.nn.utils.parametrize.register_parametrization`."""

    def __init__(self, weight: torch.Tensor, rank: int, scale: float, generator: torch.Generator) -> None:
        super().__init__()
        rows, columns = weight.shape
        # Kaiming-uniform-like bound (what LoRA implementations use for A); B = 0 so the
        # parametrized router starts out computing exactly the original one.
        bound = 1.0 / math.sqrt(columns)
        a = (torch.rand(rank, columns, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        self.A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype))
        self.B = torch.nn.Parameter(torch.zeros(rows, rank, device=weight.device, dtype=weight.dtype))
        self.scale = scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.B @ self.A)


class _RouterCapture:
    """Forward hooks keeping the ``(router_logits, ..., topk_indices)`` of each selected router."""

    def __init__(self, modules: Mapping[str, torch.nn.Module]) -> None:
        self.outputs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in modules}
        self.handles = [module.register_forward_hook(self._keep(name)) for name, module in modules.items()]

    def _keep(self, name: str) -> Callable[[torch.nn.Module, tuple, Any], None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            self.outputs[name].append((output[0], output[-1]))

        return hook

    def clear(self) -> None:
        for outputs in self.outputs.values():
            outputs.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.clear()


def _balance_loss(logits: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """DeepSeek-V3's auxiliary balance loss ``N * sum_i f_i * P_i`` over the non-pad tokens."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    indices = indices.reshape(logits.shape[0], -1)
    if valid.numel() != logits.shape[0]:
        raise RuntimeError(
            f"a router saw {logits.shape[0]} tokens, the batch has {valid.numel()}: cannot tell its padded tokens apart"
        )
    logits, indices = logits[valid], indices[valid]
    if logits.shape[0] == 0:
        return logits.sum()  # a zero that still belongs to the graph
    experts = logits.shape[-1]
    # Sigmoid routers (DeepSeek-V3 family, the ones with a correction bias) score each expert
    # on its own; the rest score with a softmax. P_i uses the scores normalised per token.
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    normalised = scores / scores.sum(dim=-1, keepdim=True)
    p = normalised.mean(dim=0)
    # f_i is a count of discrete choices: no gradient flows through it (as in DeepSeek-V3).
    f = torch.bincount(indices.reshape(-1), minlength=experts).to(p.dtype) / indices.numel()
    return experts * (f.detach() * p).sum()


_Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _inputs(batch: Any, position: int, device: torch.device) -> _Inputs:
    """``(input_ids, attention_mask, loss_mask)`` of one batch, on ``device``."""
    loss_mask = None
    if isinstance(batch, torch.Tensor):
        ids, mask = batch, None
    elif isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(f"batches[{position}]: a mapping needs input_ids, got keys {sorted(batch)}")
        ids, mask, loss_mask = batch["input_ids"], batch.get("attention_mask"), batch.get("loss_mask")
    else:
        raise TypeError(
            f"batches[{position}]: expected input_ids [B, T] or a mapping with input_ids "
            f"(and attention_mask), got {type(batch).__name__}"
        )
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"batches[{position}]: input_ids must be an integer tensor [B, T], "
            f"got {ids.dtype} of shape {tuple(ids.shape)}"
        )
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
    if mask.shape != ids.shape:
        raise ValueError(
            f"batches[{position}]: attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}"
        )
    loss_mask = mask if loss_mask is None else torch.as_tensor(loss_mask)
    if loss_mask.shape != ids.shape:
        raise ValueError(
            f"batches[{position}]: loss_mask has shape {tuple(loss_mask.shape)}, input_ids {tuple(ids.shape)}"
        )
    return tuple(t.to(device=device, dtype=torch.int64) for t in (ids, mask, loss_mask))  # type: ignore[return-value]


def _evaluate(
    model: torch.nn.Module, inputs: Sequence[_Inputs], line: str, experts: Sequence[str]
) -> tuple[float, dict[str, float]]:
    """Mean LM loss per scored token and every expert router's entropy, from one pass over ``inputs``."""
    batches = [{"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask} for ids, mask, loss_mask in inputs]
    score = score_model(model, batches, business_line=line)  # the gates' own measurement
    bits = {name: round(float(score.routers[name].stats.entropy_bits), 4) for name in experts if name in score.routers}
    return math.log(score.perplexity), bits


def _check_settings(
    lr: float, epochs: int, balance_weight: float, lora_rank: int | None, lora_alpha: float | None
) -> None:
    problems = []
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        problems.append(f"lr={lr!r} (expected a finite number > 0)")
    if not (isinstance(epochs, int) and epochs >= 1):
        problems.append(f"epochs={epochs!r} (expected an integer >= 1)")
    if not (isinstance(balance_weight, int | float) and math.isfinite(balance_weight) and balance_weight >= 0):
        problems.append(f"balance_weight={balance_weight!r} (expected a finite number >= 0)")
    if lora_rank is not None and not (isinstance(lora_rank, int) and lora_rank >= 1):
        problems.append(f"lora_rank={lora_rank!r} (expected None or an integer >= 1)")
    if lora_alpha is not None:
        if lora_rank is None:
            problems.append(f"lora_alpha={lora_alpha!r} (expected None without lora_rank)")
        elif not (isinstance(lora_alpha, int | float) and math.isfinite(lora_alpha) and lora_alpha > 0):
            problems.append(f"lora_alpha={lora_alpha!r} (expected None or a finite number > 0)")
    if problems:
        raise ValueError("finetune_routers(): " + "; ".join(problems))


def _select(model: torch.nn.Module, routers: Sequence[str] | None) -> list[str]:
    modules = router_modules(model)
    trainable = [
        name
        for name, module in modules.items()
        if isinstance(weight := getattr(module, "weight", None), torch.Tensor) and weight.dim() == 2
    ]
    if isinstance(routers, str):
        routers = [routers]  # one name, not its characters
    selected = list(dict.fromkeys(trainable if routers is None else routers))
    if not trainable:
        raise ValueError(f"{type(model).__name__} has no expert router with a 2-D weight to fine-tune")
    unknown = [name for name in selected if name not in modules]
    if unknown:
        raise ValueError(
            f"routers {unknown} are not expert routers of {type(model).__name__}; "
            f"routers that can be fine-tuned: {trainable}"
        )
    weightless = [name for name in selected if name not in trainable]
    if weightless:
        raise ValueError(
            f"routers {weightless} of {type(model).__name__} have no 2-D weight; "
            f"routers that can be fine-tuned: {trainable}"
        )
    if not selected:
        raise ValueError(f"finetune_routers(): routers is empty; routers that can be fine-tuned: {trainable}")
    return selected


def finetune_routers(
    model: torch.nn.Module,
    batches: Sequence[Any],
    *,
    routers: Sequence[str] | None = None,
    lr: float = 1e-4,
    epochs: int = 2,
    balance_weight: float = 0.1,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    seed: int = 0,
    business_line: str = "retune",
) -> FinetuneResult:
    """Fine-tune the ``weight`` of ``routers`` (default: every expert router) on ``batches``.

    ``batches`` are ``input_ids`` tensors ``[B, T]`` or mappings with ``input_ids`` and a
    right-padded ``attention_mask``; each epoch visits all of them once, in an order shuffled
    by ``seed``, one AdamW step per batch. Before/after LM losses and router entropies are
    measured on one pass over the same batches. The live ``model`` is left untouched.
    """
    _check_settings(lr, epochs, balance_weight, lora_rank, lora_alpha)
    selected = _select(model, routers)
    batches = list(batches)
    if not batches:
        raise ValueError("finetune_routers(): no batches")

    work = copy_without_hooks(model).eval()
    device = next(work.parameters()).device
    inputs = [_inputs(batch, position, device) for position, batch in enumerate(batches)]
    modules = router_modules(work)
    experts = list(modules)
    # routers of the model's own classes, whose weight torch's types know only as Tensor | Module
    trained: dict[str, Any] = {name: modules[name] for name in selected}
    generator = torch.Generator().manual_seed(seed)
    alpha = None if lora_rank is None else float(lora_rank if lora_alpha is None else lora_alpha)

    loss_before, before = _evaluate(work, inputs, business_line, experts)

    for parameter in work.parameters():
        parameter.requires_grad_(False)
    params: list[torch.nn.Parameter] = []
    for module in trained.values():
        if lora_rank is None:
            module.weight.requires_grad_(True)
            params.append(module.weight)
        else:
            assert alpha is not None  # set with lora_rank
            delta = _LowRankDelta(module.weight, lora_rank, alpha / lora_rank, generator)
            parametrize.register_parametrization(module, "weight", delta)
            params.extend([delta.A, delta.B])
    sigmoid = {
        name: isinstance(getattr(module, CORRECTION_BIAS, None), torch.Tensor) for name, module in trained.items()
    }
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    steps = 0
    capture = _RouterCapture(trained) if balance_weight > 0 else None
    try:
        with torch.enable_grad():
            for _ in range(epochs):
                for position in torch.randperm(len(inputs), generator=generator).tolist():
                    ids, mask, loss_mask = inputs[position]
                    optimizer.zero_grad(set_to_none=True)
                    lm_sum, tokens = next_token_loss(work, ids, mask, loss_mask)
                    loss = lm_sum / max(1, tokens)
                    if capture is not None:
                        valid = mask.reshape(-1).bool()
                        balance = torch.stack(
                            [
                                torch.stack(
                                    [
                                        _balance_loss(logits, indices, valid, sigmoid[name])
                                        for logits, indices in capture.outputs[name]
                                    ]
                                ).mean()
                                for name in selected
                            ]
                        ).mean()
                        capture.clear()
                        loss = loss + balance_weight * balance
                    loss.backward()
                    optimizer.step()
                    steps += 1
    finally:
        if capture is not None:
            capture.remove()
        optimizer.zero_grad(set_to_none=True)

    # Bake the LoRA deltas into plain weights: the copy's routers are then ordinary modules
    # again (probe discovery goes by class name) and the returned tensor is the merged weight.
    for module in trained.values():
        if parametrize.is_parametrized(module, "weight"):
            with torch.no_grad():
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        module.weight.requires_grad_(False)
    tensors = {
        f"{name}.weight": module.weight.detach().to("cpu", torch.float32, copy=True).contiguous()
        for name, module in trained.items()
    }

    loss_after, after = _evaluate(work, inputs, business_line, experts)
    del work
    return FinetuneResult(
        routers=selected,
        epochs=epochs,
        steps=steps,
        lr=float(lr),
        balance_weight=float(balance_weight),
        lora_rank=lora_rank,
        loss_before=loss_before,
        loss_after=loss_after,
        before_bits=before,
        after_bits=after,
        tensors=tensors,
        lora_alpha=alpha,
        seed=seed,
    )
