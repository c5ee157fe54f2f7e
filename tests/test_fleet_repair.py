"""A fleet repaired as one, on real PostgreSQL (``serve --fleet``).

Three embedded sidecars of one checkpoint share a store. Deployed with MoE layer 1 collapsed, they repair with one
job on one replica (the canary), whose version is rolled out and checked on each; a replica whose check fails rolls
back and halts the rollout; a lease holder killed mid-job is replaced; the store stopped stops re-tuning and
nothing else; a replica damaged alone restores the fleet's version without a job.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from harness import processes
from harness.broken_deploy import BUNDLED, CHAT_PROMPTS
from harness.fleet_harness import (
    LAYER1,
    LEASE_SECONDS,
    POLL_SECONDS,
    Replica,
    broken_fleet_parts,
    drive,
    fleet_replica,
    layer1_alerts,
    serving,
)
from harness.postgres import running_cluster
from harness.receivers import running_receiver
from harness.support import free_port, metric_sum, start_sidecar, wait_until
from mla_watch.routing.series import FLEET_ROLLOUT_STEPS, FLEET_STORE_UP, total_name

pytestmark = pytest.mark.slow

NAMES = ("replica-a", "replica-b", "replica-c")


def fleet_view(url: str) -> dict[str, Any]:
    answer = httpx.get(url + "/v1/fleet", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def all_resolved(urls: list[str]) -> bool:
    for url in urls:
        alerts = layer1_alerts(url)
        if not alerts or any(alert["state"] != "resolved" for alert in alerts):
            return False
    return True


def retune_notes(receiver: Any) -> list[str]:
    """The ``retune`` annotations of the layer-1 pages on-call received: what became of each re-tune request."""
    return [
        alert["annotations"]["retune"]
        for request in receiver.requests
        for alert in request.json().get("alerts", [])
        if alert["labels"].get("router") == LAYER1 and "retune" in alert["annotations"]
    ]


def layer1_bits(url: str) -> float:
    return next(
        r["entropy_bits"] for r in httpx.get(url + "/v1/routing", timeout=30).json()["routers"] if r["name"] == LAYER1
    )


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def repaired(urls: list[str]) -> bool:
    view = fleet_view(urls[0])
    return (
        view["rollout"] is not None
        and view["rollout"]["state"] == "done"
        and all_resolved(urls)
        and len({serving(url) for url in urls}) == 1
    )


def test_the_store_down_stops_re_tuning_only_and_once_back_one_job_repairs_the_fleet(tmp_path: Path) -> None:
    checkpoint, rules = broken_fleet_parts(tmp_path)
    with running_cluster() as cluster, running_receiver() as receiver, contextlib.ExitStack() as stack:
        url = cluster.create_database()
        replicas = [
            stack.enter_context(
                fleet_replica(
                    name, tmp_path, url, checkpoint=checkpoint, rules=rules, oncall_url=receiver.url + "/hook"
                )
            )
            for name in NAMES
        ]
        urls = [replica.url for replica in replicas]
        first = serving(urls[0])
        assert first is not None and all(serving(url) == first for url in urls)  # one checkpoint, one digest
        assert first[0] == "0"

        # The store down: serving, counting, alerting and notifying go on; no replica re-tunes alone.
        cluster.stop()
        assert wait_until(lambda: all(metric_sum(metrics(u), FLEET_STORE_UP) == 0 for u in urls), 30)

        def paged_everywhere() -> bool:
            return all(
                any(
                    alert["state"] == "firing" and (alert["cause"] or {}).get("name") == "model"
                    for alert in layer1_alerts(u)
                )
                for u in urls
            )

        assert drive(replicas, paged_everywhere, timeout=180), [layer1_alerts(u) for u in urls]
        # Three rounds of each member that would have retried the wanted jobs, had the store answered.
        ended = {replica.name: replica.sidecar.serving.fleet.status()["rounds"] for replica in replicas}
        assert wait_until(
            lambda: all(
                replica.sidecar.serving.fleet.status()["rounds"] >= ended[replica.name] + 3 for replica in replicas
            ),
            60,
        )
        for u in urls:
            ready = httpx.get(u + "/readyz", timeout=30)
            assert ready.status_code == 200, ready.text  # the store down stops re-tuning, not serving
            fleet = ready.json()["fleet"]
            assert fleet["store_up"] is False and "re-tuning waits" in fleet["detail"], fleet
            assert "postgresql://127.0.0.1" in fleet["detail"] and "postgres@" not in fleet["detail"]
            assert metric_sum(metrics(u), total_name("mla_watch_retune_jobs")) == 0
            assert httpx.get(u + "/v1/retune/jobs", timeout=30).json()["jobs"] == []
            assert httpx.get(u + "/v1/fleet", timeout=30).status_code == 503
        assert wait_until(lambda: len(retune_notes(receiver)) >= len(urls), 30)
        notes = retune_notes(receiver)
        assert all(
            "fleet store" in note and "cannot be reached" in note and "re-tuning waits" in note for note in notes
        ), notes
        firing = [
            alert
            for request in receiver.requests
            for alert in request.json().get("alerts", [])
            if alert["labels"].get("router") == LAYER1 and alert["status"] == "firing"
        ]
        assert firing, "on-call was not paged while the store was down"

        # The store back: the alerts that asked are asked again; one job, one canary, one rollout.
        cluster.start()
        assert drive(replicas, lambda: repaired(urls), timeout=400), (
            fleet_view(urls[0]),
            [layer1_alerts(u) for u in urls],
        )
        view = fleet_view(urls[0])
        assert len(view["jobs"]) == 1 and view["jobs"][0]["state"] == "done", view["jobs"]
        canary = view["jobs"][0]["canary"]
        steps = {step["member"]: step["outcome"] for step in view["rollout"]["steps"]}
        assert steps == dict.fromkeys(NAMES, "passed"), steps
        version, digest = view["current"]["version"], view["current"]["digest"]
        assert version == 1 and view["rollout"]["version"] == 1 and digest != first[1]
        assert {serving(u) for u in urls} == {("1", digest)}
        assert all(member["digest"] == digest and member["version"] == 1 for member in view["members"])
        assert view["lease"]["holder"] is None
        assert view["versions"][0]["bytes"] > 0 and view["versions"][0]["routers"] == [LAYER1]
        for replica, u in zip(replicas, urls, strict=True):
            text = metrics(u)
            assert metric_sum(text, FLEET_STORE_UP) == 1
            # Jobs count where they ran (a job that waits for data counts each wait): on the canary only.
            promoted = metric_sum(text, total_name("mla_watch_retune_jobs"), outcome="promoted")
            counted = metric_sum(text, total_name("mla_watch_retune_jobs"))
            assert (promoted, counted > 0) == ((1, True) if replica.name == canary else (0, False)), replica.name
            assert metric_sum(text, total_name(FLEET_ROLLOUT_STEPS), outcome="passed") == 1, replica.name
            assert layer1_bits(u) >= 5.2, replica.name
        assert not any(replica.errors for replica in replicas), [replica.errors for replica in replicas]


def fleet_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return processes.run(
        [sys.executable, "-m", "mla_watch.cli", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MLA_WATCH_ADMIN_TOKEN": "fleet-admin-token-0123456789"},
    )


def _strict_rules(rules: Path, target: Path) -> Path:
    """The scenario's rules on a replica that asks for no re-tune and holds layer 1 to a band no router meets."""
    target.mkdir(parents=True)
    text = re.sub(r"actions: \[notify, retune\]", "actions: [notify]", (rules / "routing.yaml").read_text())
    text = re.sub(r"(?m)^\s+retune_strategy: .*\n", "", text)
    text += (
        "  - alert: LayerOneNearCeiling\n    metric: entropy_bits\n"
        '    select: {kind: expert, slots: 64, layers: [1, 1], business_line: "*"}\n'
        "    below: 5.999\n    severity: warning\n    actions: [notify]\n"
    )
    (target / "routing.yaml").write_text(text)
    return target


