"""What compiled models and CUDA graphs need from the probe, and what batching passes must not change.

A captured graph keeps the addresses it was built against, so the counting buffer is sized once
(business lines past ``max_business_lines`` go to ``overflow``) and the attribution is written in
place. Eager decode steps are counted several at a time; every read must see all of them.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import mla_watch
from mla_watch.probe import OVERFLOW_LINE
from tests.test_probe_discovery import FakeTopKRouter, TinyMoE
from tests.tiny_models import VOCAB, build


def test_lines_past_the_capacity_count_as_overflow_with_one_warning() -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None, max_business_lines=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ["a", "b", "c", "d", "a", "e"]:
            with probe.attribute(name):
                model(torch.tensor([[1, 2]]))
    overflow_warnings = [w for w in caught if "max_business_lines=3" in str(w.message)]
    assert len(overflow_warnings) == 1
    assert "'c'" in str(overflow_warnings[0].message)
    assert probe.business_lines == ["default", "a", "b", OVERFLOW_LINE]
    assert probe.overflowed_lines == ["c", "d", "e"]
    assert probe.stats("a")[0]["tokens"] == 4  # two passes of two tokens
    assert probe.stats(OVERFLOW_LINE)[0]["tokens"] == 6  # c, d and e, counted together
    assert probe.counts()["layers.0.gate"].sum() == 6 * 2 * 2


def test_the_buffer_and_the_attribution_tensor_are_never_reallocated() -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None)
    buffer, rows = probe._buffer.data_ptr(), probe._row_lines.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the overflow warning
        for index in range(40):
            with probe.attribute([f"line{index}", f"line{index + 1}"]):
                model(torch.tensor([[index, 1], [2, 3]]))
            probe.collect()
    probe.reset()
    assert probe._buffer.data_ptr() == buffer
    assert probe._row_lines.data_ptr() == rows
    assert len(probe.business_lines) == probe.max_business_lines + 1


def test_attribution_is_written_in_place_and_restored_on_exit() -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model)
    with probe.attribute(["a", "b", "a"]):
        assert probe._row_lines[:3].tolist() == [1, 2, 1]
        with probe.attribute("b"):
            assert probe._row_lines[0].item() == 2
        assert probe._row_lines[:3].tolist() == [1, 2, 1]
    assert probe._row_lines[0].item() == 0


class EdgeRouter(FakeTopKRouter):
    """Picks -1 for odd first features and num_experts for multiples of three: both out of range."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat, weights, indices = super().forward(hidden)
        value = flat[:, :1].long()
        indices = torch.where(value % 2 == 1, torch.full_like(indices, -1), indices)
        indices = torch.where((value % 3 == 0) & (value > 0), torch.full_like(indices, self.num_experts), indices)
        return flat, weights, indices


def test_out_of_range_expert_picks_are_dropped_never_counted_elsewhere() -> None:
    model = TinyMoE(EdgeRouter)
    probe = mla_watch.attach(model, window_tokens=None)
    with torch.no_grad():
        model(torch.tensor([[0, 1, 2, 3, 4, 6]]))  # 1, 3: -1; 3, 6: num_experts; 0, 2, 4: in range
    counts = probe.counts()
    for name in ("layers.0.gate", "layers.1.gate"):
        np.testing.assert_array_equal(counts[name], [1, 1, 1, 1, 1, 1])  # (0,1), (2,3), (4,5)
    assert probe.dropped() == {"layers.0.gate": 6, "layers.1.gate": 6}
    assert {record["tokens"] for record in probe.stats()} == {6}


@pytest.mark.parametrize("family", ["deepseek_v32", "mixtral"])
def test_batched_decode_steps_count_exactly_what_one_pass_at_a_time_counts(family: str) -> None:
    """Left padding, one line per row, indexers whose picks grow with the context: batching changes nothing."""
    model = build(family)
    prompt = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(prompt)
    mask[1, 0] = 0
    figures = []
    for flush_every in (1, 4, 64):
        probe = mla_watch.attach(model, window_tokens=None, flush_every=flush_every)
        with torch.no_grad(), probe.attribute(["code", "sql"]):
            model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
        figures.append({line: (probe.counts(line), probe.stats(line)) for line in ("code", "sql")})
        probe.detach()
    reference = figures[0]
    for other in figures[1:]:
        for line in ("code", "sql"):
            for name, counts in reference[line][0].items():
                np.testing.assert_array_equal(other[line][0][name], counts)
            assert other[line][1] == reference[line][1]
    assert {record["tokens"] for record in reference["sql"][1]} == {2 + 8}


