"""The re-tune service on a tiny DeepSeek-V3.2 model: APScheduler with its SQLite store, one job at
a time, cooldowns, merging, restarts mid-job, missed jobs, gates, rejection, the registry."""

from __future__ import annotations

import contextlib
import pickle
import sqlite3
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from harness.support import wait_until
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.router_tensors import router_state
from mla_watch.retune.service import Cooldown, JobAbandoned
from tests.retune_harness import BIAS, GATE, OTHER, Harness, collapse, fill_capture, final, spec
from tests.tiny_models import build


def test_a_collapsed_router_is_refit_gated_promoted_and_rolled_back_exactly(tmp_path) -> None:
    harness = Harness(tmp_path)
    service = harness.start()
    healthy = router_state(harness.model)
    collapse(harness.model)
    collapsed = router_state(harness.model)

    job = final(service, service.submit(spec())["id"])

    assert job["status"] == "promoted" and job["attempts"] == 1, job
    result = job["result"]
    (attempt,) = result["attempts"]
    assert attempt["outcome"] == "promoted" and attempt["version"] == result["version"] == 1
    gates = attempt["gates"]
    assert gates["passed"] and gates["before"]["entropy_bits"][GATE] < 1.1 < 2.3 < gates["after"]["entropy_bits"][GATE]
    assert {check["gate"] for check in gates["checks"]} == {"band", "perplexity"}
    manifest = service.versions.manifest(1)
    assert manifest["strategy"] == "bias" and manifest["job"] == job["id"] and manifest["gates"]["passed"]
    assert manifest["data"]["source"] == "capture" and manifest["data"]["held_out_samples"] >= 1
    assert set(manifest["tensors"]) == {BIAS}  # only router tensors, only the re-tuned router
    assert service.versions.live_version() == 1 and harness.changed == [("promote", [GATE])]
    assert harness.outcomes == [("bias", "promoted")]
    assert not torch.equal(router_state(harness.model)[BIAS], collapsed[BIAS])

    assert service.rollback() == 0
    after_rollback = router_state(harness.model)
    assert all(torch.equal(after_rollback[name], collapsed[name]) for name in collapsed)  # bit for bit
    assert not torch.equal(after_rollback[BIAS], healthy[BIAS])
    service.stop()


def test_a_job_rejected_while_its_router_is_still_broken_keeps_trying_and_holds_no_cooldown(tmp_path) -> None:
    harness = Harness(tmp_path, retry_seconds=600.0)
    service = harness.start()
    collapse(harness.model)
    before = {name: tensor.clone() for name, tensor in harness.model.state_dict().items()}
    impossible = {"metric": "entropy_bits", "low": 3.5, "high": None}  # above log2(8 experts) = 3.0

    job_id = service.submit(spec(band=impossible, strategies=["bias", "restore"]))["id"]
    assert wait_until(lambda: service.store.get(job_id)["status"] == "waiting", timeout=60)
    job = service.store.get(job_id)

    assert [a["outcome"] for a in job["result"]["attempts"]] == ["rejected", "rejected"]
    assert job["result"]["rejected_while_outside_band"] is True
    assert job["result"]["needs"].startswith(
        f"a candidate that passes its gates: every one was rejected while {GATE} "
        "still reads outside its band (entropy_bits >= 3.5)"
    )
    assert all(torch.equal(before[name], tensor) for name, tensor in harness.model.state_dict().items())
    assert service.versions.live_version() == 0
    assert [m["gates"]["passed"] for m in service.versions.versions()] == [True, False, False]
    ((rejected_spec, result),) = harness.rejected  # on-call hears of it once, with the figures
    assert rejected_spec.id == job_id and result["attempts"][0]["gates"]["after"]["perplexity"] > 0
    assert harness.outcomes == [("restore", "waiting")]
    # No cooldown held: another job for the same router is scheduled at once.
    assert service.submit(spec(strategies=["restore"]))["status"] == "pending"
    service.stop()


