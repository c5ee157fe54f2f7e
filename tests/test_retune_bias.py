"""Aux-loss-free bias re-fit: undoes a collapse on a copy, never touching the live model."""

from __future__ import annotations

import time

import pytest
import torch

import mla_watch
from mla_watch.retune import BiasRefitResult, refit_bias, router_state, supports_bias
from mla_watch.routing.stats import entropy_bits
from tests.tiny_models import VOCAB, build

GATE = "model.layers.1.mlp.gate"
BIAS = f"{GATE}.e_score_correction_bias"


def batches(count: int, seed: int, size: tuple[int, int] = (4, 16)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, size, generator=generator) for _ in range(count)]


def entropy(model: torch.nn.Module, data: list[torch.Tensor], router: str) -> float:
    probe = mla_watch.attach(model, window_tokens=None)
    try:
        with torch.no_grad():
            for batch in data:
                model(input_ids=batch)
        return entropy_bits(probe.counts()[router])
    finally:
        probe.detach()


def test_refit_undoes_a_collapse_without_touching_the_live_model() -> None:
    model = build("deepseek_v32")
    assert supports_bias(model) == ["model.layers.0.mlp.gate", GATE]
    data = batches(8, seed=1)
    healthy = entropy(model, data, GATE)
    with torch.no_grad():
        dict(model.named_modules())[GATE].e_score_correction_bias[:2] += 10
    collapsed = entropy(model, data, GATE)
    assert collapsed < healthy - 0.5 and collapsed == pytest.approx(1.0)  # always the same 2 of 8 experts
    live_probe = mla_watch.attach(model, window_tokens=None)  # a live probe must neither break nor count the re-fit
    before = {name: t.clone() for name, t in model.state_dict().items()}

    result = refit_bias(model, data, routers=[GATE], gamma=0.05, steps=300)

    assert isinstance(result, BiasRefitResult) and result.routers == [GATE] and result.steps == 300
    assert list(result.tensors) == [BIAS] and result.tensors[BIAS].shape == (8,)
    assert result.before_bits[GATE] == pytest.approx(collapsed, abs=1e-3)
    assert result.after_bits[GATE] > collapsed + 1.0
    assert set(result.before_bits) == set(supports_bias(model))  # expert routers only, no indexers
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert live_probe.counts()[GATE].sum() == 0
    # Promoting the returned bias reproduces the re-fit's entropy on the live model.
    live_probe.detach()
    with torch.no_grad():
        dict(model.named_modules())[GATE].e_score_correction_bias.copy_(result.tensors[BIAS])
    assert entropy(model, data, GATE) == pytest.approx(result.after_bits[GATE], abs=1e-3)
    assert set(result.tensors) <= set(router_state(model))


def test_refit_touches_only_the_selected_routers() -> None:
    model = build("deepseek_v32")
    result = refit_bias(model, batches(2, seed=2), routers=["model.layers.0.mlp.gate"], steps=5)
    assert list(result.tensors) == ["model.layers.0.mlp.gate.e_score_correction_bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.indexer"):
        refit_bias(model, batches(1, seed=2), routers=["model.layers.1.self_attn.indexer"], steps=1)
    with pytest.raises(ValueError, match="no batches"):
        refit_bias(model, [], steps=1)


def test_model_without_correction_bias_is_refused() -> None:
    model = build("mixtral")
    assert supports_bias(model) == []
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        refit_bias(model, batches(1, seed=3))


@pytest.mark.slow
def test_bundled_model_collapse_is_refitted() -> None:
    from mla_watch.models.corpus import generate_mixed

    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    gate = "model.layers.2.mlp.gate"

    def encode(seed: int, count: int) -> list[torch.Tensor]:
        texts = [text for _, text in generate_mixed(8 * count, seed)]
        out = []
        for start in range(0, len(texts), 8):
            ids = [tokenizer(text)["input_ids"][:128] for text in texts[start : start + 8]]
            width = min(len(row) for row in ids)  # equal lengths: no padding needed
            out.append(torch.tensor([row[:width] for row in ids]))
        return out

    train, held_out = encode(seed=101, count=25), encode(seed=202, count=8)
    healthy = entropy(model, held_out, gate)
    with torch.no_grad():
        dict(model.named_modules())[gate].e_score_correction_bias[:6] += 10
    collapsed = entropy(model, held_out, gate)
    started = time.perf_counter()
    result = refit_bias(model, train, routers=[gate], gamma=0.05, steps=100)
    seconds = time.perf_counter() - started
    with torch.no_grad():
        dict(model.named_modules())[gate].e_score_correction_bias.copy_(
            result.tensors[f"{gate}.e_score_correction_bias"]
        )
    restored = entropy(model, held_out, gate)
    print(
        f"bundled {gate}: healthy {healthy:.3f} bits, collapsed {collapsed:.3f}, re-fitted {restored:.3f} "
        f"held-out ({result.after_bits[gate]:.3f} on the re-fit batches) in {seconds:.1f} s"
    )
    assert collapsed < 3.0
    assert restored >= 5.5
