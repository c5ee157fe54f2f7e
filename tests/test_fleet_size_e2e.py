"""The fleet view at fleet size: ten DeepSeek-V3 replicas on four business lines (596,240 per-expert series) scraped
by one real Prometheus, with the rules `mla-watch rules export --fleet` writes loaded.

Every router and line's fleet entropy, normalized entropy, MaxVio, dead experts, tokens and trusted minimum, each
replica's KL from the fleet and the replicas' Jensen-Shannon divergence equal mla_watch's own computation of the
replicas' windows summed; every rule of the fleet groups evaluates without error, and one evaluation of each reads
no more samples than the manual's budget. The groups' evaluation time is read from Prometheus' rule API and
printed, not judged: `bench/fleet_rules.py` measures it.

Prometheus comes from Debian's package, which `.ci/run` installs.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from harness.helpers import running_tool
from harness.simulated_fleet import (
    DEEPSEEK_V3,
    build_replicas,
    expected,
    read_budget,
    samples_per_evaluation,
    serving,
)
from harness.support import wait_until
from mla_watch import cli
from mla_watch.alerting.fleet import (
    FLEET_DEAD_SLOTS,
    FLEET_ENTROPY_BITS,
    FLEET_GROUP_NAME,
    FLEET_JS_DIVERGENCE,
    FLEET_MAX_VIOLATION,
    FLEET_MIN_TOKENS,
    FLEET_NORMALIZED_ENTROPY,
    FLEET_REPLICAS,
    FLEET_SLOTS,
    FLEET_TOKENS,
    REPLICA_GROUP_NAME,
    REPLICA_KL_BITS,
)
from mla_watch.routing.series import BUSINESS_LINE, INSTANCE, ROUTER

pytestmark = pytest.mark.slow

REPLICAS, LINES = 10, 4
WINDOW_TOKENS = 4096  # the sidecar's default window: what each replica's counts hold
SCRAPE_SECONDS = 10
TOLERANCE = 1e-9


def by_pair(url: str, name: str, *more: str) -> dict[tuple[str, ...], float]:
    answer = httpx.get(url + "/api/v1/query", params={"query": name}, timeout=120).json()
    assert answer["status"] == "success", answer
    return {
        (s["metric"][ROUTER], s["metric"][BUSINESS_LINE], *(s["metric"][k] for k in more)): float(s["value"][1])
        for s in answer["data"]["result"]
    }


def evaluated_at(group: dict) -> float:
    """When the group's last whole evaluation began, in seconds since the epoch (RFC 3339 in the rule API)."""
    stamp = re.sub(r"(\.\d{6})\d+", r"\1", group["lastEvaluation"]).replace("Z", "+00:00")  # Go's nanoseconds
    return datetime.fromisoformat(stamp).timestamp()