def test_a_job_rejected_while_its_router_reads_in_band_ends_rejected_and_changes_nothing(tmp_path) -> None:
    """The reference handed to restore is itself damaged, while the live router is healthy: rejected, the end."""
    harness = Harness(tmp_path)
    damaged = router_state(harness.model)
    damaged[BIAS] = damaged[BIAS].clone()
    damaged[BIAS][:2] += 10.0
    harness.reference = RouterReference(label="reference model /bad", tensors=damaged)
    service = harness.start()
    before = {name: tensor.clone() for name, tensor in harness.model.state_dict().items()}

    job = final(service, service.submit(spec(strategies=["restore"]))["id"])

    assert job["status"] == "rejected"
    (attempt,) = job["result"]["attempts"]
    checks = {check["gate"]: check for check in attempt["gates"]["checks"]}
    assert checks["band"]["decision"] == "reject" and checks["reference_health"]["decision"] == "reject"
    assert "reference model /bad on the health text" in checks["reference_health"]["message"]
    assert "TinyRouterCollapse" in checks["reference_health"]["message"]
    assert checks["perplexity"]["binding"] is True  # the live router is healthy: its perplexity is the standard
    assert all(torch.equal(before[name], tensor) for name, tensor in harness.model.state_dict().items())
    assert service.versions.live_version() == 0
    assert len(harness.rejected) == 1 and harness.outcomes == [("restore", "rejected")]
    service.stop()


def test_stop_waits_for_a_running_job_that_reschedules_or_supersedes_without_deadlocking(tmp_path) -> None:
    """A job still running when the service stops may call into the scheduler as it ends (a wait re-schedules
    it, a promotion supersedes others); stop() waits for it and returns, and the store keeps what is due."""
    harness = Harness(tmp_path, retry_seconds=600.0)
    service = harness.start()
    started, release = threading.Event(), threading.Event()

    def blocked_run(job_spec, previous=None):
        started.set()
        release.wait(30)
        return "waiting", {"needs": "more captured samples", "strategy": "bias", "attempts": []}

    service.retuner.run = blocked_run
    job_id = service.submit(spec())["id"]
    assert started.wait(30)
    stopper = threading.Thread(target=service.stop, daemon=True)
    stopper.start()
    time.sleep(0.5)  # let stop() reach the scheduler's shutdown while the job runs (where the deadlock was)
    release.set()
    stopper.join(30)
    assert not stopper.is_alive(), "stop() deadlocked with the job it was waiting for"

    restarted = harness.start()
    record = restarted.store.get(job_id)
    assert record["status"] == "waiting" and record["result"]["retry_at"] > time.time()
    assert restarted.scheduler.get_job(job_id) is not None  # the next start schedules the retry it was due
    restarted.stop()


def test_restore_puts_back_the_last_version_that_passed_its_gates(tmp_path) -> None:
    harness = Harness(tmp_path)
    service = harness.start()
    healthy = router_state(harness.model)
    with torch.no_grad():  # a bad deploy: noise on the router weights, in place
        dict(harness.model.named_modules())[GATE].weight.add_(
            torch.randn(
                dict(harness.model.named_modules())[GATE].weight.shape, generator=torch.Generator().manual_seed(3)
            )
            * 5
        )
    job = final(service, service.submit(spec(strategies=["restore"], band={"metric": "entropy_bits"}))["id"])
    assert job["status"] == "promoted", job["result"]
    assert (
        job["result"]["attempts"][0]["gates"]["after"]["perplexity"]
        <= job["result"]["attempts"][0]["gates"]["before"]["perplexity"] + 0.3
    )
    live = router_state(harness.model)
    assert all(torch.equal(live[name], healthy[name]) for name in healthy)
    assert service.versions.manifest(job["result"]["version"])["details"]["restored_from"] == 0
    service.stop()


