"""`mla-watch demo` runs the whole loop on the bundled model and says when a step did not happen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def demo(out, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_watch.cli", "demo", "--out", str(out), "--no-live", *extra],
                          capture_output=True, text=True, timeout=900, check=False)


def test_the_demo_closes_the_loop_and_draws_it(tmp_path) -> None:
    run = demo(tmp_path)
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


def test_the_demo_fails_loudly_when_a_step_does_not_happen(tmp_path) -> None:
    run = demo(tmp_path, "--no-fault", "--timeout", "45")
    assert run.returncode == 1
    assert "FAILED, these steps did not happen: fault injected, on-call paged, re-tune promoted" in run.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is False


def test_the_live_view_renders_routers_policy_changes_alerts_and_the_job() -> None:
    from rich.console import Console

    from mla_watch.demo import _View

    view = _View(live=False)
    view.state.update(phase="waiting for the page", requests={"code_assistant/code 200": 3},
                      bits={"model.layers.1.mlp.gate": 3.1, "model.layers.2.mlp.gate": 5.95},
                      adjustments=["code_assistant/code: temperature 0.9 -> 0.3"],
                      alerts=["firing: Routing entropy 3.10 bits on model.layers.1.mlp.gate (all lines)"],
                      job={"id": "j1", "status": "promoted", "spec": {"strategies": ["bias", "restore"]},
                           "result": {"strategy": "bias", "version": 1}})
    console = Console(record=True, width=140)
    console.print(view.render())
    text = console.export_text()
    for expected in ("waiting for the page", "model.layers.1.mlp.gate", "3.100", "temperature 0.9 -> 0.3",
                     "firing: Routing entropy", "job j1: promoted bias -> router version 1"):
        assert expected in text
