"""Router-only fine-tuning: trains a copy, returns only the selected gate weights, repairs damage."""

from __future__ import annotations

import json
import math

import pytest
import torch

import mla_watch
from mla_watch.retune import router_state
from mla_watch.retune.finetune import FinetuneResult, finetune_routers
from mla_watch.routing.stats import entropy_bits
from tests.tiny_models import VOCAB, build

GATE = "model.layers.1.mlp.gate"
WEIGHT = f"{GATE}.weight"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on shared cores OpenMP spin-waits cost 10-50x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batches(count: int, seed: int, size: tuple[int, int] = (4, 16)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, size, generator=generator) for _ in range(count)]


def sequences(count: int, seed: int, lengths: tuple[int, int] = (5, 16)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, VOCAB, (size,), generator=generator).tolist() for size in sizes]


def padded(seqs: list[list[int]], batch_size: int, pad: int = 0) -> list[dict[str, torch.Tensor]]:
    """Right-padded ``{"input_ids", "attention_mask"}`` batches, filling the padding with ``pad``."""
    out = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        width = max(len(row) for row in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, sequence in enumerate(chunk):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def entropy(model: torch.nn.Module, data: list, router: str) -> float:
    probe = mla_watch.attach(model, window_tokens=None)
    try:
        with torch.no_grad():
            for batch in data:
                if isinstance(batch, dict):
                    model(**batch)
                else:
                    model(input_ids=batch)
        return entropy_bits(probe.counts()[router])
    finally:
        probe.detach()


def gate(model: torch.nn.Module, name: str = GATE) -> torch.nn.Module:
    return dict(model.named_modules())[name]


def test_finetune_trains_a_copy_and_returns_only_the_selected_routers() -> None:
    from mla_watch.models.train import perplexity

    model = build("deepseek_v32")
    seqs = sequences(12, seed=1)
    data = padded(seqs, batch_size=4)
    live_probe = mla_watch.attach(model, window_tokens=None)  # must neither break nor count the fine-tune
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}

    result = finetune_routers(model, data, routers=[GATE], lr=1e-2, epochs=2)

    assert isinstance(result, FinetuneResult)
    assert (result.routers, result.epochs, result.steps, result.lr) == ([GATE], 2, 6, 1e-2)
    assert result.lora_rank is None and result.balance_weight == 0.1
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert live_probe.counts()[GATE].sum() == 0
    live_probe.detach()

    state = router_state(model)
    assert list(result.tensors) == [WEIGHT]
    tensor = result.tensors[WEIGHT]
    assert tensor.shape == state[WEIGHT].shape and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
    assert not torch.equal(tensor, state[WEIGHT])  # it did train
    assert set(result.before_bits) == set(result.after_bits) == {"model.layers.0.mlp.gate", GATE}  # no indexers
    json.dumps(result.as_dict())
    assert "tensors" not in result.as_dict()

    # The losses are per non-pad token: exactly what train.perplexity measures on the same sequences.
    assert result.loss_before == pytest.approx(math.log(perplexity(model, seqs)), abs=1e-4)
    with torch.no_grad():
        gate(model).weight.copy_(tensor)
    assert result.loss_after == pytest.approx(math.log(perplexity(model, seqs)), abs=1e-4)
    assert entropy(model, data, GATE) == pytest.approx(result.after_bits[GATE], abs=1e-3)

    everything = finetune_routers(model, batches(1, seed=2), epochs=1)
    assert everything.routers == ["model.layers.0.mlp.gate", GATE]
    assert list(everything.tensors) == ["model.layers.0.mlp.gate.weight", WEIGHT]


def test_padding_does_not_count() -> None:
    model = build("deepseek_v32")
    seqs = sequences(8, seed=3)
    zeros = finetune_routers(model, padded(seqs, 4, pad=0), lr=1e-2, epochs=1)
    noise = finetune_routers(model, padded(seqs, 4, pad=VOCAB - 1), lr=1e-2, epochs=1)
    assert zeros.loss_before == pytest.approx(noise.loss_before, rel=1e-6)
    assert zeros.loss_after == pytest.approx(noise.loss_after, rel=1e-6)
    for name, tensor in zeros.tensors.items():
        torch.testing.assert_close(tensor, noise.tensors[name], rtol=1e-5, atol=1e-6)


