"""The proxy beside a scripted engine on loopback: asking, stripping, data errors, `auto`, the recorder, set-up errors.

The engine here is our own server speaking the engines' formats (pinned in
tests/test_engine_formats.py); tests/test_engine_e2e.py puts a real mla_watch model behind it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harness import processes
from harness.support import (
    answers_counted,
    get_metrics,
    metric_value,
    running_sidecar,
    serve_app,
    settled_over_http,
    wait_until,
)
from mla_watch.engines.formats import encode_sglang, encode_vllm, every_layer
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.recorder import DUMP_PATH, START_PATH
from mla_watch.engines.watch import UNATTRIBUTED_LINE
from tests.test_engine_recorder import FakeSGLangRecorder

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}
GEOMETRY = parse_geometry(CONFIG)
ROUTERS = GEOMETRY.router_names


def ids(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, len(GEOMETRY.moe_layers), 16)), axis=2)[:, :, :4]


class FakeEngine:
    """An OpenAI-compatible engine that answers each completion with ``routing`` in ``style``'s fields."""

    def __init__(self, style: str, owner: str = "vllm", recorder: FakeSGLangRecorder | None = None) -> None:
        self.style = style
        self.owner = owner
        self.recorder = recorder
        self.routing: np.ndarray | None = ids(9)
        self.raw: object = None  # sent instead of the encoded routing when set (a broken engine)
        self.bodies: list[dict] = []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.complete, methods=["POST"]),
                Route(START_PATH, self.record, methods=["GET", "POST"]),
                Route(DUMP_PATH, self.record, methods=["GET", "POST"]),
            ]
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": self.owner}]})

    async def record(self, request: Request) -> Response:
        return Response(status_code=self.recorder.handle(request.url.path) if self.recorder else 404)

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        answer: dict = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        }
        full = None if self.routing is None else every_layer(self.routing, list(GEOMETRY.moe_layers), 4)
        if self.style == "vllm":
            answer["choices"][0]["routed_experts"] = self.raw if self.raw is not None else encode_vllm(full, 16)
        elif body.get("return_routed_experts") is True:
            answer["sglext"] = {"routed_experts": self.raw if self.raw is not None else encode_sglang(full)}
        return JSONResponse(answer)


@contextmanager
def beside(fake: FakeEngine, tmp_path: Path, **overrides) -> Iterator[tuple[str, object]]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    with (
        serve_app(fake.app) as engine_url,
        running_sidecar(
            upstream=engine_url,
            model_config=config,
            decode_workers=0,
            rules=None,
            window_tokens=None,
            **{"engine": fake.style, **overrides},
        ) as running,
    ):
        yield running


def complete(url: str, line: str = "code_assistant", **extra) -> dict:
    """One completion through the sidecar, returned once its routing is counted (which follows the answer)."""
    before = answers_counted(url)
    response = httpx.post(
        url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, **extra},
        headers={"X-Business-Line": line},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    settled_over_http(url, before + 1)
    return response.json()


def expected_counts(routing: np.ndarray) -> np.ndarray:
    return np.stack([np.bincount(routing[:, j].ravel(), minlength=16) for j in range(routing.shape[1])])


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_routing_is_asked_for_counted_per_line_and_stripped_unless_the_client_asked(tmp_path, style) -> None:
    engine = FakeEngine(style)
    with beside(engine, tmp_path) as (url, sidecar):
        plain = complete(url, "code_assistant")
        assert "sglext" not in plain and "routed_experts" not in plain["choices"][0]
        assert plain["mla_watch"]["policy"].startswith("code_assistant/")
        asked = complete(url, "doc_summary", return_routed_experts=True)
        assert ("routed_experts" in asked["choices"][0]) if style == "vllm" else ("routed_experts" in asked["sglext"])
        # SGLang returns routing only to requests that ask; the proxy asks for every request.
        assert all(body.get("return_routed_experts") is True for body in engine.bodies) == (style == "sglang")
        for line in ("code_assistant", "doc_summary"):
            counts = sidecar.engine_routing.counts(line)
            assert np.array_equal(np.stack([counts[name] for name in ROUTERS]), expected_counts(engine.routing))
        routing = httpx.get(url + "/v1/routing", params={"business_line": "doc_summary"}, timeout=10).json()
        assert [r["name"] for r in routing["routers"]] == ROUTERS and routing["routers"][0]["tokens"] == 9
        assert metric_value(get_metrics(url), "mla_watch_engine_responses_total", engine=style, outcome="counted") == 2


