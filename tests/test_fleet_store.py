"""The fleet's store on real PostgreSQL: one decision per fleet, the lease's expiry, a rollout's steps and its end,
what a version stores; and the settings and answers around it (``--fleet`` flags, ``/v1/fleet`` outside a fleet,
``router_version_info`` on every sidecar)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.support import get_metrics, metric_value, wait_until
from mla_watch.common.tensor_files import BFLOAT16, router_digest, tensors_from_bytes, tensors_to_bytes
from mla_watch.fleet.fleet_store import FleetStore, FleetStoreError, describe_url
from mla_watch.fleet.settings import FleetSettings
from mla_watch.routing.series import ROUTER_VERSION_INFO

BASE = "base-digest"


@pytest.fixture()
def store(fleet_url: str):
    made = FleetStore(fleet_url)
    for name in ("a", "b", "c"):
        made.join(name, BASE, BASE, None)
    yield made
    made.close()


def _bias(value: float) -> dict[str, dict[str, np.ndarray]]:
    return {"r1": {"r1.bias": np.full(4, value, dtype=np.float32)}}


def test_one_decision_per_fleet_the_lease_waits_and_the_cooldown_follows_a_tried_job(store: FleetStore) -> None:
    assert store.decide("a", BASE, "job-1", ["r1"], "chat", cooldown_seconds=60, lease_seconds=30) == {
        "decision": "lease"
    }
    waiting = store.decide("b", BASE, "job-2", ["r1"], "chat", cooldown_seconds=60, lease_seconds=30)
    assert waiting["decision"] == "wait" and waiting["holder"] == "a" and waiting["job"]["id"] == "job-1"
    assert store.renew("a", "job-1", 30) and not store.renew("b", "job-1", 30)
    store.finish_job("a", "job-1", "rejected", tried=True, detail={"error": "the gates rejected it"})
    cooling = store.decide("b", BASE, "job-3", ["r1"], "chat", cooldown_seconds=60, lease_seconds=30)
    assert cooling["decision"] == "cooldown" and cooling["job"]["id"] == "job-1"
    # Another router, or a job that tried nothing, holds no cooldown.
    assert (
        store.decide("b", BASE, "job-4", ["r2"], "chat", cooldown_seconds=60, lease_seconds=30)["decision"] == "lease"
    )
    store.finish_job("b", "job-4", "failed", tried=False, detail={})
    assert (
        store.decide("c", BASE, "job-5", ["r2"], "chat", cooldown_seconds=60, lease_seconds=30)["decision"] == "lease"
    )


def test_a_lease_not_renewed_expires_its_job_is_abandoned_and_another_member_decides(store: FleetStore) -> None:
    assert store.decide("a", BASE, "job-1", ["r1"], None, cooldown_seconds=60, lease_seconds=0.3)["decision"] == "lease"
    assert wait_until(lambda: store.view(BASE).lease.expired, timeout=10)
    assert store.decide("b", BASE, "job-2", ["r1"], None, cooldown_seconds=60, lease_seconds=30)["decision"] == "lease"
    jobs = {job["id"]: job for job in store.jobs()}
    assert jobs["job-1"]["state"] == "abandoned" and "stopped renewing" in jobs["job-1"]["detail"]["error"]
    assert not store.renew("a", "job-1", 30)  # the old holder cannot renew what it lost


def test_a_rollout_takes_one_member_at_a_time_and_ends_when_every_live_member_passed(store: FleetStore) -> None:
    store.decide("a", BASE, "job-1", ["r1"], None, cooldown_seconds=60, lease_seconds=30)
    number, rollout = store.publish(
        "a",
        "job-1",
        BASE,
        parent=0,
        digest="v1",
        changes=_bias(1.0),
        manifest={"routers": ["r1"]},
        batch=1,
        canary_detail={"reason": "gates"},
        lease_seconds=30,
    )
    assert number == 1
    assert store.claim_step("b", rollout) and not store.claim_step("c", rollout)  # batch 1
    assert not store.claim_step("b", rollout)  # its step is under way
    store.join("b", BASE, BASE, None)  # b started again mid-step: the step is lost and b takes it again
    steps = {step.member: step.outcome for step in store.view(BASE).rollout.steps}  # type: ignore[union-attr]
    assert steps == {"a": "passed", "b": "lost"}
    assert store.claim_step("b", rollout)
    assert store.coordinate("a", "job-1", member_seconds=60) == "rolling"
    store.end_step("b", rollout, "passed", {})
    store.heartbeat("b", "v1", 1, {})
    assert store.claim_step("c", rollout)
    store.end_step("c", rollout, "passed", {})
    store.heartbeat("c", "v1", 1, {})
    assert store.coordinate("a", "job-1", member_seconds=60) == "done"
    view = store.view(BASE)
    assert view.current.number == 1 and view.rollout is not None and view.rollout.state == "done"
    assert not view.lease.held and {job["id"]: job["state"] for job in store.jobs()} == {"job-1": "done"}
    # What the version holds: the changed tensors only, read back exactly.
    ((version, tensors),) = store.changes(BASE, 1)
    assert version == 1 and np.array_equal(tensors["r1.bias"], np.ones(4, dtype=np.float32))


def test_a_failed_step_halts_the_rollout_and_abort_marks_its_version_bad(store: FleetStore) -> None:
    store.decide("a", BASE, "job-1", ["r1"], None, cooldown_seconds=60, lease_seconds=30)
    _, rollout = store.publish(
        "a",
        "job-1",
        BASE,
        parent=0,
        digest="v1",
        changes=_bias(2.0),
        manifest={"routers": ["r1"]},
        batch=2,
        canary_detail={},
        lease_seconds=30,
    )
    assert store.claim_step("b", rollout) and store.claim_step("c", rollout)  # batch 2
    store.end_step("c", rollout, "failed", {"reason": "RoutingEntropyLow breaches"})
    view = store.view(BASE)
    assert view.rollout is not None and view.rollout.state == "halted" and view.rollout.halted_by == "c"
    assert store.coordinate("a", "job-1", member_seconds=60) == "halted"
    assert not store.view(BASE).lease.held and store.view(BASE).current.number == 0
    aborted = store.abort(BASE, "aborted by an operator")
    assert aborted is not None and aborted.state == "aborted" and store.view(BASE).bad == frozenset({1})
    assert store.abort(BASE, "again") is None


def test_a_rollout_whose_coordinator_stopped_is_taken_over(store: FleetStore) -> None:
    store.decide("a", BASE, "job-1", ["r1"], None, cooldown_seconds=60, lease_seconds=0.3)
    store.publish(
        "a",
        "job-1",
        BASE,
        parent=0,
        digest="v1",
        changes=_bias(3.0),
        manifest={"routers": ["r1"]},
        batch=1,
        canary_detail={},
        lease_seconds=0.3,
    )
    assert wait_until(lambda: store.view(BASE).lease.expired, timeout=10)
    # A new decision waits for the rollout; a member's round takes its coordination over.
    assert store.decide("b", BASE, "job-2", ["r9"], None, cooldown_seconds=0, lease_seconds=30)["decision"] == "wait"
    taken = store.take_over("b", 30)
    assert taken is not None and taken["id"] == "job-1"
    view = store.view(BASE)
    assert view.lease.holder == "b" and view.lease.held
    assert store.jobs()[0]["detail"]["taken_over_from"] == "a"


def test_the_store_unreachable_is_one_error_naming_it_without_its_password() -> None:
    url = "postgresql://fleet:s3cret-word@127.0.0.1:1/fleet"
    store = FleetStore(url, connect_timeout=1)
    with pytest.raises(FleetStoreError) as raised:
        store.ping()
    message = str(raised.value)
    assert message.startswith("postgresql://127.0.0.1:1/fleet cannot be reached")
    assert "s3cret" not in message and "\n" not in message
    assert describe_url("not a url ?=") == "the fleet store (an unreadable URL)"


def test_tensors_cross_the_store_byte_for_byte_and_the_digest_is_their_content() -> None:
    tensors = {
        "m.gate.weight": np.arange(12, dtype=np.float32).reshape(3, 4).astype(BFLOAT16),
        "m.gate.e_score_correction_bias": np.linspace(0, 1, 4, dtype=np.float32),
    }
    back = tensors_from_bytes(tensors_to_bytes(tensors))
    assert back.keys() == tensors.keys() and all(back[name].dtype == tensors[name].dtype for name in tensors)
    assert router_digest(back) == router_digest(tensors) == router_digest(dict(reversed(list(tensors.items()))))
    changed = dict(tensors, **{"m.gate.e_score_correction_bias": tensors["m.gate.e_score_correction_bias"] + 1e-3})
    assert router_digest(changed) != router_digest(tensors)


def test_fleet_settings_name_the_field_and_never_repeat_the_url() -> None:
    settings = FleetSettings(url="postgresql://u:pw@h/db", name="r1", rollout_batch=0, lease_seconds=10, poll_seconds=8)
    problems = settings.problems()
    assert problems == [
        "rollout_batch 0: expected an integer >= 1",
        "poll_seconds 8: expected seconds > 0, at most half of the lease (a holder renews it twice before it expires)",
    ]
    assert "pw" not in repr(settings)
    bad_url = FleetSettings(url="mysql://u:pw@h/db", name="r1").problems()
    assert bad_url == ["url: expected a postgresql:// URL (postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE)"]


def test_a_sidecar_outside_a_fleet_says_so_and_exports_the_router_version_it_serves(sidecar) -> None:
    import httpx

    url, running = sidecar
    answer = httpx.get(url + "/v1/fleet", timeout=30)
    assert answer.status_code == 404 and "--fleet" in answer.json()["error"]["message"]
    assert "fleet" not in httpx.get(url + "/readyz", timeout=30).json()
    digest = router_digest(running.retune.retuner.host.state())
    assert metric_value(get_metrics(url), ROUTER_VERSION_INFO, version="0", digest=digest) == 1
