"""The fleet recording rules and alerts (`mla-watch rules export --fleet`), run by the real promtool.

Three replicas of a small router (8 experts, top-2, two business lines) feed their window counts and routing gauges
into `promtool test rules`, as a sidecar exports them; what Prometheus records must be what mla_watch's own
compute_stats says of the summed windows.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness import processes
from harness.support import REPO
from mla_watch.alerting import fleet
from mla_watch.alerting.fleet_versions import VERSION_GROUP_NAME, VERSION_SKEW_ALERT
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.routing.series import ROUTING_SLOTS, routing_gauge
from mla_watch.routing.stats import compute_stats, entropy_bits, minimum_window_tokens

JOB = "mla_watch"
ROUTER = "model.layers.1.mlp.gate"
LAYER = "1"
TOP_K = 2
STEPS = 30  # minutes of input, one sample a minute
EVAL = STEPS  # evaluated at the last sample
ROLLED = 20  # the windows roll at this minute: what was counted before is no longer in them
TOLERANCE = 1e-9  # sums of p log p in another order than numpy's differ in the last bits


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: .ci/run installs Debian's prometheus package (/usr/bin/promtool)"
    return path


@dataclass(frozen=True)
class Window:
    """One replica's window of one router and line: its counts now, what it held before the window rolled (the
    rules must read the latest sample only), and when it stopped reporting (its series go stale), if it did."""

    counts: tuple[int, ...]
    before: tuple[int, ...] | None = None
    gone_at: int | None = None

    def values(self, now: float, before: float | None) -> str:
        """A gauge's promtool values: ``before`` until the window rolls, ``now`` after, absent once gone."""
        first = now if before is None else before
        end = STEPS if self.gone_at is None else self.gone_at
        return f"{first!r}x{ROLLED - 1} {now!r}x{end - ROLLED}" + (f" _x{STEPS - end}" if end < STEPS else "")

    def live(self) -> bool:
        """Whether its samples are still within Prometheus' 5 minutes of look-back at the evaluation."""
        return self.gone_at is None or EVAL - self.gone_at < 5


def labels(instance: str, line: str, router: str = ROUTER, layer: str = LAYER, **more: str) -> str:
    pairs = {
        "job": JOB,
        "instance": instance,
        "router": router,
        "layer": layer,
        "kind": "expert",
        "business_line": line,
        **more,
    }
    return "{" + ",".join(f'{key}="{value}"' for key, value in pairs.items()) + "}"


def fleet_labels(line: str, router: str = ROUTER, layer: str = LAYER) -> str:
    return "{" + f'job="{JOB}",router="{router}",layer="{layer}",kind="expert",business_line="{line}"' + "}"


Replicas = dict[str, dict[str, Window]]  # instance -> line -> its window


