"""Every MoE family of the installed transformers, read from transformers itself, and a tiny model of each.

Selection rule (:func:`router_families`): a *family* is one ``transformers.models.<module>`` package whose
``modeling_<module>.py`` defines a class named ``...Router``, ``...Gate``, ``...Gating`` or ``...Indexer``
(the names transformers gives the modules that choose experts or keys) and one of whose configs (or
sub-configs) has an expert count (``num_experts``, ``num_local_experts``, ``n_routed_experts``,
``moe_num_experts``) or an indexer budget (``index_topk``). The second condition leaves out gates that choose
nothing (D-FINE's detection gate, linear-attention forget gates in families without experts). Nothing here
names a family, so a new transformers release brings its new routers into the sweep by itself.

:func:`tiny_model` builds a 2-layer random model of a family from its default config with every size shrunk.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

ROUTER_CLASS = re.compile(r"(Router|Gate|Gating|Indexer)$")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
INDEXER_KEYS = ("index_topk",)
VOCAB = 97


@dataclass(frozen=True)
class Family:
    module: str  # transformers.models.<module>
    model_types: tuple[str, ...]  # every config model_type defined by that module
    router_classes: tuple[str, ...]


def _modeling(module: str) -> Any | None:
    try:
        return importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except Exception:  # a family whose optional dependency is missing is not a family of this install
        return None


def _sub_configs(config: Any) -> list[Any]:
    found = [config]
    for value in vars(config).values():
        if isinstance(value, transformers.PretrainedConfig):
            found.extend(_sub_configs(value))
    return found


def _routes(model_type: str) -> bool:
    """Whether the default config of ``model_type`` (or a sub-config) has experts or an indexer budget."""
    try:
        config = transformers.AutoConfig.for_model(model_type)
    except Exception:
        return False
    return any(
        isinstance(getattr(sub, key, None), int | list) and not isinstance(getattr(sub, key, None), bool)
        for sub in _sub_configs(config)
        for key in EXPERT_COUNT_KEYS + INDEXER_KEYS
    )


@cache
def router_families() -> tuple[Family, ...]:
    """The families of the selection rule above, one per modeling module, sorted by module name."""
    by_module: dict[str, list[str]] = {}
    for model_type in configuration_auto.CONFIG_MAPPING_NAMES:
        by_module.setdefault(configuration_auto.model_type_to_module_name(model_type), []).append(model_type)
    families = []
    for module, model_types in sorted(by_module.items()):
        modeling = _modeling(module)
        if modeling is None:
            continue
        classes = tuple(
            sorted(
                name
                for name, obj in vars(modeling).items()
                if inspect.isclass(obj) and obj.__module__ == modeling.__name__ and ROUTER_CLASS.search(name)
            )
        )
        if classes and any(_routes(model_type) for model_type in model_types):
            families.append(Family(module, tuple(model_types), classes))
    return tuple(families)


# ---------------------------------------------------------------------------------------- tiny configs
# Sizes every family understands; a key is only set where the default config has it.
_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "ffn_hidden_size": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_model": 64,
    "d_ff": 64,
    "d_kv": 16,
    "num_heads": 4,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_decoder_layers": 2,
    "num_sparse_encoder_layers": 1,
    "num_sparse_decoder_layers": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_topk": 4,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "num_dense_layers": 0,
    "first_dense_layers": 0,
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "expert_layer_period": 1,
    "expert_layer_offset": 0,
    "mlp_only_layers": [],
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": 64,
    "router_hidden_size": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
_EXPERTS, _TOP_K = 8, 2
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "moe_top_k", "top_k_experts", "num_selected_experts")


def _shrunk_value(key: str, default: Any) -> Any:
    if key in EXPERT_COUNT_KEYS and isinstance(default, int) and not isinstance(default, bool):
        return _EXPERTS
    if key in _TOP_K_KEYS and (default is None or (isinstance(default, int) and not isinstance(default, bool))):
        return _TOP_K
    if key in _TINY and (
        default is None
        or type(default) is type(_TINY[key])
        or (isinstance(default, int | float) and isinstance(_TINY[key], int | float))
    ):
        return _TINY[key]
    if isinstance(default, list) and key in EXPERT_COUNT_KEYS:  # per-layer expert counts
        return [_EXPERTS] * 2
    if isinstance(default, list) and key in _TOP_K_KEYS:
        return [_TOP_K] * 2
    return default


def _two_layers(per_layer: list) -> list:
    """A per-layer list (layer_types, mlp_layer_types, ...) cut to two layers: the first, then the first layer of
    another kind that routes (MoE, sparse or indexed attention), else of any other kind, else the last - so
    DeepSeek-V4 keeps a hash-routed and a learned layer, Nemotron-H an MoE layer, GLM-5-Next an indexed one."""
    first = per_layer[0]
    others = [item for item in per_layer if item != first]
    routed = [item for item in others if re.search(r"moe|sparse|expert|index|dsa", str(item), re.I)]
    return [first, (routed or others or per_layer)[-1 if not (routed or others) else 0]]


def tiny_kwargs(config_class: type, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Constructor arguments: the default config's values with every size shrunk, sub-configs included."""
    default = config_class()
    values = default.to_dict()
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key.startswith("_") or key in ("transformers_version", "architectures", "model_type"):
            continue
        sub = getattr(default, key, None)
        if isinstance(sub, transformers.PretrainedConfig):
            kwargs[key] = tiny_kwargs(type(sub))
            continue
        if (
            isinstance(value, list)
            and len(value) == getattr(default, "num_hidden_layers", -1)
            and key not in ("mlp_only_layers",)
        ):
            kwargs[key] = _two_layers(value)
            continue
        shrunk = _shrunk_value(key, value)
        if shrunk is not value:  # values derived from others (qk_head_dim, layer_types) are derived again
            kwargs[key] = shrunk
    if "kv_lora_rank" in kwargs:  # MLA: rotary head_dim is qk_rope_head_dim, and every head has its own KV
        kwargs.update(
            {
                key: value
                for key, value in (
                    ("head_dim", kwargs.get("qk_rope_head_dim")),
                    ("num_key_value_heads", kwargs.get("num_attention_heads")),
                )
                if key in kwargs
            }
        )
    kwargs.update(overrides or {})
    return kwargs


