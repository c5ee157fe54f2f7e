"""Re-tuning an engine's routers: the bias rule, the engine's scores as a gate's, and a job's decisions.

The engine here is scripted (:class:`ScriptedEngine`): it loads what a swap wrote, as vLLM's dev mode
does (tests/test_real_vllm_retune.py runs the real one), and scores and routes each sample as a
function of the router tensors it holds: a zeroed gate sends every token to the same experts, a
``penalty`` on the gate's first value makes every token's loss worse. That is enough to decide every
branch of :class:`mla_watch.retune.engine_retuning.EngineRetuner` on tiny tensors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.swap import EngineWeights, SampleScore, SwapError, SwapResult
from mla_watch.retune.capture import TrafficCapture
from mla_watch.retune.engine_retuning import BiasSchedule, EngineRetuner, EngineRouters, bias_step, engine_score
from mla_watch.retune.jobs import JobSpec, RetuneSettings
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.versions import RouterVersions

GEOMETRY = EngineGeometry(model_type="deepseek_v3", num_hidden_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2)
ROUTER = "model.layers.1.mlp.gate"
WEIGHT, BIAS = f"{ROUTER}.weight", f"{ROUTER}.e_score_correction_bias"
BAND = {"metric": "entropy_bits", "low": 2.5, "high": None}  # 8 experts, top-2: 1 to 3 bits


def healthy_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{layer}.mlp.gate.{leaf}": (
            torch.randn(8, 4, generator=generator) if leaf == "weight" else torch.zeros(8)
        )
        for layer in (0, 1)
        for leaf in ("weight", "e_score_correction_bias")
    }


def collapsed_state() -> dict[str, torch.Tensor]:
    state = healthy_state()
    state[WEIGHT] = torch.zeros(8, 4)
    return state


class ScriptedEngine(EngineWeights):
    """Loads swapped router checkpoints; routes and scores as a function of them (see the module docstring)."""

    name = "scripted"

    def __init__(self, state: dict[str, torch.Tensor], config: Path) -> None:
        self.state = {name: tensor.clone() for name, tensor in state.items()}
        self.swaps: list[Path] = []
        self.refuse = False

    def problem(self) -> str | None:
        return None

    def swap(self, weights_path: Path) -> SwapResult:
        if self.refuse:
            raise SwapError("POST /collective_rpc answered 500: reload failed")
        assert json.loads((weights_path / "config.json").read_text())["model_type"] == "deepseek_v3"
        self.state.update(load_file(str(weights_path / "model.safetensors")))
        self.swaps.append(weights_path)
        return SwapResult(str(weights_path), paused_seconds=0.01, reload_seconds=0.005)

    def score(self, samples: Sequence[Sequence[int]]) -> list[SampleScore]:
        scores = []
        for sample in samples:
            rows = []
            for position, token in enumerate(sample):
                row = []
                for layer in (0, 1):
                    weight = self.state[f"model.layers.{layer}.mlp.gate.weight"]
                    bias = self.state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
                    if float(weight.abs().sum()) == 0:
                        logits = bias.clone()  # a zeroed gate: the bias alone picks
                    else:
                        logits = torch.tensor([float((token * 3 + position + e * 5) % 8) for e in range(8)]) + bias
                    row.append(torch.topk(logits + torch.arange(8) * 1e-3, 2).indices.tolist())
                rows.append(row)
            penalty = float(self.state[WEIGHT][0, 0]) if float(self.state[WEIGHT][0, 0]) > 10 else 0.0
            tokens = len(sample) - 1
            loss = tokens * (2.0 + penalty * 0.01) + 0.01 * (sum(sample) % 7)
            scores.append(SampleScore(loss=loss, tokens=tokens, routing=np.array(rows, dtype=np.int32)))
        return scores


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 2,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 0,
                "hidden_size": 4,
            }
        )
    )
    return path


def capture_of(tmp_path: Path, count: int = 40) -> TrafficCapture:
    capture = TrafficCapture(tmp_path / "capture.sqlite")
    for index in range(count):  # distinct prompts of 20 tokens, each answered by 4
        prompt = [1, *[(index * 13 + j * 7) % 250 + 3 for j in range(19)]]
        capture.add("code", [*prompt, 9, 9, 9, 9], prompt_tokens=len(prompt))
    return capture


def make(
    tmp_path: Path,
    *,
    mode: str = "apply",
    reference: dict[str, torch.Tensor] | None = None,
    state: dict[str, torch.Tensor] | None = None,
    **settings,
) -> tuple[EngineRetuner, ScriptedEngine]:
    config = config_file(tmp_path)
    engine = ScriptedEngine(state if state is not None else collapsed_state(), config)
    host = EngineRouters(engine, GEOMETRY, engine.state, swap_dir=tmp_path / "swaps", config_json=config)
    registry = RouterVersions(tmp_path / "routers")
    registry.record_initial(host, None)
    retuner = EngineRetuner(
        host=host,
        versions=registry,
        mode=mode,
        capture=capture_of(tmp_path),
        settings=RetuneSettings(
            **{"min_samples": 8, "min_held_out_tokens": 100, "min_held_out_samples": 4, **settings}
        ),
        promote=lambda version: registry.promote(host, version),
        rollback=lambda: registry.rollback(host),
        loads=lambda router, line: None,
        reference=None if reference is None else RouterReference("reference model /healthy", reference),
    )
    return retuner, engine


def job(**overrides) -> JobSpec:
    return JobSpec(
        **{
            "routers": [ROUTER],
            "strategies": ["restore"],
            "business_line": "code",
            "band": BAND,
            "trigger": {"source": "alert", "at": 0.0},
            **overrides,
        }
    )


def test_the_bias_rule_moves_idle_experts_up_and_busy_ones_down_in_proportion() -> None:
    bias = np.zeros(4, dtype=np.float32)
    moved = bias_step(bias, np.array([0, 10, 10, 20]), gamma=0.5)
    assert moved.tolist() == pytest.approx([0.5, 0.0, 0.0, -0.5])  # mean 10: idle +gamma, twice the mean -gamma
    assert bias_step(np.zeros(2, dtype=np.float32), np.array([0, 100]), 1.0).tolist() == pytest.approx([1.0, -1.0])
    assert bias_step(np.zeros(2, dtype=ml_dtypes.bfloat16), np.array([1, 3]), 1.0).dtype == ml_dtypes.bfloat16
    with pytest.raises(
        ValueError,
        match=r"loads of shape \[3\] summing to 3: expected one positive count per "
        r"expert \(\[4\]\)",
    ):
        bias_step(np.zeros(4, dtype=np.float32), np.array([1, 1, 1]), 1.0)
    schedule = BiasSchedule(gamma=1.0, decay=0.5, steps=3)
    assert [schedule.gamma_at(step) for step in range(3)] == [1.0, 0.5, 0.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bias_rule_on_numpy_is_bit_for_bit_torchs_float32_step_rounded_to_the_bias_dtype(dtype) -> None:
    from mla_watch.common.tensor_files import from_torch

    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        bias = (torch.randn(64, generator=generator) * 3).to(dtype)
        loads = torch.randint(0, 1000, (64,), generator=generator).numpy()
        gamma = float(torch.rand(1, generator=generator)) * 2
        step = gamma * np.minimum(1.0, 1.0 - loads / loads.mean())
        expected = (bias.to(torch.float32) + torch.as_tensor(step, dtype=torch.float32)).to(dtype)
        moved = bias_step(from_torch(bias), loads, gamma)
        assert moved.dtype == from_torch(expected).dtype
        assert moved.tobytes() == from_torch(expected).tobytes()


def test_the_engines_scores_and_routing_make_a_model_score() -> None:
    collapsed = np.tile(np.array([[[0, 1], [2, 3]]], dtype=np.int32), (64, 1, 1))  # both layers on two experts
    spread = np.array([[[t % 8, (t + 4) % 8], [t % 8, (t + 1) % 8]] for t in range(64)], dtype=np.int32)
    score = engine_score([SampleScore(10.0, 5, collapsed), SampleScore(20.0, 5, spread)], GEOMETRY)
    assert score.perplexity == pytest.approx(np.exp(3.0)) and score.tokens == 10 and score.counts == [5, 5]
    assert score.routers[ROUTER].stats.tokens == 128
    assert 1.0 < score.metric(ROUTER, "entropy_bits") < 3.0
    assert engine_score([SampleScore(1.0, 1, None)], GEOMETRY).routers == {}  # no routing returned: nothing read


def test_a_swap_writes_the_whole_router_state_and_refuses_what_is_no_router(tmp_path) -> None:
    config = config_file(tmp_path)
    engine = ScriptedEngine(collapsed_state(), config)
    host = EngineRouters(engine, GEOMETRY, collapsed_state(), swap_dir=tmp_path / "swaps", config_json=config)
    taken = host.apply({WEIGHT: healthy_state()[WEIGHT]})
    written = load_file(str(engine.swaps[-1] / "model.safetensors"))
    assert set(written) == set(healthy_state())  # every layer's weight and bias: vLLM reloads whole layers
    assert torch.equal(engine.state[WEIGHT], healthy_state()[WEIGHT]) and taken["paused_seconds"] == 0.01
    for _ in range(3):
        host.apply({WEIGHT: torch.zeros(8, 4)})
    assert len(list((tmp_path / "swaps").iterdir())) == 2  # the one serving and the one before
    with pytest.raises(ValueError, match=r"model.layers.9.mlp.gate.weight is not a router tensor of the engine"):
        host.apply({"model.layers.9.mlp.gate.weight": torch.zeros(8, 4)})
    with pytest.raises(ValueError, match=r"has shape \(2, 2\), the engine's is \(8, 4\)"):
        host.apply({WEIGHT: torch.zeros(2, 2)})
    engine.refuse = True
    before = host.state()
    with pytest.raises(SwapError, match="reload failed"):
        host.apply({WEIGHT: healthy_state()[WEIGHT]})
    assert all(np.array_equal(before[name], array) for name, array in host.state().items())  # knows what serves


def test_restore_from_the_reference_is_swapped_scored_by_the_engine_and_kept(tmp_path) -> None:
    retuner, engine = make(tmp_path, reference=healthy_state())
    status, result = retuner.run(job())
    assert status == "promoted", result
    (attempt,) = result["attempts"]
    checks = {check["gate"]: check for check in attempt["gates"]["checks"]}
    assert checks["band"]["decision"] == "pass" and checks["reference_health"]["decision"] == "pass"
    assert checks["perplexity"]["binding"] is False  # the live router read outside its band
    assert torch.equal(engine.state[WEIGHT], healthy_state()[WEIGHT])
    assert retuner.versions.live_version() == result["version"] == 1
    assert retuner.versions.manifest(1)["gates"]["passed"] is True
    assert attempt["live_seconds"] >= 0 and attempt["swap"]["paused_seconds"] == 0.01


def test_a_candidate_worse_by_perplexity_is_rolled_back_at_once(tmp_path) -> None:
    worse = healthy_state()
    worse[WEIGHT] = worse[WEIGHT].clone()
    worse[WEIGHT][0, 0] = 50.0  # routes as well, scores every token 0.5 nats worse
    retuner, engine = make(tmp_path, state=healthy_state(), reference=worse)
    status, result = retuner.run(job(trigger={"source": "cli"}))
    assert status == "rejected", result
    (attempt,) = result["attempts"]
    assert attempt["outcome"] == "rejected" and attempt["rolled_back"] is True
    assert "perplexity worse than allowed" in attempt["reason"]
    assert torch.equal(engine.state[WEIGHT], healthy_state()[WEIGHT])  # what served before the job
    assert [entry["kind"] for entry in retuner.versions.promotions()] == ["initial", "promote", "rollback"]


def test_a_rejection_while_the_router_reads_outside_its_band_waits(tmp_path) -> None:
    broken = collapsed_state()
    broken[BIAS] = torch.tensor([0.0, 0.0, 0, 0, 0, 0, 0, 1e-4])  # other tensors, the same collapse: as broken
    retuner, engine = make(tmp_path, reference=broken)
    status, result = retuner.run(job())
    assert status == "waiting" and result["rejected_while_outside_band"] is True
    assert result["needs"].startswith("a candidate that passes its gates through the engine")
    assert torch.equal(engine.state[WEIGHT], torch.zeros(8, 4))


def test_restoring_the_tensors_serving_now_is_no_candidate(tmp_path) -> None:
    retuner, engine = make(tmp_path, reference=collapsed_state())
    status, result = retuner.run(job(trigger={"source": "cli"}))
    assert status == "failed" and result["attempts"][0]["outcome"] == "unchanged", result
    assert "holds the tensors serving now: nothing to restore" in result["error"]
    assert engine.swaps == [] and retuner.versions.version_numbers() == [0]


def test_the_bias_strategy_steps_until_the_engines_routing_is_back_in_band(tmp_path) -> None:
    state = healthy_state()
    state[BIAS] = torch.tensor([10.0, 10.0, 0, 0, 0, 0, 0, 0])  # two experts take every token
    retuner, engine = make(tmp_path, state=state)
    status, result = retuner.run(job(strategies=["bias"]))
    assert status == "promoted", result
    (attempt,) = result["attempts"]
    assert len(attempt["steps"]) >= 1 and attempt["steps"][-1]["outcome"] == "promoted"
    assert float(engine.state[BIAS][:2].max()) < 10.0
    assert retuner.versions.live_version() == result["version"]


def test_propose_saves_the_candidate_and_names_the_command_then_apply_gates_it(tmp_path) -> None:
    retuner, engine = make(tmp_path, mode="propose", reference=healthy_state())
    status, result = retuner.run(job())
    assert status == "proposed" and result["command"] == f"mla-watch retune apply {result['version']}"
    assert engine.swaps == [] and retuner.versions.live_version() == 0  # the engine was not touched
    status, applied = retuner.run(job(version=result["version"]))
    assert status == "promoted", applied
    assert torch.equal(engine.state[WEIGHT], healthy_state()[WEIGHT])


def test_too_few_distinct_captured_prompts_wait_and_say_what_they_need(tmp_path) -> None:
    retuner, engine = make(tmp_path, reference=healthy_state(), min_held_out_samples=50)
    status, result = retuner.run(job())
    assert status == "waiting" and "distinct samples; the gate decides on at least" in result["needs"]
    assert engine.swaps == []


def test_router_finetune_is_said_to_need_the_engines_weights(tmp_path) -> None:
    retuner, _ = make(tmp_path, reference=healthy_state())
    status, result = retuner.run(job(strategies=["router_finetune", "restore"]))
    assert status == "promoted"
    assert result["attempts"][0] == {
        "strategy": "router_finetune",
        "outcome": "unsupported",
        "reason": "router_finetune needs the model's weights, which the engine holds "
        "(engine strategies: restore, bias)",
    }


def test_an_engine_that_returns_no_routing_is_judged_by_perplexity_and_the_band_says_why(tmp_path) -> None:
    retuner, engine = make(tmp_path, reference=healthy_state())
    unrouted = engine.score

    def without_routing(samples):
        return [SampleScore(score.loss, score.tokens, None) for score in unrouted(samples)]

    engine.score = without_routing  # type: ignore[method-assign]
    status, result = retuner.run(job(trigger={"source": "cli"}))
    assert status == "promoted", result
    checks = {check["gate"]: check for check in result["attempts"][0]["gates"]["checks"]}
    assert checks["band"]["binding"] is False and "returned no routing" in checks["band"]["message"]
    assert checks["perplexity"]["decision"] == "pass" and checks["perplexity"]["binding"] is True


def test_applying_a_proposed_version_that_fails_its_gate_rolls_it_back_and_ends(tmp_path) -> None:
    retuner, engine = make(tmp_path, mode="propose", reference=collapsed_state())  # proposes the broken routers
    status, proposed = retuner.run(job())
    assert status == "proposed"
    status, result = retuner.run(job(version=proposed["version"]))
    assert status == "rejected" and result["version"] is None, result
    assert result["attempts"][0]["rolled_back"] is True
    assert [entry["kind"] for entry in retuner.versions.promotions()] == ["initial", "promote", "rollback"]
    assert torch.equal(engine.state[WEIGHT], torch.zeros(8, 4)) and len(engine.swaps) == 2  # swapped, swapped back
