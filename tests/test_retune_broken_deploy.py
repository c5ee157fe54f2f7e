"""Issue 15's scenario end to end: a checkpoint deployed with a collapsed router, capture on, the
shipped rules, short repeated prompts - the loop closes by itself (see tests/broken_deploy.py)."""

from __future__ import annotations

import pytest
from broken_deploy import LAYER1, final_jobs, run_scenario

from mla_watch.retune.jobs import RetuneSettings

pytestmark = pytest.mark.slow


def test_a_model_deployed_with_a_collapsed_router_is_repaired_and_on_call_hears_once_of_each(tmp_path) -> None:
    settings = RetuneSettings(retry_seconds=5.0)  # the default gate: 2 %, 95 %, at least 400 held-out tokens
    outcome = run_scenario(tmp_path, reference=True, settings=settings, timeout=600)

    assert outcome.fired_after_s is not None and outcome.bits_before is not None and outcome.bits_before < 5.0
    assert outcome.resolved_after_s is not None, outcome  # every layer-1 alert resolved, within the bound
    assert outcome.bits_after is not None and outcome.bits_after >= 5.2
    # One page and one resolution per alert (one per business line), nothing repeated, nothing lost.
    assert outcome.pages and all(statuses == ["firing", "resolved"] for statuses in outcome.pages.values()), \
        outcome.pages
    assert {alertname for alertname, _ in outcome.pages} == {"RoutingEntropyLow"}

    jobs = final_jobs(outcome)
    promoted = [job for job in jobs if job["status"] == "promoted"]
    assert len(promoted) == 1, [(job["status"], job["result"].get("error")) for job in jobs]
    assert {job["status"] for job in jobs} <= {"promoted", "superseded"}
    assert LAYER1 in promoted[0]["spec"]["routers"]
    attempt = promoted[0]["result"]["attempts"][-1]
    assert attempt["strategy"] in ("bias", "restore") and attempt["gates"]["decision"] == "pass"
    paired = attempt["gates"]["perplexity"]
    assert paired["decision"] == "pass" and paired["tokens"] >= settings.min_held_out_tokens
    assert paired["high"] <= paired["limit"]
    for job in outcome.jobs:  # no decision against a candidate rests on fewer tokens than the minimum
        for tried in (job["result"] or {}).get("attempts", []):
            if tried.get("outcome") == "rejected":
                assert tried["gates"]["perplexity"]["tokens"] >= settings.min_held_out_tokens