def test_strategies_the_model_cannot_use_are_skipped_with_the_reason(tmp_path) -> None:
    harness = Harness(tmp_path, model=build("mixtral"))
    service = harness.start()
    routers = list(router_state(harness.model))
    router = routers[0].rsplit(".", 1)[0]
    job = final(service, service.submit(spec(routers=[router], strategies=["bias"], band={}))["id"])
    assert job["status"] == "failed"
    assert job["result"]["attempts"][0]["outcome"] == "unsupported"
    assert "has no expert router with an e_score_correction_bias" in job["result"]["error"]
    service.stop()


def test_cooldown_merging_and_bad_submissions(tmp_path) -> None:
    harness = Harness(tmp_path)
    service = harness.start()
    service.scheduler.pause()
    first = service.submit(spec())
    merged = service.submit(spec(routers=[OTHER]))
    assert merged["id"] == first["id"] and merged["spec"]["routers"] == [GATE, OTHER]  # one job, not two
    service.scheduler.resume()
    final(service, first["id"])
    with pytest.raises(Cooldown, match=rf"router {GATE} had re-tune job {first['id']}.*cooldown is 3600 s"):
        service.submit(spec())
    forced = service.submit(spec(), force=True)
    assert forced["id"] != first["id"]
    final(service, forced["id"])
    with pytest.raises(ValueError, match=r"strategies=\['magic'\]: expected a non-empty list of"):
        service.submit(spec(strategies=["magic"]))
    with pytest.raises(ValueError, match=r"routers=\['model.layers.1.self_attn.indexer'\]: expected expert routers"):
        service.submit(spec(routers=["model.layers.1.self_attn.indexer"]))
    service.stop()


def test_a_job_short_of_captured_samples_waits_and_runs_again_by_itself_once_there_are_enough(tmp_path) -> None:
    harness = Harness(tmp_path, min_samples=200, retry_seconds=1.0)
    service = harness.start()
    collapse(harness.model)
    submitted = service.submit(spec())
    assert wait_until(lambda: service.store.get(submitted["id"])["status"] == "waiting", timeout=30)
    job = service.store.get(submitted["id"])
    assert job["result"]["needs"] == (
        "160 samples of business line 'code' are available; the job needs at least "
        "200 (let more traffic be captured, or give a dataset)"
    )
    assert job["result"]["retry_at"] > job["result"]["waiting_since"]
    # Waiting is not a rejection: no cooldown is held, and a new alert joins the waiting job.
    merged = service.submit(spec(routers=[OTHER]))
    assert merged["id"] == job["id"] and merged["spec"]["routers"] == [GATE, OTHER]
    other_line = service.submit(spec(business_line="chat"))  # another line's alert: a job of its own, waiting too
    assert other_line["id"] != job["id"]
    fill_capture(tmp_path / "capture.sqlite", count=60, seed=1)  # traffic goes on being captured

    job = final(service, job["id"])

    assert job["status"] == "promoted", job
    assert job["result"]["data"]["samples"] == 220  # the samples captured while it waited count
    # The router it was for now serves the promoted version: the other line's job is superseded, not run.
    superseded = final(service, other_line["id"])
    assert superseded["status"] == "superseded" and superseded["result"]["superseded_by"] == job["id"]
    assert superseded["result"]["error"] == (
        f"superseded: job {job['id']} promoted router version 1 for {OTHER}, {GATE}"
    )
    assert ("bias", "waiting") in harness.outcomes and harness.outcomes[-1] == ("bias", "promoted")
    service.stop()