def test_routing_that_does_not_fit_the_config_is_counted_as_a_data_error_with_one_log_line(tmp_path, caplog) -> None:
    engine = FakeEngine("vllm")
    engine.routing = ids(5) + 16  # ids beyond the 16 experts of the config
    with beside(engine, tmp_path) as (url, sidecar), caplog.at_level(logging.WARNING, "mla_watch.engines"):
        for _ in range(3):
            assert "routed_experts" not in complete(url)["choices"][0]
        text = get_metrics(url)
        assert metric_value(text, "mla_watch_engine_routing_data_errors_total", engine="vllm", reason="expert_id") == 3
        assert metric_value(text, "mla_watch_engine_responses_total", engine="vllm", outcome="data_error") == 3
        assert sidecar.engine_routing.windows.business_lines == []  # nothing silently counted
        logged = [r.getMessage() for r in caplog.records if "not counted" in r.getMessage()]
        assert len(logged) == 1 and "expert ids in [16," in logged[0] and "expected [0, 15]" in logged[0]
        engine.routing, engine.raw = None, None
        engine.style = "none"  # an engine whose flag is off: no routing at all
        complete(url)
        assert (
            metric_value(get_metrics(url), "mla_watch_engine_responses_total", engine="vllm", outcome="no_routing") == 1
        )


@pytest.mark.parametrize(("owner", "style"), [("vllm", "vllm"), ("sglang", "sglang")])
def test_auto_asks_the_engine_who_it_is(tmp_path, owner, style) -> None:
    engine = FakeEngine(style, owner=owner)
    with beside(engine, tmp_path, engine="auto") as (url, sidecar):
        complete(url)
        assert sidecar.engine_routing.engine == style
        assert sidecar.engine_routing.counts("code_assistant")[ROUTERS[0]].sum() == 9 * 4


def test_the_recorder_counts_all_traffic_as_the_unattributed_line(tmp_path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    recorder = FakeSGLangRecorder(dumps, GEOMETRY, buffer_size=50, passes_per_dump=5)
    engine = FakeEngine("sglang", owner="sglang", recorder=recorder)
    with beside(engine, tmp_path, engine="none", sglang_recorder_dir=dumps, sglang_recorder_interval=0.05) as (url, _):
        assert wait_until(lambda: recorder.calls[DUMP_PATH] >= 2 and not list(dumps.iterdir()), timeout=30)
        routing = httpx.get(url + "/v1/routing", params={"business_line": UNATTRIBUTED_LINE}, timeout=10).json()
        assert {r["name"] for r in routing["routers"]} == set(ROUTERS) and routing["routers"][0]["tokens"] > 0
        assert recorder.calls[START_PATH] == 1
        assert metric_value(get_metrics(url), "mla_watch_engine_recorder_dumps_total", outcome="counted") >= 2


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--engine", "vllm", "--upstream", "http://127.0.0.1:9"], "--engine needs --model-config"),
        (["--engine", "sglang"], "it needs --upstream URL"),
        (["--sglang-recorder-dir", "/tmp", "--upstream", "http://127.0.0.1:9"], "--sglang-recorder-dir needs"),
        (
            ["--engine", "vllm", "--upstream", "http://127.0.0.1:9", "--model-config", "{config}"],
            "'num_experts_per_tok' = 99: expected an integer in [1, 16]",
        ),
        (["--engine", "trtllm"], "invalid choice: 'trtllm'"),
    ],
)
def test_serve_refuses_an_engine_it_cannot_read_naming_the_flag(tmp_path, args, expected) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "num_experts_per_tok": 99}))
    command = [
        sys.executable,
        "-m",
        "mla_watch.cli",
        "serve",
        "--state-dir",
        str(tmp_path / "state"),
        *[arg.replace("{config}", str(config)) for arg in args],
    ]
    done = processes.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("pod", ["vllm-pod.yaml", "sglang-pod.yaml"])
def test_the_deploy_examples_sidecar_flags_are_flags_serve_takes(pod) -> None:
    import yaml

    from mla_watch.cli import build_parser

    document = yaml.safe_load((Path(__file__).parents[1] / "deploy" / pod).read_text())
    containers = {container["name"]: container for container in document["spec"]["containers"]}
    sidecar = containers["mla-watch"]
    # The image's entrypoint (Dockerfile) is `mla-watch serve ...`: the pod adds its args (tests/test_dockerfile.py).
    args = build_parser().parse_args(["serve", *sidecar["args"]])
    engine = pod.split("-")[0]
    assert args.engine == engine and args.model_config.name == "config.json"
    assert "--enable-return-routed-experts" in " ".join(containers[engine]["args"])
    assert args.upstream.endswith(next(a.split("=")[1] for a in containers[engine]["args"] if a.startswith("--port")))