def test_a_replica_whose_check_fails_rolls_back_and_halts_the_rollout(tmp_path: Path, fleet_url: str) -> None:
    checkpoint, rules = broken_fleet_parts(tmp_path)
    strict = _strict_rules(rules, tmp_path / "strict-rules")
    with running_receiver() as receiver, contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(
                fleet_replica(
                    name,
                    tmp_path,
                    fleet_url,
                    checkpoint=checkpoint,
                    rules=strict if name == "replica-c" else rules,
                    oncall_url=receiver.url + "/hook",
                )
            )
            for name in NAMES
        ]
        urls = {replica.name: replica.url for replica in replicas}
        base = serving(urls["replica-a"])
        assert base is not None

        def halted() -> bool:
            rollout = fleet_view(urls["replica-a"])["rollout"]
            return rollout is not None and rollout["state"] == "halted"

        assert drive(replicas, halted, timeout=400), fleet_view(urls["replica-a"])
        assert wait_until(lambda: fleet_view(urls["replica-a"])["lease"]["holder"] is None, 30)
        view = fleet_view(urls["replica-a"])
        rollout = view["rollout"]
        assert rollout["halted_by"] == "replica-c" and "LayerOneNearCeiling" in rollout["reason"], rollout
        steps = {step["member"]: step for step in rollout["steps"]}
        assert steps["replica-c"]["outcome"] == "failed"
        canary = view["jobs"][0]["canary"]
        assert canary != "replica-c" and view["jobs"][0]["state"] == "halted", view["jobs"]
        # The replica that failed rolled back; the fleet's current version is still the one it was.
        assert view["current"]["version"] == 0
        assert serving(urls["replica-c"]) == base
        assert serving(urls[canary]) == ("1", rollout["digest"])
        other = next(name for name in ("replica-a", "replica-b") if name != canary)
        assert serving(urls[other]) == (("1", rollout["digest"]) if other in steps else base)
        assert metric_sum(metrics(urls["replica-c"]), total_name(FLEET_ROLLOUT_STEPS), outcome="failed") == 1
        assert httpx.get(urls["replica-c"] + "/v1/retune/jobs", timeout=30).json()["jobs"] == []

        # On-call is paged once, naming the replica.
        assert wait_until(
            lambda: any(
                alert["labels"].get("alertname") == "FleetRolloutHalted"
                for request in receiver.requests
                for alert in request.json().get("alerts", [])
            ),
            30,
        )
        pages = [
            alert
            for request in receiver.requests
            for alert in request.json().get("alerts", [])
            if alert["labels"].get("alertname") == "FleetRolloutHalted"
        ]
        assert len(pages) == 1 and pages[0]["labels"]["replica"] == "replica-c", pages
        assert "replica-c failed its check" in pages[0]["annotations"]["summary"]

        assert "mla-watch fleet abort" in pages[0]["annotations"]["description"]
        shown = fleet_cli("show", "--url", urls["replica-a"])
        assert (
            shown.returncode == 0
            and f"rollout {rollout['id']} of version 1 (from 0): halted by replica-c" in shown.stdout
        ), shown.stdout + shown.stderr

        # Aborted: every replica that took the version goes back to the fleet's current one.
        token = {"Authorization": "Bearer fleet-admin-token-0123456789"}
        aborted = fleet_cli("abort", "--url", urls["replica-b"])
        assert aborted.returncode == 0 and "aborted: version 1 is marked bad" in aborted.stdout, aborted.stderr
        assert wait_until(lambda: {serving(u) for u in urls.values()} == {base}, 60), {
            name: serving(u) for name, u in urls.items()
        }
        view = fleet_view(urls["replica-a"])
        assert view["versions"][0]["bad"] is True and view["lease"]["holder"] is None
        # One replica's own promotion or rollback is refused in a fleet, naming the fleet's command.
        refused = httpx.post(urls["replica-a"] + "/admin/retune/rollback", headers=token, timeout=30)
        assert refused.status_code == 409 and "/admin/fleet/rollout" in refused.json()["error"]["message"]


