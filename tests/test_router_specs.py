"""Built-in router specs, attach-time refusal of specs that cannot be counted, RouterInfo flags, and
``check`` / ``load_model`` on models that used to crash (issue 14, Families)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import mla_watch
from mla_watch.cli import main
from mla_watch.probe import RouterRegistry
from mla_watch.routing.routers import RouterInfo
from tests.family_sweep_models import VOCAB, router_families, tiny_model
from tests.test_probe_discovery import RoutedBlock

FAMILIES = {family.module: family for family in router_families()}


def _run(model: nn.Module, seed: int = 1) -> None:
    input_ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)


def test_llama4_picks_are_recovered_from_its_logits() -> None:
    model = tiny_model(FAMILIES["llama4"])
    probe = mla_watch.attach(model, window_tokens=None)
    modules = dict(model.named_modules())
    seen: dict[str, list[torch.Tensor]] = {info.name: [] for info in probe.routers}
    handles = [
        modules[name].register_forward_hook(
            lambda module, args, output, name=name: seen[name].append(output[0].detach().clone())
        )
        for name in seen
    ]
    _run(model)
    for handle in handles:
        handle.remove()
    assert probe.routers
    for info in probe.routers:
        # Llama-4 scatters the chosen experts' scores into -inf logits, then takes a sigmoid: nonzero = chosen.
        chosen = (seen[info.name][0] > 0).sum(0).numpy()
        np.testing.assert_array_equal(probe.counts()[info.name], chosen)
        assert info.top_k == modules[info.name].top_k and info.num_slots == modules[info.name].num_experts


def test_zaya_skip_expert_is_a_slot_of_its_own() -> None:
    model = tiny_model(FAMILIES["zaya"])
    for module in model.modules():
        if type(module).__name__ == "ZayaRouter":
            module.balancing_biases[-1] = 10.0  # every token picks the skip expert
    probe = mla_watch.attach(model, window_tokens=None)
    _run(model)
    for info in probe.routers:
        assert info.zero_slots == (info.num_slots - 1,)
        counts = probe.counts()[info.name]
        assert counts[-1] == counts.sum() == 10  # 2 x 5 tokens, top-1, all skipped, none counted as expert 0


def test_longcat_zero_experts_are_counted_in_their_own_slots() -> None:
    model = tiny_model(FAMILIES["longcat_flash"])
    probe = mla_watch.attach(model, window_tokens=None)
    config = model.config
    for info in probe.routers:
        assert info.num_slots == config.n_routed_experts + config.zero_expert_num
        assert info.zero_slots == tuple(range(config.n_routed_experts, info.num_slots))
    _run(model)
    for info in probe.routers:
        assert probe.counts()[info.name].sum() == 10 * info.top_k  # every pick, zero experts included


def test_deepseek_v4_hash_routers_are_flagged() -> None:
    model = tiny_model(FAMILIES["deepseek_v4"])
    probe = mla_watch.attach(model, window_tokens=None)
    flags = {type(dict(model.named_modules())[info.name]).__name__: info.hash_routed for info in probe.routers}
    assert flags["DeepseekV4HashRouter"] is True
    assert flags["DeepseekV4TopKRouter"] is False


class LogitsOnlyRouter(nn.Module):
    """Named like the routers the generic rule reads, but returns float logits only (the Llama-4 / Zaya trap)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = 4, 2
        self.proj = nn.Linear(3, 4)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(hidden.reshape(-1, 3))
        return logits.softmax(-1), logits


class Tiny(nn.Module):
    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RoutedBlock(router)])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.layers[0](input_ids.unsqueeze(-1).float().expand(*input_ids.shape, 3))


class MyTopKRouter(LogitsOnlyRouter):
    pass


def test_a_spec_that_reads_floats_is_refused_at_attach_not_in_the_forward() -> None:
    with pytest.raises(mla_watch.UnknownRouterError) as caught:
        mla_watch.attach(Tiny(MyTopKRouter()))
    message = str(caught.value)
    assert "'layers.0.gate'" in message and "MyTopKRouter" in message
    assert "torch.float32" in message and "register_router('MyTopKRouter'" in message


