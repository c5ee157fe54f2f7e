"""The status page's pure functions (``static/status.js``), run under Node.js on tiny inputs.

The browser test shows the page working end to end; these pin down the parts it cannot see
exactly: how an incremental reply is merged into what the page holds, how a value is placed
against its band, and for the metric selector: what an alert link's anchor selects (and that the
page writes the anchor the alert engine does), a row's state (its alerts first, then no signal,
then its value), values and "healthy" baselines per metric, and what the page says when a metric
has no history.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from harness import processes
from mla_watch.server.status import static_file

BAND = {"fire_below": 5.0, "resolve_above": 5.2, "fire_above": 6.5, "resolve_below": 6.3}


def run_js(expression: str, **inputs: object) -> object:
    """Evaluate ``expression`` with status.js's exports in scope as ``page`` and ``inputs`` as globals."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("no node: the machine's Node.js runs the status page's script in these tests")
    script = static_file("status.js")[0].decode()
    program = (
        f"const module = {{ exports: {{}} }};\n{script}\nconst page = module.exports;\n"
        + "".join(f"const {name} = {json.dumps(value)};\n" for name, value in inputs.items())
        + f"process.stdout.write(JSON.stringify({expression}));\n"
    )
    run = processes.run([node, "-e", program], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def series(router: str, line: str, values: list, band: dict | None = None) -> dict:
    return {
        "router": router,
        "layer": 1,
        "kind": "expert",
        "business_line": line,
        "floor_bits": 2.585,
        "ceiling_bits": 6.0,
        "band": band or BAND,
        "values": values,
        "too_small": [False] * len(values),
    }


def test_a_value_is_placed_against_its_band() -> None:
    values = [None, 4.2, 5.0, 5.1, 5.2, 6.0, 6.4, 6.6]
    states = run_js("values.map((v) => page.stateOf(v, band))", values=values, band=BAND)
    assert states == ["none", "fire", "warn", "warn", "ok", "ok", "warn", "high"]
    no_rules = {key: None for key in BAND}
    assert run_js("[page.stateOf(3.0, band), page.stateOf(null, band)]", band=no_rules) == ["ok", "none"]


def test_colours_darken_towards_the_edge_of_the_band() -> None:
    colours = run_js("[2.6, 4.9, 5.3, 5.99].map((v) => page.colourOf(v, s))", s=series("g", "code", []))
    rgb = [tuple(int(c) for c in colour[4:-1].split(",")) for colour in colours]  # "rgb(r,g,b)"
    deep_red, shallow_red, low_green, high_green = rgb
    assert deep_red[0] < shallow_red[0] and all(c[0] > c[1] for c in (deep_red, shallow_red))
    assert low_green[1] < high_green[1] and all(c[1] > c[0] for c in (low_green, high_green))


def test_an_incremental_reply_is_appended_aligned_and_old_points_dropped() -> None:
    old = {
        "times": [100, 110, 120],
        "span_seconds": 30,
        "interval_seconds": 10,
        "series": [series("a", "code", [5.9, 5.8, None]), series("b", "code", [5.7, None, None])],
    }
    fresh = {
        "times": [130, 140],
        "span_seconds": 30,
        "interval_seconds": 10,
        "series": [series("a", "code", [4.1, 4.0], band={**BAND, "fire_below": 4.5}), series("c", "sql", [5.5, None])],
    }
    merged = run_js("page.mergeHistory(old, fresh)", old=old, fresh=fresh)
    assert merged["times"] == [110, 120, 130, 140]  # 100 is older than 140 - 30
    by_router = {s["router"]: s for s in merged["series"]}
    assert by_router["a"]["values"] == [5.8, None, 4.1, 4.0]
    assert by_router["a"]["band"]["fire_below"] == 4.5  # the newest band (rules may have been reloaded)
    assert by_router["c"]["values"] == [None, None, 5.5, None]  # new: padded to the shown times
    assert "b" not in by_router  # its only value left the span
    assert all(len(s["too_small"]) == len(s["values"]) == 4 for s in merged["series"])
    first = run_js("page.mergeHistory(null, fresh)", fresh=fresh)
    assert first == fresh  # the first reply is taken as it is


def test_only_http_links_from_annotations_become_links() -> None:
    urls = [
        "https://runbooks.example/a#b",
        " http://wiki/x ",
        "javascript:alert(1)",
        "JAVASCRIPT:x",
        "data:text/html,<b>",
        "/relative",
        None,
        42,
    ]
    assert run_js("urls.map(page.safeHref)", urls=urls) == [
        "https://runbooks.example/a#b",
        "http://wiki/x",
        None,
        None,
        None,
        None,
        None,
        None,
    ]


def test_a_history_range_asks_for_at_most_720_columns_never_finer_than_the_samples() -> None:
    urls = run_js(
        "[page.historyUrl(86400, 1800000000.5, 10), page.historyUrl(2592000, 1800000000, 10),"
        " page.historyUrl(86400, 1800000000, 300)]"
    )
    assert urls == [
        "v1/history?since=1799913600&until=1800000000&step=120",
        "v1/history?since=1797408000&until=1800000000&step=3600",
        "v1/history?since=1799913600&until=1800000000&step=300",
    ]


# ---------------------------------------------------------------- the metric a row shows, and why it fired

ALERT = {
    "rule": "ExpertHotspot",
    "metric": "max_violation",
    "state": "firing",
    "value": 9.67,
    "labels": {
        "alertname": "ExpertHotspot",
        "severity": "warning",
        "router": "model.layers.2.mlp.gate",
        "layer": "2",
        "kind": "expert",
        "business_line": "code assistant/eu",
    },
}


def test_the_anchor_selects_router_line_metric_and_alert_and_old_links_show_entropy() -> None:
    hashes = [
        "#router=model.layers.2.mlp.gate&layer=2&business_line=code&metric=max_violation&alertname=Hot",
        "#router=model.layers.1.mlp.gate&layer=1&business_line=code",  # an alert link of before
        "#metric=dead_slots",
        "#router=g&metric=rm%20-rf",
        "#router=g&metric=bits_below_ceiling",
        "",
        "#",
    ]
    anchors = run_js("hashes.map(page.parseAnchor)", hashes=hashes)
    assert anchors[0] == {
        "focus": {"router": "model.layers.2.mlp.gate", "layer": "2", "alertname": "Hot"},
        "line": "code",
        "metric": "max_violation",
    }
    assert anchors[1] == {
        "focus": {"router": "model.layers.1.mlp.gate", "layer": "1", "alertname": None},
        "line": "code",
        "metric": "entropy_bits",
    }
    assert anchors[2] == {"focus": None, "line": None, "metric": "dead_slots"}
    assert [a["metric"] for a in anchors[3:]] == ["entropy_bits"] * 4  # unknown, or entropy in other units
    assert anchors[5] == anchors[6] == {"focus": None, "line": None, "metric": "entropy_bits"}


def test_an_alerts_show_link_is_the_anchor_the_alert_engine_writes() -> None:
    from urllib.parse import urlencode

    labels = ALERT["labels"]
    engine = "#" + urlencode(
        {
            "router": labels["router"],
            "layer": labels["layer"],
            "business_line": labels["business_line"],
            "metric": "max_violation",
            "alertname": labels["alertname"],
        }
    )
    assert run_js("page.anchorOf(alert)", alert=ALERT) == engine
    # An alert from a sidecar that does not name the metric: the metric is left empty (the page shows entropy).
    older = {**ALERT, "metric": None}
    assert "&metric=&alertname=ExpertHotspot" in run_js("page.anchorOf(alert)", alert=older)
    assert run_js(
        "[page.alertMetric(a), page.alertMetric(b), page.alertMetric(c)]",
        a=ALERT,
        b=older,
        c={**older, "labels": {**labels, "metric": "dead_slots"}},
    ) == ["max_violation", None, "dead_slots"]


def test_a_row_takes_the_worst_state_of_the_alerts_on_its_router_and_line() -> None:
    router, line = ALERT["labels"]["router"], ALERT["labels"]["business_line"]
    pending = {**ALERT, "state": "pending", "labels": {**ALERT["labels"], "alertname": "DeadExperts"}}
    resolved = {**ALERT, "state": "resolved"}
    elsewhere = {**ALERT, "labels": {**ALERT["labels"], "business_line": "sql"}}
    summed = {**ALERT, "labels": {k: v for k, v in ALERT["labels"].items() if k != "business_line"}}
    result = run_js(
        "[page.alertsOn([pending, alert, resolved, elsewhere], router, line),"
        " page.alertsOn([pending, resolved], router, line),"
        " page.alertsOn([resolved, elsewhere], router, line),"
        " page.alertsOn([summed], router, 'all'), page.alertsOn(null, router, line)]",
        alert=ALERT,
        pending=pending,
        resolved=resolved,
        elsewhere=elsewhere,
        summed=summed,
        router=router,
        line=line,
    )
    assert [r["state"] for r in result] == ["fire", "warn", None, "fire", None]
    assert [a["labels"]["alertname"] for a in result[0]["alerts"]] == ["DeadExperts", "ExpertHotspot"]


def test_the_state_of_a_row_alert_first_then_no_signal_then_the_value() -> None:
    record = {"no_signal": None}
    quiet = {"no_signal": "no query saw more than index_topk = 64 keys: the indexer selected every key"}
    cases = [
        {"metric": "max_violation", "value": 0.4, "band": BAND, "record": record, "alertState": "fire"},  # alert wins
        {"metric": "entropy_bits", "value": 5.9, "band": BAND, "record": record, "alertState": "warn"},
        {"metric": "entropy_bits", "value": 5.02, "band": BAND, "record": quiet, "alertState": "fire"},
        {"metric": "entropy_bits", "value": 5.02, "band": BAND, "record": quiet, "alertState": None},  # greyed
        {"metric": "max_violation", "value": 9.7, "band": BAND, "record": record, "alertState": None},  # no thresholds
        {"metric": "js_divergence", "value": None, "band": BAND, "record": record, "alertState": None},
        {"metric": "entropy_bits", "value": 4.2, "band": BAND, "record": record, "alertState": None},
        {"metric": "entropy_bits", "value": 5.9, "band": BAND, "record": None, "alertState": None},
        # normalized entropy against the entropy band, converted: floor 2.585, ceiling 6.0 (5.0 bits = 0.7072)
        {
            "metric": "normalized_entropy",
            "value": 0.70,
            "band": BAND,
            "floor": 2.585,
            "ceiling": 6.0,
            "record": record,
            "alertState": None,
        },
        {
            "metric": "normalized_entropy",
            "value": 0.9,
            "band": BAND,
            "floor": 2.585,
            "ceiling": 6.0,
            "record": record,
            "alertState": None,
        },
    ]
    assert run_js("cases.map(page.rowState)", cases=cases) == [
        "fire",
        "warn",
        "fire",
        "nosignal",
        "ok",
        "none",
        "fire",
        "ok",
        "fire",
        "ok",
    ]
    band = run_js("page.normalizedBand(band, 2.585, 6.0)", band=BAND)
    assert band == {"fire_below": 0.7072, "resolve_above": 0.7657, "fire_above": 1.1464, "resolve_below": 1.0878}
    assert set(run_js("page.normalizedBand(band, null, 6.0)", band=BAND).values()) == {None}


def test_values_are_read_and_written_per_metric_and_a_baseline_says_healthy() -> None:
    record = {
        "entropy_bits": 5.93123,
        "normalized_entropy": 0.98123,
        "max_violation": 9.6667,
        "dead_slots": 4,
        "js_divergence": None,
        "locality": None,
    }
    metrics = ["entropy_bits", "normalized_entropy", "max_violation", "dead_slots", "js_divergence", "locality"]
    assert run_js(
        "metrics.map((m) => page.formatMetric(page.metricValue(record, m), m))", record=record, metrics=metrics
    ) == ["5.93", "0.981", "9.67", "4", "–", "–"]
    assert run_js("page.metricValue(null, 'dead_slots')") is None
    baseline = {
        "max_violation": 0.61,
        "dead_slots": 0,
        "entropy_bits": 5.93,
        "normalized_entropy": 0.98,
        "tokens": 4096,
        "taken_at": 1764662400.0,
    }
    texts = run_js(
        "[page.healthyText({...record, baseline}, 'max_violation'), page.healthyText({...record, baseline},"
        " 'dead_slots'), page.healthyText({...record, baseline}, 'locality'),"
        " page.healthyText({...record, baseline: null}, 'max_violation'),"
        " page.healthyText(record, 'max_violation'), page.healthyText(null, 'max_violation')]",
        record=record,
        baseline=baseline,
    )
    assert texts == ["healthy 0.61", "healthy 0", None, None, None, None]
    assert [m[0] for m in run_js("page.METRICS")] == metrics


def test_a_metric_without_thresholds_is_drawn_on_a_ramp_brighter_when_higher() -> None:
    s = series("g", "code", [])
    colours = run_js("[0, 0.5, 1, 3, 9].map((v) => page.metricColour(v, 'max_violation', s))", s=s)
    brightness = [sum(int(c) for c in colour[4:-1].split(",")) for colour in colours]
    assert brightness == sorted(brightness) and len(set(brightness)) == 5
    assert run_js(
        "[page.rampPosition(16, 'dead_slots', 64), page.rampPosition(1, 'max_violation', 64),"
        " page.rampPosition(2, 'locality', 0)]"
    ) == [1, 0.5, 1]
    # Entropy keeps the band's colours.
    assert run_js("page.metricColour(4.0, 'entropy_bits', s) === page.colourOf(4.0, s)", s=s) is True


def test_other_metrics_ask_the_durable_history_by_name_and_the_routing_of_the_shown_line() -> None:
    urls = run_js(
        "[page.historyUrl(300, 1800000000, 10, 'code', 'max_violation'),"
        " page.historyUrl(300, 1800000000, 10, 'code', 'entropy_bits'), page.routingUrl('all'),"
        " page.routingUrl(null), page.routingUrl('code assistant')]"
    )
    assert urls == [
        "v1/history?since=1799999700&until=1800000000&step=10&business_line=code&metric=max_violation",
        "v1/history?since=1799999700&until=1800000000&step=10&business_line=code",
        "v1/routing",
        "v1/routing",
        "v1/routing?business_line=code%20assistant",
    ]


def test_the_page_says_when_a_metric_has_no_history() -> None:
    rows = [
        {"layer": 1, "kind": "expert", "series": {"values": [0.5, 0.7]}},
        {"layer": 1, "kind": "indexer", "series": None},
        {"layer": 2, "kind": "indexer", "series": {"values": [None, None]}},
    ]
    notes = run_js(
        """[
        page.historyNote({ metric: "max_violation", durable: true, held: false, store: false, error: null, rows }),
        page.historyNote({ metric: "max_violation", durable: true, held: false, store: true, error: null, rows }),
        page.historyNote({ metric: "locality", durable: true, held: false, store: true, error: "HTTP 429", rows }),
        page.historyNote({ metric: "locality", durable: true, held: true, store: true, error: null, rows }),
        page.historyNote({ metric: "dead_slots", durable: true, held: true, store: true, error: null, rows: one }),
        page.historyNote({ metric: "entropy_bits", durable: false, held: false, store: false, error: null, rows: one }),
        page.historyNote({ metric: "entropy_bits", durable: true, held: false, store: false, error: null, rows }),
    ]""",
        rows=rows,
        one=rows[:1],
    )
    assert notes[0].startswith(
        "No history of MaxVio here: the live hour holds entropy only and the durable history is off"
    ) and notes[0].endswith("the rows show its value now.")
    assert notes[1] == "Loading the history of MaxVio…"
    assert notes[2] == "The history of locality did not load (HTTP 429); the rows show its value now."
    assert notes[3] == (
        "locality (durable history): no history for 2 of 3 routers (layer 1 indexer, layer 2 indexer):"
        " no value in this span."
    )
    assert notes[4] == "dead slots: value now, and its history (durable history)."
    assert notes[5] == ""  # entropy from the live hour: nothing to say
    assert notes[6].startswith("No history of entropy here") and notes[6].endswith("the live hour is drawn instead.")


def test_an_alerts_cause_is_shown_as_the_engine_labels_it_and_a_pending_one_is_still_being_read() -> None:
    alerts = [
        {**ALERT, "labels": {**ALERT["labels"], "cause": cause}} for cause in ("model", "traffic", "undetermined")
    ]
    pending = {**ALERT, "state": "pending"}
    assert run_js("[...alerts, pending, old].map(page.causeText)", alerts=alerts, pending=pending, old=ALERT) == [
        "model",
        "traffic",
        "undetermined",
        "reading…",
        "–",
    ]
    # With the time the engine gives (its `for` plus the wait for the reading): when the reading is due.
    due = run_js("page.causeText(a)", a={**pending, "cause_due_at": 1796187257.5})
    assert re.fullmatch(r"reading… due by \d\d:\d\d:\d\d", str(due)), due


# ---------------------------------------------------------------- routing by position


def bucket(label: str, tokens: int, js: float | None, judged: bool, entropy: float = 5.5) -> dict:
    return {
        "bucket": label,
        "start": 0,
        "end": None,
        "tokens": tokens,
        "entropy_bits": entropy,
        "js_divergence": js,
        "judged": judged,
        "in_range": judged and (js is None or js <= 0.025),
    }


LABELS = ["0-63", "64-127", "128-255", "256-511", "512+"]


def positions(drift_bits: float = 0.025) -> dict:
    """A positions document as PositionCounts.as_dict writes it: three expert routers, given out of layer order."""
    departing = [
        bucket("0-63", 4096, None, False, 5.81),
        bucket("64-127", 2048, None, True),  # seeds in-range
        bucket("128-255", 3000, 0.0104, True),
        bucket("256-511", 2800, 0.04321, True, 5.123),
        bucket("512+", 900, 0.061, True),
    ]
    # Noise past the threshold in a bucket under its minimum is no edge; an empty bucket has nothing to show.
    staying = [
        bucket("0-63", 4096, None, False),
        bucket("64-127", 2048, None, True),
        bucket("128-255", 40, 0.31, False),
        bucket("256-511", 0, None, False),
        bucket("512+", 700, 0.02, True),
    ]
    unjudged = [bucket(label, 8, None if index < 2 else 0.2, False) for index, label in enumerate(LABELS)]
    return {
        "business_line": "code",
        "context_length": 512,
        "buckets": LABELS,
        "drift_bits": drift_bits,
        "min_tokens": 512,
        "routers": [
            {"name": "model.layers.2.mlp.gate", "layer": 2, "buckets": departing},
            {"name": "model.layers.1.mlp.gate", "layer": 1, "buckets": staying},
            {"name": "model.layers.3.mlp.gate", "layer": 3, "buckets": unjudged},
        ],
    }


def test_the_position_strip_marks_the_first_judged_bucket_past_the_documents_drift_bits() -> None:
    strips = run_js("page.positionStrips(doc)", doc=positions())
    assert [(s["router"], s["layer"]) for s in strips] == [
        ("model.layers.1.mlp.gate", 1),
        ("model.layers.2.mlp.gate", 2),
        ("model.layers.3.mlp.gate", 3),
    ]
    staying, departing, unjudged = strips
    assert [[c["bucket"] for c in s["cells"]] for s in strips] == [LABELS] * 3  # one cell per bucket, in order
    # The first bucket past 0.025 bits is the edge; the one after it, further still, is not marked again.
    assert departing["edge"] == "256-511" and departing["text"] == "leaves in-range routing at 256-511"
    assert [c["edge"] for c in departing["cells"]] == [False, False, False, True, False]
    assert [c["state"] for c in departing["cells"]] == ["none", "none", "ok", "fire", "fire"]
    assert staying["edge"] is None and staying["text"] == "in range where judged (within 0.025 bits)"
    # 40 tokens past the threshold: too few to judge, so greyed, never red beside "in range where judged"
    assert [c["state"] for c in staying["cells"]] == ["none", "none", "unjudged", "none", "ok"]
    assert all(c["state"] in ("none", "unjudged") for c in unjudged["cells"])
    assert [c["judged"] for c in staying["cells"]] == [False, True, False, False, True]
    assert unjudged["edge"] is None and unjudged["text"] == "too few tokens to judge (a bucket needs 512)"
    # The threshold is the document's: at 0.05 bits the edge is the bucket past 0.05.
    assert [s["edge"] for s in run_js("page.positionStrips(doc)", doc=positions(0.05))] == [None, "512+", None]
    assert run_js(
        "[page.firstDeparture(b, 0.025), page.firstDeparture([], 0.025), page.firstDeparture(null, 1)]",
        b=positions()["routers"][0]["buckets"],
    ) == [3, -1, -1]


def test_a_position_cell_is_coloured_by_its_drift_and_titled_with_its_numbers() -> None:
    (_, departing, _) = run_js("page.positionStrips(doc)", doc=positions())
    cells = departing["cells"]
    assert cells[3]["title"] == (
        "256-511: 2800 tokens · entropy 5.12 bits · JS 0.0432 bits from in-range routing\n"
        "past 0.025 bits: leaves in-range routing here"
    )
    assert cells[0]["title"] == (
        "0-63: 4096 tokens · entropy 5.81 bits · JS – bits from in-range routing\n"
        "the prompts' openings: shown, not judged"
    )
    assert cells[2]["tokens"] == 3000 and cells[2]["js"] == 0.0104 and cells[2]["entropy_bits"] == 5.5
    # Neutral without a divergence or tokens; green within the threshold (brighter nearer 0), red past it (darker
    # further).
    neutral = run_js("page.positionCell(b, 1, 0.025, 512, false).colour", b=bucket("64-127", 0, 0.01, False))
    assert neutral == cells[0]["colour"] == cells[1]["colour"]
    rgb = [
        tuple(
            int(v)
            for v in run_js("page.positionCell(b, 2, 0.025, 512, false).colour", b=bucket("128-255", 1000, js, True))[
                4:-1
            ].split(",")
        )
        for js in (0.001, 0.02, 0.03, 0.09)
    ]
    near, far, past, deep = rgb
    assert near[1] > far[1] and all(c[1] > c[0] for c in (near, far))
    assert past[0] > deep[0] and all(c[0] > 2 * c[1] for c in (past, deep))
    under = run_js("page.positionCell(b, 2, 0.025, 512, false)", b=bucket("128-255", 40, 0.31, False))
    assert under["title"].endswith("\nnot judged: fewer than 512 tokens") and under["judged"] is False


def test_the_position_section_says_why_it_draws_no_strip() -> None:
    notes = run_js(
        "[page.positionsNote(null), page.positionsNote({ missing: true, positions: null }),"
        " page.positionsNote({ missing: false, positions: null }),"
        " page.positionsNote({ missing: false, positions: { routers: [] } }),"
        " page.positionsNote({ missing: false, positions: doc })]",
        doc=positions(),
    )
    assert notes[0] == "Loading the routing by position…"
    assert notes[1] == "No routing counts for this business line yet."
    assert notes[2].startswith("No routing by position here: counting by position is off")
    assert "SGLang" in notes[2] and "\n" not in notes[2]
    assert notes[3] == "No expert router is counted by position."
    assert notes[4] is None


def alert(alertname: str, router: str, state: str, since: float, incident: dict | None, **labels: str) -> dict:
    return {
        "rule": alertname,
        "metric": "max_violation",
        "state": state,
        "value": 2.0,
        "active_since": since - 1,
        "firing_since": since if state == "firing" else None,
        "resolved_at": since if state == "resolved" else None,
        "labels": {
            "alertname": alertname,
            "router": router,
            "layer": router.split(".")[2],
            "business_line": "code_assistant",
            "severity": "warning",
            **labels,
        },
        "annotations": {},
        "fingerprint": f"{alertname}-{router}",
        "incident": incident,
    }


def test_alerts_become_one_incident_per_notification_group_worst_state_first() -> None:
    flood = {
        "receiver": "line_owners",
        "key": '{}:{business_line="code_assistant", cause="traffic"}',
        "labels": {"business_line": "code_assistant", "cause": "traffic"},
        "notified_at": 1000.0,
    }
    page = {
        "receiver": "oncall",
        "key": '{}:{alertname="RoutingEntropyLow", router="g"}',
        "labels": {"alertname": "RoutingEntropyLow"},
        "notified_at": None,
    }
    alerts = [
        alert("ExpertHotspot", "model.layers.1.mlp.gate", "firing", 900, flood, cause="traffic"),
        alert("LongContextDrift", "model.layers.1.mlp.gate", "resolved", 990, flood, cause="traffic"),
        alert("ExpertHotspot", "model.layers.2.mlp.gate", "firing", 950, flood, cause="traffic"),
        alert("RoutingEntropyLow", "model.layers.3.mlp.gate", "pending", 980, page, severity="critical"),
        alert("DeadExperts", "model.layers.3.mlp.gate", "firing", 800, None, cause="model"),
    ]
    incidents = run_js(
        "page.incidentsOf(alerts).map((i) => ({ ...i, names: page.incidentNames(i),"
        " alerts: i.alerts.map((a) => a.fingerprint) }))",
        alerts=alerts,
    )
    assert [i["key"] for i in incidents] == [
        f"line_owners|{flood['key']}",
        "alert|DeadExperts-model.layers.3.mlp.gate",
        f"oncall|{page['key']}",
    ]  # firing (newest first), then pending
    flooded, alone, pending = incidents
    assert flooded["alerts"] == [
        "ExpertHotspot-model.layers.2.mlp.gate",
        "ExpertHotspot-model.layers.1.mlp.gate",
        "LongContextDrift-model.layers.1.mlp.gate",
    ]  # firing newest first, then resolved
    assert (flooded["state"], flooded["cause"], flooded["severity"], flooded["since"], flooded["notified_at"]) == (
        "firing",
        "traffic",
        "warning",
        900,
        1000.0,
    )
    assert flooded["names"] == "ExpertHotspot ×2, LongContextDrift" and flooded["receiver"] == "line_owners"
    assert (alone["receiver"], alone["cause"], len(alone["alerts"])) == (None, "model", 1)
    assert (pending["state"], pending["cause"], pending["severity"]) == ("pending", "", "critical")
    mixed = run_js(
        "page.incidentsOf(alerts)[0].cause",
        alerts=[
            alert("A", "model.layers.1.mlp.gate", "firing", 1, flood, cause="traffic"),
            alert("B", "model.layers.2.mlp.gate", "firing", 2, flood, cause="model"),
        ],
    )
    assert mixed == "mixed" and run_js("page.incidentsOf([])") == []


def test_a_baseline_says_whose_traffic_it_was_and_the_line_what_is_not_learned() -> None:
    mix = {
        "tokens": 4096,
        "count": 4,
        "keys_seen": 0,
        "clients": [{"client": "app-1", "share": 0.31}, {"client": "app-2", "share": 0.3}],
    }
    assert run_js(
        "[page.baselineClients({clients: m}), page.baselineClients({clients: null}), page.baselineClients(null)]", m=mix
    ) == ["4 clients, largest app-1 31%", None, None]
    waiting = {
        "business_line": "code_assistant",
        "routers": ["g1", "g2", "g3"],
        "clients": mix,
        "reason": "client flood-1 sent 100% of the line's tokens (4096 in the window): a baseline takes at "
        "most 50% from one client",
    }
    found = [
        {
            "router": router,
            "business_line": "sql",
            "reason": "reference",
            "found_at": 0,
            "why": "the reference prompts of sql sit 0.6 bits from it",
        }
        for router in ("g1", "g2")
    ]
    summary = {"learning": True, "not_learning": "...", "waiting": [waiting], "unrepresentative": found}
    notes = run_js("['code_assistant', 'sql', 'all', 'doc'].map((line) => page.baselineNotes(s, line))", s=summary)
    refused = (
        "No healthy baseline for code_assistant (3 routers): client flood-1 sent 100% of the line's tokens "
        "(4096 in the window): a baseline takes at most 50% from one client."
    )
    relearned = (
        "2 healthy baselines of sql found not to be the line's traffic at –, and learned again: the "
        "reference prompts of sql sit 0.6 bits from it."
    )  # found_at 0: no time to show
    assert notes == [[refused], [relearned], [refused, relearned], []]
    untrusted = {
        "learning": False,
        "not_learning": "router version 0 is not known to be good",
        "waiting": [],
        "unrepresentative": [],
    }
    assert run_js("page.baselineNotes(s, 'sql')", s=untrusted) == [
        "No healthy baselines are learned: router version 0 is not known to be good"
    ]
    assert run_js("page.baselineNotes(null, 'sql')") == []


def test_a_lines_clients_are_named_by_their_share_the_largest_first() -> None:
    shares = {
        "tokens": 1000,
        "clients": [
            {"client": f"app-{i}", "share": share, "long_run_share": share}
            for i, share in enumerate((0.5, 0.2, 0.1, 0.1, 0.05, 0.05), 1)
        ],
    }
    texts = run_js(
        "[page.clientsText(s), page.clientsText(few), page.clientsText({ tokens: 0, clients: [] }), "
        "page.clientsText(undefined)]",
        s=shares,
        few={**shares, "clients": shares["clients"][:2]},
    )
    assert texts == [
        "clients: app-1 50% · app-2 20% · app-3 10% · app-4 10% · 2 more",
        "clients: app-1 50% · app-2 20%",
        "clients: none counted here for this line",
        "clients: none counted here for this line",
    ]
