"""SglangWeights against our own server answering as SGLang 0.5.23 does: swap order, scores, errors.

The answers are built from SGLang 0.5.23's source (``sglang/srt/...`` in the wheel):

* ``POST /pause_generation`` and ``/continue_generation``: 200 ``{"message": "Generation paused successfully.",
  "status": "ok"}`` / ``"Generation continued successfully."`` (entrypoints/http_server.py:1831-1854); a JSON body
  is required and ``mode`` is one of abort, retract, in_place (managers/io_struct.py:1927-1955), else FastAPI's
  422 ``{"detail": [...]}``. ``retract`` moves running requests to the waiting queue
  (managers/scheduler.py:5817-5910), ``in_place`` leaves them running (scheduler.py:5821-5833), ``abort`` ends
  them (managers/tokenizer_manager.py:2267-2280).
* ``POST /update_weights_from_disk``: 200 or 400 ``{"success", "message", "num_paused_requests"}``
  (http_server.py:1300-1334); success's message is "Succeeded to update model weights."
  (managers/scheduler_components/weight_updater.py:140); a directory without weights fails as "Failed to get
  weights iterator: ..." (model_executor/model_runner_components/weight_updater.py:222-227,
  model_loader/loader.py:593-596); the flush after the load is refused while a request runs (or, unpaused,
  waits), which fails the call with the message of scheduler_components/weight_updater.py:120-136 and
  scheduler.py:5518-5521, 5337-5359.
* ``POST /generate`` (http_server.py:928-990): ``{"text", "output_ids", "meta_info"}``; meta_info as
  tokenizer_manager.py:2507-2513, 2550-2556, 2602-2609 build it, with ``input_token_logprobs`` one
  ``[logprob, token_id, null]`` per prompt token (tokenizer_manager.py:2840-2868, 3098-3108), the first logprob
  null and ids at or past vocab_size - 1 reported as 0 (scheduler_components/logprob_result_processor.py:26-55);
  ``routed_experts`` base64 of int32 ``[prompt + 1 - 1, num_hidden_layers, top_k]`` when asked and enabled
  (tokenizer_manager.py:2602-2609; rows as in tests/fixtures/sglang/make_fixtures.py). Errors: a sampling
  parameter the contract does not know is a 400 ``{"error": "..."}`` (http_server.py:937-939,
  sglang/api/v1/api_types.py:177-178), a prompt at the context length a 400 ``{"error": {"message": ...}}``
  (tokenizer_manager.py:1338-1351, http_server.py:2246-2250); ``--allow-auto-truncate`` cuts the prompt instead
  (tokenizer_manager.py:1339-1346); an abort without a status code is a 200 with ``finish_reason.type`` abort
  (tokenizer_manager.py:1891-1907, 3598-3606).
* Keys as utils/auth.py:128-150 decide them: 401 ``{"error": "Unauthorized"}`` (auth.py:191-198).
* ``GET /server_info``: every server argument, flat (utils/common.py:3584-3593, server_args.py:316-333).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pybase64
import pytest
import torch
from safetensors.torch import save_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harness.support import free_port, serve_app
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.sglang_weights import SglangWeights
from mla_watch.engines.swap import ENGINE_MESSAGE_CHARS, EngineWeights, SwapError
from mla_watch.engines.vllm_weights import write_router_checkpoint

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "hidden_size": 8,
}
GEOMETRY = parse_geometry(CONFIG)
ADMIN_OPTIONAL = {"/pause_generation", "/continue_generation", "/update_weights_from_disk", "/flush_cache"}
# A few of the sampling parameters the contract knows (api_types.py:180-207); any other is refused.
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "ignore_eos"}
SUCCESS = "Succeeded to update model weights."
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


def logprob(ids: list[int], position: int) -> float:
    """The fake model's log-probability of ``ids[position]`` after the ids before it."""
    return -(((ids[position] * 7 + position) % 13) + 1) / 8


def routed(ids: list[int]) -> np.ndarray:
    """The fake router's choice per position and layer (dense layer 0 zero): distinct experts, int32."""
    rows = np.zeros((len(ids), CONFIG["num_hidden_layers"], 4), dtype=np.int32)
    for position, token in enumerate(ids):
        for layer in GEOMETRY.moe_layers:
            start = (token + 3 * position + layer) % 16
            rows[position, layer] = [(start + k * 5) % 16 for k in range(4)]
    return rows