def test_a_replica_damaged_alone_restores_the_fleet_version_without_a_job(tmp_path: Path, fleet_url: str) -> None:
    """Two replicas damaged alone, one after the other: B's router tensors changed in place (its routers are not the
    fleet's version: restored); then C's routing damaged where its router tensors do not show it, as an engine
    whose reload went wrong looks to its sidecar (its peers serving the same version read healthy: the version is
    applied again). No job runs in either case."""
    _, rules = broken_fleet_parts(tmp_path)
    with running_receiver() as receiver, contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(
                fleet_replica(
                    name, tmp_path, fleet_url, checkpoint=BUNDLED, rules=rules, oncall_url=receiver.url + "/hook"
                )
            )
            for name in NAMES
        ]
        urls = [replica.url for replica in replicas]
        healthy = serving(urls[0])

        def members_healthy() -> bool:  # every replica holds healthy readings of its reference prompts
            return all(
                member["health"].get(LAYER1, {}).get("state") == "healthy" for member in fleet_view(urls[0])["members"]
            )

        assert wait_until(members_healthy, 180), fleet_view(urls[0])["members"]
        damaged = replicas[1]
        worker = damaged.sidecar.model_worker
        assert worker is not None
        with worker.model_lock, torch.no_grad():  # in place, outside any router version: a bad host
            worker.model.model.layers[1].mlp.gate.e_score_correction_bias[:6] += 10.0

        def restored() -> bool:
            alerts = layer1_alerts(damaged.url)
            return (
                any(alert["state"] == "resolved" for alert in alerts)
                and all(alert["state"] == "resolved" for alert in alerts)
                and serving(damaged.url) == healthy
            )

        assert drive(replicas, restored, timeout=300), layer1_alerts(damaged.url)
        assert wait_until(lambda: retune_notes(receiver), 30)
        notes = retune_notes(receiver)
        assert notes and all("no re-tune job" in note and "restored here" in note for note in notes), notes
        view = fleet_view(urls[0])
        assert view["jobs"] == [] and view["rollout"] is None, view
        assert {serving(u) for u in urls} == {healthy}

        # C's routing damaged before its router (the norm that feeds layer 1's gate): its router tensors still
        # read the fleet's version, its peers read healthy, so the version is applied to it again - and no job.
        assert wait_until(members_healthy, 120), fleet_view(urls[0])["members"]
        third = replicas[2]
        assert third.sidecar.model_worker is not None
        with third.sidecar.model_worker.model_lock, torch.no_grad():
            third.sidecar.model_worker.model.model.layers[1].post_attention_layernorm.weight.mul_(0.05)
        seen = len(notes)
        assert drive(replicas, lambda: len(retune_notes(receiver)) > seen, timeout=300), layer1_alerts(third.url)
        again = retune_notes(receiver)[seen:]
        assert all("applied again on this replica alone" in note and "read healthy" in note for note in again), again
        assert "replica-a" in again[0] or "replica-b" in again[0]
        versions = httpx.get(third.url + "/v1/retune/versions", timeout=30).json()
        assert versions["versions"][-1]["source"] == "fleet" and versions["versions"][-1]["routers"] == [LAYER1]
        view = fleet_view(urls[0])
        assert view["jobs"] == [] and view["rollout"] is None, view
        for u in urls:
            assert httpx.get(u + "/v1/retune/jobs", timeout=30).json()["jobs"] == []


