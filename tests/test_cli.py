"""The mla-watch command line, run in-process on the bundled model."""

from __future__ import annotations

import json
import shutil

import pytest

from harness import processes
from harness.support import REPO
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.cli import main
from mla_watch.shipped import SHIPPED_RULES

pytestmark = pytest.mark.slow


def test_check_lints_the_shipped_rules_against_the_bundled_model(capsys, monkeypatch) -> None:
    monkeypatch.delenv("MLA_WATCH_ONCALL_URL", raising=False)
    monkeypatch.delenv("MLA_WATCH_LINE_OWNERS_URL", raising=False)
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "MLA_WATCH_ONCALL_URL is unset" in out  # says that no receiver is configured
    assert "MLA_WATCH_LINE_OWNERS_URL is unset" in out
    # the seed's 6.5 bits cannot fire on these routers: said once, as expected, not warned of per router
    assert "can never fire on any of the 3 routers it selects" in out and "Expected: the seed's threshold" in out
    assert "needs --capture" not in out and "0 error(s), 2 warning(s)" in out  # the warnings: no receiver URL
    assert "ok: policy code_assistant" in out and "0 error(s)" in out
    for strategy in ("bias", "router_finetune", "restore"):  # the bundled model supports every strategy
        assert f"ok: re-tune strategy {strategy} is supported" in out


def test_check_warns_of_a_retune_that_needs_traffic_only_where_nothing_else_can_run(tmp_path, capsys) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    rule = (
        "rules:\n  - alert: {name}\n    metric: entropy_bits\n    select: {{kind: expert{extra}}}\n"
        "    below: 3.0\n    actions: [retune]\n    retune_strategy: [bias]\n"
    )
    (rules / "r.yaml").write_text(
        rule.format(name="BiasOnly", extra="")
        + rule.format(name="OtherGeometry", extra=", slots: 8").split("rules:\n", 1)[1]
    )
    assert main(["check", "--rules", str(rules)]) == 0
    out = capsys.readouterr().out
    assert "warning: rule BiasOnly asks for re-tuning by bias, which fit on traffic: serve with --capture" in out
    assert "rule OtherGeometry asks" not in out  # selects none of this model's routers: nothing to warn of


def test_check_fails_on_a_broken_rule_file(tmp_path, capsys) -> None:
    rules = tmp_path / "rules"
    shutil.copytree(REPO / "rules", rules)
    (rules / "extra.yaml").write_text("rules:\n  - alert: Always\n    metric: entropy_bits\n    below: 7\n")
    assert main(["check", "--rules", str(rules)]) == 1
    out = capsys.readouterr().out
    assert "below 7 bits always fires on model.layers.1.mlp.gate" in out
    (rules / "extra.yaml").write_text("rules:\n  - alert: Bad\n    metric: entropy\n    below: 5\n")
    assert main(["check", "--rules", str(rules)]) == 1
    assert "extra.yaml: rules[Bad].metric = 'entropy'" in (out := capsys.readouterr().out) and "(line 3)" in out


def test_rules_export_is_accepted_by_promtool(tmp_path) -> None:
    out = tmp_path / "mla_watch.rules.yml"
    assert main(["rules", "export", "--format", "prometheus", "--out", str(out)]) == 0
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: .ci/run installs Debian's prometheus package"
    checked = processes.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    # seeds, relative twins, companions, forecasts, long-context drift
    shipped = len(load_rules_dir(SHIPPED_RULES, environ={}).rules)
    assert shipped == 11
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {shipped} rules found" in checked.stdout


def test_routing_table_baseline_and_drift(tmp_path, capsys) -> None:
    assert main(["routing", "--domain", "sql", "--samples", "8", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 7 and {r["kind"] for r in records} == {"expert", "indexer"}
    assert all(r["floor_bits"] <= r["entropy_bits"] + 1e-9 for r in records if r["kind"] == "expert")
    baseline = tmp_path / "baseline.json"
    assert main(["baseline", "--domain", "sql", "--samples", "8", "--out", str(baseline)]) == 0
    capsys.readouterr()
    assert main(["routing", "--domain", "sql", "--samples", "8", "--baseline", str(baseline)]) == 0
    table = capsys.readouterr().out
    assert "layer" in table and "entropy" in table and "0.0000" in table  # same traffic: no drift
    assert main(["routing", "--domain", "code", "--samples", "8", "--baseline", str(baseline), "--json"]) == 0
    drift = [r["js_divergence"] for r in json.loads(capsys.readouterr().out) if r["kind"] == "expert"]
    assert all(value > 0.01 for value in drift)  # another business line routes differently


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--history-interval", "0"], "argument --history-interval: expected a positive number, got '0'"),
        (["--history-span", "nan"], "argument --history-span: expected a positive number, got 'nan'"),
        (["--max-queue", "0"], "argument --max-queue: expected an integer >= 1, got '0'"),
        (["--request-timeout", "-1"], "argument --request-timeout: expected a positive number, got '-1'"),
        (["--port", "70000"], "argument --port: expected a TCP port in [0, 65535], got '70000'"),
        (
            ["--history-interval", "100", "--history-span", "50"],
            "mla-watch serve: --history-interval 100.0: expected at most --history-span (50.0)",
        ),
        (["--retune-option", "bad"], "--retune-option 'bad': expected STRATEGY.NAME=VALUE"),
        (["--ingest-max-lines", "0"], "mla-watch serve: --ingest-max-lines 0: expected an integer >= 1"),
        (
            ["--history-retention", "0.5"],
            "argument --history-retention: expected 0 (no durable history) or a number of days in [1, 365], got '0.5'",
        ),
        (["--history-retention", "nan"], "argument --history-retention: expected 0 (no durable history)"),
        (["--history-max-series", "0"], "argument --history-max-series: expected an integer >= 1, got '0'"),
    ],
)
def test_serve_refuses_a_bad_setting_by_flag(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:  # before anything loads or listens
        main(["serve", "--port", "1", *flags])
    assert message in str(info.value) + capsys.readouterr().err
