"""The fleet recording rules and alerts (`mla-watch rules export --fleet`), run by the real promtool.

Three replicas of a small router (8 experts, top-2, two business lines) feed counters into `promtool test rules`;
what Prometheus records must be what mla_watch's own compute_stats says of the summed window deltas.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from mla_watch.alerting import fleet
from mla_watch.alerting.fleet_versions import VERSION_GROUP_NAME, VERSION_SKEW_ALERT
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.routing.stats import compute_stats, entropy_bits, minimum_window_tokens
from tests import processes
from tests.support import REPO

JOB = "mla_watch"
ROUTER = "model.layers.1.mlp.gate"
LAYER = "1"
TOP_K = 2
STEPS = 90  # minutes of input, one sample a minute
EVAL = STEPS  # evaluated at the last sample: the window is (30m, 90m]
WINDOW = 60
TOLERANCE = 1e-9  # sums of p log p in another order than numpy's differ in the last bits


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: .ci/run installs Debian's prometheus package (/usr/bin/promtool)"
    return path


@dataclass(frozen=True)
class Series:
    """One replica's counter for one expert (or its tokens): a base, a rate per minute, and when it starts or
    resets (in minutes)."""

    base: int
    rate: int
    start: int = 0
    reset_at: int | None = None

    def values(self) -> str:
        if self.reset_at is not None:
            return f"{self.base}+{self.rate}x{self.reset_at - 1} 0+{self.rate}x{STEPS - self.reset_at}"
        if self.start:
            return f"_x{self.start} {self.base}+{self.rate}x{STEPS - self.start}"
        return f"{self.base}+{self.rate}x{STEPS}"

    def at(self, minute: int) -> int | None:
        """The sample PromQL sees at ``minute`` (5 minutes of look-back; samples every minute)."""
        if minute < self.start:
            return None
        if self.reset_at is not None and minute >= self.reset_at:
            return (minute - self.reset_at) * self.rate
        return self.base + (minute - self.start) * self.rate

    def window_delta(self) -> int:
        """The exact delta the rules must record: now minus a window ago, whole if newer, after a reset."""
        now, before = self.at(EVAL), self.at(EVAL - WINDOW)
        assert now is not None
        return now - before if before is not None and now >= before else now


def labels(instance: str, line: str, **more: str) -> str:
    pairs = {"job": JOB, "instance": instance, "router": ROUTER, "layer": LAYER, "kind": "expert",
             "business_line": line, **more}
    return "{" + ",".join(f'{key}="{value}"' for key, value in pairs.items()) + "}"


def fleet_labels(line: str) -> str:
    return "{" + f'job="{JOB}",router="{ROUTER}",layer="{LAYER}",kind="expert",business_line="{line}"' + "}"


Replicas = dict[str, dict[str, list[Series]]]  # instance -> line -> per-expert series


def input_series(replicas: Replicas) -> list[dict[str, str]]:
    out = []
    for instance, lines in replicas.items():
        for line, experts in lines.items():
            for expert, series in enumerate(experts):
                out.append({"series": fleet.SELECTIONS_COUNTER + labels(instance, line, expert=str(expert)),
                            "values": series.values()})
            rate = sum(s.rate for s in experts)
            assert rate % TOP_K == 0
            first = experts[0]
            tokens = Series(sum(s.base for s in experts) // TOP_K, rate // TOP_K, first.start, first.reset_at)
            out.append({"series": fleet.TOKENS_COUNTER + labels(instance, line), "values": tokens.values()})
            # The sidecar's floor gauge: log2 min(top_k, experts)
            out.append({"series": "mla_watch_routing_entropy_floor_bits" + labels(instance, line),
                        "values": f"{math.log2(TOP_K)!r}+0x{STEPS}"})
    return out


def rates(*values: int, base: int = 500, **kwargs: int) -> list[Series]:
    return [Series(base, rate, **kwargs) for rate in values]


def exact(name: str, selector: str, value: float) -> dict:
    return {"expr": name + selector, "eval_time": f"{EVAL}m",
            "exp_samples": [{"labels": name + selector, "value": value}]}


def close(name: str, selector: str, value: float) -> dict:
    """promtool compares exactly; a float that Prometheus sums in its own order is checked within TOLERANCE."""
    return {"expr": f"abs({name}{selector} - {float(value)!r}) <= bool {TOLERANCE}", "eval_time": f"{EVAL}m",
            "exp_samples": [{"labels": selector, "value": 1}]}


def run_tests(tmp_path: Path, tests: list[dict], rule_file: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "fleet_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    return processes.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120,
                         check=False)


def export(*args: str) -> str:
    result = processes.run([sys.executable, "-m", "mla_watch.cli", "rules", "export", *args], capture_output=True,
                           text=True, timeout=120, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def fleet_rule_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "fleet.rules.yml"
    path.write_text(export("--format", "prometheus", "--fleet"))
    return path


# Line A: r2 started 40 minutes ago (newer than the window: it counts whole). Line B: r1 restarted 20 minutes ago
# (a reset: what came after it counts), and expert 7 is never chosen (one dead slot).
STATS_REPLICAS: Replicas = {
    "r0": {"code_assistant": rates(3, 1, 2, 2, 1, 3, 2, 2), "customer_service": rates(5, 3, 1, 4, 2, 1, 0, 0)},
    "r1": {"code_assistant": rates(2, 2, 2, 2, 2, 2, 2, 2),
           "customer_service": rates(2, 2, 2, 2, 2, 2, 4, 0, reset_at=70)},
    "r2": {"code_assistant": rates(4, 0, 2, 2, 2, 2, 2, 2, base=0, start=50),
           "customer_service": rates(1, 3, 3, 3, 3, 3, 0, 0)},
}


def expected(replicas: Replicas, line: str) -> tuple[object, dict[str, float], float]:
    """compute_stats of the summed window deltas, each replica's KL from the fleet, and the JSD."""
    per_replica = {name: np.array([s.window_delta() for s in lines[line]], dtype=np.float64)
                   for name, lines in replicas.items()}
    summed = sum(per_replica.values())
    tokens = int(summed.sum()) // TOP_K
    stats = compute_stats(summed, kind="expert", top_k=TOP_K, tokens=tokens)
    fleet_p = summed / summed.sum()
    kl = {}
    for name, counts in per_replica.items():
        p = counts / counts.sum()
        nonzero = p > 0
        kl[name] = float(np.sum(p[nonzero] * np.log2(p[nonzero] / fleet_p[nonzero])))
    weights = {name: counts.sum() / summed.sum() for name, counts in per_replica.items()}
    jsd = float(sum(weights[name] * kl[name] for name in replicas))
    # The decomposition the recordings rest on: H_fleet = sum_r w_r H_r + JSD.
    within = sum(weights[name] * entropy_bits(counts) for name, counts in per_replica.items())
    assert math.isclose(stats.entropy_bits, within + jsd, abs_tol=1e-12)
    return stats, kl, jsd