def test_a_canary_job_waiting_for_its_lines_data_gives_way_to_a_line_that_has_it(
    tmp_path: Path, fleet_url: str
) -> None:
    # Customer-service traffic that repeats one prompt: its job waits for a second distinct text, holding the lease.
    checkpoint, rules = broken_fleet_parts(tmp_path)
    with running_receiver() as receiver, contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(
                fleet_replica(
                    name, tmp_path, fleet_url, checkpoint=checkpoint, rules=rules, oncall_url=receiver.url + "/hook"
                )
            )
            for name in NAMES[:2]
        ]
        urls = [replica.url for replica in replicas]
        chat_only = [CHAT_PROMPTS[0]]
        assert chat_only[0][0] == "customer_service"

        def waiting_canary() -> str | None:
            jobs = fleet_view(urls[0])["jobs"]
            if not jobs or jobs[0]["state"] != "running":
                return None
            canary = next(replica for replica in replicas if replica.name == jobs[0]["canary"])
            local = httpx.get(canary.url + "/v1/retune/jobs", timeout=30).json()["jobs"]
            return canary.name if local and local[0]["status"] == "waiting" else None

        assert drive(replicas, lambda: waiting_canary() is not None, timeout=300, prompts=chat_only), (
            fleet_view(urls[0]),
            [layer1_alerts(u) for u in urls],
        )
        first = fleet_view(urls[0])["jobs"][0]
        assert first["business_line"] == "customer_service", first
        assert drive(replicas, lambda: False, timeout=15, prompts=chat_only) is False  # it goes on waiting
        assert fleet_view(urls[0])["jobs"][0]["id"] == first["id"]

        # Code traffic with two distinct prompts: its alert asks for the same router, the waiting job gives way.
        assert drive(replicas, lambda: repaired(urls), timeout=400), (
            fleet_view(urls[0]),
            [layer1_alerts(u) for u in urls],
        )
        jobs = {job["id"]: job for job in fleet_view(urls[0])["jobs"]}
        gave_way = jobs[first["id"]]
        assert gave_way["state"] == "superseded" and gave_way["tried"] is False, gave_way
        assert "waited for data of business line customer_service" in gave_way["detail"]["error"], gave_way
        assert "business line code_assistant" in gave_way["detail"]["error"], gave_way
        done = [job for job in jobs.values() if job["state"] == "done"]
        assert [job["business_line"] for job in done] == ["code_assistant"], jobs
        canary = next(replica for replica in replicas if replica.name == first["canary"])
        local = {job["id"]: job for job in httpx.get(canary.url + "/v1/retune/jobs", timeout=30).json()["jobs"]}
        withdrawn = local[gave_way["detail"]["local_job"]]
        assert withdrawn["status"] == "superseded" and withdrawn["result"]["error"].startswith("superseded: fleet job")
        assert len({serving(u) for u in urls}) == 1