def test_a_spec_whose_slots_overflow_is_refused_at_attach() -> None:
    registry = RouterRegistry()
    registry.register(
        "MyTopKRouter",
        kind="expert",
        num_slots=lambda m, c: 2,
        top_k=lambda m, c: 2,
        indices=lambda output: torch.topk(output[1], 2).indices,
        may_pad=False,
    )
    model = Tiny(MyTopKRouter())
    with torch.no_grad():
        model.layers[0].gate.proj.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 6.0]))  # picks experts 2 and 3 of "2"
    with pytest.raises(mla_watch.UnknownRouterError, match=r"values in \[2, 3\]; expected slots in \[0, 2\)"):
        mla_watch.attach(model, registry=registry)


def test_the_attach_time_check_leaves_the_router_untouched() -> None:
    model = tiny_model(FAMILIES["deepseek_v3"])
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    probe = mla_watch.attach(model, window_tokens=None)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert probe.counts()[probe.routers[0].name].sum() == 0  # the dummy tokens were not counted


class Uncallable(nn.Module):
    """A router whose forward needs arguments attach cannot make up: checked on its first real output instead."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = 4, 2

    def forward(self, hidden: torch.Tensor, cache: object) -> tuple[torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat, flat  # floats where the indices should be


class UncallableTopKRouter(Uncallable):
    pass


class CacheBlock(RoutedBlock):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.gate(hidden, None)
        return hidden


def test_a_router_that_cannot_be_called_alone_is_checked_on_its_first_output() -> None:
    model = Tiny(UncallableTopKRouter())
    model.layers[0] = CacheBlock(UncallableTopKRouter())
    mla_watch.attach(model)
    with pytest.raises(mla_watch.UnknownRouterError, match=r"UncallableTopKRouter.*register_router"):
        model(torch.zeros((1, 3), dtype=torch.int64))


def test_router_info_flags_round_trip_and_plain_records_keep_their_shape() -> None:
    plain = RouterInfo("a", 0, "expert", 8, 2)
    assert plain.as_dict() == {"name": "a", "layer": 0, "kind": "expert", "num_slots": 8, "top_k": 2}
    flagged = RouterInfo("b", 1, "expert", 12, 2, zero_slots=(8, 9, 10, 11), hash_routed=True)
    assert RouterInfo.from_dict(flagged.as_dict()) == flagged
    with pytest.raises(ValueError, match=r"router.zero_slots = \[12\]: expected a list of slot numbers in \[0, 12\)"):
        RouterInfo.from_dict({**flagged.as_dict(), "zero_slots": [12]})


def _save(model: nn.Module, path) -> None:
    model.save_pretrained(path)
    tokenizer_json = {
        "version": "1.0",
        "added_tokens": [],
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def test_load_model_falls_back_to_the_architectures_of_config_json(tmp_path) -> None:
    model = tiny_model(FAMILIES["glm4v_moe"])  # Glm4vMoeTextModel: no AutoModelForCausalLM mapping
    _save(model, tmp_path)
    loaded, _ = mla_watch.load_model(tmp_path, device="cpu")
    assert type(loaded).__name__ == type(model).__name__
    assert mla_watch.attach(loaded).routers


def test_load_model_says_why_not(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4v_moe_vision", "architectures": ["Nope"]}))
    with pytest.raises(ValueError, match=r"config.json: model_type='glm4v_moe_vision' has no AutoModelForCausalLM"):
        mla_watch.load_model(tmp_path, device="cpu")


def test_check_prints_error_lines_not_a_traceback(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    assert main(["check", "--model", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "error: model" in out.out and "does not load" in out.out


def test_check_on_an_unknown_router_prints_an_error_line(tmp_path, capsys) -> None:
    def loader(*args, **kwargs) -> tuple[Tiny, None]:  # a model whose router class nobody registered
        return Tiny(MyTopKRouter()), None

    assert main(["check", "--model", str(tmp_path)], model_loader=loader) == 1
    out = capsys.readouterr().out
    assert "error: model" in out and "MyTopKRouter" in out and "register_router" in out