class FakeSGLangServer:
    """SGLang 0.5.23's HTTP answers (see the module docstring), with its scheduler's queues as two counters."""

    def __init__(self, *, api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.calls: list[tuple[str, Any]] = []
        self.running = 2  # requests in the scheduler's running batch
        self.waiting = 1
        self.paused = False
        self.update: str = "ok"  # ok | missing | slow
        self.answer_slow = threading.Event()  # "slow": the update answers once the test sets this (it has timed out)
        self.update_message = SUCCESS
        self.continue_status = 200
        self.routing_enabled = True  # --enable-return-routed-experts
        self.vocab_size = 1000
        self.context_len = 64
        self.auto_truncate = False
        self.generate_override: dict[str, Any] | None = None  # meta_info keys replaced in every answer
        self.routed_override: str | None = None
        self.padding = 0  # bytes of extra text in /generate's answer
        self.info: dict[str, Any] = {
            "version": "0.5.23",
            "weight_cache_mode": "off",
            "model_checksum": None,
            "load_format": "auto",
            "model_path": "deepseek-ai/DeepSeek-V3",
        }
        self.app = Starlette(
            routes=[
                Route("/pause_generation", self.pause, methods=["POST"]),
                Route("/continue_generation", self.resume, methods=["POST"]),
                Route("/update_weights_from_disk", self.update_from_disk, methods=["POST"]),
                Route("/flush_cache", self.flush, methods=["GET", "POST"]),
                Route("/generate", self.generate, methods=["POST", "PUT"]),
                Route("/server_info", self.server_info, methods=["GET"]),
            ]
        )

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def denied(self, request: Request) -> Response | None:
        """utils/auth.py:128-150: the admin key alone opens ADMIN_OPTIONAL endpoints where it is set."""
        expected = (self.admin_api_key or self.api_key) if request.url.path in ADMIN_OPTIONAL else self.api_key
        if expected is None or request.headers.get("authorization") == f"Bearer {expected}":
            return None
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    async def body(self, request: Request) -> tuple[dict[str, Any] | None, Response | None]:
        raw = await request.body()
        if not raw:  # FastAPI's Body() with no default
            return None, JSONResponse(
                {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]},
                status_code=422,
            )
        return json.loads(raw), None

    async def pause(self, request: Request) -> Response:
        if (refused := self.denied(request)) is not None:
            self.calls.append(("/pause_generation", None))
            return refused
        body, error = await self.body(request)
        self.calls.append(("/pause_generation", body))
        if error is not None:
            return error
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return JSONResponse(
                {
                    "detail": [
                        {
                            "type": "literal_error",
                            "loc": ["body", "mode"],
                            "msg": "Input should be 'abort', 'retract' or 'in_place'",
                            "input": mode,
                        }
                    ]
                },
                status_code=422,
            )
        self.paused = True
        if mode == "retract":  # scheduler.py:5845-5900: running requests back to the waiting queue
            self.waiting += self.running
            self.running = 0
        elif mode == "abort":
            self.running = self.waiting = 0
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Request) -> Response:
        if (refused := self.denied(request)) is not None:
            self.calls.append(("/continue_generation", None))
            return refused
        body, error = await self.body(request)
        self.calls.append(("/continue_generation", body))
        if error is not None:
            return error
        if self.continue_status != 200:
            return JSONResponse({"detail": "Internal Server Error"}, status_code=self.continue_status)
        self.paused = False
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def update_from_disk(self, request: Request) -> Response:
        if (refused := self.denied(request)) is not None:
            self.calls.append(("/update_weights_from_disk", None))
            return refused
        body, error = await self.body(request)
        self.calls.append(("/update_weights_from_disk", body))
        if error is not None:
            return error
        if not isinstance(body.get("model_path"), str):
            return JSONResponse(
                {
                    "detail": [
                        {"type": "missing", "loc": ["body", "model_path"], "msg": "Field required", "input": body}
                    ]
                },
                status_code=422,
            )
        if self.update == "slow":
            await asyncio.to_thread(self.answer_slow.wait, 30)
        if self.update == "missing":
            message = (
                f"Failed to get weights iterator: Cannot find any model weights with `{body['model_path']}`."
                + " x" * 200
            )
            return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status_code=400)
        # scheduler.py:5520: idle ignores the waiting queue only while paused
        idle = self.running == 0 and (self.paused or self.waiting == 0)
        if body.get("flush_cache", True) and not idle:
            return JSONResponse({"success": False, "message": NOT_FLUSHED, "num_paused_requests": 0}, status_code=400)
        return JSONResponse({"success": True, "message": self.update_message, "num_paused_requests": 0})

    async def flush(self, request: Request) -> Response:
        self.calls.append(("/flush_cache", None))
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )

    async def server_info(self, request: Request) -> Response:
        if (refused := self.denied(request)) is not None:
            return refused
        return JSONResponse(self.info)

    async def generate(self, request: Request) -> Response:
        if (refused := self.denied(request)) is not None:
            self.calls.append(("/generate", None))
            return refused
        body = json.loads(await request.body())
        self.calls.append(("/generate", body))
        unknown = set(body.get("sampling_params") or {}) - SAMPLING_KEYS
        if unknown:
            return JSONResponse({"error": f"sampling_params: unknown field `{sorted(unknown)[0]}`"}, status_code=400)
        ids = list(body["input_ids"])
        if len(ids) >= self.context_len:
            if not self.auto_truncate:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"The input ({len(ids)} tokens) is longer than the model's "
                            f"context length ({self.context_len} tokens)."
                        }
                    },
                    status_code=400,
                )
            del ids[self.context_len :]
        start = body.get("logprob_start_len", -1)
        entries: list[list[Any]] = []
        if body.get("return_logprob") and start == 0:
            values: list[float | None] = [None] + [logprob(ids, i) for i in range(1, len(ids))]
            clipped = [x if x < self.vocab_size - 1 else 0 for x in ids]
            entries = [[value, token, None] for value, token in zip(values, clipped, strict=True)]
        meta: dict[str, Any] = {
            "id": "9f1c",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "num_retractions": 0,
            "input_token_logprobs": entries,
            "output_token_logprobs": [[-0.5, 17, None]],
            "output_token_logprobs_length": 1,
            "reasoning_tokens": 0,
            "completion_tokens": 1,
            "cached_tokens": 0,
            "e2e_latency": 0.01,
            "response_sent_to_client_ts": 1.7e9,
        }
        if body.get("return_routed_experts") and self.routing_enabled:
            meta["routed_experts"] = self.routed_override or pybase64.b64encode(routed(ids).tobytes()).decode()
        if self.generate_override is not None:
            meta.update(self.generate_override)
        return JSONResponse({"text": " the" + " " * self.padding, "output_ids": [17], "meta_info": meta})


