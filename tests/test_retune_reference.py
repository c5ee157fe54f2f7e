"""A known-good reference for ``restore`` when the model was deployed broken: the routers' start-up
health check, the reference checkpoint (router tensors only), and the errors that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mla_watch.common.tensor_files import from_torch
from mla_watch.retune.reference import load_reference_routers
from mla_watch.retune.router_tensors import router_state
from tests.retune_harness import BIAS, GATE, Harness, collapse, final, spec
from tests.tiny_models import build

RESTORE = {"strategies": ["restore"], "band": {"metric": "entropy_bits", "low": 2.3, "high": None}}


def test_a_model_deployed_broken_is_not_restored_to_itself_and_the_job_says_what_would_help(tmp_path) -> None:
    model = build("deepseek_v32")
    collapse(model)  # before the server starts: version 0 is the damage
    harness = Harness(tmp_path, model=model)
    service = harness.start()
    health = service.versions.manifest(0)["health"]
    assert health["checked"] and not health["passed"]
    assert health["reason"].startswith(f"{GATE}: TinyRouterCollapse (entropy_bits 1, threshold 1.5)")
    assert service.versions.last_good() is None

    job = final(service, service.submit(spec(**RESTORE))["id"])

    assert job["status"] == "failed"
    (attempt,) = job["result"]["attempts"]
    assert attempt["outcome"] == "failed" and "no known-good router state to restore: version 0" in attempt["reason"]
    assert "failed its start-up health check" in attempt["reason"] and "--reference-model DIR" in attempt["reason"]
    assert service.versions.live_version() == 0
    service.stop()


def test_restore_from_the_reference_checkpoint_puts_back_its_routers_and_says_so(tmp_path) -> None:
    healthy = build("deepseek_v32")
    healthy.save_pretrained(tmp_path / "original")
    model = build("deepseek_v32")
    collapse(model)
    harness = Harness(tmp_path / "state", model=model)
    (tmp_path / "state").mkdir(exist_ok=True)
    harness.reference = load_reference_routers(tmp_path / "original", router_state(model))
    service = harness.start()

    job = final(service, service.submit(spec(**RESTORE))["id"])

    assert job["status"] == "promoted", job["result"]
    (attempt,) = job["result"]["attempts"]
    details = service.versions.manifest(attempt["version"])["details"]
    assert details["reference"] == f"reference model {tmp_path / 'original'}" and details["restored_from"] is None
    gates = attempt["gates"]
    assert gates["perplexity"]["decision"] == "pass" and gates["perplexity"]["tokens"] >= 400
    assert torch.equal(router_state(model)[BIAS], router_state(healthy)[BIAS])  # the layer asked for, exactly
    service.stop()


def test_the_reference_reads_router_tensors_only_and_names_what_does_not_match(tmp_path) -> None:
    model = build("deepseek_v32")
    model.save_pretrained(tmp_path / "same")
    live = router_state(model)
    reference = load_reference_routers(tmp_path / "same", live)
    assert set(reference.tensors) == set(live)  # gate weights and biases, no expert weight
    assert all(np.array_equal(reference.tensors[name], from_torch(live[name])) for name in live)  # numpy arrays

    with pytest.raises(ValueError, match=r"^reference_model = .*/nowhere: not a directory: expected the checkpoint"):
        load_reference_routers(tmp_path / "nowhere", live)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"/empty: no \*\.safetensors file: expected a checkpoint saved with"):
        load_reference_routers(tmp_path / "empty", live)
    (tmp_path / "other").mkdir()
    save_file({name: torch.zeros(1) for name in live}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=rf"/other: {next(iter(live))} has shape \(1,\) in model\.safetensors: "
        rf"expected \({live[next(iter(live))].shape[0]}, ",
    ):
        load_reference_routers(tmp_path / "other", live)
    (tmp_path / "partial").mkdir()
    save_file({BIAS: live[BIAS]}, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=rf"router tensor .* is not in the checkpoint \({len(live) - 1} of "
        rf"{len(live)} missing\): expected a checkpoint of the served model",
    ):
        load_reference_routers(tmp_path / "partial", live)
    (tmp_path / "escape").mkdir()
    (tmp_path / "escape" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {BIAS: "../same/model.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"maps .* to a file outside the directory"):
        load_reference_routers(tmp_path / "escape", live)
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match=r"/damaged: cannot read the checkpoint: SafetensorError"):
        load_reference_routers(tmp_path / "damaged", live)


def test_check_validates_a_reference_model_against_the_model(tmp_path: Path, capsys) -> None:
    from mla_watch.cli import main

    assert (
        main(
            [
                "check",
                "--capture",
                "--reference-model",
                str(Path(__file__).parents[1] / "mla_watch" / "models" / "bundled"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "router tensors match the model's; `restore` puts them back" in out
    assert "can only restore" not in out  # --capture: there is data
    assert main(["check", "--reference-model", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"error: --reference-model {tmp_path}: no *.safetensors file" in out
    # without --capture the shipped RoutingEntropyLow can still restore: said once, not warned of
    assert "info: without --capture the re-tune jobs of RoutingEntropyLow can only restore" in out
