"""Beside an engine the sidecar needs neither torch nor transformers; --help and bad configuration import nothing heavy.

Python cannot unload torch, and the test process has it: each check runs in a fresh interpreter. There a
``sitecustomize`` module (put first on ``PYTHONPATH``, so the spawned decoder workers load it too) makes torch
and transformers look absent, as in ``pip install mla-watch`` without the ``[model]`` extra, and writes
``HEAVY IMPORT: name`` for each attempt to import one (a look whether one is installed is no import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from harness import processes
from harness.support import REPO, free_port, metric_value, serve_app, sidecar_process, wait_until
from mla_watch.common.extras import MODEL_INSTALL
from mla_watch.engines.geometry import parse_geometry
from tests.vllm_twin import VllmTwin

MARK = "HEAVY IMPORT:"
BLOCKER = f'''
import importlib.abc
import sys


class _WithoutTheModelExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            if sys._getframe(2).f_code.co_name != "find_spec":  # importlib.util.find_spec only looks
                sys.stderr.write("{MARK} " + name + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _WithoutTheModelExtra())
'''
# What stands beside an engine (docs/architecture.md): serving, proxy, counting, alerting, causes, the re-tuning
# parts the engine path reads, the command line.
ENGINE_SIDE = [
    "mla_watch.cli",
    "mla_watch.cli.serve",
    "mla_watch.cli.check",
    "mla_watch.cli.retune",
    "mla_watch.server.app",
    "mla_watch.server.proxy",
    "mla_watch.server.admin",
    "mla_watch.server.reference_readings",
    "mla_watch.server.retuning",
    "mla_watch.engines.count_queue",
    "mla_watch.engines.decoder",
    "mla_watch.engines.formats",
    "mla_watch.engines.replay",
    "mla_watch.engines.watch",
    "mla_watch.engines.reading",
    "mla_watch.engines.backends",
    "mla_watch.engines.recorder",
    "mla_watch.engines.vllm_weights",
    "mla_watch.engines.sglang_weights",
    "mla_watch.alerting.alert_service",
    "mla_watch.alerting.outbox",
    "mla_watch.alerting.fleet",
    "mla_watch.references.prober",
    "mla_watch.references.readers",
    "mla_watch.references.gate",
    "mla_watch.quality.score",
    "mla_watch.models.corpus",
    "mla_watch.retune.gates",
    "mla_watch.retune.specs",
    "mla_watch.retune.data",
    "mla_watch.retune.capture",
    "mla_watch.retune.reference",
    "mla_watch.retune.health",
    "mla_watch.retune.engine_retuning",
    "mla_watch.retune.versions",
    "mla_watch.retune.hosts",
    "mla_watch.retune.service",
    "mla_watch.common.tensor_files",
    "mla_watch.routing.ingest",
    "mla_watch.history.store",
]
HEAVY = ("torch", "transformers", "scipy.stats", "scipy.spatial", "matplotlib")
CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}


def router_arrays(value: float = 0.0) -> dict[str, np.ndarray]:
    """The routers of :data:`CONFIG`'s MoE layers (hidden size 8), bf16 weights and f32 biases, as numpy holds them."""
    import ml_dtypes

    geometry = parse_geometry(CONFIG)
    tensors: dict[str, np.ndarray] = {}
    for layer in geometry.moe_layers:
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = np.full((16, 8), value, dtype=ml_dtypes.bfloat16)
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = np.full(16, value, dtype=np.float32)
    return tensors


