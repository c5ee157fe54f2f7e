"""RouterVersionSkew (`rules export --fleet`), run by the real promtool: a fleet whose replicas serve different router
digests for longer than ``--version-skew-for`` fires once, with the count; a rollout shorter than that does not."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import yaml

from harness import processes
from mla_watch.routing.series import ROUTER_VERSION_INFO


def _series(instance: str, digest: str, values: str) -> dict[str, str]:
    return {
        "series": f'{ROUTER_VERSION_INFO}{{job="mla_watch",instance="{instance}",version="1",digest="{digest}"}}',
        "values": values,
    }


def test_replicas_serving_two_digests_past_the_skew_duration_fire_and_a_short_rollout_does_not(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: ./test installs Debian's prometheus package"
    rules = tmp_path / "rules.yml"
    exported = processes.run(
        [
            sys.executable,
            "-m",
            "mla_watch.cli",
            "rules",
            "export",
            "--fleet",
            "--version-skew-for",
            "10m",
            "--out",
            str(rules),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exported.returncode == 0, exported.stderr
    # a: one digest throughout; b: the new digest from minute 0; c: stuck on the old one (a halted rollout) - the
    # fleet serves two digests for 30 minutes. A second fleet rolls out within 5 minutes.
    series = [
        _series("a:1", "new", "1x30"),
        _series("b:1", "new", "1x30"),
        _series("c:1", "old", "1x30"),
        {
            "series": f'{ROUTER_VERSION_INFO}{{job="other",instance="d:1",version="0",digest="old"}}',
            "values": "1x4 _x26",
        },
        {
            "series": f'{ROUTER_VERSION_INFO}{{job="other",instance="d:1",version="1",digest="new"}}',
            "values": "_x4 1x26",
        },
        {"series": f'{ROUTER_VERSION_INFO}{{job="other",instance="e:1",version="1",digest="new"}}', "values": "1x30"},
    ]
    alert = {"alertname": "RouterVersionSkew", "severity": "warning", "scope": "fleet"}
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "RouterVersionSkew", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "RouterVersionSkew",
                    "exp_alerts": [{"exp_labels": {**alert, "job": "mla_watch"}}],
                },
            ],
        }
    ]
    # promtool checks the annotations too: read them from the exported file rather than restating them.
    document = yaml.safe_load(rules.read_text())
    (rule,) = [
        rule for group in document["groups"] for rule in group["rules"] if rule.get("alert") == "RouterVersionSkew"
    ]
    tests[0]["alert_rule_test"][1]["exp_alerts"][0]["exp_annotations"] = {
        key: value.replace("{{ $labels.job }}", "mla_watch").replace("{{ $value }}", "2")
        for key, value in rule["annotations"].items()
    }
    test_file = tmp_path / "test.yml"
    test_file.write_text(
        yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}, sort_keys=False)
    )
    result = processes.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
