"""Reference readings that reach what they judge, end to end: a sidecar on the bundled model (its DSA indexers pick
``index_topk = 64`` keys) whose reference prompts are all short pages its indexer alert ``undetermined``, saying
how far each set reached; once a long set is added, its reading reaches past 2 x index_topk and the same alert
becomes ``traffic``. ``GET /v1/reference`` shows the positions each set reached.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from harness.support import running_sidecar, wait_until
from mla_watch.models import corpus
from mla_watch.references.prober import ReferenceSettings

pytestmark = pytest.mark.slow

RULE = """
receivers:
  - name: oncall
    type: alertmanager_webhook
    url: ${MLA_WATCH_REACH_TEST_UNSET_URL}
rules:
  - alert: IndexerChoosing
    metric: locality
    select: {kind: indexer, layers: [2, 2], business_line: "*"}
    above: 0.0
    resolve_below: 0.0
    for: 0s
    min_tokens: 1
    severity: warning
    actions: [notify]
    annotations:
      summary: "{router}: locality {value:.2f}"
"""


def indexer_alerts(url: str) -> list[dict]:
    return [
        alert
        for alert in httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
        if alert["labels"]["alertname"] == "IndexerChoosing"
        and alert["state"] == "firing"
        and "cause" in alert["labels"]
    ]


def test_an_indexer_alert_no_reading_reached_is_undetermined_until_a_long_set_reaches_it(tmp_path: Path) -> None:
    rules, references = tmp_path / "rules", tmp_path / "references"
    rules.mkdir()
    references.mkdir()
    (rules / "indexers.yaml").write_text(RULE)
    prompts = [text[:120] for text in corpus.prompts("customer_service", 4, seed=5)]  # under 64 tokens each
    (references / "default.yaml").write_text(
        "business_line: default\nversion: 1\nprompts:\n" + "".join(f"  - {prompt!r}\n" for prompt in prompts)
    )
    settings = ReferenceSettings(interval_seconds=0, wait_seconds=20, long_interval_seconds=0)
    with running_sidecar(rules=rules, reference_prompts=references, reference=settings, alert_interval=0.5) as (
        url,
        sidecar,
    ):
        for text in corpus.generate("doc_summary", 3, seed=9):  # past 2 x index_topk = 128 keys: the indexer chooses
            answer = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": text, "max_tokens": 4},
                headers={"X-Business-Line": "doc_summary"},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text[:300]
        assert wait_until(lambda: indexer_alerts(url), timeout=60, interval=0.5)
        (alert,) = indexer_alerts(url)
        assert alert["labels"]["cause"] == "undetermined", alert
        cause = alert["annotations"]["cause"]
        assert cause.startswith(
            "no reading of the reference prompts reached positions 127 on, where a query sees 2 x "
            "index_topk = 128 keys or more and model.layers.2.self_attn.indexer chooses among "
            "them: the longest prompt each set read (default v1 "
        ), cause
        assert "add a long set (long: true" in cause

        (references / "long_documents.yaml").write_text(
            "business_line: long_documents\nversion: 1\nlong: true\ngenerate: {documents: 2}\n"
        )
        assert sidecar.references.sets.reload().changed
        assert wait_until(
            lambda: [a for a in indexer_alerts(url) if a["labels"]["cause"] == "traffic"], timeout=90, interval=0.5
        ), indexer_alerts(url)
        (alert,) = indexer_alerts(url)
        assert alert["annotations"]["summary"].startswith("TRAFFIC CHANGED")
        assert [entry["set"] for entry in alert["cause"]["details"]["sets"]] == ["long_documents"]
        assert alert["cause"]["details"]["reach"]["from_position"] == 127

        described = httpx.get(f"{url}/v1/reference", timeout=30).json()
        assert described["prompt_tokens"] == 512 and described["long_share"] == settings.long_share
        by_set = {entry["name"]: entry for entry in described["sets"]}
        assert by_set["long_documents"]["long"] and by_set["long_documents"]["baseline"] is not None
        reading = by_set["long_documents"]["reading"]
        assert reading["reach"] == 512 and reading["positions"] == {
            "0-63": 128,
            "64-127": 128,
            "128-255": 256,
            "256-511": 512,
            "512+": 0,
        }
        short = by_set["default"]["reading"]
        assert short["reach"] < 64 and short["positions"]["64-127"] == 0 and not short["long"]