def test_bad_routers_and_settings_are_refused() -> None:
    model = build("deepseek_v32")
    data = batches(1, seed=4)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.indexer.*model\.layers\.0\.mlp\.gate"):
        finetune_routers(model, data, routers=["model.layers.1.self_attn.indexer"])
    with pytest.raises(ValueError, match="no batches"):
        finetune_routers(model, [])
    with pytest.raises(ValueError, match="routers is empty"):
        finetune_routers(model, data, routers=[])
    for setting, shown in [
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": -1e-4}, "lr=-0.0001"),
        ({"epochs": 0}, "epochs=0"),
        ({"balance_weight": -0.5}, "balance_weight=-0.5"),
        ({"lora_rank": 0}, "lora_rank=0"),
        ({"lora_alpha": 8.0}, "lora_alpha=8.0"),
    ]:
        with pytest.raises(ValueError, match=f"{shown} \\(expected"):
            finetune_routers(model, data, **setting)
    with pytest.raises(TypeError, match=r"batches\[1\]"):
        finetune_routers(model, [data[0], "text"])

    # A router whose weight is not a matrix cannot be fine-tuned; the others are listed.
    with torch.no_grad():
        del gate(model).weight
        gate(model).weight = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match=r"\['model\.layers\.1\.mlp\.gate'\].*no 2-D weight.*\['model\.layers\.0"):
        finetune_routers(model, data, routers=[GATE])


def test_same_seed_gives_bit_identical_tensors() -> None:
    model = build("deepseek_v32")
    data = batches(4, seed=5)
    first = finetune_routers(model, data, lr=1e-2, seed=7)
    second = finetune_routers(model, data, lr=1e-2, seed=7)
    other = finetune_routers(model, data, lr=1e-2, seed=8)  # another epoch order
    assert list(first.tensors) == list(second.tensors)
    assert all(torch.equal(first.tensors[name], second.tensors[name]) for name in first.tensors)
    assert first.as_dict() == second.as_dict()
    assert not all(torch.equal(first.tensors[name], other.tensors[name]) for name in first.tensors)


def test_softmax_routers_train_too() -> None:
    model = build("mixtral")
    result = finetune_routers(model, batches(2, seed=6), routers=[GATE], lr=1e-2)
    assert list(result.tensors) == [WEIGHT] and result.tensors[WEIGHT].shape == (8, 32)
    assert math.isfinite(result.loss_after)


def test_lora_delta_has_at_most_the_rank() -> None:
    model = build("deepseek_v32")
    original = gate(model).weight.detach().clone()
    result = finetune_routers(model, batches(4, seed=7), routers=[GATE], lr=1e-2, epochs=2, lora_rank=2)
    assert result.lora_rank == 2 and result.lora_alpha == 2.0
    delta = result.tensors[WEIGHT] - original
    assert delta.abs().max() > 1e-4  # it did train
    assert int(torch.linalg.matrix_rank(delta)) <= 2
    assert torch.equal(gate(model).weight, original)
    full = finetune_routers(model, batches(4, seed=7), routers=[GATE], lr=1e-2, epochs=2)
    assert int(torch.linalg.matrix_rank(full.tensors[WEIGHT] - original)) > 2  # what LoRA is limiting


def test_balance_term_spreads_a_collapsed_router() -> None:
    model = build("deepseek_v32")
    data = batches(4, seed=1)
    # Collapse onto experts 0 and 1: add the direction of the router's mean input to their rows.
    inputs: list[torch.Tensor] = []
    handle = gate(model).register_forward_hook(lambda module, args, output: inputs.append(args[0].flatten(0, -2)))
    with torch.no_grad():
        for batch in data:
            model(input_ids=batch)
    handle.remove()
    mean = torch.cat(inputs).mean(0)
    with torch.no_grad():
        gate(model).weight[:2] += 10 * mean / mean.norm() ** 2

    plain = finetune_routers(model, data, routers=[GATE], lr=0.1, epochs=10, balance_weight=0.0)
    balanced = finetune_routers(model, data, routers=[GATE], lr=0.1, epochs=10, balance_weight=1.0)
    assert plain.before_bits[GATE] == balanced.before_bits[GATE] < 2.7  # of 3 bits
    gained = {
        run: result.after_bits[GATE] - result.before_bits[GATE]
        for run, result in (("plain", plain), ("balanced", balanced))
    }
    assert gained["balanced"] > gained["plain"] + 0.1, gained  # measured: +0.25 vs +0.08 bits


@pytest.mark.slow
def test_finetune_repairs_a_damaged_bundled_router() -> None:
    from mla_watch.models import corpus
    from mla_watch.models.train import perplexity

    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    gate_name = "model.layers.1.mlp.gate"
    texts = corpus.generate("code", 64, seed=7)
    seqs = [[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]][:128] for text in texts]
    data = padded(seqs, batch_size=8, pad=tokenizer.pad_token_id)
    healthy = perplexity(model, seqs)
    generator = torch.Generator().manual_seed(0)
    weight = gate(model, gate_name).weight
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=generator) * 0.5)
    damaged = perplexity(model, seqs)
    assert damaged > healthy + 0.2  # measured: 1.662 -> 2.034

    result = finetune_routers(model, data, routers=[gate_name], lr=1e-3, epochs=2)

    assert result.loss_after < result.loss_before
    assert result.loss_before == pytest.approx(math.log(damaged), abs=1e-3)
    with torch.no_grad():
        weight.copy_(result.tensors[f"{gate_name}.weight"])
    repaired = perplexity(model, seqs)
    assert repaired < damaged - 0.01  # measured: 2.006