def test_a_waiting_job_withdrawn_ends_superseded_and_never_runs_again(tmp_path) -> None:
    harness = Harness(tmp_path, min_samples=200, retry_seconds=0.5)
    service = harness.start()
    collapse(harness.model)
    job_id = service.submit(spec())["id"]
    assert wait_until(lambda: service.store.get(job_id)["status"] == "waiting", timeout=30)
    before = {name: tensor.clone() for name, tensor in harness.model.state_dict().items()}

    withdrawn = False
    for _ in range(100):  # a retry may have it pending or running at that instant: it is withdrawn only waiting
        if withdrawn := service.withdraw(job_id, "another line asks for the same repair"):
            break
        assert wait_until(lambda: service.store.get(job_id)["status"] == "waiting", timeout=30)
    assert withdrawn
    job = service.store.get(job_id)
    assert job["status"] == "superseded" and job["result"]["cannot_run"] and job["result"]["version"] is None
    assert job["result"]["error"] == "superseded: another line asks for the same repair"
    assert job["result"]["needs"].startswith("160 samples of business line 'code'")  # what it waited for stays
    fill_capture(tmp_path / "capture.sqlite", count=60, seed=1)  # enough data now: a retry would promote
    assert service.withdraw(job_id, "again") is False  # ended: left as it is
    assert not wait_until(lambda: service.store.get(job_id)["status"] != "superseded", timeout=2)
    assert all(torch.equal(before[name], tensor) for name, tensor in harness.model.state_dict().items())
    assert service.versions.live_version() == 0
    assert service.submit(spec())["id"] != job_id  # no cooldown held
    service.stop()


def test_a_wait_is_bounded_and_a_job_that_could_not_decide_holds_no_cooldown(tmp_path) -> None:
    harness = Harness(tmp_path, min_held_out_tokens=100_000, max_wait_seconds=0)
    service = harness.start()
    job = final(service, service.submit(spec())["id"])
    assert job["status"] == "failed" and job["result"]["cannot_run"]
    assert job["result"]["error"].startswith("not enough data to decide after waiting 0 s (max_wait_seconds 0): ")
    assert (
        "scored held-out tokens in 40 distinct samples; the perplexity gate decides on at least 100000"
        in job["result"]["error"]
    )
    assert job["result"]["attempts"] == []  # nothing was fitted on data no gate could judge
    again = service.submit(spec())
    assert again["id"] != job["id"]  # no cooldown
    final(service, again["id"])
    service.stop()


def test_a_job_without_capture_or_dataset_fails_at_once_saying_what_is_missing(tmp_path) -> None:
    harness = Harness(tmp_path)
    harness.capture = None
    service = harness.start()
    job = final(service, service.submit(spec())["id"])
    assert job["status"] == "failed" and job["result"]["cannot_run"]
    assert job["result"]["error"].startswith("no data: traffic capture is off (serve with --capture")
    assert service.submit(spec())["id"] != job["id"]  # it tried nothing: no cooldown
    service.stop()


def test_a_pending_job_survives_a_crash_in_the_sqlite_job_store(tmp_path) -> None:
    harness = Harness(tmp_path)
    service = harness.start()
    service.scheduler.pause()
    job_id = service.submit(spec())["id"]
    harness.crash()
    with sqlite3.connect(tmp_path / "retune_schedule.sqlite") as db:  # APScheduler's own store kept it
        assert [row[0] for row in db.execute("SELECT id FROM apscheduler_jobs")] == [job_id]

    collapse(harness.model)
    service = harness.start()
    assert final(service, job_id)["status"] == "promoted"
    service.stop()


def test_a_job_still_running_when_the_stop_runs_out_of_time_promotes_nothing_and_is_recorded_interrupted(
    tmp_path,
) -> None:
    harness = Harness(tmp_path, max_attempts=1)
    service = harness.start()
    started, release, refused = threading.Event(), threading.Event(), threading.Event()

    def slow_run(job_spec, previous=None):
        started.set()
        release.wait(30)
        try:
            service.promote(1)  # what a job that passed its gates does next
        except JobAbandoned:
            refused.set()
            raise
        return "promoted", {"version": 1, "strategy": "bias", "attempts": []}

    service.retuner.run = slow_run
    job_id = service.submit(spec())["id"]
    assert started.wait(30)
    stopper = threading.Thread(target=service.stop, args=(0.2,), daemon=True)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive(), "stop() waited for the job past its time"
    release.set()
    assert refused.wait(30)
    assert service.versions.live_version() == 0

    restarted = harness.start()
    record = restarted.store.get(job_id)
    assert record["status"] == "failed", record
    assert record["result"]["error"] == "interrupted 1 times by a restart (max_attempts 1)"
    assert restarted.versions.live_version() == 0
    restarted.stop()


