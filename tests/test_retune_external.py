"""The external command template: the same job run by another process (as torchrun would on a
cluster), handing back a checkpoint in the registry's format; and its failures, reported."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import mla_watch
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.models import corpus
from mla_watch.retune.capture import TrafficCapture
from mla_watch.retune.health import startup_health
from mla_watch.retune.jobs import JobSpec, RetuneSettings
from mla_watch.retune.router_tensors import router_state
from mla_watch.retune.runner import Retuner
from mla_watch.retune.versions import RouterVersions
from mla_watch.shipped import SHIPPED_RULES

pytestmark = pytest.mark.slow

LAYER1 = "model.layers.1.mlp.gate"
WORKER = (
    "{python} -m mla_watch.retune.worker --job {job} --data {data} --routers {routers} --output {output} "
    "--model {model} --device cpu"
)


def retuner(tmp_path: Path, command: str) -> Retuner:
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    capture = TrafficCapture(tmp_path / "capture.sqlite")
    for text in corpus.generate("code", 40, seed=11):  # 10 distinct held out: the gate decides on 8
        capture.add("code_assistant", [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]])
    registry = RouterVersions(tmp_path / "routers")
    shipped = load_rules_dir(SHIPPED_RULES, environ={}).rules
    registry.record_initial(model, startup_health(model, tokenizer, shipped))  # healthy: `restore` may use it
    lock = threading.Lock()
    return Retuner(
        model=model,
        tokenizer=tokenizer,
        versions=registry,
        capture=capture,
        model_lock=lock,
        settings=RetuneSettings(min_samples=8, command=command, max_tokens_per_sample=128),
        workdir=tmp_path / "work",
        promote=lambda version: registry.promote(model, version, lock),
    )


def job(**overrides) -> JobSpec:
    return JobSpec(
        **{
            "routers": [LAYER1],
            "strategies": ["bias"],
            "business_line": "code_assistant",
            "options": {"bias": {"gamma": 0.2, "steps": 40}},
            **overrides,
        }
    )


def test_an_external_command_fits_the_job_and_the_server_gates_and_promotes_it(tmp_path) -> None:
    runner = retuner(tmp_path, WORKER)
    with torch.no_grad():
        runner.model.model.layers[1].mlp.gate.e_score_correction_bias[:6] += 10.0
    collapsed = router_state(runner.model)

    status, result = runner.run(job())

    assert status == "promoted", result
    (attempt,) = result["attempts"]
    assert attempt["gates"]["after"]["entropy_bits"][LAYER1] >= 5.2 > attempt["gates"]["before"]["entropy_bits"][LAYER1]
    manifest = runner.versions.manifest(result["version"])
    assert manifest["details"]["external"] is True and manifest["details"]["worker"] == "mla_watch.retune.worker"
    assert manifest["details"]["steps"] == 40 and manifest["details"]["gamma"] == 0.2
    assert manifest["tensors"] == [f"{LAYER1}.e_score_correction_bias"]
    live = router_state(runner.model)
    assert not torch.equal(live[f"{LAYER1}.e_score_correction_bias"], collapsed[f"{LAYER1}.e_score_correction_bias"])
    assert all(
        torch.equal(live[name], collapsed[name])
        for name in collapsed
        if not name.endswith("correction_bias") or not name.startswith(LAYER1)
    )
    assert list((tmp_path / "work").iterdir()) == []  # the job's copy of the traffic is gone once it ended


def test_a_failing_command_is_reported_and_the_next_strategy_runs(tmp_path) -> None:
    runner = retuner(tmp_path, "{python} -c 'import sys; sys.stderr.write(\"no GPUs left\"); sys.exit(3)'")
    before = router_state(runner.model)
    status, result = runner.run(job(strategies=["bias", "restore"]))
    first, second = result["attempts"]
    assert first["outcome"] == "failed"
    assert first["reason"] == "RuntimeError: the external command exited with status 3: no GPUs left"
    # restore never leaves the server; the routers serving are already its source: no candidate, nothing changed
    assert second["strategy"] == "restore" and second["outcome"] == "unchanged", second
    assert status == "failed" and all(torch.equal(router_state(runner.model)[n], t) for n, t in before.items())


def test_a_bad_template_names_its_fields(tmp_path) -> None:
    runner = retuner(tmp_path, "{python} train.py --checkpoint {ckpt}")
    status, result = runner.run(job())
    assert status == "failed"
    assert (
        "retune command template '{python} train.py --checkpoint {ckpt}' is invalid: KeyError('ckpt')"
        in result["attempts"][0]["reason"]
    )
    assert (
        "fields are ['data', 'job', 'job_id', 'model', 'output', 'python', 'routers', 'strategy']"
        in result["attempts"][0]["reason"]
    )
