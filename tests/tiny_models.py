"""Tiny random models of the MoE families in transformers, for tests that need real routers."""

from __future__ import annotations

import torch
import transformers

VOCAB = 97
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
MLA = {
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "moe_intermediate_size": 16,
    "intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
}
DSA = {"index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}

FAMILIES: dict[str, tuple[str, str, dict]] = {
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {**MLA, "n_routed_experts": 8, "num_experts_per_tok": 2},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**MLA, "n_routed_experts": 8, "num_experts_per_tok": 2},
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        {**MLA, **DSA, "n_routed_experts": 8, "num_experts_per_tok": 2},
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        {**MLA, **DSA, "n_routed_experts": 8, "num_experts_per_tok": 2},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "intermediate_size": 32,
            "head_dim": 16,
        },
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "head_dim": 16,
            "layer_types": ["full_attention", "full_attention"],
        },
    ),
}


def build(family: str) -> torch.nn.Module:
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for module in model.modules():
            # Fresh routers are all zeros in some families; random weights make the choices differ.
            if type(module).__name__.lower().endswith("router"):
                module.weight.normal_(0, 1)
    return model