# ---------------------------------------------------------------------------------------- tiny models
def _class(name: str | None) -> type | None:
    return getattr(transformers, name, None) if name else None


def pick_model(family: Family) -> tuple[str, type]:
    """``(model_type, model class)`` to sweep: a causal LM where there is one (text variants first), else the
    text model, else the family's base model. Raises ``LookupError`` naming what is missing."""
    ordered = sorted(family.model_types, key=lambda model_type: (not model_type.endswith("_text"), model_type))
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        for model_type in ordered:
            name = mapping.get(model_type)
            if (
                isinstance(name, str)
                and _class(name) is not None
                and (mapping is not modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or name.endswith("ForCausalLM"))
            ):
                return model_type, _class(name)
    raise LookupError(
        f"{family.module}: no model class for any of {family.model_types} in the causal-LM or base "
        "mappings of transformers.models.auto"
    )


# Sizes the generic shrinking cannot guess: validators that tie two sizes together, indexer budgets whose
# defaults are None. Keyed by modeling module; a family needs no entry to be swept.
OVERRIDES: dict[str, dict[str, Any]] = {
    "zaya": {"num_experts_per_tok": 1},  # the config accepts top-1 only
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}},
    "glm5_next": {"index_kpool": 2, "qk_rope_head_dim": 0},
    "lfm2_moe": {"num_dense_layers": 0, "layer_types": ["full_attention", "full_attention"]},
    "qwen4_exp": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
    },
    "glm4v_moe": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.5,
        }
    },
    "hy_v4_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
    "kolibri1_1": {"index_num_heads": 2},  # at most the query heads of one key head (4 // 2)
}


def tiny_model(family: Family) -> torch.nn.Module:
    """A 2-layer random model of ``family`` in eval mode, router weights random (some start at zero)."""
    model_type, model_class = pick_model(family)
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    config = config_class(**tiny_kwargs(config_class, OVERRIDES.get(family.module)))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if ROUTER_CLASS.search(type(module).__name__):
                for parameter in module.parameters(recurse=True):
                    parameter.normal_(0, 1)
    return model
