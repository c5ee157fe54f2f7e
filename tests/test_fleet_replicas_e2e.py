"""A fleet of three replicas, one picture: real Prometheus scrapes three live sidecars (the bundled model, each
with its own traffic) and evaluates the fleet rules `mla-watch rules export --fleet` writes; real Alertmanager
routes the alerts with the shipped deploy/alertmanager.yaml.

* Its fleet entropy, normalized entropy, MaxVio, dead experts and tokens per router and business line equal
  mla_watch's own statistics (`compute_stats`) of the three sidecars' windows summed, to 1e-9; each replica's
  divergence from the fleet and the replicas' Jensen-Shannon divergence equal ours too.
* One replica given a collapsed router is named by the outlier rule, and on-call gets one notification naming it.
* Every replica collapsed: one notification for the fleet, not one per replica.

Prometheus and Alertmanager come from Debian's packages, which `.ci/run` installs.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness import processes
from harness.helpers import binary, running_tool
from harness.receivers import running_receiver
from harness.support import REPO, running_sidecar, wait_until
from mla_watch import cli
from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.alerting.fleet import (
    FLEET_DEAD_SLOTS,
    FLEET_ENTROPY_BITS,
    FLEET_JS_DIVERGENCE,
    FLEET_MAX_VIOLATION,
    FLEET_NORMALIZED_ENTROPY,
    FLEET_TOKENS,
    OUTLIER_ALERT,
    REPLICA_KL_BITS,
)
from mla_watch.routing.stats import compute_stats

pytestmark = pytest.mark.slow

COLLAPSED = "model.layers.1.mlp.gate"
MIXED, ONE_BROKEN, ALL_BROKEN = "code_assistant", "customer_service", "doc_summary"
PROMPTS = [
    "def parse_invoice(path):\n    with open(path) as handle:\n        rows = [line.split(',') for line in",
    "Dear customer, thank you for contacting support about your order. We are sorry that the parcel",
    "SELECT c.name, SUM(o.total) FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY",
    "Summary of the quarterly report: revenue grew in every region, while operating costs rose",
]


def send(url: str, line: str, requests: int, seed: int) -> None:
    for i in range(requests):
        response = httpx.post(
            url + "/v1/completions",
            timeout=120,
            headers={"X-Business-Line": line},
            json={
                "prompt": PROMPTS[(seed + i) % len(PROMPTS)],
                "max_tokens": 32,
                "temperature": 0.9,
                "seed": seed * 100 + i,
            },
        )
        assert response.status_code == 200, response.text


def collapse(sidecar: object) -> None:
    """Push layer 1's correction bias towards six experts: that replica's router collapses."""
    gate = sidecar.model_worker.model.model.layers[1].mlp.gate  # type: ignore[attr-defined]
    with torch.no_grad():
        gate.e_score_correction_bias[:6] += 10.0


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def vector(self, query: str) -> list[dict]:
        answer = httpx.get(self.url + "/api/v1/query", params={"query": query}, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def values(self, query: str, *keys: str) -> dict[tuple[str, ...], float]:
        return {
            tuple(sample["metric"].get(key, "") for key in keys): float(sample["value"][1])
            for sample in self.vector(query)
        }


def summed(sidecars: list, router: str, line: str) -> tuple[list[np.ndarray], list[int]]:
    """Each replica's window counts and tokens of ``router`` on ``line`` (what its per-expert gauges export)."""
    counts, tokens = [], []
    for sidecar in sidecars:
        sidecar.probe.collect()
        total = sidecar.probe.windows.window_totals(router, line)
        counts.append(np.zeros(64, dtype=np.int64) if total is None else total.counts)
        tokens.append(0 if total is None else total.tokens)
    return counts, tokens


def entropy(counts: np.ndarray) -> float:
    shares = counts[counts > 0] / counts.sum()
    return float(-(shares * np.log2(shares)).sum())


def kl_bits(replica: np.ndarray, fleet: np.ndarray) -> float:
    p, q = replica / replica.sum(), fleet / fleet.sum()
    keep = p > 0
    return float((p[keep] * np.log2(p[keep] / q[keep])).sum())


