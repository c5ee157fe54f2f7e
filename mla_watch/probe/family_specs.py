"""How each model family's routers are read: :class:`RouterSpec` (what a router's output holds and where its picks
are), and the built-in specs by router class name (``BUILTIN_SPECS``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import torch
from torch import nn

from mla_watch.routing.stats import Kind

__all__ = [
    "BUILTIN_SPECS",
    "RouterModule",
    "RouterSpec",
    "UnknownRouterError",
    "expert_spec",
    "indexer_spec",
    "last_of_tuple",
]


class UnknownRouterError(ValueError):
    """A module looks like a router but no rule knows how to read it."""


# A router module of the model's own class: its attributes (num_experts, top_k, ...) are the model's, which
# torch's types know only as Tensor | Module.
RouterModule: TypeAlias = Any


def last_of_tuple(output: Any) -> torch.Tensor:
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
    ``zero_slots`` (module, config -> slot numbers) names the slots that are zero-compute
    experts; ``hash_routed`` marks a token-id lookup router (see :class:`RouterInfo`).
    """

    kind: Kind
    num_slots: Callable[[RouterModule, Any], int]
    top_k: Callable[[RouterModule, Any], int]
    indices: Callable[[Any], torch.Tensor] = last_of_tuple
    mask_argument: tuple[str, int] | None = None
    may_pad: bool = False
    zero_slots: Callable[[RouterModule, Any], Sequence[int]] | None = None
    hash_routed: bool = False


def expert_spec() -> RouterSpec:
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