def sidecar_series(
    instance: str, line: str, window: Window, router: str = ROUTER, layer: str = LAYER
) -> list[dict[str, str]]:
    """What one sidecar exports of one window: each expert's selections and the tokens (--export-expert-counts),
    and beside them its routing gauges of the same window (entropy, selections, floor)."""
    now = np.array(window.counts, dtype=np.int64)
    before = None if window.before is None else np.array(window.before, dtype=np.int64)
    where = labels(instance, line, router, layer)
    out = [
        {
            "series": fleet.WINDOW_SELECTIONS + labels(instance, line, router, layer, expert=str(expert)),
            "values": window.values(float(now[expert]), None if before is None else float(before[expert])),
        }
        for expert in range(now.size)
    ]

    def per_pair(name: str, of: Callable[[np.ndarray], float]) -> dict[str, str]:
        return {"series": name + where, "values": window.values(of(now), None if before is None else of(before))}

    out += [
        per_pair(fleet.WINDOW_TOKENS, lambda c: float(c.sum() // TOP_K)),
        per_pair(fleet.SELECTIONS_GAUGE, lambda c: float(c.sum())),
        per_pair(fleet.ENTROPY_GAUGE, entropy_bits),
        per_pair(routing_gauge("floor_bits"), lambda c: math.log2(TOP_K)),
        per_pair(ROUTING_SLOTS, lambda c: float(c.size)),
    ]
    return out


def input_series(replicas: Replicas) -> list[dict[str, str]]:
    return [
        series
        for instance, lines in replicas.items()
        for line, window in lines.items()
        for series in sidecar_series(instance, line, window)
    ]


def exact(name: str, selector: str, value: float) -> dict:
    return {
        "expr": name + selector,
        "eval_time": f"{EVAL}m",
        "exp_samples": [{"labels": name + selector, "value": value}],
    }


def close(name: str, selector: str, value: float) -> dict:
    """promtool compares exactly; a float that Prometheus sums in its own order is checked within TOLERANCE."""
    return {
        "expr": f"abs({name}{selector} - {float(value)!r}) <= bool {TOLERANCE}",
        "eval_time": f"{EVAL}m",
        "exp_samples": [{"labels": selector, "value": 1}],
    }


def run_tests(tmp_path: Path, tests: list[dict], rule_file: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "fleet_test.yml"
    path.write_text(
        yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": tests}, sort_keys=False)
    )
    return processes.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )


def export(*args: str) -> str:
    result = processes.run(
        [sys.executable, "-m", "mla_watch.cli", "rules", "export", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def fleet_rule_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "fleet.rules.yml"
    path.write_text(export("--format", "prometheus", "--fleet"))
    return path


# Line A: every replica's window rolled at minute 20 (the rules read what the windows hold now). Line B: r1's
# window is empty (no traffic: no divergence to judge), r3 exports only line B (its budget admitted no other), r4
# stopped reporting 10 minutes ago (its series are stale), and expert 7 is in no live window (one dead slot).
STATS_REPLICAS: Replicas = {
    "r0": {
        "code_assistant": Window((3, 1, 2, 2, 1, 3, 2, 2), before=(9, 9, 0, 0, 0, 0, 0, 0)),
        "customer_service": Window((5, 3, 1, 4, 2, 1, 0, 0)),
    },
    "r1": {
        "code_assistant": Window((2, 2, 2, 2, 2, 2, 2, 2), before=(1, 1, 1, 1, 1, 1, 1, 1)),
        "customer_service": Window((0, 0, 0, 0, 0, 0, 0, 0), before=(2, 2, 2, 2, 2, 2, 2, 2)),
    },
    "r2": {
        "code_assistant": Window((4, 0, 2, 2, 2, 2, 2, 2), before=(2, 2, 2, 2, 2, 2, 2, 2)),
        "customer_service": Window((1, 3, 3, 3, 3, 3, 0, 0)),
    },
    "r3": {"customer_service": Window((2, 2, 0, 0, 4, 0, 2, 0))},
    "r4": {"customer_service": Window((0, 0, 0, 0, 0, 0, 0, 40), gone_at=STEPS - 10)},
}


def expected(replicas: Replicas, line: str) -> tuple[object, dict[str, float], float]:
    """compute_stats of the summed live windows, each replica's KL from the fleet, and the JSD."""
    per_replica = {
        name: np.array(lines[line].counts, dtype=np.float64)
        for name, lines in replicas.items()
        if line in lines and lines[line].live()
    }
    summed = sum(per_replica.values())
    tokens = int(summed.sum()) // TOP_K
    stats = compute_stats(summed, kind="expert", top_k=TOP_K, tokens=tokens)
    fleet_p = summed / summed.sum()
    kl = {}
    for name, counts in per_replica.items():
        if counts.sum() == 0:
            continue  # an empty window has no mix to diverge
        p = counts / counts.sum()
        nonzero = p > 0
        kl[name] = float(np.sum(p[nonzero] * np.log2(p[nonzero] / fleet_p[nonzero])))
    weights = {name: counts.sum() / summed.sum() for name, counts in per_replica.items()}
    jsd = float(sum(weights[name] * kl[name] for name in kl))
    # The decomposition the recordings rest on: H_fleet = sum_r w_r H_r + JSD.
    within = sum(weights[name] * entropy_bits(counts) for name, counts in per_replica.items())
    assert math.isclose(stats.entropy_bits, within + jsd, abs_tol=1e-12)
    return stats, kl, jsd


def stats_checks(replicas: Replicas, line: str, shard: str = "") -> list[dict]:
    """Every recording of ``line`` against compute_stats (``shard``: the label a shard's group adds)."""
    stats, kl, jsd = expected(replicas, line)
    where = fleet_labels(line)
    if shard:
        where = where[:-1] + f',{fleet.SHARD_LABEL}="{shard}"' + "}"
    median = sorted(kl.values())[(len(kl) - 1) // 2] if len(kl) % 2 else float(np.median(list(kl.values())))
    return [
        close(fleet.FLEET_ENTROPY_BITS, where, stats.entropy_bits),
        close(fleet.FLEET_NORMALIZED_ENTROPY, where, stats.normalized_entropy),
        close(fleet.FLEET_BITS_BELOW_CEILING, where, stats.bits_below_ceiling),
        close(fleet.FLEET_MAX_VIOLATION, where, stats.max_violation),
        close(fleet.FLEET_CEILING_BITS, where, stats.ceiling_bits),
        close(fleet.FLEET_FLOOR_BITS, where, stats.floor_bits),
        close(fleet.FLEET_JS_DIVERGENCE, where, jsd),
        close(fleet.FLEET_MEDIAN_REPLICA_KL, where, median),
        exact(fleet.FLEET_DEAD_SLOTS, where, stats.dead_slots),
        exact(fleet.FLEET_TOKENS, where, stats.tokens),
        exact(fleet.FLEET_SELECTIONS, where, stats.selections),
        exact(fleet.FLEET_SLOTS, where, stats.num_slots),
        exact(fleet.FLEET_MIN_TOKENS, where, stats.min_tokens),
        exact(fleet.FLEET_REPLICAS, where, len(kl)),
        *[
            close(
                fleet.REPLICA_KL_BITS,
                labels(name, line)[:-1] + (f',{fleet.SHARD_LABEL}="{shard}"' if shard else "") + "}",
                value,
            )
            for name, value in kl.items()
        ],
    ]


def test_fleet_recordings_equal_compute_stats_of_the_summed_windows(tmp_path, fleet_rule_file) -> None:
    checks = stats_checks(STATS_REPLICAS, "code_assistant") + stats_checks(STATS_REPLICAS, "customer_service")
    # Line A has every expert chosen: dead slots is a 0 sample, not an absent series.
    assert expected(STATS_REPLICAS, "code_assistant")[0].dead_slots == 0
    customer = expected(STATS_REPLICAS, "customer_service")
    assert customer[0].dead_slots == 1 and set(customer[1]) == {"r0", "r2", "r3"}  # r1 empty, r4 stale
    # The replicas' own per-expert series are read, never recorded again.
    checks.append({"expr": "count({__name__=~'replica:.*',expert!=''})", "eval_time": f"{EVAL}m", "exp_samples": []})
    result = run_tests(
        tmp_path,
        [{"interval": "1m", "input_series": input_series(STATS_REPLICAS), "promql_expr_test": checks}],
        fleet_rule_file,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_each_shard_records_its_own_layers_as_the_whole_fleet_group_does(tmp_path) -> None:
    """--fleet-shards 2: layer 1's statistics come from shard 1/2's group, layer 2's from shard 0/2's, equal to the
    unsplit group's; each recording once, labelled with its shard."""
    rule_file = tmp_path / "sharded.rules.yml"
    rule_file.write_text(export("--fleet", "--fleet-shards", "2"))
    other = "model.layers.2.mlp.gate"
    series = input_series(STATS_REPLICAS)
    for instance, lines in STATS_REPLICAS.items():
        for line, window in lines.items():
            series += sidecar_series(instance, line, window, router=other, layer="2")
    checks = stats_checks(STATS_REPLICAS, "customer_service", shard="1/2")
    for check in stats_checks(STATS_REPLICAS, "customer_service", shard="0/2"):
        check = yaml.safe_load(yaml.safe_dump(check).replace(ROUTER, other).replace('layer="1"', 'layer="2"'))
        checks.append(check)
    checks.append(
        {
            "expr": f"count by ({fleet.SHARD_LABEL}) ({fleet.FLEET_ENTROPY_BITS})",
            "eval_time": f"{EVAL}m",
            "exp_samples": [
                {"labels": f'{{{fleet.SHARD_LABEL}="0/2"}}', "value": 2},
                {"labels": f'{{{fleet.SHARD_LABEL}="1/2"}}', "value": 2},
            ],
        }
    )
    result = run_tests(tmp_path, [{"interval": "1m", "input_series": series, "promql_expr_test": checks}], rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_checks_can_fail(tmp_path, fleet_rule_file) -> None:
    stats, _, _ = expected(STATS_REPLICAS, "code_assistant")
    wrong = close(fleet.FLEET_ENTROPY_BITS, fleet_labels("code_assistant"), stats.entropy_bits + 1e-6)
    result = run_tests(
        tmp_path,
        [{"interval": "1m", "input_series": input_series(STATS_REPLICAS), "promql_expr_test": [wrong]}],
        fleet_rule_file,
    )
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_minimum_tokens_follow_the_geometry(tmp_path, fleet_rule_file) -> None:
    """The fleet's trusted minimum is the sidecar's, computed in PromQL from the slots and the floor gauge."""
    tests = []
    for experts, top_k in ((8, 2), (64, 6), (16, 20), (1, 1)):
        where = labels("r0", "doc_summary")
        lines = [
            {
                "series": fleet.WINDOW_SELECTIONS + labels("r0", "doc_summary", expert=str(expert)),
                "values": f"1x{STEPS}",
            }
            for expert in range(experts)
        ]
        lines += [
            {"series": name + where, "values": f"{value!r}x{STEPS}"}
            for name, value in (
                (routing_gauge("floor_bits"), math.log2(min(top_k, experts))),
                (ROUTING_SLOTS, float(experts)),
                (fleet.WINDOW_TOKENS, 1.0),
                (fleet.SELECTIONS_GAUGE, float(experts)),
            )
        ]
        tests.append(
            {
                "interval": "1m",
                "input_series": lines,
                "promql_expr_test": [
                    exact(fleet.FLEET_MIN_TOKENS, fleet_labels("doc_summary"), minimum_window_tokens(experts, top_k))
                ],
            }
        )
    result = run_tests(tmp_path, tests, fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


UNIFORM = (20, 20, 20, 20, 20, 20, 20, 20)  # 80 tokens a window: past the trusted minimum of 51
COLLAPSED = (80, 80, 0, 0, 0, 0, 0, 0)


def alerts_firing(alertname: str, rows: list[dict[str, str]]) -> dict:
    return {
        "expr": f'ALERTS{{alertstate="firing", alertname="{alertname}"}}',
        "eval_time": f"{EVAL}m",
        "exp_samples": [
            {"labels": "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in row.items()) + "}", "value": 1} for row in rows
        ],
    }


def alert_case(replicas: dict[str, tuple[int, ...]], checks: list[dict]) -> dict:
    series = {name: {"code_assistant": Window(values)} for name, values in replicas.items()}
    return {"interval": "1m", "input_series": input_series(series), "promql_expr_test": checks}


def fleet_alert(alertname: str, severity: str, **more: str) -> dict[str, str]:
    return {
        "alertname": alertname,
        "alertstate": "firing",
        "job": JOB,
        "router": ROUTER,
        "layer": LAYER,
        "kind": "expert",
        "business_line": "code_assistant",
        "severity": severity,
        **more,
    }


def test_one_collapsed_replica_is_an_outlier_and_the_fleet_twin_stays_quiet(tmp_path, fleet_rule_file) -> None:
    outlier = fleet_alert(fleet.OUTLIER_ALERT, "warning", instance="r2", scope="replica")
    case = alert_case(
        {"r0": UNIFORM, "r1": UNIFORM, "r2": COLLAPSED},
        [
            alerts_firing(fleet.OUTLIER_ALERT, [outlier]),  # r2 only: its healthy peers are not named
            alerts_firing("RoutingCollapse", []),  # the fleet's mix is still balanced enough
        ],
    )
    result = run_tests(tmp_path, [case], fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_a_fleet_wide_collapse_fires_the_fleet_twin_and_no_outlier(tmp_path, fleet_rule_file) -> None:
    twin = fleet_alert("RoutingCollapse", "critical", scope="fleet", team="ml-platform")
    case = alert_case(
        {"r0": COLLAPSED, "r1": COLLAPSED, "r2": COLLAPSED},
        [
            alerts_firing("RoutingCollapse", [twin]),
            alerts_firing(fleet.OUTLIER_ALERT, []),
        ],
    )
    result = run_tests(tmp_path, [case], fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_two_replicas_are_not_judged_for_outliers(tmp_path, fleet_rule_file) -> None:
    case = alert_case({"r0": UNIFORM, "r2": COLLAPSED}, [alerts_firing(fleet.OUTLIER_ALERT, [])])
    result = run_tests(tmp_path, [case], fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def groups_of(text: str, file_format: str) -> dict:
    document = yaml.safe_load(text)
    if file_format == "operator":
        assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["kind"] == "PrometheusRule"
        assert document["metadata"]["name"] and document["metadata"]["labels"]
        return document["spec"]
    if file_format == "mimir":
        assert document.pop("namespace") == "mla_watch"
    return document


@pytest.mark.parametrize("file_format", ["prometheus", "operator", "mimir"])
@pytest.mark.parametrize("with_fleet", [False, True])
def test_promtool_checks_every_format(tmp_path, file_format, with_fleet) -> None:
    args = [
        "--format",
        file_format,
        *(
            [
                "--fleet",
                "--fleet-labels",
                "namespace,job",
                "--replica-label",
                "pod",
                "--fleet-interval",
                "2m",
                "--fleet-shards",
                "4",
            ]
            if with_fleet
            else []
        ),
    ]
    document = groups_of(export(*args), file_format)
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(document))
    result = processes.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [group["name"] for group in document["groups"]]
    shards = [f"{base}_{k}_of_4" for k in range(4) for base in (fleet.FLEET_GROUP_NAME, fleet.REPLICA_GROUP_NAME)]
    assert names == (["mla_watch_routing", *shards, VERSION_GROUP_NAME] if with_fleet else ["mla_watch_routing"])
    if with_fleet:
        for index, group in enumerate(document["groups"][1:-1]):  # the last: the router versions
            shard = f"{index // 2}/4"
            records = [r["record"] for r in group["rules"] if "record" in r]
            assert all(r["labels"] == {fleet.SHARD_LABEL: shard} for r in group["rules"] if "record" in r)
            assert all(r["labels"][fleet.SHARD_LABEL] == shard for r in group["rules"] if "alert" in r)
            if index % 2 == 0:  # the fleet group
                assert "by (namespace, job, router" in group["rules"][0]["expr"] and group["interval"] == "2m"
            else:  # the replica group
                kl = next(r for r in group["rules"] if r.get("record") == fleet.REPLICA_KL_BITS)
                assert "by (namespace, job, pod, router" in kl["expr"] and group["interval"] == "5m"
                assert records == list(fleet.RECORDING_NAMES[-len(records) :])
        assert [r["record"] for group in document["groups"][1:3] for r in group["rules"] if "record" in r] == list(
            fleet.RECORDING_NAMES
        )
        assert not any(
            "offset" in rule["expr"] or re.search(r"\[[0-9]+[smhdwy]", rule["expr"])
            for group in document["groups"][1:]
            for rule in group["rules"]
            if "record" in rule
        )
        # (instant samples: no range, no offset)


def test_the_shipped_prometheusrule_is_the_export() -> None:
    shipped = (REPO / "deploy" / "prometheusrule.yaml").read_text()
    assert shipped == export("--format", "operator", "--fleet")
    assert "mla-watch rules export --format operator --fleet" in shipped.splitlines()[0]


def test_fleet_twins_carry_the_rules_labels_and_thresholds() -> None:
    document = yaml.safe_load(export("--fleet"))
    replica, fleet_group, replicas_group, versions = document["groups"]
    assert [rule["alert"] for rule in versions["rules"]] == [VERSION_SKEW_ALERT]
    assert all(rule["labels"]["scope"] == "replica" for rule in replica["rules"])
    alerts = {
        rule["alert"]: rule for group in (fleet_group, replicas_group) for rule in group["rules"] if "alert" in rule
    }
    assert [rule["alert"] for rule in replicas_group["rules"] if "alert" in rule] == [fleet.OUTLIER_ALERT]
    shipped = load_rules_dir(REPO / "rules", environ={})
    for rule in shipped.rules:
        if rule.metric not in fleet.FLEET_METRICS or rule.selector.kind == "indexer":
            assert rule.name not in alerts
            continue
        twin = alerts[rule.name]
        assert twin["labels"] == {"severity": rule.severity, **dict(rule.labels), "scope": "fleet"}
        assert fleet.FLEET_METRICS[rule.metric] in twin["expr"]
        assert set(rule.annotations) <= set(twin["annotations"])
    assert alerts[fleet.OUTLIER_ALERT]["labels"]["scope"] == "replica"


ERRORS: list[tuple[list[str], Callable[[str], bool]]] = [
    (["--fleet", "--fleet-interval", "0s"], lambda e: "--fleet-interval '0s'" in e and "1s to 1h" in e),
    (["--fleet", "--fleet-interval", "2h"], lambda e: "--fleet-interval '2h'" in e and "1s to 1h" in e),
    (["--fleet", "--outlier-interval", "0s"], lambda e: "--outlier-interval '0s'" in e and "1s to 1h" in e),
    (["--outlier-interval", "5m"], lambda e: "--outlier-interval 5m" in e and "--fleet" in e),
    (["--fleet-interval", "1m"], lambda e: "--fleet-interval 1m" in e and "--fleet" in e),
    (["--fleet-shards", "2"], lambda e: "--fleet-shards 2" in e and "--fleet" in e),
    (["--fleet", "--fleet-shards", "3"], lambda e: "--fleet-shards 3" in e and "1, 2, 4, 5, 10, 20, 25, 50, 100" in e),
    (["--fleet", "--fleet-shards", "two"], lambda e: "--fleet-shards 'two'" in e and "divisor of 100" in e),
    (["--fleet", "--fleet-window", "1h"], lambda e: "--fleet-window" in e and "unrecognized" in e),
    (["--fleet", "--fleet-labels", "job,,pod"], lambda e: "--fleet-labels 'job,,pod'" in e and "label names" in e),
    (["--fleet", "--fleet-labels", "9lives"], lambda e: "'9lives' is not a Prometheus label name" in e),
    (["--fleet", "--fleet-labels", "router"], lambda e: "--fleet-labels 'router'" in e and "expected" in e),
    (["--fleet", "--replica-label", "job"], lambda e: "--replica-label 'job'" in e and "--fleet-labels" in e),
    (["--fleet", "--outlier-bits", "0"], lambda e: "--outlier-bits 0.0" in e and "positive" in e),
    (["--fleet", "--outlier-factor", "x"], lambda e: "--outlier-factor 'x'" in e and "number" in e),
    (["--fleet", "--outlier-for", "later"], lambda e: "--outlier-for 'later'" in e and "duration" in e),
    (["--outlier-for", "1s"], lambda e: "--outlier-for 1s" in e and "--fleet" in e),
    (["--format", "thanos"], lambda e: "--format" in e and "'thanos'" in e and "mimir" in e),
]


@pytest.mark.parametrize(("args", "says"), ERRORS, ids=[" ".join(args) for args, _ in ERRORS])
def test_bad_flags_name_the_flag_the_value_and_what_was_expected(args, says) -> None:
    result = processes.run(
        [sys.executable, "-m", "mla_watch.cli", "rules", "export", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 2 and not result.stdout
    assert says(result.stderr), result.stderr


@pytest.mark.parametrize("pod", ["vllm-pod.yaml", "sglang-pod.yaml"])
def test_the_monitors_scrape_the_sidecars_port_as_the_rules_job(pod) -> None:
    spec = yaml.safe_load((REPO / "deploy" / pod).read_text())
    (sidecar,) = [c for c in spec["spec"]["containers"] if c["name"] == "mla-watch"]
    ports = {port["name"] for port in sidecar["ports"]}
    service, service_monitor = yaml.safe_load_all((REPO / "deploy" / "servicemonitor.yaml").read_text())
    pod_monitor = yaml.safe_load((REPO / "deploy" / "podmonitor.yaml").read_text())
    assert service["spec"]["selector"].items() <= spec["metadata"]["labels"].items()
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= ports
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= spec["metadata"]["labels"].items()
    for endpoint in (*service_monitor["spec"]["endpoints"], *pod_monitor["spec"]["podMetricsEndpoints"]):
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in ports | {port["name"] for port in service["spec"]["ports"]}
        assert {"targetLabel": "job", "replacement": JOB} in endpoint["relabelings"]  # what the rules select