def test_prometheus_computes_exact_fleet_routing_and_names_the_broken_replica(tmp_path: Path) -> None:
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "routing.yaml").write_text(entropy_low_rules(hold="1s", group_by=False))
    exported = tmp_path / "fleet.rules.yml"
    assert (
        cli.main(
            [
                "rules",
                "export",
                "--rules",
                str(rules_dir),
                "--fleet",
                "--fleet-interval",
                "1s",
                "--outlier-interval",
                "1s",
                "--outlier-for",
                "1s",
                "--out",
                str(exported),
            ]
        )
        == 0
    )
    check = processes.run(
        [binary("promtool"), "check", "rules", str(exported)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr

    with ExitStack() as stack, running_receiver() as receiver:
        replicas = [stack.enter_context(running_sidecar(rules=None, export_expert_counts="all")) for _ in range(3)]
        urls = [url for url, _ in replicas]
        sidecars = [sidecar for _, sidecar in replicas]
        instances = [url.removeprefix("http://") for url in urls]
        shipped = yaml.safe_load((REPO / "deploy" / "alertmanager.yaml").read_text())
        for receiver_config in shipped["receivers"]:
            for webhook in receiver_config.get("webhook_configs", []):
                webhook["url"] = receiver.url + "/alerts"
        # The shipped routing, its wait shortened (30 s) so that the test does not sit through it: the alerts of
        # one problem that fire within it page together; group_interval stays 5 m, so a later one would not
        # page again within this test, and any second page seen here is a second problem.
        shipped["route"]["group_wait"] = "10s"
        alertmanager = stack.enter_context(
            running_tool("prometheus-alertmanager", tmp_path, yaml.safe_dump(shipped), "--cluster.listen-address=")
        )
        targets = ", ".join(f"'{instance}'" for instance in instances)
        prometheus = Prometheus(
            stack.enter_context(
                running_tool(
                    "prometheus",
                    tmp_path,
                    (
                        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                        f"rule_files: [{exported}]\n"
                        "alerting:\n  alertmanagers:\n    - static_configs:\n"
                        f"        - targets: ['{alertmanager.removeprefix('http://')}']\n"
                        "scrape_configs:\n  - job_name: mla_watch\n    static_configs:\n"
                        f"      - targets: [{targets}]\n"
                    ),
                )
            )
        )

        def logs() -> str:
            return (tmp_path / "prometheus.log").read_text()[-3000:] + (
                tmp_path / "prometheus-alertmanager.log"
            ).read_text()[-3000:]

        # 1. Healthy traffic, a different amount on each replica: exact fleet statistics.
        for index, url in enumerate(urls):
            send(url, MIXED, 2 + 2 * index, seed=index)
        routers = [info for info in sidecars[0].probe.routers if info.kind == "expert"]
        sums = {info.name: summed(sidecars, info.name, MIXED) for info in routers}
        want_tokens = {(info.name,): float(sum(sums[info.name][1])) for info in routers}

        def scraped() -> bool:
            line = f'{{business_line="{MIXED}"}}'
            return prometheus.values(FLEET_TOKENS + line, "router") == want_tokens

        assert wait_until(scraped, timeout=90, interval=0.5), logs()
        by_router = {name: f'{{business_line="{MIXED}",router="{name}"}}' for name in sums}
        for info in routers:
            counts, tokens = sums[info.name]
            fleet = np.sum(counts, axis=0)
            stats = compute_stats(fleet, kind="expert", top_k=info.top_k, tokens=sum(tokens))
            got = {
                name: prometheus.values(name + by_router[info.name], "router")[(info.name,)]
                for name in (FLEET_ENTROPY_BITS, FLEET_NORMALIZED_ENTROPY, FLEET_MAX_VIOLATION, FLEET_DEAD_SLOTS)
            }
            assert got[FLEET_ENTROPY_BITS] == pytest.approx(stats.entropy_bits, abs=1e-9)
            assert got[FLEET_NORMALIZED_ENTROPY] == pytest.approx(stats.normalized_entropy, abs=1e-9)
            assert got[FLEET_MAX_VIOLATION] == pytest.approx(stats.max_violation, abs=1e-9)
            assert got[FLEET_DEAD_SLOTS] == stats.dead_slots
            kl = prometheus.values(REPLICA_KL_BITS + by_router[info.name], "instance")
            expected_kl = {
                (instance,): kl_bits(replica, fleet) for instance, replica in zip(instances, counts, strict=True)
            }
            assert kl.keys() == expected_kl.keys()
            for key, value in expected_kl.items():
                assert kl[key] == pytest.approx(value, abs=1e-9)
            weights = [replica.sum() / fleet.sum() for replica in counts]
            jsd = prometheus.values(FLEET_JS_DIVERGENCE + by_router[info.name], "router")[(info.name,)]
            assert jsd == pytest.approx(
                sum(w * kl_bits(c, fleet) for w, c in zip(weights, counts, strict=True)), abs=1e-9
            )
            # fleet entropy = the replicas' weighted mean entropy + their generalized JS divergence
            assert got[FLEET_ENTROPY_BITS] == pytest.approx(
                sum(w * entropy(c) for w, c in zip(weights, counts, strict=True)) + jsd, abs=1e-9
            )
            assert math.isfinite(got[FLEET_ENTROPY_BITS]) and got[FLEET_ENTROPY_BITS] > 4.0  # healthy routing
        assert not prometheus.vector(f'ALERTS{{alertstate="firing", business_line="{MIXED}"}}')

        # 2. One replica's router collapses: the outlier rule names it, on-call hears once.
        collapse(sidecars[2])
        for index, url in enumerate(urls):
            send(url, ONE_BROKEN, 4 if index < 2 else 3, seed=10 + index)

        def outliers() -> set[str]:
            return {
                sample["metric"]["instance"]
                for sample in prometheus.vector(
                    f'ALERTS{{alertname="{OUTLIER_ALERT}", alertstate="firing", business_line="{ONE_BROKEN}"}}'
                )
            }

        assert wait_until(lambda: outliers() == {instances[2]}, timeout=90, interval=0.5), (outliers(), logs())
        assert {
            s["metric"]["router"]
            for s in prometheus.vector(f'ALERTS{{alertname="{OUTLIER_ALERT}", alertstate="firing"}}')
        } == {COLLAPSED}

        def notifications(line: str) -> list[dict]:
            return [
                body
                for body in (request.json() for request in list(receiver.requests))
                if body.get("status") == "firing"
                and any(alert["labels"].get("business_line") == line for alert in body["alerts"])
            ]

        def paging_groups(line: str) -> list[dict]:
            """Alertmanager's groups holding an alert of ``line`` it would send (neither silenced nor inhibited):
            each pages once, after group_wait, and not again within group_interval."""
            groups = httpx.get(
                alertmanager + "/api/v2/alerts/groups",
                timeout=10,
                params={"active": "true", "silenced": "false", "inhibited": "false"},
            ).json()
            return [
                group
                for group in groups
                if any(alert["labels"].get("business_line") == line for alert in group["alerts"])
            ]

        def paged_already(group: dict, page: dict) -> bool:
            """Whether Alertmanager's ``group`` is the one that sent ``page`` (it pages again only after
            group_interval)."""
            return group["receiver"]["name"] == page["receiver"] and group["labels"] == page["groupLabels"]

        def rule_rounds() -> dict[str, float]:
            """Prometheus's evaluations so far, by rule group."""
            text = httpx.get(prometheus.url + "/metrics", timeout=10).text
            return {
                sample.labels["rule_group"]: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "prometheus_rule_group_iterations_total"
            }

        def settled() -> None:
            """Every rule group evaluated twice more (what fires has fired and reached Alertmanager by then)."""
            before = rule_rounds()
            assert wait_until(
                lambda: all(rule_rounds().get(group, 0) >= done + 2 for group, done in before.items()),
                timeout=60,
                interval=0.2,
            ), logs()

        assert wait_until(lambda: bool(notifications(ONE_BROKEN)), timeout=60, interval=0.5), logs()
        settled()  # a second group of the same fault would be in Alertmanager now, waiting to page
        [page] = notifications(ONE_BROKEN)
        assert all(paged_already(group, page) for group in paging_groups(ONE_BROKEN)), paging_groups(ONE_BROKEN)
        assert page["commonLabels"].get("instance") == instances[2]  # the page names the broken replica
        assert OUTLIER_ALERT in {alert["labels"]["alertname"] for alert in page["alerts"]}

        # 3. Every replica's router collapses: one notification for the fleet, not three.
        collapse(sidecars[0])
        collapse(sidecars[1])
        for index, url in enumerate(urls):
            send(url, ALL_BROKEN, 3, seed=20 + index)
        fleet_alerts = f'ALERTS{{alertname="RoutingEntropyLow", alertstate="firing", business_line="{ALL_BROKEN}"}}'
        assert wait_until(
            lambda: any("instance" not in s["metric"] for s in prometheus.vector(fleet_alerts)),
            timeout=90,
            interval=0.5,
        ), logs()
        assert not any(
            s["metric"].get("business_line") == ALL_BROKEN
            for s in prometheus.vector(f'ALERTS{{alertname="{OUTLIER_ALERT}"}}')
        )  # everyone alike: no outlier
        assert wait_until(lambda: bool(notifications(ALL_BROKEN)), timeout=60, interval=0.5), logs()
        settled()
        [page] = notifications(ALL_BROKEN)
        assert all(paged_already(group, page) for group in paging_groups(ALL_BROKEN)), paging_groups(ALL_BROKEN)
        assert page["commonLabels"].get("scope") == "fleet"