def test_fleet_recordings_equal_compute_stats_of_the_summed_window(tmp_path, fleet_rule_file) -> None:
    checks: list[dict] = []
    for line in ("code_assistant", "customer_service"):
        stats, kl, jsd = expected(STATS_REPLICAS, line)
        where = fleet_labels(line)
        checks += [
            close(fleet.FLEET_ENTROPY_BITS, where, stats.entropy_bits),
            close(fleet.FLEET_NORMALIZED_ENTROPY, where, stats.normalized_entropy),
            close(fleet.FLEET_BITS_BELOW_CEILING, where, stats.bits_below_ceiling),
            close(fleet.FLEET_MAX_VIOLATION, where, stats.max_violation),
            close(fleet.FLEET_CEILING_BITS, where, stats.ceiling_bits),
            close(fleet.FLEET_FLOOR_BITS, where, stats.floor_bits),
            close(fleet.FLEET_JS_DIVERGENCE, where, jsd),
            exact(fleet.FLEET_DEAD_SLOTS, where, stats.dead_slots),
            exact(fleet.FLEET_TOKENS, where, stats.tokens),
            exact(fleet.FLEET_SLOTS, where, stats.num_slots),
            exact(fleet.FLEET_MIN_TOKENS, where, stats.min_tokens),
            exact(fleet.FLEET_REPLICAS, where, 3),
            close(fleet.FLEET_MEDIAN_REPLICA_KL, where, sorted(kl.values())[1]),
        ]
        checks += [close(fleet.REPLICA_KL_BITS, labels(name, line), value) for name, value in kl.items()]
    # Line A has every expert chosen: dead slots is a 0 sample, not an absent series.
    assert expected(STATS_REPLICAS, "code_assistant")[0].dead_slots == 0
    assert expected(STATS_REPLICAS, "customer_service")[0].dead_slots == 1
    # A replica newer than the window counts whole; a reset counts what came after it.
    newer = STATS_REPLICAS["r2"]["code_assistant"][0]
    checks.append(exact(fleet.REPLICA_EXPERT_SELECTIONS, labels("r2", "code_assistant", expert="0"),
                        newer.at(EVAL)))
    reset = STATS_REPLICAS["r1"]["customer_service"][6]
    checks.append(exact(fleet.REPLICA_EXPERT_SELECTIONS, labels("r1", "customer_service", expert="6"),
                        reset.at(EVAL)))
    assert newer.window_delta() == newer.at(EVAL) and reset.window_delta() == reset.at(EVAL)
    result = run_tests(tmp_path, [{"interval": "1m", "input_series": input_series(STATS_REPLICAS),
                                   "promql_expr_test": checks}], fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_checks_can_fail(tmp_path, fleet_rule_file) -> None:
    stats, _, _ = expected(STATS_REPLICAS, "code_assistant")
    wrong = close(fleet.FLEET_ENTROPY_BITS, fleet_labels("code_assistant"), stats.entropy_bits + 1e-6)
    result = run_tests(tmp_path, [{"interval": "1m", "input_series": input_series(STATS_REPLICAS),
                                   "promql_expr_test": [wrong]}], fleet_rule_file)
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_minimum_tokens_follow_the_geometry(tmp_path, fleet_rule_file) -> None:
    """The fleet's trusted minimum is the sidecar's, computed in PromQL from the slots and the floor gauge."""
    tests = []
    for experts, top_k in ((8, 2), (64, 6), (16, 20), (1, 1)):
        lines = []
        for expert in range(experts):
            lines.append({"series": fleet.SELECTIONS_COUNTER + labels("r0", "doc_summary", expert=str(expert)),
                          "values": f"0+1x{STEPS}"})
        lines.append({"series": "mla_watch_routing_entropy_floor_bits" + labels("r0", "doc_summary"),
                      "values": f"{math.log2(min(top_k, experts))!r}+0x{STEPS}"})
        tests.append({"interval": "1m", "input_series": lines, "promql_expr_test": [
            exact(fleet.FLEET_MIN_TOKENS, fleet_labels("doc_summary"), minimum_window_tokens(experts, top_k))]})
    result = run_tests(tmp_path, tests, fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


UNIFORM = (2, 2, 2, 2, 2, 2, 2, 2)
COLLAPSED = (8, 8, 0, 0, 0, 0, 0, 0)


def alerts_firing(alertname: str, rows: list[dict[str, str]]) -> dict:
    return {"expr": f'ALERTS{{alertstate="firing", alertname="{alertname}"}}', "eval_time": f"{EVAL}m",
            "exp_samples": [{"labels": "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in row.items()) + "}", "value": 1}
                            for row in rows]}


def alert_case(replicas: dict[str, tuple[int, ...]], checks: list[dict]) -> dict:
    series = {name: {"code_assistant": rates(*values)} for name, values in replicas.items()}
    return {"interval": "1m", "input_series": input_series(series), "promql_expr_test": checks}


def fleet_alert(alertname: str, severity: str, **more: str) -> dict[str, str]:
    return {"alertname": alertname, "alertstate": "firing", "job": JOB, "router": ROUTER, "layer": LAYER,
            "kind": "expert", "business_line": "code_assistant", "severity": severity, **more}


def test_one_collapsed_replica_is_an_outlier_and_the_fleet_twin_stays_quiet(tmp_path, fleet_rule_file) -> None:
    outlier = fleet_alert(fleet.OUTLIER_ALERT, "warning", instance="r2", scope="replica")
    case = alert_case({"r0": UNIFORM, "r1": UNIFORM, "r2": COLLAPSED}, [
        alerts_firing(fleet.OUTLIER_ALERT, [outlier]),  # r2 only: its healthy peers are not named
        alerts_firing("RoutingCollapse", []),  # the fleet's mix is still balanced enough
    ])
    result = run_tests(tmp_path, [case], fleet_rule_file)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_a_fleet_wide_collapse_fires_the_fleet_twin_and_no_outlier(tmp_path, fleet_rule_file) -> None:
    twin = fleet_alert("RoutingCollapse", "critical", scope="fleet", team="ml-platform")
    case = alert_case({"r0": COLLAPSED, "r1": COLLAPSED, "r2": COLLAPSED}, [
        alerts_firing("RoutingCollapse", [twin]),
        alerts_firing(fleet.OUTLIER_ALERT, []),
    ])
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
    args = ["--format", file_format, *(["--fleet", "--fleet-labels", "namespace,job", "--replica-label", "pod",
                                        "--fleet-window", "2h", "--fleet-interval", "2m"] if with_fleet else [])]
    document = groups_of(export(*args), file_format)
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(document))
    result = processes.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [group["name"] for group in document["groups"]]
    assert names == (["mla_watch_routing", fleet.FLEET_GROUP_NAME, VERSION_GROUP_NAME] if with_fleet
                     else ["mla_watch_routing"])
    if with_fleet:
        records = [r["record"] for r in document["groups"][1]["rules"] if "record" in r]
        assert records == list(fleet.RECORDING_NAMES)
        assert "by (namespace, job, pod, router" in document["groups"][1]["rules"][0]["expr"]
        assert "offset 2h" in document["groups"][1]["rules"][0]["expr"]
        assert document["groups"][1]["interval"] == "2m"


def test_the_shipped_prometheusrule_is_the_export() -> None:
    shipped = (REPO / "deploy" / "prometheusrule.yaml").read_text()
    assert shipped == export("--format", "operator", "--fleet")
    assert "mla-watch rules export --format operator --fleet" in shipped.splitlines()[0]


def test_fleet_twins_carry_the_rules_labels_and_thresholds() -> None:
    document = yaml.safe_load(export("--fleet"))
    replica, fleet_group, versions = document["groups"]
    assert [rule["alert"] for rule in versions["rules"]] == [VERSION_SKEW_ALERT]
    assert all(rule["labels"]["scope"] == "replica" for rule in replica["rules"])
    alerts = {rule["alert"]: rule for rule in fleet_group["rules"] if "alert" in rule}
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
    (["--fleet-window", "1h"], lambda e: "--fleet-window 1h" in e and "--fleet" in e),
    (["--fleet", "--fleet-window", "30s"], lambda e: "--fleet-window '30s'" in e and "1m to 31d" in e),
    (["--fleet", "--fleet-window", "soon"], lambda e: "--fleet-window 'soon'" in e and "duration" in e),
    (["--fleet", "--fleet-interval", "0s"], lambda e: "--fleet-interval '0s'" in e and "1s to 1h" in e),
    (["--fleet", "--fleet-window", "5m", "--fleet-interval", "10m"],
     lambda e: "--fleet-interval '10m'" in e and "1s to 5m" in e),
    (["--fleet-interval", "1m"], lambda e: "--fleet-interval 1m" in e and "--fleet" in e),
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
    result = processes.run([sys.executable, "-m", "mla_watch.cli", "rules", "export", *args], capture_output=True,
                           text=True, timeout=60, check=False, cwd=REPO)
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