def test_a_job_interrupted_mid_run_is_retried_then_failed(tmp_path) -> None:
    harness = Harness(tmp_path, max_attempts=2)
    service = harness.start()
    collapse(harness.model)
    job = service.store.add(spec())
    service.store.start(job["id"])  # the process dies while the job runs
    harness.crash()

    service = harness.start()
    retried = final(service, job["id"])
    assert retried["status"] == "promoted" and retried["attempts"] == 2
    harness.crash()

    service = harness.start()  # a job interrupted as often as allowed is failed, not run forever
    other = service.store.add(spec(routers=[OTHER]))
    service.store.start(other["id"])
    service.store.start(other["id"])
    harness.crash()
    service = harness.start()
    failed = final(service, other["id"])
    assert failed["status"] == "failed"
    assert failed["result"]["error"] == "interrupted 2 times by a restart (max_attempts 2)"
    service.stop()


def test_a_job_late_beyond_the_misfire_grace_time_is_failed_not_forgotten(tmp_path) -> None:
    harness = Harness(tmp_path, misfire_grace_seconds=1)
    service = harness.start()
    service.scheduler.pause()
    job_id = service.submit(spec())["id"]
    harness.crash()
    down_since(tmp_path / "retune_schedule.sqlite", job_id, seconds=10)
    service = harness.start()
    job = final(service, job_id)
    assert job["status"] == "failed" and job["result"]["error"].startswith("missed: the scheduler was down")
    service.stop()


def down_since(schedule: Path, job_id: str, seconds: float) -> None:
    """Moves the run time ``job_id`` has in APScheduler's SQLite store ``seconds`` back, as the store reads after
    the scheduler was down that long (instead of waiting it out)."""
    with contextlib.closing(sqlite3.connect(schedule)) as db, db:
        (blob,) = db.execute("SELECT job_state FROM apscheduler_jobs WHERE id = ?", (job_id,)).fetchone()
        state = pickle.loads(blob)
        state["trigger"].run_date -= timedelta(seconds=seconds)
        state["next_run_time"] -= timedelta(seconds=seconds)
        db.execute(
            "UPDATE apscheduler_jobs SET job_state = ?, next_run_time = ? WHERE id = ?",
            (pickle.dumps(state), state["next_run_time"].timestamp(), job_id),
        )


def test_promotions_survive_a_restart(tmp_path) -> None:
    harness = Harness(tmp_path)
    service = harness.start()
    collapse(harness.model)
    assert final(service, service.submit(spec())["id"])["status"] == "promoted"
    promoted = router_state(harness.model)
    service.stop()

    harness.model = build("deepseek_v32")  # the server restarts and loads the model from disk ...
    service = harness.start()  # ... and the promoted routers are put back
    assert service.versions.live_version() == 1
    live = router_state(harness.model)
    assert all(torch.equal(live[name], promoted[name]) for name in promoted)
    service.stop()


def test_the_strategies_rules_may_name_are_the_strategies_there_are() -> None:
    from mla_watch.alerting.vocabulary import RETUNE_STRATEGIES
    from mla_watch.retune.service import DEFAULT_STRATEGIES
    from mla_watch.retune.strategies import STRATEGIES

    assert set(RETUNE_STRATEGIES) == set(STRATEGIES) and DEFAULT_STRATEGIES == RETUNE_STRATEGIES
