"""Operating the sidecar: hot reload, admin auth, overload, timeouts, the attention self-test, proxying."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

import mla_watch
from harness.helpers import FakeClock
from harness.support import REPO, get_metrics, metric_value, running_sidecar, serve_app, wait_until
from tests.client import SQL, post, sse_events

pytestmark = pytest.mark.slow

TOKEN = "test-admin-token"


def test_policies_reload_on_file_change_and_a_broken_file_keeps_the_last_good(policies_copy) -> None:
    code_file = policies_copy / "code_assistant.yaml"
    with running_sidecar(policies=policies_copy, policy_poll_seconds=0.05) as (url, _):

        def sql_max_temperature() -> float:
            sql = httpx.get(url + "/v1/policies").json()["business_lines"]["code_assistant"]["tasks"]["sql"]
            return sql["params"]["temperature"]["max"]

        assert sql_max_temperature() == 0.3
        code_file.write_text(
            code_file.read_text().replace(
                "temperature: {min: 0.1, max: 0.3, default: 0.1}", "temperature: {min: 0.1, max: 0.4, default: 0.1}"
            )
        )
        assert wait_until(lambda: sql_max_temperature() == 0.4, 10)
        assert (
            post(url, "/v1/completions", {"prompt": "SELECT", "temperature": 0.35, "max_tokens": 1}, SQL).status_code
            == 200
        )

        code_file.write_text(code_file.read_text().replace("max: 0.4", "max: lots"))
        assert wait_until(lambda: httpx.get(url + "/v1/policies").json()["last_reload_error"] is not None, 10)
        errors = httpx.get(url + "/v1/policies").json()["last_reload_error"]
        assert any("code_assistant.yaml" in e and "lots" in e for e in errors)
        assert sql_max_temperature() == 0.4  # the last good policies stay in force
        assert (
            post(url, "/v1/completions", {"prompt": "SELECT", "temperature": 0.35, "max_tokens": 1}, SQL).status_code
            == 200
        )
        assert metric_value(get_metrics(url), "mla_watch_policy_reloads_total", outcome="refused") >= 1


def test_admin_reload_needs_the_bearer_token(policies_copy) -> None:
    with running_sidecar(policies=policies_copy, admin_token=None) as (url, _):
        disabled = httpx.post(url + "/admin/reload")
        assert disabled.status_code == 403 and "MLA_WATCH_ADMIN_TOKEN" in disabled.json()["error"]["message"]
    with running_sidecar(policies=policies_copy, admin_token=TOKEN) as (url, _):
        assert httpx.post(url + "/admin/reload").status_code == 401
        assert httpx.post(url + "/admin/reload", headers={"Authorization": "Bearer wrong"}).status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(url + "/admin/reload", headers=auth).json()["ok"] is True
        (policies_copy / "doc_summary.yaml").write_text("business_line: doc_summary\ntasks: [oops]\n")
        refused = httpx.post(url + "/admin/reload", headers=auth)
        assert refused.status_code == 422
        assert any("doc_summary.yaml" in e for e in refused.json()["errors"])
        lines = httpx.get(url + "/v1/policies").json()["business_lines"]
        assert "summarize" in lines["doc_summary"]["tasks"]


def test_an_overloaded_server_answers_429_with_retry_after() -> None:
    with running_sidecar(max_queue=1) as (url, _):
        body = {"prompt": "def f(", "max_tokens": 60}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(
                pool.map(lambda _: post(url, "/v1/completions", body, {"X-Business-Line": "default"}), range(8))
            )
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1 and refused.json()["error"]["code"] == "overloaded"
        text = get_metrics(url)
        assert metric_value(text, "mla_watch_overloaded_total") == statuses.count(429)
        assert metric_value(
            text, "mla_watch_requests_total", endpoint="/v1/completions", status="200"
        ) == statuses.count(200)


def test_a_request_past_its_deadline_gets_503(tmp_path) -> None:
    from mla_watch.server.app import ServerConfig, Sidecar

    config = ServerConfig(
        device="cpu", policy_poll_seconds=None, admin_token=None, state_dir=tmp_path, request_timeout=0.3, rules=None
    )
    # half a second passes at every reading: a deadline of 0.3 s has passed by the next look at it, however
    # fast (or slow) the machine generates
    sidecar = Sidecar(config, clock=FakeClock(0.0, tick=0.5))
    with serve_app(sidecar.app) as url:
        assert sidecar.wait_ready(120), sidecar.load_error
        response = post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 400}, {"X-Business-Line": "default"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "timeout"
        assert "Retry-After" in response.headers
        assert metric_value(get_metrics(url), "mla_watch_request_timeouts_total") == 1


def test_an_attention_that_disagrees_with_eager_is_refused() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def skewed_attention(module, query, key, value, attention_mask, **kwargs):
        output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return output * 1.5, weights  # a kernel with a bug, like flash-attention was with MLA

    AttentionInterface.register("mla_watch_test_skewed", skewed_attention)
    AttentionMaskInterface.register("mla_watch_test_skewed", sdpa_mask)
    # Registered without a mask function, the kernel cannot even run the MLA layers: refused as well.
    AttentionInterface.register("mla_watch_test_maskless", sdpa_attention_forward)
    with running_sidecar(attn_implementation="mla_watch_test_maskless") as (url, _):
        attention = httpx.get(url + "/readyz").json()["attention"]
        assert attention["refused"] is True and "failed on the self-test batch" in attention["message"]
        assert attention["max_relative_difference"] is None
    with running_sidecar(attn_implementation="mla_watch_test_skewed") as (url, sidecar):
        attention = httpx.get(url + "/readyz").json()["attention"]
        assert attention["refused"] is True and attention["used"] == "eager"
        assert "disagrees with eager" in attention["message"]
        assert sidecar.model_worker.model.config._attn_implementation == "eager"
        assert metric_value(get_metrics(url), "mla_watch_attention_fallback") == 1
        assert post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 2}).status_code == 200


def test_the_proxy_enforces_policies_in_front_of_another_server_streaming_included() -> None:
    with running_sidecar() as (upstream_url, _), running_sidecar(upstream=upstream_url) as (proxy_url, _):
        request = {"prompt": "def merge_orders(", "max_tokens": 12, "temperature": 0.9, "seed": 4}
        headers = {"X-Business-Line": "code_assistant"}
        proxied = post(proxy_url, "/v1/completions", request, headers)
        assert proxied.status_code == 200 and proxied.headers["X-MLA-Policy"] == "code_assistant/code"
        adjustments = {a["param"]: a for a in proxied.json()["mla_watch"]["adjustments"]}
        assert adjustments["temperature"]["applied"] == 0.3
        direct = post(upstream_url, "/v1/completions", {**request, "temperature": 0.3}, headers)
        assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]

        streamed = post(proxy_url, "/v1/completions", {**request, "stream": True}, headers)
        events = sse_events(streamed.text)
        assert events[0]["mla_watch"]["policy"] == "code_assistant/code" and events[-1] == "[DONE]"
        text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
        assert text == proxied.json()["choices"][0]["text"]

        rejected = post(proxy_url, "/v1/completions", {"prompt": "SELECT", "temperature": 2.0}, SQL)
        assert rejected.status_code == 400 and rejected.json()["error"]["param"] == "temperature"
        assert httpx.get(proxy_url + "/v1/models").json()["data"][0]["id"] == "bundled"


def test_workers_ship_router_counts_to_the_sidecar(tmp_path) -> None:
    from tests.tiny_models import build

    with running_sidecar(upstream="http://127.0.0.1:9", admin_token=TOKEN, history_interval_seconds=0.1) as (url, _):
        model = build("deepseek_v32")
        probe = mla_watch.attach(
            model, agent_url=url, agent_token=TOKEN, agent_source="worker-1", ship_interval=3600, window_tokens=None
        )
        local = mla_watch.attach(model, window_tokens=None)
        with torch.no_grad(), probe.attribute("code_assistant"), local.attribute("code_assistant"):
            model(input_ids=torch.randint(1, 90, (2, 9)))
        assert probe.flush() is True
        routing = httpx.get(url + "/v1/routing", params={"business_line": "code_assistant"}).json()
        remote = {r["name"]: r for r in routing["routers"]}
        for record in local.stats("code_assistant"):  # watched as <source>/<router>, apart from local routers
            assert remote["worker-1/" + record["name"]]["tokens"] == record["tokens"] == 18
            assert remote["worker-1/" + record["name"]]["entropy_bits"] == pytest.approx(record["entropy_bits"])
        assert metric_value(get_metrics(url), "mla_watch_ingested_snapshots_total", source="worker-1") == 1

        # The status page of a proxy shows the shipped routing; there is no local model to re-tune.
        status: dict = {}

        def sampled() -> bool:
            status.update(httpx.get(url + "/v1/status", timeout=10).json())
            return any(s["business_line"] == "code_assistant" for s in status["history"]["series"])

        assert wait_until(sampled, 10)
        shown = {s["router"]: s for s in status["history"]["series"] if s["business_line"] == "code_assistant"}
        assert set(shown) == set(remote)
        # float32 in the history: 4 decimals, give or take the last
        assert all(
            s["values"][-1] == pytest.approx(remote[name]["entropy_bits"], abs=1e-4) for name, s in shown.items()
        )
        assert status["retune"] is None and status["upstream"] == "http://127.0.0.1:9"

        wrong = mla_watch.attach(model, agent_url=url, agent_token="wrong", ship_interval=3600)
        with torch.no_grad():
            model(input_ids=torch.randint(1, 90, (1, 4)))
        assert wrong.flush() is False and "401" in wrong.shipper.last_error
        for attached in (probe, local, wrong):
            attached.detach()


def test_undelivered_counts_wait_for_the_sidecar() -> None:
    from mla_watch.server.app import ServerConfig, Sidecar
    from tests.tiny_models import build

    def sidecar() -> Sidecar:
        return Sidecar(ServerConfig(upstream="http://127.0.0.1:9", admin_token=TOKEN, policy_poll_seconds=None))

    with serve_app(sidecar().app) as url:
        pass  # learn a free port, then leave nothing listening there: the sidecar is down
    model = build("mixtral")
    probe = mla_watch.attach(model, agent_url=url, agent_token=TOKEN, ship_interval=3600)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 90, (1, 5)))
    assert probe.flush() is False and probe.shipper.pending == 2  # two routers, one line
    with torch.no_grad():
        model(input_ids=torch.randint(1, 90, (1, 3)))
    with serve_app(sidecar().app, port=int(url.rsplit(":", 1)[1])):
        assert probe.flush() is True
        routers = httpx.get(url + "/v1/routing").json()["routers"]
        assert [r["tokens"] for r in routers] == [8, 8]
    probe.detach()


def test_a_broken_rule_file_on_reload_keeps_the_last_good_rules(tmp_path, policies_copy) -> None:
    import shutil

    from mla_watch.alerting.rules import load_rules_dir

    rules = tmp_path / "rules"
    shutil.copytree(REPO / "rules", rules)
    shipped = len(load_rules_dir(rules, environ={}).rules)
    with running_sidecar(policies=policies_copy, rules=rules, admin_token=TOKEN) as (url, _):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url + "/v1/alerts").json()["rules"] == shipped
        (rules / "extra.yaml").write_text("rules:\n  - alert: Typo\n    metric: entropy\n    below: 5\n")
        refused = httpx.post(url + "/admin/reload", headers=auth)
        assert refused.status_code == 422
        assert any("extra.yaml" in e and "'entropy'" in e for e in refused.json()["errors"])
        assert httpx.get(url + "/v1/alerts").json()["rules"] == shipped  # the last good rules stay in force
        (rules / "extra.yaml").write_text(
            "rules:\n  - alert: Extra\n    metric: entropy_bits\n    below: 4.0\n    actions: [notify]\n"
        )
        assert httpx.post(url + "/admin/reload", headers=auth).json()["ok"] is True
        assert httpx.get(url + "/v1/alerts").json()["rules"] == shipped + 1