def test_a_mask_changed_in_place_before_its_pass_is_counted_is_warned_about_once() -> None:
    """The padding is read when a pass is counted; the mask's version counter shows a caller that reused it."""
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None, flush_every=1000)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    model(ids, attention_mask=mask)
    probe.count_pending()  # counted before the reuse: no warning, the padding as it was
    mask[1, 0] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe.stats()[0]["tokens"] == 5
    model(ids, attention_mask=mask)
    mask[1, :2] = 0
    model(ids, attention_mask=mask)
    with pytest.warns(RuntimeWarning, match=r"attention_mask was changed in place.*count_pending\(\)"):
        probe.counts()
    assert probe.stats()[0]["tokens"] == 5 + 4 + 4  # the reused pass read as the mask is now
    model(ids, attention_mask=mask)
    mask[0, 0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per probe
        probe.counts()


def test_padding_of_inference_mode_masks_is_read_during_the_pass() -> None:
    """Inference tensors keep no version counter, so their padding is read when the pass runs."""
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None, flush_every=1000)
    with torch.inference_mode():
        mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=mask)
        mask[1, :2] = 1  # allowed in inference mode, and invisible to a version check
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.ones_like(mask))
    assert probe.stats()[0]["tokens"] == 4 + 6


def test_every_read_sees_the_passes_still_waiting_to_be_counted() -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None, flush_every=1000)
    for step in range(5):
        model(torch.tensor([[step]]))
        assert probe.counts()["layers.0.gate"].sum() == 2 * (step + 1)
        assert probe.stats()[0]["tokens"] == step + 1
    model(torch.tensor([[1]]))
    probe.detach()  # counts what waits before letting go
    assert probe.counts()["layers.0.gate"].sum() == 12


def test_a_deep_copy_of_a_watched_model_computes_like_it_and_is_not_counted() -> None:
    model = build("mixtral")
    probe = mla_watch.attach(model, window_tokens=None)
    clone = copy.deepcopy(model)
    input_ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(clone(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
    assert {record["tokens"] for record in probe.stats()} == {5}
    probe.detach()
    assert not any("forward" in module.__dict__ for module in model.modules())


@pytest.mark.slow
def test_compiled_decode_counts_like_eager_without_recompiling() -> None:
    """CPU inductor, static cache: one graph for every decode step, the counting traced into it, the
    attribution read from the in-place tensor (a new line needs no new graph)."""
    from torch._inductor.compile_fx import compile_fx
    from transformers import StaticCache

    model, _ = mla_watch.load_model("bundled", device="cpu")
    tokens = torch.randint(3, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(7))
    prompt = 6

    def decode(step, probe: mla_watch.Probe, line: str) -> dict[str, np.ndarray]:
        cache = StaticCache(config=model.config, max_cache_len=24)
        with torch.no_grad(), probe.attribute(line):
            model(input_ids=tokens[:, :prompt], position_ids=torch.arange(prompt)[None], cache=cache, use_cache=True)
            for index in range(prompt, tokens.shape[1]):  # teacher-forced: the same inputs both ways
                step(
                    input_ids=tokens[:, index : index + 1],
                    position_ids=torch.tensor([[index]]),
                    cache=cache,
                    use_cache=True,
                )
        return probe.counts(line)

    probe = mla_watch.attach(model, window_tokens=None)
    eager = decode(model, probe, "chat")
    probe.detach()

    graphs: list[int] = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(graph_module.graph.nodes))
        return compile_fx(graph_module, example_inputs)

    torch._dynamo.reset()
    probe = mla_watch.attach(model, window_tokens=None)
    compiled = torch.compile(model, backend=backend)
    first = decode(compiled, probe, "chat")
    compiles = len(graphs)
    second = decode(compiled, probe, "code")
    probe.detach()
    torch._dynamo.reset()
    assert compiles == 1, f"expected one graph for every decode step, got {compiles}"
    assert len(graphs) == compiles, "a new business line recompiled the model"
    for name, counts in eager.items():
        np.testing.assert_array_equal(first[name], counts)
        np.testing.assert_array_equal(second[name], counts)
        assert counts.sum() > 0


def test_probes_attached_one_over_another_detach_in_any_order() -> None:
    model = build("mixtral")
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    first, second, third = (mla_watch.attach(model, window_tokens=None) for _ in range(3))
    with torch.no_grad():
        model(input_ids=ids)
    counts = [probe.counts() for probe in (first, second, third)]
    assert all(all((c[name] == counts[0][name]).all() for name in c) for c in counts)  # each saw every pass
    first.detach()  # the innermost, under two others
    with torch.no_grad():
        model(input_ids=ids)
    assert all(int(third.counts()[n].sum()) == 2 * int(counts[0][n].sum()) for n in counts[0])
    third.detach()
    second.detach()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert all("forward" not in module.__dict__ for module in model.modules())
