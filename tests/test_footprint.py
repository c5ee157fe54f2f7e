"""The expert footprint of a batch: distinct experts per MoE layer of one decode step, per line and mixed."""

from __future__ import annotations

import numpy as np
import pytest

from mla_watch.cli import main
from mla_watch.routing.footprint import FootprintSampler, distinct_experts


def test_distinct_experts_counts_each_layer_of_a_step() -> None:
    step = np.array([[[0, 1], [4, 5]], [[1, 2], [4, 5]], [[0, 2], [6, 7]]])  # [B=3, layers=2, top_k=2]
    assert distinct_experts(step, 8).tolist() == [3, 4]


def test_lines_that_route_apart_read_fewer_experts_batched_apart_than_mixed() -> None:
    """Two lines each confined to half of 16 experts (top-2): a step of B requests of one line reads at most 8 experts
    per layer, a mixed step up to 16; the figures are exact where the draw cannot vary."""
    rng = np.random.default_rng(0)
    sampler = FootprintSampler(16, max_requests=64, tokens_per_request=4)
    for line, offset in (("a", 0), ("b", 8)):
        for _ in range(64):
            rows = np.stack(
                [np.stack([rng.choice(8, 2, replace=False) + offset for _ in range(3)]) for _ in range(10)]
            )  # [10 tokens, 3 layers, top-2]
            sampler.add(line, rows)
    table = sampler.table((1, 32), draws=32)
    assert table.requests == {"a": 64, "b": 64}
    assert table.lines["a"][0] == table.lines["b"][0] == table.mixed[0] == 2.0  # one request: its top-k
    assert table.lines["a"][1] == table.lines["b"][1] == 8.0  # 32 requests cover the line's 8 experts
    assert 15.5 < table.mixed[1] <= 16.0
    assert table.ratio[0] == 1.0 and 0.5 <= table.ratio[1] < 0.52
    assert table.as_dict()["ratio_apart_to_mixed"] == list(table.ratio)
    # Bounded: 64 requests of at most 4 tokens per line, uint16 ids.
    assert sampler.nbytes == 2 * 64 * 4 * 3 * 2 * 2


def test_expert_ids_out_of_range_are_refused() -> None:
    sampler = FootprintSampler(8)
    with pytest.raises(ValueError, match=r"expert ids in \[0, 9\]: expected \[0, 7\]"):
        sampler.add("a", np.array([[[0, 9]]]))
    with pytest.raises(ValueError, match="num_experts = 0: expected 1 to 65536"):
        FootprintSampler(0)


def test_the_routing_command_prints_the_footprint_of_a_batch(capsys: pytest.CaptureFixture) -> None:
    assert main(["routing", "--samples", "8"]) == 0
    out = capsys.readouterr().out
    assert "Expert footprint of a batch" in out and "all lines mixed" in out
    ratio = next(line for line in out.splitlines() if line.startswith("bytes apart / mixed")).split()[-4:]
    assert ratio[0] == "1.000" and all(0.0 < float(value) <= 1.5 for value in ratio)
