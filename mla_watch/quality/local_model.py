"""Scoring a model loaded in this process on token batches: a hook-free copy, the batches, perplexity and routing.

torch is imported when a function runs, so that importing the module costs nothing beside an engine.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mla_watch.common.values import is_integer
from mla_watch.common.yamlcheck import check_positive, fmt
from mla_watch.quality.score import ModelScore

if TYPE_CHECKING:
    import torch

__all__ = ["copy_without_hooks", "make_batches", "score_model"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def copy_without_hooks(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)`` with every module's hook dicts replaced by empty ones.

    A live model may carry hooks (bound methods of objects holding locks, which cannot be
    deep-copied, and which would count the copy's passes into live windows); a probe's forward
    wrappers deep-copy as the original forwards themselves.
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for attribute in _HOOK_DICTS:
            hooks = module.__dict__.get(attribute)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    return copy.deepcopy(model, memo)


def make_batches(
    samples: Sequence[list[int]], *, batch_size: int = 8, pad_id: int = 0, max_tokens: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Consecutive batches in the given order: ``{"input_ids", "attention_mask", "loss_mask"}``, LongTensors ``[B, T]``.

    Each sample is cut to its first ``max_tokens`` and right-padded with ``pad_id`` to the
    longest in its batch; ``attention_mask`` is 1 on real tokens, 0 on padding; ``loss_mask`` is
    1 on the tokens a loss may predict: a :class:`TokenSample`'s first ``scored_tokens`` (all
    its real tokens when that is ``None``, as for a plain list).
    """
    import torch

    check_positive("batch_size", batch_size, int)
    if max_tokens is not None:
        check_positive("max_tokens", max_tokens, int)
    if not is_integer(pad_id):
        raise ValueError(f"pad_id = {fmt(pad_id)}: expected an int")
    batches = []
    for start in range(0, len(samples), batch_size):
        chunk = []
        for index in range(start, min(start + batch_size, len(samples))):
            sample = samples[index]
            if isinstance(sample, torch.Tensor):
                sample = sample.tolist()
            ids = list(sample[:max_tokens] if max_tokens is not None else sample)
            if not ids:
                raise ValueError(f"samples[{index}]: empty: expected at least one token id")
            scored = getattr(sample, "scored_tokens", None)
            chunk.append((ids, len(ids) if scored is None else min(scored, len(ids))))
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (ids, scored) in enumerate(chunk):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
            loss_mask[row, :scored] = 1
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask})
    return batches


def score_model(
    model: torch.nn.Module,
    batches: Sequence[Mapping[str, torch.Tensor]],
    business_line: str = "gate",
    *,
    indexers: bool = False,
    context_length: int | None = None,
) -> ModelScore:
    """Perplexity and per-router statistics of ``model`` over ``batches`` (padding excluded); DSA indexers are
    watched too with ``indexers`` (their key positions cost more to count, and gates judge expert routers); with
    ``context_length``, expert routers' selections are counted per position bucket up to it too.

    ``model`` must not carry another probe counting into live windows: pass a hook-free copy.
    """
    import torch

    with torch.no_grad():
        return _score_model(model, batches, business_line, indexers=indexers, context_length=context_length)


def _score_model(
    model: torch.nn.Module,
    batches: Sequence[Mapping[str, torch.Tensor]],
    business_line: str,
    *,
    indexers: bool,
    context_length: int | None,
) -> ModelScore:
    from mla_watch.models.loss import next_token_losses
    from mla_watch.probe import attach, discover_routers

    ignored = (
        set()
        if indexers
        else {type(module).__name__ for module, info, _ in discover_routers(model) if info.kind != "expert"}
    )
    probe = attach(
        model,
        window_tokens=None,
        ignore=sorted(ignored),
        count_positions=context_length is not None,
        context_length=context_length,
    )
    # The records stay statistics of the whole pass (what rules and gates judge); the counts by position are apart.
    probe.windows.positions = None
    losses: list[float] = []
    counts: list[int] = []
    try:
        device = next(model.parameters()).device
        with probe.attribute(business_line):
            for batch in batches:
                loss_mask = batch.get("loss_mask")
                loss, count = next_token_losses(
                    model,
                    batch["input_ids"].to(device),
                    batch["attention_mask"].to(device),
                    None if loss_mask is None else loss_mask.to(device),
                )
                losses.extend(loss.double().tolist())
                counts.extend(int(n) for n in count.tolist())
        records = {record.router.name: record for record in probe.router_stats(business_line)}
        counted = probe.positions
        positions = {} if counted is None else {name: counted.counts(name, business_line) for name in counted.routers}
        edges = () if counted is None else counted.buckets.edges
    finally:
        probe.detach()
    total_tokens = sum(counts)
    if total_tokens == 0:
        raise ValueError(
            "the samples hold no token to predict: a sample needs at least 2 scored tokens "
            "(captured traffic scores the prompt only)"
        )
    return ModelScore(
        perplexity=math.exp(sum(losses) / total_tokens),
        tokens=total_tokens,
        routers=records,
        losses=losses,
        counts=counts,
        positions=positions,
        position_edges=edges,
    )