def router_tensors() -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for layer in GEOMETRY.moe_layers:
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(16, 8, dtype=torch.bfloat16)
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.zeros(16)
    return tensors


@pytest.fixture()
def router_dir(tmp_path: Path) -> Path:
    """A router checkpoint as mla_watch writes one: model.safetensors of router tensors, and the config."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return write_router_checkpoint(tmp_path / "step-3", router_tensors(), tmp_path / "config.json")


@pytest.fixture()
def engine() -> Iterator[tuple[FakeSGLangServer, str]]:
    fake = FakeSGLangServer()
    with serve_app(fake.app) as url:
        yield fake, url


def weights(url: str, **options: Any) -> SglangWeights:
    return SglangWeights(url, **options)


# ---------------------------------------------------------------------- swap
def test_swap_pauses_retracting_updates_and_continues_in_that_order(engine, router_dir) -> None:
    fake, url = engine
    with weights(url) as client:
        assert isinstance(client, EngineWeights)
        result = client.swap(router_dir)
    assert fake.calls == [
        ("/pause_generation", {"mode": "retract"}),
        (
            "/update_weights_from_disk",
            {
                "model_path": str(router_dir),
                "load_format": "safetensors",
                "flush_cache": True,
                "abort_all_requests": False,
            },
        ),
        ("/continue_generation", {}),
    ]
    # The update flushed the cache itself (it would have failed otherwise): no separate /flush_cache.
    assert "/flush_cache" not in fake.paths
    assert not fake.paused and fake.waiting == 3  # the retracted requests wait to be recomputed, none dropped
    assert result.weights_path == str(router_dir)
    assert 0 < result.reload_seconds <= result.paused_seconds
    assert result.detail == {
        "engine": "sglang",
        "pause_mode": "retract",
        "load_format": "safetensors",
        "engine_message": SUCCESS,
        "num_paused_requests": 0,
    }
    assert json.loads(json.dumps(result.as_dict()))["engine_message"] == SUCCESS


def test_in_place_pause_would_have_failed_the_flush(engine, router_dir) -> None:
    """Why retract: the same fake, paused in place, refuses the flush with SGLang's message."""
    _, url = engine
    httpx.post(url + "/pause_generation", json={"mode": "in_place"})
    answer = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(router_dir)})
    assert answer.status_code == 400 and answer.json()["message"] == NOT_FLUSHED


