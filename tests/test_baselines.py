"""Healthy baselines: learned per router and business line, persisted, set by hand, served (routing/baselines.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from mla_watch.routing.baselines import BASELINE_FORMAT, Baselines
from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.windows import RouterWindows
from tests.support import get_metrics, metric_value, running_sidecar, wait_until

GATE = RouterInfo("model.layers.1.mlp.gate", 1, "expert", 8, 2)
INDEXER = RouterInfo("model.layers.1.self_attn.indexer", 1, "indexer", 512, 64)


def fed(windows: RouterWindows, line: str, tokens: int, hot: int | None = None) -> None:
    counts = np.full(8, tokens * 2 // 8, dtype=np.int64)
    if hot is not None:
        counts[:] = tokens * 2 // 16
        counts[hot] += tokens * 2 - int(counts.sum())
    windows.add(GATE.name, line, CountDelta(counts, tokens))


def records(windows: RouterWindows) -> list:
    return [record for line in [None, *windows.business_lines] for record in windows.router_stats(line)]


def test_a_series_is_learned_once_its_window_holds_enough_healthy_tokens(tmp_path) -> None:
    baselines = Baselines(tmp_path / "baseline.json", learn_tokens=1000, clock=lambda: 1234.0)
    windows = RouterWindows([GATE], window_tokens=4096, baselines=baselines)
    fed(windows, "chat", 2000)
    assert baselines.learn(records(windows)) == []  # not trusted yet: nothing learned
    assert baselines.describe()["learning"] is False
    baselines.trust(None)
    fed(windows, "code", 500, hot=3)  # under learn_tokens: not yet
    learned = baselines.learn(records(windows), excluded=lambda: {(GATE.name, "all")})  # an alert on "all"
    assert sorted((b.router, b.business_line) for b in learned) == [(GATE.name, "chat")]
    (chat,) = learned
    assert chat.source == "learned" and chat.tokens == 2000 and chat.taken_at == 1234.0
    assert chat.values["max_violation"] == pytest.approx(0.0) and chat.values["dead_slots"] == 0
    fed(windows, "code", 1000, hot=3)
    learned = {b.business_line: b for b in baselines.learn(records(windows))}
    assert sorted(learned) == ["all", "code"]  # no alert on all lines summed any more
    code = learned["code"]
    assert code.values["max_violation"] > 1.0  # its own healthy skew
    assert baselines.learn(records(windows)) == []  # learned once: later windows do not replace it
    # each record carries its own line's baseline; drift is measured from it
    by_line = {record.line_label: record for record in windows.router_stats("code") + windows.router_stats("chat")}
    assert by_line["code"].as_dict()["baseline"]["max_violation"] == pytest.approx(code.values["max_violation"])
    assert by_line["code"].stats.js_divergence == pytest.approx(0.0, abs=1e-12)
    # persisted 0600, and read again by a new store (a restart neither forgets nor re-learns)
    path = tmp_path / "baseline.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    document = json.loads(path.read_text())
    assert document["format"] == BASELINE_FORMAT and len(document["series"]) == 3  # chat, code and all
    again = Baselines(path)
    again.load()
    assert again.get(GATE.name, "code").values == code.values


def test_windows_without_a_signal_are_not_learned() -> None:
    baselines = Baselines(learn_tokens=100)
    baselines.trust(None)
    windows = RouterWindows([INDEXER], window_tokens=4096, baselines=baselines)
    # contexts of 40 keys, index_topk 64: every key picked, no query with a real choice
    windows.add(INDEXER.name, "chat", CountDelta(np.array([40 - j for j in range(40)] + [0] * 472), 40 * 10))
    (record,) = windows.router_stats("chat")
    assert record.stats.no_signal is not None
    assert baselines.learn([record]) == []


def test_set_by_hand_replaces_what_was_learned(tmp_path) -> None:
    baselines = Baselines(tmp_path / "baseline.json", learn_tokens=100)
    baselines.trust(None)
    windows = RouterWindows([GATE], window_tokens=4096, baselines=baselines)
    fed(windows, "chat", 1000)
    baselines.learn(records(windows))
    fed(windows, "chat", 4000, hot=1)
    taken = windows.save_baseline(tmp_path / "baseline.json", "chat")["series"]
    assert [(entry["business_line"], entry["source"]) for entry in taken] == [("chat", "set")]
    assert baselines.get(GATE.name, "chat").values["max_violation"] > 1.0


def test_a_bad_or_planted_file_is_named_and_kept_aside_for_an_operator(tmp_path, caplog) -> None:
    path = tmp_path / "baseline.json"
    for text, words in ([("{nope", "not JSON"),
                         ('{"format": "mla_watch.baseline/9"}', "format = 'mla_watch.baseline/9': expected"),
                         (json.dumps({"format": BASELINE_FORMAT, "series": [{"router": "r", "business_line": "x",
                                                                              "counts": [1, -2], "tokens": 1,
                                                                              "values": {}, "taken_at": 0,
                                                                              "source": "learned"}]}),
                          "series[0].counts: expected a non-empty list of selection counts")]):
        path.write_text(text)
        baselines = Baselines(path, learn_tokens=100)
        baselines.load()
        assert baselines.load_error is not None and words in baselines.load_error, baselines.load_error
        assert str(path) in baselines.load_error
        baselines.trust(None)
        windows = RouterWindows([GATE], window_tokens=4096, baselines=baselines)
        fed(windows, "chat", 1000)
        assert baselines.learn(records(windows))  # learning goes on, and is saved ...
        assert json.loads(path.read_text())["format"] == BASELINE_FORMAT
        assert (tmp_path / "baseline.json.corrupt").read_text() == text  # ... and the bad file is kept aside


def test_a_legacy_file_serves_every_lines_drift(tmp_path) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"format": "mla_watch.baseline/1", "business_line": None,
                                "routers": [{**GATE.as_dict(), "counts": [10] * 8}]}))
    windows = RouterWindows([GATE], window_tokens=4096)
    windows.load_baseline(path)
    fed(windows, "chat", 1000)
    fed(windows, "sql", 1000, hot=2)
    drift = {line: windows.router_stats(line)[0].stats.js_divergence for line in ("chat", "sql")}
    assert drift["chat"] == pytest.approx(0.0, abs=1e-12) and drift["sql"] > 0.05
    assert windows.router_stats("chat")[0].baseline is None  # no healthy values: relative rules stay silent


@pytest.mark.slow
def test_serve_learns_baselines_from_healthy_traffic_and_keeps_them(tmp_path) -> None:
    state = tmp_path / "state"
    token = "b" * 24
    body = {"model": "bundled", "max_tokens": 4, "prompt": "SELECT name FROM customers WHERE id = 7 ORDER BY "
                                                          "name LIMIT 10; -- " * 6}
    headers = {"X-Business-Line": "code_assistant", "X-Task": "sql"}
    with running_sidecar(state_dir=state, baseline_tokens=400, alert_interval=0.2, admin_token=token) as (url, _):
        assert wait_until(lambda: httpx.get(url + "/v1/baseline", timeout=10).json()["learning"], timeout=60)
        for _ in range(12):
            assert httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
        assert wait_until(lambda: any(s["business_line"] == "code_assistant" for s in
                                      httpx.get(url + "/v1/baseline", timeout=10).json()["series"]), timeout=30)
        view = httpx.get(url + "/v1/baseline", timeout=10).json()
        assert Path(view["path"]) == state / "baseline.json"
        learned = [s for s in view["series"] if s["business_line"] == "code_assistant"]
        assert {s["source"] for s in learned} == {"learned"} and all(s["tokens"] >= 400 for s in learned)
        assert "counts" not in json.dumps(view)  # healthy values only: the counts stay in the state directory
        routing = httpx.get(url + "/v1/routing", params={"business_line": "code_assistant"}, timeout=10).json()
        gate = next(r for r in routing["routers"] if r["name"] == "model.layers.1.mlp.gate")
        assert gate["baseline"]["source"] == "learned" and gate["js_divergence"] is not None
        text = get_metrics(url)
        assert metric_value(text, "mla_watch_routing_baseline_max_violation", router="model.layers.1.mlp.gate",
                            business_line="code_assistant") == pytest.approx(gate["baseline"]["max_violation"])
        # set by hand: replaces what was learned for that line
        refused = httpx.post(url + "/admin/baseline", params={"business_line": "code_assistant"}, timeout=10)
        assert refused.status_code in (401, 403)
        saved = httpx.post(url + "/admin/baseline", params={"business_line": "code_assistant"},
                           headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert saved.status_code == 200 and saved.json()["series"] > 0
        sources = {s["source"] for s in httpx.get(url + "/v1/baseline", timeout=10).json()["series"]
                   if s["business_line"] == "code_assistant"}
        assert sources == {"set"}
    assert oct(os.stat(state / "baseline.json").st_mode & 0o777) == "0o600"
    with running_sidecar(state_dir=state) as (url, _):  # a restart keeps them
        series = httpx.get(url + "/v1/baseline", timeout=10).json()["series"]
        assert {s["source"] for s in series if s["business_line"] == "code_assistant"} == {"set"}


def test_the_counts_held_are_bounded_whatever_reports_them(monkeypatch) -> None:
    from mla_watch.routing import baselines as module

    monkeypatch.setattr(module, "MAX_COUNTS", 20)  # two 8-expert series fit, a third does not
    baselines = Baselines(learn_tokens=100)
    baselines.trust(None)
    windows = RouterWindows([GATE], window_tokens=4096, baselines=baselines)
    for line in ("a", "b", "c"):
        fed(windows, line, 1000)
    learned = baselines.learn(windows.router_stats("a") + windows.router_stats("b") + windows.router_stats("c"))
    assert [b.business_line for b in learned] == ["a", "b"] and len(baselines) == 2
    assert baselines.get(GATE.name, "c") is None
    assert baselines.describe()["learning"] is False and "the baselines are full" in baselines.not_learning
    assert baselines.learn(windows.router_stats("c")) == []  # no retry every round
