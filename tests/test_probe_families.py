"""The probe's counts equal a recomputation from the same forward pass, for every family."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import mla_watch
from tests.tiny_models import FAMILIES, VOCAB, build


class Recorder:
    """An independent hook that keeps each router's raw output."""

    def __init__(self, model: torch.nn.Module, probe: mla_watch.Probe) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {info.name: [] for info in probe.routers}
        modules = dict(model.named_modules())
        self.handles = [
            modules[info.name].register_forward_hook(self._keep(info.name, info.kind)) for info in probe.routers
        ]

    def _keep(self, name: str, kind: str) -> Callable:
        def hook(module, args, output):
            indices = output[-1] if kind == "expert" else output
            self.outputs[name].append(indices.detach().clone())

        return hook


def expected_counts(info: mla_watch.RouterInfo, outputs: list[torch.Tensor], past: int = 0) -> np.ndarray:
    """Recount from raw outputs: expert indices per token; indexer keys j <= query position."""
    counts = np.zeros(info.num_slots, dtype=np.int64)
    for step, indices in enumerate(outputs):
        if info.kind == "expert":
            chosen = indices.reshape(-1, indices.shape[-1]).numpy()
            for token in chosen:
                for slot in token:
                    counts[slot] += 1
        else:
            batch, seq, _ = indices.shape
            offset = 0 if step == 0 else past + step - 1
            for b in range(batch):
                for s in range(seq):
                    position = offset + s
                    for key in indices[b, s].tolist():
                        if 0 <= key <= position:
                            counts[key] += 1
    return counts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_counts_equal_recomputation(family: str) -> None:
    model = build(family)
    probe = mla_watch.attach(model, window_tokens=None)
    kinds = {info.kind for info in probe.routers}
    assert "expert" in kinds
    if family in ("deepseek_v32", "glm_moe_dsa"):
        assert "indexer" in kinds
    recorder = Recorder(model, probe)
    input_ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=input_ids)
    counts = probe.counts()
    for info in probe.routers:
        assert len(recorder.outputs[info.name]) == 1
        np.testing.assert_array_equal(counts[info.name], expected_counts(info, recorder.outputs[info.name]))
        assert counts[info.name].sum() > 0
    stats = {record["name"]: record for record in probe.stats()}
    for info in probe.routers:
        assert stats[info.name]["tokens"] == 27
        assert stats[info.name]["floor_bits"] <= stats[info.name]["entropy_bits"] <= stats[info.name]["ceiling_bits"]


@pytest.mark.parametrize("family", ["deepseek_v32", "mixtral"])
def test_generation_with_kv_cache_counts_every_step(family: str) -> None:
    model = build(family)
    probe = mla_watch.attach(model, window_tokens=None)
    recorder = Recorder(model, probe)
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    counts = probe.counts()
    for info in probe.routers:
        outputs = recorder.outputs[info.name]
        assert len(outputs) == 5  # prefill + 4 decode steps (the last token is not fed back)
        np.testing.assert_array_equal(counts[info.name], expected_counts(info, outputs, past=6))
    tokens = {record["name"]: record["tokens"] for record in probe.stats()}
    assert set(tokens.values()) == {2 * (6 + 4)}


def test_padding_is_not_counted_and_lines_are_attributed_per_row() -> None:
    model = build("deepseek_v32")
    probe = mla_watch.attach(model, window_tokens=None)
    recorder = Recorder(model, probe)
    input_ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding on the second row
    with torch.no_grad(), probe.attribute(["code", "sql"]):
        model(input_ids=input_ids, attention_mask=mask)
    code, sql = probe.counts("code"), probe.counts("sql")
    for info in probe.routers:
        (indices,) = recorder.outputs[info.name]
        if info.kind == "expert":
            per_row = indices.reshape(2, 8, -1)
            want_code = np.bincount(per_row[0].reshape(-1).numpy(), minlength=info.num_slots)
            want_sql = np.bincount(per_row[1, 3:].reshape(-1).numpy(), minlength=info.num_slots)
        else:
            want_code = np.zeros(info.num_slots, dtype=np.int64)
            want_sql = np.zeros(info.num_slots, dtype=np.int64)
            for s in range(8):
                for key in indices[0, s].tolist():
                    if key <= s:
                        want_code[key] += 1
                if s >= 3:
                    for key in indices[1, s].tolist():
                        if 3 <= key <= s:
                            want_sql[key] += 1
        np.testing.assert_array_equal(code[info.name], want_code)
        np.testing.assert_array_equal(sql[info.name], want_sql)
    tokens = {r["name"]: r["tokens"] for r in probe.stats("sql")}
    assert set(tokens.values()) == {5}
    assert probe.business_lines == ["default", "code", "sql"]


def test_num_return_sequences_repeats_the_row_line() -> None:
    model = build("mixtral")
    probe = mla_watch.attach(model, window_tokens=None)
    prompt = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), probe.attribute(["chat", "code"]):
        model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=3,
            do_sample=True,
            num_return_sequences=2,
            pad_token_id=0,
        )
    chat = probe.stats("chat")[0]["tokens"]
    code = probe.stats("code")[0]["tokens"]
    assert chat == code == 2 * (4 + 2)


def test_detach_restores_the_model_bit_for_bit() -> None:
    model = build("deepseek_v32")
    input_ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        probe = mla_watch.attach(model)
        during = model(input_ids=input_ids).logits
        probe.detach()
        after = model(input_ids=input_ids).logits
    assert torch.equal(before, during)
    assert torch.equal(before, after)
    assert not probe.attached
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_stats_records_carry_the_contract_fields() -> None:
    model = build("deepseek_v32")
    probe = mla_watch.attach(model)
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (1, 12)))
    required = {
        "name",
        "layer",
        "kind",
        "tokens",
        "entropy_bits",
        "floor_bits",
        "ceiling_bits",
        "normalized_entropy",
        "max_violation",
        "dead_slots",
    }
    for record in probe.stats():
        assert required <= set(record)
        assert record["layer"] in (0, 1)
    probe.reset()
    assert all(record["tokens"] == 0 for record in probe.stats())