def test_continue_is_sent_when_the_update_fails_and_the_error_names_it(engine, router_dir) -> None:
    fake, url = engine
    fake.update = "missing"
    with weights(url) as client, pytest.raises(SwapError) as failure:
        client.swap(router_dir)
    assert fake.paths == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert not fake.paused
    message = str(failure.value)
    assert "POST /update_weights_from_disk" in message and "answered 400" in message
    assert str(router_dir) in message and "expected 200 with success true" in message
    engine_said = f"Failed to get weights iterator: Cannot find any model weights with `{router_dir}`." + " x" * 200
    assert repr(engine_said[:ENGINE_MESSAGE_CHARS]) in message  # the engine's message, cut at 200 characters
    assert engine_said[: ENGINE_MESSAGE_CHARS + 2] not in message


def test_continue_is_sent_when_the_pause_is_refused(engine, router_dir) -> None:
    fake, url = engine
    fake.api_key = "k" * 16
    with weights(url) as client, pytest.raises(SwapError) as failure:
        client.swap(router_dir)
    assert fake.paths == ["/pause_generation", "/continue_generation"]  # no update without a pause
    message = str(failure.value)
    assert "POST /pause_generation" in message and "answered 401" in message and "'Unauthorized'" in message
    assert "set api_key" in message


def test_continue_is_sent_when_the_update_times_out(engine, router_dir) -> None:
    fake, url = engine
    fake.update = "slow"
    try:
        with weights(url, timeout=0.5) as client, pytest.raises(SwapError) as failure:
            client.swap(router_dir)
    finally:
        fake.answer_slow.set()
    assert fake.paths[-1] == "/continue_generation"
    assert "POST /update_weights_from_disk" in str(failure.value) and "no answer within 0.5 s" in str(failure.value)


def test_a_failed_continue_is_an_error_that_says_the_engine_may_stay_paused(engine, router_dir) -> None:
    fake, url = engine
    fake.continue_status = 500
    with weights(url) as client, pytest.raises(SwapError) as failure:
        client.swap(router_dir)
    message = str(failure.value)
    assert "POST /continue_generation" in message and "answered 500" in message
    assert "new routers are loaded" in message and "may still hold its requests" in message


def test_a_failed_update_and_continue_name_both(engine, router_dir) -> None:
    fake, url = engine
    fake.update, fake.continue_status = "missing", 500
    with weights(url) as client, pytest.raises(SwapError) as failure:
        client.swap(router_dir)
    message = str(failure.value)
    assert message.index("/continue_generation") < message.index("before that: POST /update_weights_from_disk")
    assert isinstance(failure.value.__cause__, SwapError)


def test_admin_key_opens_the_weight_endpoints_and_api_key_generate(router_dir) -> None:
    fake = FakeSGLangServer(api_key="user-key-000000", admin_api_key="admin-key-00000")
    with serve_app(fake.app) as url:
        with weights(url, api_key="user-key-000000") as client, pytest.raises(SwapError, match="answered 401"):
            client.swap(router_dir)  # the api key does not open ADMIN_OPTIONAL endpoints beside an admin key
        fake.calls.clear()
        with weights(url, api_key="user-key-000000", admin_api_key="admin-key-00000") as client:
            client.swap(router_dir)
            assert client.score([[1, 2, 3]])[0].tokens == 2
        assert fake.paths == ["/pause_generation", "/update_weights_from_disk", "/continue_generation", "/generate"]


