"""Issue 15's scenario end to end: a checkpoint deployed with a collapsed router, capture on, the
shipped rules, short repeated prompts - the loop closes by itself (see harness/broken_deploy.py)."""

from __future__ import annotations

import pytest

from harness.broken_deploy import BUNDLED, CHAT_PROMPTS, LAYER1, final_jobs, run_scenario
from mla_watch.retune.jobs import RetuneSettings

pytestmark = pytest.mark.slow


def test_a_model_deployed_with_a_collapsed_router_is_repaired_and_on_call_hears_once_of_each(tmp_path) -> None:
    settings = RetuneSettings(retry_seconds=5.0)  # the default gate: 2 %, 95 %, at least 400 held-out tokens
    outcome = run_scenario(tmp_path, reference=True, settings=settings, timeout=600)

    assert outcome.fired_after_s is not None and outcome.bits_before is not None and outcome.bits_before < 5.0
    assert outcome.resolved_after_s is not None, outcome  # every layer-1 alert resolved, within the bound
    assert outcome.bits_after is not None and outcome.bits_after >= 5.2
    # One page and one resolution per alert (one per business line), nothing repeated, nothing lost.
    assert outcome.pages and all(statuses == ["firing", "resolved"] for statuses in outcome.pages.values()), (
        outcome.pages
    )
    assert {alertname for alertname, _ in outcome.pages} == {"RoutingEntropyLow"}

    jobs = final_jobs(outcome)
    promoted = [job for job in jobs if job["status"] == "promoted"]
    assert len(promoted) == 1, [(job["status"], job["result"].get("error")) for job in jobs]
    assert {job["status"] for job in jobs} <= {"promoted", "superseded"}
    assert LAYER1 in promoted[0]["spec"]["routers"]
    attempt = promoted[0]["result"]["attempts"][-1]
    assert attempt["strategy"] in ("bias", "restore") and attempt["gates"]["decision"] == "pass"
    checks = {check["gate"]: check for check in attempt["gates"]["checks"]}
    paired = attempt["gates"]["perplexity"]
    if checks["perplexity"].get("binding", True):  # decided on enough distinct held-out texts
        assert paired["decision"] == "pass" and paired["tokens"] >= settings.min_held_out_tokens
        assert paired["samples"] >= settings.min_held_out_samples and paired["high"] <= paired["limit"]
    else:  # a known-good restore while the live router is broken: the reference's own health decided
        assert attempt["strategy"] == "restore" and checks["reference_health"]["decision"] == "pass"
    for job in outcome.jobs:  # no decision against a candidate rests on fewer tokens than the minimum
        for tried in (job["result"] or {}).get("attempts", []):
            if tried.get("outcome") == "rejected":
                assert tried["gates"]["perplexity"]["tokens"] >= settings.min_held_out_tokens


def test_four_short_chat_prompts_repeated_close_the_loop_in_five_runs_of_five(tmp_path) -> None:
    """Four distinct texts are too few for a perplexity verdict either way: bias waits for more, and the restore
    of the reference is judged by the reference's own health on the health text and the band gate."""
    settings = RetuneSettings(retry_seconds=5.0)
    for run in range(5):
        outcome = run_scenario(
            tmp_path / f"run{run}", reference=True, settings=settings, timeout=300, chat=True, seed=run
        )
        jobs = final_jobs(outcome)
        assert outcome.resolved_after_s is not None, (run, [(job["status"], job["result"]) for job in jobs])
        assert outcome.bits_after is not None and outcome.bits_after >= 5.2
        assert outcome.pages and all(statuses == ["firing", "resolved"] for statuses in outcome.pages.values())
        assert {job["status"] for job in jobs} <= {"promoted", "superseded"}
        (promoted,) = [job for job in jobs if job["status"] == "promoted"]
        line = promoted["spec"]["business_line"]
        assert promoted["result"]["data"]["distinct_samples"] == sum(1 for kind in CHAT_PROMPTS if kind[0] == line)
        *others, restored = promoted["result"]["attempts"]
        assert restored["strategy"] == "restore" and restored["outcome"] == "promoted"
        assert all(attempt["outcome"] == "insufficient" for attempt in others)  # never "rejected" on four texts
        checks = {check["gate"]: check for check in restored["gates"]["checks"]}
        assert checks["reference_health"]["decision"] == "pass"
        assert checks["reference_health"]["value"] == f"reference model {BUNDLED}"
        assert checks["band"]["decision"] == "pass"  # on the held-out text, or on the health text when too short
        paired = checks["perplexity"]
        assert paired["decision"] == "insufficient" and paired["binding"] is False
        assert restored["gates"]["perplexity"]["samples"] == 1  # the held-out text, once