def _attention_mask_argument(module: nn.Module) -> tuple[str, int] | None:
    """``("attention_mask", its position in forward)``: DeepSeek-V3.2 passes the mask 4th, Mistral-Large-4 3rd."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):  # a forward without a readable signature: DeepSeek-V3.2's order
        return ("attention_mask", 3)
    return ("attention_mask", names.index("attention_mask")) if "attention_mask" in names else None


def indexer_spec(module: nn.Module) -> RouterSpec:
    return RouterSpec(
        kind="indexer",
        num_slots=_indexer_slots,
        top_k=lambda module, config: int(module.index_topk),
        indices=lambda output: output,
        mask_argument=_attention_mask_argument(module),
        # DeepSeek-V4's compressed-attention indexer pads its choices with -1.
        may_pad=hasattr(module, "compress_rate"),
    )


# ------------------------------------------------------------------ built-in specs
# Routers whose forward does not return (logits, weights, indices), read as their model reads them.
# Each factory takes the module and the model config, so that a spec can close over the module's top_k.
def _topk_of(k: int, *, position: int = -1, softmax_first: bool = False) -> Callable[[Any], torch.Tensor]:
    """Indices = ``topk(output[position], k)`` over the last dim, the same call on the same tensor as the model
    makes, so the picks are bit-identical (``softmax_first`` repeats DBRX's softmax in the logits' dtype)."""

    def indices(output: Any) -> torch.Tensor:
        scores = output[position] if isinstance(output, tuple | list) else output
        if softmax_first:
            scores = torch.nn.functional.softmax(scores, dim=1, dtype=scores.dtype)
        return torch.topk(scores, k, dim=-1).indices

    return indices


def _llama4_spec(module: RouterModule, config: Any) -> RouterSpec:
    # forward returns (scores, logits); Llama4TextMoe's experts use topk(logits, top_k, dim=1) - the router's
    # own call - whose indices it scattered into the scores and did not return.
    return RouterSpec(
        "expert",
        lambda m, c: int(m.num_experts),
        lambda m, c: int(m.top_k),
        indices=_topk_of(int(module.top_k), position=1),
    )


def _zaya_indices(output: Any) -> torch.Tensor:
    # (logits [N, E + 1], probs [N, k], indices [N, k], states): a pick of the skip expert (slot E) comes back as
    # expert 0 with its weight zeroed, so the skip is recovered as (index 0, weight exactly 0).
    logits, probs, chosen = output[0], output[1], output[2]
    return torch.where((chosen == 0) & (probs == 0), logits.shape[-1] - 1, chosen)


def _zaya_spec(module: nn.Module, config: Any) -> RouterSpec:
    return RouterSpec(
        "expert",
        lambda m, c: int(m.num_router_classes),
        lambda m, c: int(m.top_k),
        indices=_zaya_indices,
        zero_slots=lambda m, c: (int(m.num_experts),),
    )


def _dbrx_top_k(module: nn.Module, config: Any) -> int:
    ffn = getattr(config, "ffn_config", None)
    top_k = getattr(ffn, "moe_top_k", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise UnknownRouterError(
            f"DbrxRouter: config.ffn_config.moe_top_k={top_k!r}; expected a positive integer (DBRX's router returns "
            "only logits and the experts take their top-k)"
        )
    return top_k


def _dbrx_spec(module: nn.Module, config: Any) -> RouterSpec:
    # forward returns logits only; DbrxExperts.route_tokens_to_experts takes topk(softmax(logits, dim=1)).
    return RouterSpec(
        "expert",
        lambda m, c: int(m.layer.out_features),
        _dbrx_top_k,
        indices=_topk_of(_dbrx_top_k(module, config), softmax_first=True),
    )


def _jetmoe_spec(module: RouterModule, config: Any) -> RouterSpec:
    # forward returns (sorted expert order, batch index, gates, expert sizes, logits): the per-token picks are
    # logits.topk(top_k, dim=1), recomputed on the same float32 logits.
    return RouterSpec(
        "expert", lambda m, c: int(m.num_experts), lambda m, c: int(m.top_k), indices=_topk_of(int(module.top_k))
    )


def _longcat_spec(module: nn.Module, config: Any) -> RouterSpec:
    # n_routed_experts counts the zero-compute experts too (slots num_experts .. n_routed_experts - 1).
    return RouterSpec(
        "expert",
        lambda m, c: int(m.n_routed_experts),
        lambda m, c: int(m.top_k),
        zero_slots=lambda m, c: tuple(range(int(m.num_experts), int(m.n_routed_experts))),
    )


def _third_of_four_spec(module: nn.Module, config: Any) -> RouterSpec:
    # Inkling: (routed logits, weights, indices, shared-expert gammas).
    return RouterSpec(
        "expert", lambda m, c: int(m.num_experts), lambda m, c: int(m.top_k), indices=lambda output: output[2]
    )


def _gemma4_spec(module: nn.Module, config: Any) -> RouterSpec:
    # (probabilities, weights, indices) but no num_experts / top_k attributes: read them from the projection
    # and the router's own config.
    return RouterSpec("expert", lambda m, c: int(m.proj.out_features), lambda m, c: int(m.config.top_k_experts))


def _projection_spec(module: nn.Module, config: Any) -> RouterSpec:
    # Ergo: (logits, weights, indices) with top_k but no expert count: the projection's width is the count.
    return RouterSpec("expert", lambda m, c: int(m.linear.out_features), lambda m, c: int(m.top_k))


def _hash_spec(module: nn.Module, config: Any) -> RouterSpec:
    # (logits, weights, indices) where indices = tid2eid[input_ids]: counted as chosen, flagged as hash-routed.
    return replace(expert_spec(), hash_routed=True)


def _padded_indexer_spec(module: nn.Module, config: Any) -> RouterSpec:
    # GLM-5-Next (k-pools plus the tail pool) and MiniMax-M3 return [B, S, width] int picks padded with -1;
    # without a range check the -1 reached the probe's gather (GLM-5-Next's crash).
    return replace(indexer_spec(module), may_pad=True, mask_argument=None)


def _mask_positions(mask: torch.Tensor) -> torch.Tensor:
    # [B, 1, S, K] bool mask of the keys each query may see -> [B, S, K] key positions, -1 where not picked.
    keys = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.int64)
    return torch.where(mask[:, 0], keys, -1)


def _qsa_indexer_spec(module: nn.Module, config: Any) -> RouterSpec:
    # Qwen4's QSA indexer returns the mask of selected keys (its token_budget blocks plus the tail), not indices.
    return RouterSpec(
        "indexer", _indexer_slots, lambda m, c: int(m.token_budget), indices=_mask_positions, may_pad=True
    )


def _budget_mask_indexer_spec(module: nn.Module, config: Any) -> RouterSpec:
    # Kolibri 1.1's indexer returns (mask of the keys each query attends to, the pool it chose them from); each
    # query keeps at most index_topk scored keys plus its sink and local tokens, so that budget is its top-k.
    return RouterSpec(
        "indexer",
        _indexer_slots,
        lambda m, c: int(m.topk) + int(m.num_local_tokens) + int(m.num_sink_tokens),
        indices=lambda output: _mask_positions(output[0]),
        may_pad=True,
    )


BUILTIN_SPECS: dict[str, Callable[[nn.Module, Any], RouterSpec]] = {
    "Llama4Router": _llama4_spec,
    "ZayaRouter": _zaya_spec,
    "DbrxRouter": _dbrx_spec,
    "HunYuanMoEV1Gate": lambda module, config: expert_spec(),
    "JetMoeTopKGating": _jetmoe_spec,
    "LongcatFlashTopkRouter": _longcat_spec,
    "InklingTopkRouter": _third_of_four_spec,
    "Gemma4TextRouter": _gemma4_spec,
    "ErgoTopkRouter": _projection_spec,
    "DiffusionGemmaTextRouter": _gemma4_spec,
    "DeepseekV4HashRouter": _hash_spec,
    "Glm5NextTextIndexer": _padded_indexer_spec,
    "MiniMaxM3VLIndexer": _padded_indexer_spec,
    "Qwen4ExpTextQSAIndexer": _qsa_indexer_spec,
    "Kolibri1_1Indexer": _budget_mask_indexer_spec,
}
