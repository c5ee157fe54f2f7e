"""The shipped model: its size, its architecture, and what its card claims, re-measured."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

import mla_watch
from mla_watch.models import BUNDLED_DIR, corpus
from mla_watch.models.train import perplexity

REPORT = json.loads((BUNDLED_DIR / "training_report.json").read_text())


def run(model, tokenizer, probe, texts_by_line: dict[str, list[str]]) -> None:
    with torch.no_grad():
        for line, texts in texts_by_line.items():
            for text in texts:
                ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
                with probe.attribute(line):
                    model(input_ids=torch.tensor([ids]))


def test_weights_fit_in_the_package_and_the_architecture_is_deepseek_v32(bundled) -> None:
    model, _ = bundled
    assert (BUNDLED_DIR / "model.safetensors").stat().st_size <= 16 * 1024 * 1024
    config = model.config
    assert config.model_type == "deepseek_v32"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (64, 6, 1)
    assert config.kv_lora_rank < config.hidden_size  # MLA's compressed latent KV
    assert config.index_topk < config.max_position_embeddings
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(biases) == 3 and all(bias.abs().sum() > 0 for bias in biases)  # balancing really ran
    probe = mla_watch.attach(model)
    kinds = [info.kind for info in probe.routers]
    probe.detach()
    assert kinds.count("expert") == 3 and kinds.count("indexer") == 4


@pytest.mark.slow
def test_mixed_traffic_is_balanced_and_single_domains_specialise(bundled) -> None:
    model, tokenizer = bundled
    probe = mla_watch.attach(model, window_tokens=None)
    run(model, tokenizer, probe, {d: corpus.generate(d, 24, seed=4242) for d in corpus.DOMAINS})
    mixed = {r["name"]: r["entropy_bits"] for r in probe.stats() if r["kind"] == "expert"}
    assert all(value >= 5.8 for value in mixed.values()), mixed
    drops = [
        mixed[r["name"]] - r["entropy_bits"]
        for domain in corpus.DOMAINS
        for r in probe.stats(domain)
        if r["kind"] == "expert"
    ]
    assert max(drops) >= 0.1, drops  # some layer's experts specialise by domain
    probe.detach()


@pytest.mark.slow
def test_the_card_perplexity_is_what_the_model_measures(bundled) -> None:
    model, tokenizer = bundled
    settings = REPORT["settings"]
    texts = corpus.generate("sql", settings["heldout_samples_per_domain"], settings["seed"] + 1)
    sequences = [
        [tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        for t in texts
    ]
    assert perplexity(model, sequences) == pytest.approx(REPORT["heldout_perplexity"]["sql"], abs=0.01)
    card = (BUNDLED_DIR / "MODEL_CARD.md").read_text()
    assert f"| sql | {REPORT['heldout_perplexity']['sql']} |" in card
    assert all(1.2 < value < 20 for value in REPORT["heldout_perplexity"].values())  # learned, not memorised


DOMAIN_MARKERS = {
    "code": ("return", "def ", "    "),
    "sql": ("SELECT", "FROM", "WHERE", "GROUP BY", ";"),
    "customer_service": ("order", "Order", "refund", "account", "<|user|>", "help"),
    "doc_summary": (".", "<|eos|>", " the ", "reported", "%"),  # a short summary sentence that ends
}


@pytest.mark.slow
@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_completions_look_like_their_domain(bundled, domain: str) -> None:
    model, tokenizer = bundled
    prompt = corpus.prompts(domain, 1, seed=99)[0]
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    completion = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=False)
    assert sum(marker in completion for marker in DOMAIN_MARKERS[domain]) >= 2, completion
    others = {"code": "def ", "sql": "SELECT", "customer_service": "<|assistant|>", "doc_summary": "Summary:"}
    assert not any(marker in completion for other, marker in others.items() if other != domain), completion


def test_a_watched_model_keeps_its_forward_signature_so_generate_computes_the_same(bundled) -> None:
    """generate() reads forward's parameters (logits_to_keep, position_ids, ...): the probe must not hide them,
    or a watched model computes logits for every prompt position instead of the last one."""
    model, _ = bundled
    before = inspect.signature(model.forward)
    assert model._supports_logits_to_keep()
    probe = mla_watch.attach(model)
    try:
        assert inspect.signature(model.forward) == before
        assert model._supports_logits_to_keep()
        assert inspect.signature(model.model.layers[1].mlp.gate.forward) == inspect.signature(
            type(model.model.layers[1].mlp.gate).forward.__get__(model.model.layers[1].mlp.gate)
        )
    finally:
        probe.detach()
