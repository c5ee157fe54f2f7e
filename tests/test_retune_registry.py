"""Versioned router checkpoints: bit-exact round trips, verification, promotion and rollback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from mla_watch.common.tensor_files import from_torch
from mla_watch.retune import RouterVersions, router_state
from tests.mounts import fill, small_tmpfs
from tests.tiny_models import build

GATE = "model.layers.1.mlp.gate"


@pytest.fixture()
def model() -> torch.nn.Module:
    return build("deepseek_v32")


def non_router_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    routers = set(router_state(model))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items() if name not in routers}


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + torch.randn(tensor.shape, generator=generator) for name, tensor in router_state(model).items()
    }


def test_router_state_holds_only_router_tensors(model: torch.nn.Module) -> None:
    state = router_state(model)
    assert sorted(state) == sorted(
        f"model.layers.{i}.mlp.gate.{leaf}" for i in (0, 1) for leaf in ("weight", "e_score_correction_bias")
    )
    assert not any("experts" in name or "indexer" in name for name in state)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    assert list(router_state(model, [GATE])) == [f"{GATE}.weight", f"{GATE}.e_score_correction_bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.gate"):
        router_state(model, ["model.layers.9.mlp.gate"])


def test_round_trip_is_bit_exact_and_versions_are_listed(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path / "routers")
    assert registry.record_initial(model) == 0
    assert registry.live_version() == 0
    initial = router_state(model)
    assert all(np.array_equal(from_torch(initial[n]), t) for n, t in registry.load(0).items())  # numpy arrays
    assert set(registry.load(0)) == set(initial)

    tensors = perturbed(model, 1)
    version = registry.save(tensors, {"source": "test", "gates": {"passed": False}})
    assert version == 1
    loaded = registry.load(1)
    assert set(loaded) == set(tensors) and all(np.array_equal(loaded[n], from_torch(tensors[n])) for n in tensors)
    assert all(loaded[n].dtype == from_torch(tensors[n]).dtype for n in tensors)
    manifests = registry.versions()
    assert [m["version"] for m in manifests] == [0, 1]
    assert manifests[1]["source"] == "test" and len(manifests[1]["sha256"]) == 64 and manifests[1]["created_at"]
    assert registry.last_good() is None  # version 0 was not health-checked: not known to be good
    assert registry.save(perturbed(model, 2), {"gates": {"passed": True}}) == 2
    assert registry.last_good() == 2
    # Recording again (a restart) keeps version 0 and makes it live.
    assert registry.record_initial(model) == 0
    assert len(registry.versions()) == 3


def test_version_0_recorded_unchecked_takes_its_first_health_check_once(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path / "routers")
    assert registry.record_initial_health({"passed": True, "checked": True}) is False  # no version 0 yet
    registry.record_initial(model)  # beside an engine: recorded before the engine could be read
    assert not registry.is_good(0)
    assert registry.record_initial_health({"passed": False, "checked": True, "reason": "a breach"}) is True
    assert not registry.is_good(0) and registry.manifest(0)["health"]["reason"] == "a breach"
    assert registry.record_initial_health({"passed": True, "checked": True}) is False  # the first check stands
    assert not registry.is_good(0)

    healthy = RouterVersions(tmp_path / "healthy")
    healthy.record_initial(model)
    assert healthy.record_initial_health({"passed": True, "checked": True, "reason": "no rule breached"}) is True
    assert healthy.is_good(0) and healthy.last_good() == 0
    checked = RouterVersions(tmp_path / "checked")
    checked.record_initial(model, {"passed": False, "checked": True, "reason": "a breach at start"})
    assert checked.record_initial_health({"passed": True, "checked": True}) is False  # a start-up check stands
    assert not checked.is_good(0)


def test_record_initial_refuses_other_tensor_names(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path)
    registry.record_initial(model)
    with pytest.raises(ValueError, match="gate"):
        registry.record_initial(build("mixtral"))


def test_unusable_directory_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=str(blocker)):
        RouterVersions(blocker / "routers")


def test_tampered_or_missing_version_is_refused(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path)
    registry.record_initial(model)
    version = registry.save(perturbed(model, 1), {})
    path = tmp_path / f"v{version:04d}" / "routers.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"router version {version}: sha256"):
        registry.load(version)
    with pytest.raises(ValueError, match="router version 7"):
        registry.load(7)
    with pytest.raises(ValueError, match=f"router version {version}"):
        registry.promote(model, version)


def test_promote_changes_only_routers_and_rollback_is_exact(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path)
    registry.record_initial(model)
    initial, others = router_state(model), non_router_state(model)
    full = perturbed(model, 1)
    v1 = registry.save(full, {})
    partial = {f"{GATE}.e_score_correction_bias": torch.arange(8, dtype=torch.float32)}
    v2 = registry.save(partial, {})

    lock = threading.Lock()
    registry.promote(model, v1, lock=lock)
    assert not lock.locked()
    assert all(torch.equal(router_state(model)[n], full[n]) for n in full)
    registry.promote(model, v2, lock=lock)
    after_v2 = router_state(model)
    assert torch.equal(after_v2[f"{GATE}.e_score_correction_bias"], partial[f"{GATE}.e_score_correction_bias"])
    assert torch.equal(after_v2[f"{GATE}.weight"], full[f"{GATE}.weight"])  # untouched by the partial version
    assert registry.live_version() == v2
    current = non_router_state(model)
    assert set(current) == set(others) and all(torch.equal(current[n], others[n]) for n in others)

    assert registry.rollback(model, lock=lock) == v1
    assert all(torch.equal(router_state(model)[n], full[n]) for n in full)
    assert registry.rollback(model) == 0
    assert all(torch.equal(router_state(model)[n], initial[n]) for n in initial)
    assert registry.live_version() == 0
    with pytest.raises(ValueError, match="nothing to roll back"):
        registry.rollback(model)

    history = [json.loads(line) for line in (tmp_path / "promotions.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["version"], e["previous"]) for e in history] == [
        ("initial", 0, None),
        ("promote", v1, 0),
        ("promote", v2, v1),
        ("rollback", v1, v2),
        ("rollback", 0, v1),
    ]
    assert all(e["at"] for e in history)
    non_router = non_router_state(model)
    assert all(torch.equal(non_router[n], others[n]) for n in others)


def test_promote_refuses_mismatched_tensors(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path)
    registry.record_initial(model)
    before = router_state(model)
    wrong_shape = registry.save({f"{GATE}.weight": torch.zeros(9, 32)}, {})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate.weight has shape \(9, 32\)"):
        registry.promote(model, wrong_shape)
    expert = registry.save({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(1)}, {})
    with pytest.raises(ValueError, match="not a router tensor"):
        registry.promote(model, expert)
    assert all(torch.equal(router_state(model)[n], before[n]) for n in before)
    assert registry.live_version() == 0


def test_failed_write_leaves_no_partial_version(model: torch.nn.Module, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        registry = RouterVersions(disk / "routers")
        registry.record_initial(model)
        filler = fill(disk)
        with pytest.raises(OSError, match="full"):
            registry.save(perturbed(model, 1), {})
        assert sorted(p.name for p in (disk / "routers").iterdir()) == ["promotions.jsonl", "v0000"]
        filler.unlink()
        assert registry.save(perturbed(model, 1), {}) == 1


def test_known_good_is_a_healthy_version_0_a_version_marked_good_or_one_that_passed_its_gates(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    unchecked = RouterVersions(tmp_path / "unchecked")
    unchecked.record_initial(model)
    with pytest.raises(
        ValueError,
        match=r"version 0 \(the routers the server started with\) was not health-checked "
        r"\(no start-up health check ran\).*--reference-model DIR, or mark a version "
        r"good with `mla-watch retune mark-good N`",
    ):
        unchecked.last_good_state([GATE])
    assert unchecked.mark_good(0) == 0 and unchecked.marked_good() == [0]
    assert unchecked.last_good_state([GATE])[0::2] == (0, "marked good by an operator")

    broken = RouterVersions(tmp_path / "broken")
    broken.record_initial(model, {"passed": False, "checked": True, "reason": "layer 1: RoutingCollapse"})
    assert broken.manifest(0)["health"]["reason"] == "layer 1: RoutingCollapse" and broken.last_good() is None
    with pytest.raises(ValueError, match=r"failed its start-up health check \(layer 1: RoutingCollapse\)"):
        broken.last_good_state()
    fixed = broken.save(perturbed(model, 1), {"gates": {"passed": True}})
    broken.promote(model, fixed)
    version, state, why = broken.last_good_state([GATE])
    assert (version, why) == (fixed, "passed its gates") and set(state) == set(router_state(model, [GATE]))
    with pytest.raises(ValueError, match=r"router version 7 does not exist"):
        broken.mark_good(7)
    rolled = broken.save(perturbed(model, 2), {"gates": {"passed": False}})
    with pytest.raises(ValueError, match=rf"router version {rolled} is not on the promotion stack \[0, {fixed}\]"):
        broken.mark_good(rolled)

    healthy = RouterVersions(tmp_path / "healthy")
    healthy.record_initial(model, {"passed": True, "checked": True, "reason": "no rule breached"})
    assert healthy.last_good() == 0
    assert healthy.last_good_state()[0::2] == (0, "passed its start-up health check")


def test_a_line_cut_short_by_a_crash_is_skipped_and_spoils_nothing_after_it(
    model: torch.nn.Module, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = RouterVersions(tmp_path)
    registry.record_initial(model, {"passed": True, "checked": True, "reason": "no rule breached"})
    v1 = registry.save(perturbed(model, 1), {"gates": {"passed": True}})
    registry.promote(model, v1)
    registry.mark_good(0)
    for name in ("promotions.jsonl", "marked_good.jsonl"):  # a crash mid-append: half a line, no newline
        with (tmp_path / name).open("a") as handle:
            handle.write('{"kind": "promote", "version": 9, "secret-looking": "tok')
    with caplog.at_level("WARNING"):
        assert registry.live_version() == v1
        assert registry.marked_good() == [0]
        assert registry.last_good() == v1
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
    assert skipped and all("line 3" in message or "line 2" in message for message in skipped)
    assert not any("secret-looking" in message for message in skipped)
    registry.mark_good(v1)  # the next append starts on a line of its own
    assert registry.marked_good() == [0, v1]
    v2 = registry.save(perturbed(model, 2), {"gates": {"passed": True}})
    registry.promote(model, v2)
    assert registry.live_version() == v2 and registry.last_good() == v2


def test_a_candidate_identical_to_a_saved_version_is_not_written_again(model: torch.nn.Module, tmp_path: Path) -> None:
    registry = RouterVersions(tmp_path / "routers")
    registry.record_initial(model)
    tensors = perturbed(model, 3)
    assert registry.save(tensors, {"job": "a", "gates": {"passed": False}}) == 1
    assert (
        registry.save(
            {name: tensor.clone() for name, tensor in tensors.items()}, {"job": "b", "gates": {"passed": False}}
        )
        == 1
    )
    assert registry.version_numbers() == [0, 1] and registry.manifest(1)["candidate_of"] == ["b"]
    assert registry.save(perturbed(model, 4), {"job": "c", "gates": {"passed": False}}) == 2


def test_versions_past_the_retention_policy_go_oldest_first_but_never_what_is_needed(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    from mla_watch.retune.jobs import RetentionPolicy

    registry = RouterVersions(tmp_path / "routers", RetentionPolicy(max_versions=4))
    registry.record_initial(model)
    good = registry.save(perturbed(model, 10), {"gates": {"passed": True}})  # 1: promoted, on the stack
    registry.promote(model, good)
    proposal = registry.save(perturbed(model, 11), {"gates": {"passed": False, "decision": "pending"}})  # 2
    for seed in range(12, 18):  # 3..8: rejected candidates
        registry.save(perturbed(model, seed), {"gates": {"passed": False, "decision": "reject"}})
    kept = registry.version_numbers()
    assert {0, good, proposal} <= set(kept) and len(kept) == 4 and kept[-1] == 8
    assert registry.live_version() == good and registry.rollback(model) == 0  # the stack is whole

    small = RouterVersions(tmp_path / "small", RetentionPolicy(max_versions=100, max_bytes=1024))
    small.record_initial(model)
    for seed in range(20, 24):
        small.save(perturbed(model, seed), {"gates": {"passed": False}})
    assert small.version_numbers() == [0, 4]  # the newest is kept whatever its size; the rest went for bytes
    with pytest.raises(ValueError, match="max_versions = 1: expected an integer >= 2"):
        RetentionPolicy(max_versions=1)
