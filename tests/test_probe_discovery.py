"""Discovery errors, custom routers, and hooks that never wait for the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mla_watch
from mla_watch.probe import RouterRegistry


class PlainModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.layers[0](input_ids.float())


class FakeTopKRouter(nn.Module):
    """Chooses experts by a fixed rule, so the expected counts are known."""

    def __init__(self, num_experts: int = 6, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, hidden.shape[-1])
        first = flat[:, 0].long() % self.num_experts
        indices = torch.stack([first, (first + 1) % self.num_experts], dim=-1)
        return flat, torch.ones_like(indices, dtype=flat.dtype), indices


class RoutedBlock(nn.Module):
    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.gate = router

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.gate(hidden)
        return hidden


class TinyMoE(nn.Module):
    def __init__(self, router_factory=FakeTopKRouter) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RoutedBlock(router_factory()) for _ in range(2)])
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = input_ids.unsqueeze(-1).float().expand(*input_ids.shape, 3)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class WeirdGateRouter(nn.Module):
    """A router the built-in rules cannot read: it returns (weights, indices) and names k differently."""

    def __init__(self) -> None:
        super().__init__()
        self.n_experts, self.k = 5, 1

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, hidden.shape[-1])
        indices = (flat[:, :1].long() * 2) % self.n_experts
        return torch.ones_like(indices, dtype=flat.dtype), indices


def test_a_model_without_routers_gets_a_clear_error() -> None:
    with pytest.raises(mla_watch.NoRoutersFoundError, match=r"no routers found in PlainModel.*register_router"):
        mla_watch.attach(PlainModel())


def test_an_unknown_router_class_is_named_with_the_way_to_register_it() -> None:
    with pytest.raises(mla_watch.UnknownRouterError) as caught:
        mla_watch.attach(TinyMoE(WeirdGateRouter))
    message = str(caught.value)
    assert "'layers.0.gate'" in message and "WeirdGateRouter" in message and "register_router" in message


def test_a_registered_custom_router_is_counted() -> None:
    registry = RouterRegistry()
    registry.register(
        "WeirdGateRouter",
        kind="expert",
        num_slots=lambda gate, config: gate.n_experts,
        top_k=lambda gate, config: gate.k,
        indices=lambda output: output[1],
    )
    model = TinyMoE(WeirdGateRouter)
    probe = mla_watch.attach(model, registry=registry, window_tokens=None)
    assert [(r.name, r.layer, r.num_slots, r.top_k) for r in probe.routers] == [
        ("layers.0.gate", 0, 5, 1),
        ("layers.1.gate", 1, 5, 1),
    ]
    model(torch.tensor([[0, 1, 2, 3, 4, 5]]))
    # token t picks expert (2t) % 5: 0, 2, 4, 1, 3, 0
    np.testing.assert_array_equal(probe.counts()["layers.0.gate"], [2, 1, 1, 1, 1])


def test_ignore_skips_a_router_class() -> None:
    with pytest.raises(mla_watch.NoRoutersFoundError):
        mla_watch.attach(TinyMoE(WeirdGateRouter), ignore=["WeirdGateRouter"])


def test_hooks_never_synchronise_with_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None)
    input_ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside a forward pass")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, forbidden)
        with probe.attribute(["a", "b"]):
            model(input_ids, attention_mask=mask)
    counts_a = probe.counts("a")["layers.0.gate"]
    counts_b = probe.counts("b")["layers.0.gate"]
    np.testing.assert_array_equal(counts_a, [1, 2, 2, 2, 1, 0])  # tokens 0..3 pick (t, t+1)
    np.testing.assert_array_equal(counts_b, [2, 2, 1, 0, 0, 1])  # tokens 5, 6, 7 (4 is padding)


def test_attribution_must_fit_the_batch() -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model)
    with probe.attribute(["a", "b", "c"]), pytest.raises(ValueError, match=r"3 business lines.*batch of 2 rows"):
        model(torch.zeros((2, 3), dtype=torch.int64))
    with pytest.raises(ValueError, match="business_lines is empty"), probe.attribute([]):
        pass


def test_every_line_up_to_max_business_lines_keeps_its_own_counts() -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None, max_business_lines=21)
    for index in range(20):
        with probe.attribute(f"line{index}"):
            model(torch.tensor([[index]]))
    assert len(probe.business_lines) == 21
    for index in range(20):
        assert probe.stats(f"line{index}")[0]["tokens"] == 1
    assert probe.counts()["layers.0.gate"].sum() == 40


def test_baseline_round_trip_gives_zero_drift(tmp_path) -> None:
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None)
    model(torch.arange(12).view(2, 6))
    probe.save_baseline(tmp_path / "baseline.json")
    probe.load_baseline(tmp_path / "baseline.json")
    assert all(record["js_divergence"] == pytest.approx(0.0, abs=1e-12) for record in probe.stats())
    probe.reset()
    model(torch.zeros((2, 6), dtype=torch.int64))  # every token now picks experts 0 and 1
    assert all(record["js_divergence"] > 0.3 for record in probe.stats())


def test_a_bad_baseline_file_names_the_problem(tmp_path) -> None:
    probe = mla_watch.attach(TinyMoE())
    path = tmp_path / "baseline.json"
    path.write_text('{"format": "mla_watch.baseline/1", "routers": [{"name": "layers.0.gate", "counts": [1, 2]}]}')
    with pytest.raises(ValueError, match=r"router 'layers.0.gate' has 2 counts; expected 6"):
        probe.load_baseline(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"baseline .*baseline.json: not JSON"):
        probe.load_baseline(path)


def test_time_window_forgets_old_traffic() -> None:
    now = [1000.0]
    model = TinyMoE()
    probe = mla_watch.attach(model, window_tokens=None, window_seconds=60, clock=lambda: now[0])
    model(torch.zeros((1, 5), dtype=torch.int64))
    probe.collect()
    now[0] += 30
    model(torch.ones((1, 3), dtype=torch.int64))
    assert probe.stats()[0]["tokens"] == 8
    now[0] += 45  # the first batch is now 75 s old
    assert probe.stats()[0]["tokens"] == 3
