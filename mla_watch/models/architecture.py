"""The bundled model's architecture: a miniature DeepSeek-V3.2.

Every part a production DeepSeek-V3.2 has, at a size that trains in minutes on two CPU
cores: MLA attention with a compressed latent KV (``kv_lora_rank``) and a low-rank query,
the DSA lightning indexer choosing ``index_topk`` keys per query, a first dense layer and
then MoE layers of 64 routed experts (top-6) plus one shared expert, with DeepSeek-V3's
``e_score_correction_bias`` for auxiliary-loss-free balancing.
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV32Config

__all__ = ["BUNDLED_ARCHITECTURE", "bundled_config"]

BUNDLED_ARCHITECTURE: dict[str, object] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
    "index_topk": 64,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def bundled_config(
    vocab_size: int, *, pad_token_id: int, bos_token_id: int, eos_token_id: int, **overrides: object
) -> DeepseekV32Config:
    """The bundled architecture for a tokenizer of ``vocab_size`` tokens."""
    values: dict[str, Any] = {**BUNDLED_ARCHITECTURE, **overrides}
    config = DeepseekV32Config(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        **values,
    )
    config._attn_implementation = "eager"
    return config