def bad_checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A directory as a broken writer would leave it (write_router_checkpoint refuses to write these)."""
    directory = tmp_path / "bad"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda tmp: Path("routers/step-3"),
            r"weights_path routers/step-3: relative: expected an absolute path \(SGLang takes a path that is not a "
            r"directory for a Hugging Face repo id\)",
        ),
        (
            lambda tmp: tmp / "absent",
            r"weights_path .*/absent: not a directory here: expected the directory write_router_checkpoint wrote",
        ),
        (
            lambda tmp: bad_checkpoint(tmp, {"model.layers.1.mlp.gate.weight": torch.zeros(16, 7)}),
            r"model.layers.1.mlp.gate.weight has shape \[16, 7\]: expected \[16x8\]",
        ),
        (
            lambda tmp: bad_checkpoint(tmp, {"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(8, 8)}),
            r"'model.layers.1.mlp.experts.0.down_proj.weight' is no router tensor: expected router tensors only",
        ),
    ],
)
def test_a_checkpoint_sglang_would_fail_on_is_refused_before_anything_is_sent(engine, tmp_path, make, expected) -> None:
    """A tensor that does not fit fails SGLang's load, and its rollback reads the same directory again: the
    server stops (model_runner_components/weight_updater.py:193, 229-237; scheduler.py:2253, 6370-6378)."""
    fake, url = engine
    with weights(url) as client, pytest.raises(SwapError, match=expected):
        client.swap(make(tmp_path))
    assert fake.calls == []


# ---------------------------------------------------------------------- score
def test_score_sums_the_logprobs_of_every_token_but_the_first(engine) -> None:
    fake, url = engine
    samples = [[5, 9, 2, 7, 11], [3, 3], [42]]
    with weights(url) as client:
        scores = client.score(samples)
    for sample, score in zip(samples, scores, strict=True):
        expected = -sum(logprob(sample, i) for i in range(1, len(sample)))
        assert score.tokens == len(sample) - 1
        assert math.isclose(score.loss, expected, rel_tol=0, abs_tol=1e-12)
        assert score.routing is None  # no geometry: no routing asked for
    assert scores[2].loss == 0.0
    assert [body for _, body in fake.calls] == [
        {
            "input_ids": sample,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        for sample in samples
    ]


def test_score_returns_the_routing_at_the_moe_layers(engine) -> None:
    fake, url = engine
    sample = [5, 9, 2, 7, 11, 4]
    with weights(url, geometry=GEOMETRY) as client:
        (score,) = client.score([sample])
    assert fake.calls[0][1]["return_routed_experts"] is True
    assert score.routing.shape == (len(sample), len(GEOMETRY.moe_layers), 4)
    assert score.routing.dtype == np.int32 and score.routing.flags.writeable
    np.testing.assert_array_equal(score.routing, routed(sample)[:, list(GEOMETRY.moe_layers), :])
    fake.routing_enabled = False  # started without --enable-return-routed-experts: the field is ignored
    with weights(url, geometry=GEOMETRY) as client:
        assert client.score([sample])[0].routing is None


def test_score_accepts_the_last_vocabulary_ids_sglang_reports_as_zero(engine) -> None:
    fake, url = engine
    fake.vocab_size = 50
    sample = [3, 49, 60, 4]  # 49 and 60 come back as 0 (logprob_result_processor.py:51-55)
    with weights(url) as client:
        (score,) = client.score([sample])
    assert math.isclose(score.loss, -sum(logprob(sample, i) for i in (1, 2, 3)), abs_tol=1e-12)


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (
            lambda fake: setattr(fake, "context_len", 4),
            r"sample 0 \(5 tokens\) answered 400: \"The input \(5 tokens\) is longer than the model's context "
            r"length \(4 "
            r"tokens\).\"; expected 200 with its logprobs",
        ),
        (
            lambda fake: (setattr(fake, "context_len", 4), setattr(fake, "auto_truncate", True)),
            r"input_token_logprobs is 4 entries: expected one per input token \(5; "
            r"a shorter list is a truncated prompt",
        ),
        (
            lambda fake: setattr(
                fake, "generate_override", {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
            ),
            r"the engine aborted it \('Abort in waiting queue'\); expected it scored",
        ),
        (
            lambda fake: setattr(
                fake,
                "generate_override",
                {
                    "input_token_logprobs": [
                        [None, 5, None],
                        [None, 9, None],
                        [-1.0, 2, None],
                        [-1.0, 7, None],
                        [-1.0, 11, None],
                    ]
                },
            ),
            r"input_token_logprobs\[1\] has logprob None: expected a finite number "
            r"\(SGLang sends -inf and NaN as null\)",
        ),
        (
            lambda fake: setattr(
                fake,
                "generate_override",
                {
                    "input_token_logprobs": [
                        [None, 5, None],
                        [-1.0, 8, None],
                        [-1.0, 2, None],
                        [-1.0, 7, None],
                        [-1.0, 11, None],
                    ]
                },
            ),
            r"input_token_logprobs\[1\] is for token 8: expected 9, the id sent there",
        ),
        (
            lambda fake: setattr(fake, "generate_override", {"meta_info": None, "input_token_logprobs": "none"}),
            r"input_token_logprobs is a str: expected one per input token",
        ),
        (
            lambda fake: setattr(fake, "padding", 200_000),
            r"POST /generate at http://127.0.0.1:\d+ answered 200 with more than \d+ bytes: expected at most that",
        ),
    ],
)
def test_score_errors_name_the_endpoint_the_value_and_the_expectation(engine, setup, expected) -> None:
    fake, url = engine
    setup(fake)
    with weights(url) as client, pytest.raises(SwapError, match=expected):
        client.score([[5, 9, 2, 7, 11]])


def test_score_refuses_routing_that_names_an_expert_twice(engine) -> None:
    fake, url = engine
    bad = routed([5, 9, 2])
    bad[1, 2] = [3, 3, 4, 5]
    fake.routed_override = pybase64.b64encode(bad.tobytes()).decode()
    with (
        weights(url, geometry=GEOMETRY) as client,
        pytest.raises(
            SwapError,
            match=r"sample 0 \(3 tokens\): "
            r"meta_info.routed_experts: .*"
            r"names one expert twice.*"
            r"\(duplicate_ids\)",
        ),
    ):
        client.score([[5, 9, 2]])


def test_score_refuses_ids_that_are_no_token_ids_before_sending(engine) -> None:
    fake, url = engine
    with weights(url) as client:
        with pytest.raises(ValueError, match=r"samples\[1\] is empty: expected at least one token id"):
            client.score([[1, 2], []])
        with pytest.raises(ValueError, match=r"samples\[0\]\[1\] is True: expected a token id in \[0, 2147483647\]"):
            client.score([[1, True]])
        with pytest.raises(ValueError, match=r"samples\[0\]\[0\] is -1: expected a token id"):
            client.score([np.array([-1, 2])])
        with pytest.raises(ValueError, match=r"samples\[0\] is a str: expected a sequence of token ids"):
            client.score(["hello"])
    assert fake.calls == []


# ---------------------------------------------------------------------- problem and construction
def test_problem_reads_the_server_info(engine) -> None:
    fake, url = engine
    with weights(url) as client:
        assert client.problem() is None
        fake.info["weight_cache_mode"] = "daemon"
        assert "--weight-cache-mode daemon" in client.problem() and "--weight-cache-mode off" in client.problem()
        fake.info["weight_cache_mode"], fake.info["model_checksum"] = "off", ""
        assert "--model-checksum" in client.problem()
        fake.api_key = "k" * 16
        assert "answered 401" in client.problem() and "set api_key" in client.problem()


def test_problem_says_when_nothing_answers() -> None:
    with weights(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
        said = client.problem()
    assert said.startswith("SGLang cannot be asked for its configuration: GET /server_info at http://127.0.0.1:")
    assert "ConnectError" in said


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"base_url": "localhost:30000"},
            "base_url is 'localhost:30000': expected SGLang's http:// or https:// address",
        ),
        ({"timeout": 0}, "timeout is 0: expected a finite number of seconds above 0"),
        ({"timeout": float("inf")}, "timeout is inf"),
        ({"api_key": " key"}, "api_key is not a non-empty string"),
        ({"admin_api_key": ""}, "admin_api_key is not a non-empty string"),
    ],
)
def test_construction_errors_name_the_parameter(options, expected) -> None:
    base_url = options.pop("base_url", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        SglangWeights(base_url, **options)