def test_a_baseline_taken_beside_the_engine_measures_drift_and_survives_a_restart(tmp_path) -> None:
    engine = FakeEngine("vllm")
    token = "t" * 20
    state = tmp_path / "state"
    with beside(engine, tmp_path, admin_token=token, state_dir=state) as (url, _):
        complete(url)
        refused = httpx.post(url + "/admin/baseline", timeout=10)
        assert refused.status_code in (401, 403)
        missing = httpx.post(
            url + "/admin/baseline",
            params={"business_line": "nope"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert missing.status_code == 404 and "code_assistant" in missing.json()["error"]["message"]
        saved = httpx.post(url + "/admin/baseline", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert saved.status_code == 200 and saved.json()["routers"] == ROUTERS
        same = httpx.get(url + "/v1/routing", timeout=10).json()["routers"]
        assert all(r["js_divergence"] == pytest.approx(0.0, abs=1e-9) for r in same)
    engine.routing = np.tile(np.arange(4), (9, len(ROUTERS), 1))  # every token now picks experts 0-3
    with beside(engine, tmp_path, admin_token=token, state_dir=state) as (url, _):
        complete(url)
        drifted = httpx.get(url + "/v1/routing", timeout=10).json()["routers"]
        assert all(r["js_divergence"] > 0.1 for r in drifted)


def test_beside_an_engine_without_alert_rules_baselines_are_learned_for_prometheus(tmp_path) -> None:
    # Prometheus may run the rules instead of the sidecar (a fleet): its copies of the rules relative to a baseline
    # read the learned values from /metrics, so learning must not wait for an alert evaluation that never comes.
    with beside(FakeEngine("vllm"), tmp_path, baseline_tokens=100) as (url, _):
        for sent in range(200):  # from three clients (the body's user field): the line's traffic, not one client's
            complete(url, user=f"app-{sent % 3}")
            window = httpx.get(url + "/v1/routing", params={"business_line": "code_assistant"}, timeout=10).json()[
                "routers"
            ][0]
            if sent >= 2 and not window["too_small"] and window["tokens"] >= 100:
                break
        get_metrics(url)  # a scrape reads the routing, as Prometheus would
        view = httpx.get(url + "/v1/baseline", timeout=10).json()
        learned = {s["router"] for s in view["series"] if s["business_line"] == "code_assistant"}
        assert learned == set(ROUTERS) and {s["source"] for s in view["series"]} == {"learned"}, view
        assert {c["client"] for c in view["series"][0]["clients"]["clients"]} == {
            "user:app-0",
            "user:app-1",
            "user:app-2",
        }
        text = get_metrics(url)
        assert all(
            metric_value(text, "mla_watch_routing_baseline_entropy_bits", router=router, business_line="code_assistant")
            > 0
            for router in ROUTERS
        )


def test_check_lints_the_rules_against_an_engines_routers(tmp_path, capsys) -> None:
    from mla_watch.cli import main

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 61,
                "first_k_dense_replace": 3,
                "n_routed_experts": 256,
                "num_experts_per_tok": 8,
            }
        )
    )
    assert main(["check", "--model-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "58 MoE layers of 61 (first 3), 256 experts, top-8" in out
    # An engine's routers are expert routers: the indexer rule does not apply, and says so (no warning).
    (indexer,) = [line for line in out.splitlines() if "IndexerDegenerate" in line]
    assert indexer.startswith("info: ") and "for indexer routers; this model has none" in indexer
    config.write_text(json.dumps({"num_hidden_layers": 61}))
    assert main(["check", "--model-config", str(config)]) == 1
    assert "none of the keys n_routed_experts" in capsys.readouterr().out


def test_sglangs_start_field_is_the_proxys_too_and_the_client_gets_the_rows_it_asked_for(tmp_path) -> None:
    engine = FakeEngine("sglang")
    with beside(engine, tmp_path) as (url, sidecar):
        answer = complete(url, return_routed_experts=True, routed_experts_start_len=5)
        assert "routed_experts_start_len" not in engine.bodies[-1]  # every row comes back, and is counted
        assert sidecar.engine_routing.counts("code_assistant")[ROUTERS[0]].sum() == 9 * 4
        full = every_layer(engine.routing, list(GEOMETRY.moe_layers), 4)
        assert answer["sglext"]["routed_experts"] == encode_sglang(full[5:])
        refused = httpx.post(
            url + "/v1/completions",
            json={"prompt": "x", "routed_experts_start_len": 2, "routed_experts_prompt_start": 3},
            timeout=30,
        )
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "conflict"