def without_model_extra(tmp_path: Path) -> dict[str, str]:
    """The environment of a child that finds neither torch nor transformers."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join([str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path}


def python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return processes.run(
        [sys.executable, "-c", code],
        env=env or {**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def heavy_loaded(after: str) -> str:
    """Code that runs ``after`` (its ``SystemExit`` message on stderr), then prints the heavy modules loaded as JSON."""
    return (
        f"import json, sys\ntry:\n    {after}\nexcept SystemExit as stop:\n"
        "    print(stop.code if isinstance(stop.code, str) else '', file=sys.stderr)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({HEAVY!r}))))"
    )


def test_engine_side_modules_import_neither_torch_nor_transformers(tmp_path: Path) -> None:
    imports = "; ".join(f"import {name}" for name in ENGINE_SIDE)
    done = python(f"{imports}; print('imported')", env=without_model_extra(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-3000:]
    assert MARK not in done.stderr, done.stderr[-3000:]


def test_the_blocker_sees_a_torch_import(tmp_path: Path) -> None:
    """The check above can fail: a module that imports torch is caught."""
    done = python("import mla_watch.probe", env=without_model_extra(tmp_path))
    assert done.returncode != 0 and f"{MARK} torch" in done.stderr


def test_help_of_every_subcommand_imports_nothing_heavy() -> None:
    helps = "; ".join(f"run({sub!r})" for sub in ("serve", "check", "demo", "routing", "baseline", "retune", "rules"))
    code = heavy_loaded(
        "from mla_watch.cli import main\n"
        "    def run(sub):\n"
        "        try:\n"
        "            main([sub, '--help'] if sub != '--help' else [sub])\n"
        "        except SystemExit:\n"
        "            pass\n"
        f"    run('--help'); {helps}"
    )
    done = python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: mla-watch serve" in done.stdout and json.loads(done.stdout.splitlines()[-1]) == []


def test_a_bad_policy_is_reported_before_anything_heavy_is_imported(tmp_path: Path) -> None:
    """Serving the bundled model: the configuration is judged before torch (or the model) loads."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "code_assistant.yaml").write_text("business_line: code_assistant\ntasks: [1]\n")
    args = ["serve", "--policies", str(policies), "--state-dir", str(tmp_path / "state"), "--port", "0"]
    done = python(heavy_loaded(f"from mla_watch.cli import main; main({args!r})"))
    assert "the policy configuration cannot be used" in done.stderr and "code_assistant.yaml" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["serve"], "--model bundled (serving the model here, without --upstream)"),
        (
            ["serve", "--upstream", "http://127.0.0.1:9", "--engine", "sglang", "--sglang-recorder-dir", "/tmp"],
            "--sglang-recorder-dir /tmp (its .pt dumps)",
        ),
        (["demo"], "mla-watch demo"),
        (["routing"], "--model bundled (run here)"),
        (["check"], "--model bundled (loaded here to lint the rules"),
        (["context"], "--model bundled (run here over the prompts; --url reads a sidecar's traffic without it)"),
    ],
    ids=["serve-model", "sglang-recorder", "demo", "routing", "check", "context"],
)
def test_a_feature_whose_extra_is_missing_fails_at_start_up_in_one_line(
    tmp_path: Path, args: list[str], named: str
) -> None:
    done = processes.run(
        [sys.executable, "-m", "mla_watch.cli", *args, "--state-dir", str(tmp_path / "state")]
        if args[0] == "serve"
        else [sys.executable, "-m", "mla_watch.cli", *args],
        env=without_model_extra(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert named in lines[0] and lines[0].endswith(f"needs torch (the [model] extra): {MODEL_INSTALL}"), lines
    assert MARK not in done.stderr


def test_context_from_a_sidecars_traffic_needs_no_model_extra(tmp_path: Path) -> None:
    """``context --url`` reads a sidecar's answer, no model: without the extra it runs (here: nobody listens)."""
    done = processes.run(
        [
            sys.executable,
            "-m",
            "mla_watch.cli",
            "context",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--business-line",
            "code_assistant",
            "--timeout",
            "5",
        ],
        env=without_model_extra(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "cannot read /v1/routing" in lines[0], done.stderr[-3000:]
    assert MARK not in done.stderr


@pytest.mark.slow
def test_serve_beside_vllm_without_the_model_extra_counts_streamed_and_unstreamed_alike(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    save_file(router_arrays(), str(tmp_path / "model.safetensors"))  # the engine's checkpoint: its routers
    twin = VllmTwin(parse_geometry(CONFIG))
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in without_model_extra(tmp_path).items() if not k.startswith("MLA_WATCH_")}
    with (
        serve_app(twin.app) as twin.url,
        sidecar_process(
            port,
            tmp_path / "state",
            "--upstream",
            twin.url,
            "--engine",
            "vllm",
            "--model-config",
            str(config),
            "--decode-workers",
            "1",
            "--engine-retune",
            "propose",
            env=env,
            log=log,
        ),
    ):
        for line, stream in (("code_assistant", False), ("customer_service", True)):
            for chat in (False, True):
                body: dict = {"max_tokens": 6, "stream": stream}
                body.update(
                    {"messages": [{"role": "user", "content": "where is my order"}]}
                    if chat
                    else {"prompt": "where is my order"}
                )
                answer = httpx.post(
                    url + ("/v1/chat/completions" if chat else "/v1/completions"),
                    json=body,
                    headers={"X-Business-Line": line},
                    timeout=30,
                )
                assert answer.status_code == 200 and "routed_experts" not in answer.text, answer.text

        def counted() -> bool:
            text = httpx.get(url + "/metrics", timeout=10).text
            return metric_value(text, "mla_watch_engine_responses_total", engine="vllm", outcome="counted") == 4

        assert wait_until(counted, timeout=30, interval=0.2), log.read_text()[-3000:]
        routing = {
            line: {
                r["name"]: r["selections"]
                for r in httpx.get(url + "/v1/routing", params={"business_line": line}, timeout=10).json()["routers"]
            }
            for line in ("code_assistant", "customer_service")
        }
        assert routing["code_assistant"] == routing["customer_service"] and all(
            np.array(list(routing["code_assistant"].values())) > 0
        )
        status = httpx.get(url + "/v1/status", timeout=10).json()
        assert status["engine"]["retune"].startswith("re-tuning the engine's routers: propose"), status["engine"]
    assert MARK not in log.read_text(), log.read_text()[-3000:]


ENGINE_JOB = """
import json, sys
from pathlib import Path
import numpy as np
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.swap import EngineWeights, SwapResult
from mla_watch.engines.vllm_weights import read_router_tensors
from mla_watch.retune.engine_retuning import EngineRouters, bias_step
from mla_watch.retune.versions import RouterVersions

work = Path(sys.argv[1])
geometry = parse_geometry(json.loads((work / "engine" / "config.json").read_text()))


class Engine(EngineWeights):
    name = "recorded"

    def __init__(self):
        self.loaded = []

    def problem(self):
        return None

    def swap(self, weights_path):
        self.loaded.append(read_router_tensors(weights_path))  # what the engine was asked to load
        return SwapResult(str(weights_path), paused_seconds=0.0, reload_seconds=0.0)

    def score(self, samples):
        return []


engine = Engine()
initial = read_router_tensors(work / "engine")
host = EngineRouters(engine, geometry, initial, swap_dir=work / "swaps", config_json=work / "engine" / "config.json")
registry = RouterVersions(work / "routers")
registry.record_initial(host, {"passed": True})
bias = "model.layers.2.mlp.gate.e_score_correction_bias"
stepped = bias_step(host.state()[bias], np.arange(16), 1.0)
version = registry.save({bias: stepped}, {"strategy": "bias"})
registry.promote(host, version)
promoted = engine.loaded[-1]
registry.rollback(host)
rolled_back = engine.loaded[-1]
print(json.dumps({"version": version, "promoted": {name: array.astype(np.float32).tolist()
                                                   for name, array in promoted.items()},
                  "dtypes": {name: str(array.dtype) for name, array in promoted.items()},
                  "rolled_back": all(np.array_equal(rolled_back[name], initial[name]) for name in initial)}))
"""


def test_a_router_version_is_saved_promoted_into_the_engine_and_rolled_back_without_torch(tmp_path: Path) -> None:
    """The engine path's registry, host, bias rule and router checkpoints run where torch cannot be imported."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps(CONFIG))
    save_file(router_arrays(0.5), str(engine / "model.safetensors"))
    done = processes.run(
        [sys.executable, "-c", ENGINE_JOB, str(tmp_path)],
        env=without_model_extra(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0 and MARK not in done.stderr, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    promoted, dtypes = result["promoted"], result["dtypes"]
    assert result["version"] == 1 and result["rolled_back"] is True
    loads = np.arange(16)
    expected = (np.float32(0.5) + np.minimum(1.0, 1.0 - loads / loads.mean()).astype(np.float32)).tolist()
    assert promoted["model.layers.2.mlp.gate.e_score_correction_bias"] == expected  # the stepped bias
    assert promoted["model.layers.1.mlp.gate.e_score_correction_bias"] == [0.5] * 16  # the rest as it was
    assert promoted["model.layers.3.mlp.gate.weight"] == [[0.5] * 8] * 16  # every router whole
    assert (
        dtypes["model.layers.1.mlp.gate.weight"] == "bfloat16"
        and dtypes["model.layers.2.mlp.gate.e_score_correction_bias"] == "float32"
    )