def test_ten_replicas_of_four_lines_record_their_fleet_statistics_exactly(tmp_path: Path) -> None:
    rules = tmp_path / "fleet.rules.yml"
    assert (
        cli.main(
            ["rules", "export", "--fleet", "--fleet-interval", "20s", "--outlier-interval", "40s", "--out", str(rules)]
        )
        == 0
    )
    replicas = build_replicas(REPLICAS, DEEPSEEK_V3, LINES, WINDOW_TOKENS, np.random.default_rng(7))
    for replica in replicas:
        replica.render("")  # the windows stay as they are: every scrape reads this body
    with serving(replicas) as targets:
        want = expected(replicas)
        assert len(want) == DEEPSEEK_V3.routers * LINES
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_SECONDS}s",
                "scrape_timeout": f"{SCRAPE_SECONDS}s",
                "evaluation_interval": "20s",
            },
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "mla_watch", "static_configs": [{"targets": targets}]}],
        }
        # What this judges is what the groups record, not how fast: on a loaded machine a query may take longer than
        # Prometheus' 2 minutes by default, and that is the bench's to measure.
        with running_tool("prometheus", tmp_path, yaml.safe_dump(config), "--query.timeout=10m") as url:
            tokens = {key: float(found.stats.tokens) for key, found in want.items()}

            def groups() -> dict[str, dict]:
                answer = httpx.get(url + "/api/v1/rules", timeout=60).json()
                return {group["name"]: group for group in answer["data"]["groups"]}

            started = time.monotonic()

            # Every replica scraped: the fleet's tokens read it. Then a whole evaluation of each fleet group that began
            # after it, so that every recording is of that evaluation (a round takes seconds, rule after rule).
            def logs() -> str:
                up = httpx.get(url + "/api/v1/query", params={"query": "up"}, timeout=60).json()["data"]["result"]
                return f"up: {[s['value'][1] for s in up]}\n" + (tmp_path / "prometheus.log").read_text()[-3000:]

            assert wait_until(lambda: by_pair(url, FLEET_TOKENS) == tokens, timeout=600, interval=5), logs()
            scraped = time.time()
            assert wait_until(
                lambda: (
                    min(
                        evaluated_at(group)
                        for name, group in groups().items()
                        if name in (FLEET_GROUP_NAME, REPLICA_GROUP_NAME)
                    )
                    > scraped
                ),
                timeout=600,
                interval=5,
            )
            every = groups()
            failed = [
                (rule["name"], rule.get("lastError"))
                for group in every.values()
                for rule in group["rules"]
                if rule.get("health") != "ok" or rule.get("lastError")
            ]
            assert not failed, failed
            print(
                f"\n{len(targets)} replicas x {LINES} lines of DeepSeek-V3, recorded "
                f"{time.monotonic() - started:.0f} s after Prometheus started: "
                + ", ".join(
                    f"{name} evaluated in {every[name]['evaluationTime']:.2f} s (interval "
                    f"{every[name]['interval']:g} s)"
                    for name in (FLEET_GROUP_NAME, REPLICA_GROUP_NAME)
                )
            )
            entropy, normalized = by_pair(url, FLEET_ENTROPY_BITS), by_pair(url, FLEET_NORMALIZED_ENTROPY)
            maxvio, dead, slots = (
                by_pair(url, FLEET_MAX_VIOLATION),
                by_pair(url, FLEET_DEAD_SLOTS),
                by_pair(url, FLEET_SLOTS),
            )
            minimum, jsd, counted = (
                by_pair(url, FLEET_MIN_TOKENS),
                by_pair(url, FLEET_JS_DIVERGENCE),
                by_pair(url, FLEET_REPLICAS),
            )
            kl = by_pair(url, REPLICA_KL_BITS, INSTANCE)
            # What a replica costs each evaluation stays within the budget the manual states (docs/fleet.md).
            read = samples_per_evaluation(url, (FLEET_GROUP_NAME, REPLICA_GROUP_NAME))
            budget = read_budget(REPLICAS, len(want), DEEPSEEK_V3.experts)
            print(f"samples read per evaluation: {read} (budget {budget})")
    for key, found in want.items():
        stats = found.stats
        assert entropy[key] == pytest.approx(stats.entropy_bits, abs=TOLERANCE), key
        assert normalized[key] == pytest.approx(stats.normalized_entropy, abs=TOLERANCE), key
        assert maxvio[key] == pytest.approx(stats.max_violation, abs=TOLERANCE), key
        assert (dead[key], slots[key], minimum[key]) == (stats.dead_slots, stats.num_slots, stats.min_tokens), key
        assert stats.dead_slots >= 3  # the experts nobody picks: a count the rules make, not a zero by default
        assert jsd[key] == pytest.approx(found.jsd_bits, abs=TOLERANCE), key
        assert counted[key] == len(found.kl_bits) == REPLICAS
        for target, value in found.kl_bits.items():
            assert kl[(*key, target)] == pytest.approx(value, abs=TOLERANCE), (key, target)
    assert read[FLEET_GROUP_NAME] <= budget[0] and read[REPLICA_GROUP_NAME] <= budget[1], (read, budget)
    # The skewed replica routes apart on its one router and line: the largest KL of the fleet, by far.
    router, line = replicas[0].windows.routers[0].name, "line_0"
    skewed = kl[(router, line, replicas[-1].target)]
    peers = [kl[(router, line, replica.target)] for replica in replicas[:-1]]
    assert skewed > 10 * max(peers) and skewed == max(kl.values())