def _serve(port: int, state: Path, name: str, url: str, checkpoint: Path, rules: Path, log: Path, oncall: str) -> Any:
    return start_sidecar(
        port,
        state,
        "--model",
        str(checkpoint),
        "--rules",
        str(rules),
        "--capture",
        "--reference-model",
        str(BUNDLED),
        "--alert-interval",
        "0.5",
        "--retune-retry",
        "5",
        "--reference-interval",
        "30",
        "--fleet",
        url,
        "--fleet-name",
        name,
        "--fleet-poll",
        str(POLL_SECONDS),
        "--fleet-lease",
        str(LEASE_SECONDS),
        env={"MLA_WATCH_ONCALL_URL": oncall},
        log=log,
    )


def test_a_lease_holder_killed_mid_job_is_replaced_and_every_replica_ends_on_a_version_the_store_knows(
    tmp_path: Path, fleet_url: str
) -> None:
    checkpoint, rules = broken_fleet_parts(tmp_path)
    ports = {name: free_port() for name in NAMES}
    started: dict[str, Any] = {}
    with running_receiver() as receiver:
        try:
            for name in NAMES:
                started[name] = _serve(
                    ports[name],
                    tmp_path / name,
                    name,
                    fleet_url,
                    checkpoint,
                    rules,
                    tmp_path / f"{name}.log",
                    receiver.url + "/hook",
                )
            urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}

            def ready(url: str) -> bool:
                try:
                    return httpx.get(url + "/readyz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_until(lambda: all(ready(u) for u in urls.values()), 180)
            replicas = [Replica(name, urls[name], None) for name in NAMES]  # type: ignore[arg-type]

            holder: list[str] = []

            def leased() -> bool:
                lease = fleet_view(urls["replica-a"])["lease"]
                if lease["holder"] is not None:
                    holder.append(lease["holder"])
                    return True
                return False

            assert drive(replicas, leased, timeout=300, check_every=1), fleet_view(urls["replica-a"])
            killed = holder[0]
            state_then = fleet_view(urls[killed])["lease"]["job_record"]["state"]  # running (mid-job) or rolling
            started[killed].send_signal(signal.SIGKILL)
            started[killed].wait(timeout=30)
            survivors = [replica for replica in replicas if replica.name != killed]
            survivor_urls = [replica.url for replica in survivors]

            def done_without_it() -> bool:
                view = fleet_view(survivor_urls[0])
                return (
                    view["rollout"] is not None and view["rollout"]["state"] == "done" and all_resolved(survivor_urls)
                )

            # A lease expiry, a job and a rollout: minutes on a loaded machine.
            assert drive(survivors, done_without_it, timeout=600), fleet_view(survivor_urls[0])
            view = fleet_view(survivor_urls[0])
            jobs = {job["id"]: job for job in view["jobs"]}
            assert not [job for job in jobs.values() if job["state"] == "running"], jobs
            if state_then == "running":  # killed mid-job: its job was abandoned, another replica ran the next one
                assert [job["state"] for job in view["jobs"]].count("abandoned") == 1, jobs
                assert view["jobs"][0]["canary"] != killed
            else:  # killed mid-rollout: another member took the rollout over
                assert view["jobs"][0]["detail"].get("taken_over_from") == killed, jobs
            current = view["current"]

            # The killed replica starts again: it adopts the fleet's current version before it judges its routers.
            started[killed] = _serve(
                ports[killed],
                tmp_path / killed,
                killed,
                fleet_url,
                checkpoint,
                rules,
                tmp_path / f"{killed}-again.log",
                receiver.url + "/hook",
            )
            assert wait_until(lambda: ready(urls[killed]), 180)
            assert serving(urls[killed]) == (str(current["version"]), current["digest"])
            assert {serving(u) for u in urls.values()} == {(str(current["version"]), current["digest"])}
            known = {version["digest"] for version in fleet_view(urls[killed])["versions"]}
            assert all(member["digest"] in known for member in fleet_view(urls[killed])["members"])
            local_jobs = httpx.get(urls[killed] + "/v1/retune/jobs", timeout=30).json()["jobs"]
            assert all(job["status"] in ("failed", "promoted") for job in local_jobs), local_jobs
            assert not [
                job
                for job in local_jobs
                if job["status"] == "failed" and "the fleet decides again" not in (job["result"] or {}).get("error", "")
            ]
            for log in tmp_path.glob("*.log"):
                assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
        finally:
            for process in started.values():
                processes.stop(process, grace=10)
