"""Traffic or damage, end to end on the bundled model: a client flooding a healthy line pages no one for the model
and re-fits nothing; a router damaged in place pages on-call as a model change and is repaired.

The scenarios (harness/floods.py, shared with bench/traffic_or_damage.py): ``serve --capture`` in this process,
the shipped rules and reference prompts with every hold cut to 0 s (the receivers' group wait to 30 s), on-call and
the line owners on a real webhook receiver; healthy traffic of four lines until their baselines are learned, then
the flood or the damage.
"""

from __future__ import annotations

import pytest

from harness.floods import FLOOD_CLIENT, FLOODS, damage_scenario, flood_scenario

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flood", FLOODS, ids=[flood.name.replace(" ", "-") for flood in FLOODS])
def test_a_flood_of_one_client_is_traffic_pages_no_one_for_the_model_and_re_tunes_nothing(flood) -> None:
    outcome = flood_scenario(flood)
    firing = [alert for alert in outcome.alerts if alert["state"] == "firing"]
    # every flood moves code_assistant's routing enough to fire (bench/traffic_or_damage.py has the figures)
    assert [a for a in firing if a["labels"]["business_line"] == "code_assistant"], outcome.alerts
    assert all(alert["labels"].get("cause") == "traffic" for alert in firing), [
        (a["labels"]["alertname"], a["labels"].get("cause"), a["annotations"].get("cause")) for a in firing
    ]
    for alert in firing:  # the page's first words, the figures that decided it, the client who moved it
        assert alert["annotations"]["summary"].startswith("TRAFFIC CHANGED")
        assert "route as while healthy" in alert["annotations"]["cause"]
        assert alert["labels"]["severity"] == "warning"
        if alert["labels"]["business_line"] == "code_assistant":
            assert f"client {FLOOD_CLIENT} sent" in alert["annotations"]["cause"]
            assert alert["cause"]["details"]["clients"][0]["client"] == FLOOD_CLIENT
    assert outcome.oncall == []  # on-call's pager stayed silent
    assert all(alert["labels"].get("cause") == "traffic" for alert in outcome.owners)
    # One notification per incident: the line owners heard of the flood once, with every alert of it.
    told = [
        body for body in outcome.owner_notifications if body["groupLabels"].get("business_line") == "code_assistant"
    ]
    assert len(told) == 1, [(body["status"], len(body["alerts"])) for body in told]
    assert told[0]["groupLabels"] == {"business_line": "code_assistant", "cause": "traffic"}
    notified = {alert["fingerprint"] for alert in told[0]["alerts"]}
    code = [alert for alert in outcome.alerts if alert["labels"]["business_line"] == "code_assistant"]
    assert {a["fingerprint"] for a in code if a["state"] == "firing"} <= notified <= {a["fingerprint"] for a in code}
    assert len(notified) > 1  # rules and routers moved by one flood
    assert outcome.jobs == [] and outcome.versions == [0]  # no re-tune job, no router version written
    # the reference prompts' readings are series of their own, apart from live traffic
    assert {"reference:code_assistant", "code_assistant"} <= outcome.history_lines
    gauges = {entry["name"]: entry for entry in outcome.reference["sets"]}
    assert gauges["code_assistant"]["reading"]["prompts"] == 32 and gauges["code_assistant"]["baseline"] is not None


def test_a_router_damaged_in_place_pages_on_call_as_a_model_change_and_is_repaired() -> None:
    router = "model.layers.2.mlp.gate"
    outcome = damage_scenario(router, (0, 1, 2, 3, 4, 5), 10.0)
    pages = [
        alert for alert in outcome.oncall if alert["status"] == "firing" and alert["labels"].get("router") == router
    ]
    assert pages and all(page["labels"]["cause"] == "model" for page in pages), outcome.oncall
    assert pages[0]["annotations"]["summary"].startswith("MODEL CHANGED")
    assert "route differently now" in pages[0]["annotations"]["cause"]
    assert not [alert for alert in outcome.owners if alert["labels"].get("router") == router]
    promoted = [job for job in outcome.jobs if job["status"] == "promoted"]
    assert promoted, [(job["status"], (job["result"] or {}).get("error")) for job in outcome.jobs]
    (attempt,) = [a for a in promoted[0]["result"]["attempts"] if a.get("outcome") == "promoted"]
    gates = {check["gate"]: check["decision"] for check in attempt["gates"]["checks"]}
    assert gates["reference_band"] == gates["reference_drift"] == gates["reference_perplexity"] == "pass", gates
    still = [
        (alert["labels"]["alertname"], alert["labels"]["business_line"])
        for alert in outcome.alerts
        if alert["state"] == "firing" and alert["labels"].get("router") == router
    ]
    assert still == [], still  # resolved after the repair
