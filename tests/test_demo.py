"""`mla-watch demo` runs the whole loop on the bundled model and says when a step did not happen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import processes
from harness.support import free_port

pytestmark = pytest.mark.slow


COLUMNS = 72  # the terminal width the summary wraps to (stdout is a pipe: COLUMNS says it)


def demo(out, *extra: str) -> subprocess.CompletedProcess:
    """The demo with stdout piped: a live view asked for (the default) is left out, not its lines."""
    return processes.run(
        [sys.executable, "-m", "mla_watch.cli", "demo", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "COLUMNS": str(COLUMNS)},
    )


def test_the_demo_closes_the_loop_and_draws_it(tmp_path) -> None:
    port = free_port()
    # piped: every event line is there, without the live view's redraws; on-call's receiver on the port asked for
    run = demo(tmp_path, "--port", str(port), "--receiver-port", str(free_port()))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and all(summary["steps"].values())
    events = summary["events_seconds"]
    assert events["fault injected"] < events["on-call paged"] < events["re-tune promoted"] <= events["alert resolved"]
    assert summary["job"]["status"] == "promoted" and summary["job"]["strategy"] == "bias"
    bits = summary["entropy_bits"]
    assert bits["healthy"] > 5.2 and bits["at the page"] < 5.0 and bits["after"] >= 5.2
    assert summary["adjustments"] > 0
    assert any(key.startswith("code_assistant/sql 400") for key in summary["requests"])  # the reject policy
    png = (tmp_path / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert "[x] alert resolved" in run.stdout
    out = run.stdout
    assert "\x1b[" not in out and "None" not in out  # no cursor movement, no Python None
    urls = re.findall(
        r"^mla-watch demo: the status page, open while the demo runs: (http://127\.0\.0\.1:\d+/)$", out, re.MULTILINE
    )
    assert urls == [f"http://127.0.0.1:{port}/"], out  # once, early, a line to open, on the port asked for
    assert out.index(urls[0]) < out.index("healthy traffic served")
    lines = out.splitlines()
    assert "mla-watch demo: policy: code_assistant/code: temperature 0.9 -> 0.3" in lines  # the clamp
    refused = "mla-watch demo: policy: code_assistant/sql: refused: temperature=0.9"
    assert any(line.startswith(refused) for line in lines)
    paged = [
        line for line in lines if line.startswith("mla-watch demo: paged: RoutingEntropyLow on model.layers.1.mlp.gate")
    ]
    resolved = [
        line
        for line in lines
        if line.startswith("mla-watch demo: resolved: RoutingEntropyLow on model.layers.1.mlp.gate")
    ]
    # the page's cause, as the reference prompts told it: the model changed
    said = re.search(r": (\d\.\d\d) bits, below 5\.0; cause: model \(.+\)$", paged[0]) if len(paged) == 1 else None
    assert said, out
    # The summary's entropy at the page is the page's own (the summary keeps 3 decimals, the line 2), and the
    # page's job is said after the page.
    assert abs(float(said.group(1)) - bits["at the page"]) <= 0.0051, (paged[0], bits)
    jobs = [line for line in lines if line.startswith("mla-watch demo: re-tune: job ")]
    assert jobs and lines.index(paged[0]) < lines.index(jobs[0]), out
    assert len(resolved) == 1 and re.search(r": \d\.\d\d bits, back above 5\.2$", resolved[0]), out
    assert all("is below" not in line for line in lines if "resolved:" in line)
    assert lines.index(paged[0]) < lines.index(resolved[0])
    assert any(
        re.fullmatch(r"mla-watch demo: re-tune: job \S+ \(bias\): promoted -> router version 1", line) for line in lines
    ), out
    summary_text = out[out.index("mla-watch demo summary") :]
    assert "{" not in summary_text and "'" not in summary_text  # no raw dicts
    # wrapped to the terminal, at word boundaries: only a path longer than the line is not broken
    assert all(
        len(line) <= COLUMNS or line.strip().rstrip(",").endswith(".png") or line.endswith(".json")
        for line in summary_text.splitlines()
    ), summary_text
    assert re.search(r"re-tune job: \S+: promoted, bias, router version 1 ", " ".join(summary_text.split()))


def test_the_demo_fails_loudly_when_a_step_does_not_happen(tmp_path) -> None:
    run = demo(tmp_path, "--no-live", "--no-fault", "--timeout", "45")
    assert run.returncode == 1
    assert "FAILED, these steps did not happen: fault injected, on-call paged, re-tune promoted" in run.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is False


def test_the_live_view_renders_routers_policy_changes_alerts_and_the_job() -> None:
    from rich.console import Console

    from mla_watch.cli.demo import _View

    view = _View(live=False)
    view.console = Console(record=True, width=140)
    view.state.update(
        phase="waiting for the page",
        requests={"code_assistant/code 200": 3},
        bits={"model.layers.1.mlp.gate": 3.1, "model.layers.2.mlp.gate": 5.95},
    )
    view.event("policy", "code_assistant/code: temperature 0.9 -> 0.3", counted=True)
    view.event("policy", "code_assistant/code: temperature 0.9 -> 0.3", counted=True)
    view.event("alert", "paged: RoutingEntropyLow on model.layers.1.mlp.gate (all lines): 3.10 bits, below 5.0")
    view.event("re-tune", "job j1 (bias): promoted -> router version 1")
    printed = view.console.export_text()  # not live: one line per event, the first time it is seen
    assert printed.splitlines() == [
        "mla-watch demo: policy: code_assistant/code: temperature 0.9 -> 0.3",
        "mla-watch demo: paged: RoutingEntropyLow on model.layers.1.mlp.gate (all lines): 3.10 bits, below 5.0",
        "mla-watch demo: re-tune: job j1 (bias): promoted -> router version 1",
    ]
    view.console.print(view.render())
    text = view.console.export_text()
    for expected in (
        "waiting for the page",
        "model.layers.1.mlp.gate",
        "3.100",
        "temperature 0.9 -> 0.3",
        "paged: RoutingEntropyLow",
        "job j1 (bias): promoted -> router version 1",
    ):
        assert expected in text
    assert re.search(r"temperature 0\.9 -> 0\.3 +│ +2 │", text), text  # seen twice, one row


def test_only_changed_requested_values_are_policy_events() -> None:
    from mla_watch.cli.demo import policy_changes

    adjustments = [
        {"param": "n", "requested": None, "applied": 1},  # a default filled in: no event
        {"param": "temperature", "requested": 0.9, "applied": 0.3},
        {"param": "top_p", "requested": 0.95, "applied": 0.95},
        {"param": "max_tokens", "requested": 900, "applied": 512},
    ]
    assert policy_changes("code_assistant/code", adjustments) == [
        "code_assistant/code: temperature 0.9 -> 0.3",
        "code_assistant/code: max_tokens 900 -> 512",
    ]


def test_an_alert_line_says_what_the_value_is_now() -> None:
    from mla_watch.cli.demo import alert_line

    labels = {
        "alertname": "RoutingEntropyLow",
        "router": "model.layers.2.mlp.gate",
        "business_line": "customer_service",
    }
    notes = {
        "summary": "Routing entropy 5.71 bits on model.layers.2.mlp.gate (all lines) is below 5.0 bits",
        "value": "5.7123",
        "threshold": "5.0",
        "resolve_threshold": "5.2",
    }
    assert (
        alert_line({"status": "resolved", "labels": labels, "annotations": notes})
        == "resolved: RoutingEntropyLow on model.layers.2.mlp.gate (customer_service): 5.71 bits, back above 5.2"
    )
    firing = {**notes, "value": "3.5"}
    assert (
        alert_line({"status": "firing", "labels": {**labels, "business_line": "all"}, "annotations": firing})
        == "paged: RoutingEntropyLow on model.layers.2.mlp.gate (all lines): 3.50 bits, below 5.0"
    )
    assert "None" not in alert_line({"status": "firing", "labels": labels, "annotations": {"value": "None"}})
    # the cause the page carries: its label, and what the reference prompts said
    caused = alert_line(
        {
            "status": "firing",
            "labels": {**labels, "cause": "model"},
            "annotations": {**firing, "cause": "the reference prompts   route differently now"},
        }
    )
    assert caused == (
        "paged: RoutingEntropyLow on model.layers.2.mlp.gate (customer_service): 3.50 bits, below 5.0; "
        "cause: model (the reference prompts route differently now)"
    )

    # An event carries no value: its summary says what happened, never "? bits".
    event = {
        "status": "firing",
        "annotations": {"summary": "Re-tune job j1 for  model.layers.1.mlp.gate (all) was rejected by its gates"},
        "labels": {"alertname": "RouterRetuneRejected", "router": "model.layers.1.mlp.gate", "business_line": "all"},
    }
    assert alert_line(event) == (
        "paged: RouterRetuneRejected on model.layers.1.mlp.gate (all lines): Re-tune job j1 "
        "for model.layers.1.mlp.gate (all) was rejected by its gates"
    )


def test_a_job_line_says_the_version_it_promoted_or_why_it_waits() -> None:
    from mla_watch.cli.demo import job_line

    spec = {"strategies": ["bias"]}
    assert job_line({"id": "j1", "status": "pending", "spec": spec, "result": None}) == "job j1 (bias): pending"
    assert (
        job_line({"id": "j1", "status": "promoted", "spec": spec, "result": {"strategy": "bias", "version": 2}})
        == "job j1 (bias): promoted -> router version 2"
    )
    assert (
        job_line({"id": "j1", "status": "waiting", "spec": spec, "result": {"needs": "12 more samples"}})
        == "job j1 (bias): waiting for more captured traffic"
    )
    rejected = {
        "attempts": [
            {"strategy": "bias", "outcome": "rejected", "reason": "reference prompts\n  moved 0.08 bits (limit 0.05)"}
        ]
    }
    assert job_line({"id": "j1", "status": "waiting", "spec": spec, "result": rejected}) == (
        "job j1 (bias): waiting, bias rejected: reference prompts moved 0.08 bits (limit 0.05)"
    )


def test_the_summary_is_aligned_lines_wrapped_at_word_boundaries() -> None:
    from mla_watch.cli.demo import STEPS, DemoResult, summary_lines

    result = DemoResult(
        {step: True for step in STEPS},
        {"fault injected": 11.2},
        [],
        {
            "code_assistant/code 200": 15,
            "code_assistant/sql 400": 14,
            "customer_service 200": 15,
            "doc_summary 200": 14,
        },
        ["code_assistant/code: temperature 0.9 -> 0.3"],
        {
            "id": "20261202-102100-5b0bbe",
            "status": "promoted",
            "result": {"strategy": "bias", "version": 1, "timings": {"total_seconds": 9.2}},
        },
        Path("/tmp/demo-out"),
        ["gave up waiting: traffic goes on until the alerts resolve"],
    )
    for width in (50, 80, 160):
        lines = summary_lines(result, width)
        assert all(len(line) <= width for line in lines), (width, lines)
        text = "\n".join(lines)
        assert "None" not in text and "{" not in text and "'" not in text
        for item in (
            "code_assistant/code 200: 15",
            "doc_summary 200: 14",
            "at the page n/a",
            "/tmp/demo-out/summary.json",
            "router version 1",
            "total 9.2 s",
        ):
            assert item in text, (item, text)  # never split inside an item
        keyed = [line for line in lines if re.match(r"  [a-z][a-z ()-]+: ", line)]
        assert len({line.index(":") + len(re.match(r": +", line[line.index(":") :]).group()) for line in keyed}) == 1
    assert "  [x] fault injected  (11.2 s)" in lines
