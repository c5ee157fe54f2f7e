"""SGLang's weight-update endpoints as :class:`~mla_watch.engines.swap.EngineWeights` (sync httpx).

Read from SGLang 0.5.23's source (``sglang/srt/...``, file:line; tests/test_engine_sglang_weights.py answers as
these lines do):

* **Swap.** ``POST /pause_generation {"mode": "retract"}`` (entrypoints/http_server.py:1831-1841): new requests
  wait in the tokenizer manager (managers/tokenizer_manager.py:938-939) and running ones go back to the waiting
  queue with their KV freed (managers/scheduler.py:5817-5910), to be recomputed - by the new routers - after
  ``POST /continue_generation {}`` (http_server.py:1844-1854; its body is required, io_struct.py:1949-1955).
  The default mode, ``abort``, would end them (tokenizer_manager.py:2267-2280); ``in_place`` keeps them running,
  so the flush below is refused and the update reports failure after loading (scheduler.py:5518-5521,
  managers/scheduler_components/weight_updater.py:120-136).
* ``POST /update_weights_from_disk {"model_path": DIR, ...}`` (http_server.py:1300-1334,
  io_struct.py:1970-1999): the model runner iterates the directory's safetensors files only and hands those
  tensors to ``model.load_weights`` (model_runner_components/weight_updater.py:174-253,
  model_loader/loader.py:480-601, 1028-1030); no other weight is touched, nothing is rebuilt, ``config.json``
  is not read. DeepSeek-V2/V3 loads ``model.layers.N.mlp.gate.weight`` and ``...gate.e_score_correction_bias``
  with ``default_weight_loader``, an in-place ``copy_`` that captured CUDA graphs see
  (models/deepseek_common/deepseek_weight_loader.py:517-545, model_loader/weight_utils.py:1574-1586); a name it
  does not know is only logged (deepseek_weight_loader.py:528-533). ``flush_cache`` (default true) drops the
  radix cache after the load, and a refused flush fails the call (scheduler_components/weight_updater.py:120-163).
  Success: 200 ``{"success": true, "message", "num_paused_requests"}``; failure: 400, same keys. With
  several data-parallel workers ``message`` is their messages joined by `` | `` and ``num_paused_requests`` a
  list (tokenizer_manager.py:2386-2394).
* ``model_path`` must be an absolute directory the engine sees: any path that is not a directory there is taken
  for a Hugging Face repo id and downloaded (loader.py:494, 529-535). The directory is checked here first
  (router tensors only, of the shapes its config gives): a tensor that does not fit fails the load, the
  "rollback" reads the same directory again (model_config.model_path is re-pointed first,
  model_runner_components/weight_updater.py:193, 229-237), its exception escapes the scheduler's dispatch
  (managers/scheduler.py:2253) and the scheduler takes the server down (scheduler.py:6370-6378).
* **Score.** ``POST /generate`` with ``input_ids``, ``return_logprob``, ``logprob_start_len: 0`` and
  ``max_new_tokens: 1`` (io_struct.py:177-237) answers ``{"text", "output_ids", "meta_info"}``;
  ``meta_info.input_token_logprobs`` has one ``[logprob, token_id, text]`` per prompt token
  (tokenizer_manager.py:2840-2868, 3098-3116): the first logprob is ``null`` (nothing before it) and ids at or
  past ``vocab_size - 1`` come back as 0 (managers/scheduler_components/logprob_result_processor.py:26-55).
  A logprob start of 0 caps the prefix-cache match at 0, so every position is computed by the live weights
  (managers/schedule_batch.py:1774-1775). ``return_routed_experts`` adds ``meta_info.routed_experts`` where
  SGLang runs with ``--enable-return-routed-experts`` (tokenizer_manager.py:2602-2609; ignored otherwise),
  decoded by :mod:`mla_watch.engines.formats`. Errors: 400 ``{"error": {"message"}}``
  (http_server.py:985-990, 2246-2250); an abort without a status is a 200 whose ``finish_reason`` has type
  ``abort`` (tokenizer_manager.py:1891-1921).
* **Keys.** The weight and pause endpoints are ``ADMIN_OPTIONAL``: with ``--admin-api-key`` only that key opens
  them, else ``--api-key``; ``/generate`` and ``/server_info`` take ``--api-key`` (utils/auth.py:128-150).
"""

from __future__ import annotations

import json
import math
import operator
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mla_watch.common.values import is_number
from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.router_checkpoint import checked_router_dir
from mla_watch.engines.routing_ids import DataError, routing_counts, sglang_routing_decoder
from mla_watch.engines.swap import (
    ENGINE_MESSAGE_CHARS,
    MAX_TOKENIZE_ANSWER_BYTES,
    EngineWeights,
    SampleScore,
    SwapError,
    SwapResult,
    engine_said,
    tokens_of_answer,
)

__all__ = ["PAUSE_MODE", "SglangWeights"]

# Requests held, not dropped, and the cache flushable meanwhile (see the module docstring).
PAUSE_MODE = "retract"
# The update is read as safetensors whatever --load-format the engine started with: that default
# (tokenizer_manager.py:2295-2296) may name a loader that cannot read a plain directory (dummy, gguf, mistral's
# consolidated*.safetensors, remote ...), and the router checkpoint is one model.safetensors.
LOAD_FORMAT = "safetensors"
CONTROL_MAX_BYTES = 64 << 10  # a control answer is one short JSON object
INFO_MAX_BYTES = 4 << 20  # /server_info: every server argument and the scheduler's state
SCORE_BASE_BYTES = 64 << 10  # /generate's answer beside its per-token parts
LOGPROB_ENTRY_BYTES = 64  # `[-12.345678901234567,1234567,null],` is 36 bytes
MAX_TOKEN_ID = (1 << 31) - 1  # SGLang keeps token ids as int32


class SglangWeights(EngineWeights):
    """A running SGLang server's routers swapped from a directory on its disk, and its scores.

    ``api_key`` is SGLang's ``--api-key`` (``/generate``, ``/server_info`` and, without an admin key, the
    weight endpoints); ``admin_api_key`` its ``--admin-api-key``, which alone opens the weight and pause
    endpoints where it is set. ``geometry`` (the model's MoE layers) lets :meth:`score` return the routing
    the engine chose; without it no routing is asked for.
    """

    name = "sglang"

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 60.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        geometry: EngineGeometry | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url is {base_url!r}: expected SGLang's http:// or https:// address")
        if not is_number(timeout, finite=True) or timeout <= 0:
            raise ValueError(f"timeout is {timeout!r}: expected a finite number of seconds above 0")
        for field, key in (("api_key", api_key), ("admin_api_key", admin_api_key)):
            if key is not None and (not isinstance(key, str) or not key or key.strip() != key):
                raise ValueError(
                    f"{field} is not a non-empty string without surrounding spaces: expected the key "
                    "SGLang was started with, or None"
                )
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.geometry = geometry
        self._normal = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = admin_api_key or api_key
        self._admin = {"Authorization": f"Bearer {admin}"} if admin else {}
        self._client = httpx.Client(
            base_url=self.base_url, timeout=self.timeout, transport=transport, follow_redirects=False
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SglangWeights:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ EngineWeights
    def problem(self) -> str | None:
        try:
            status, body = self._call("GET", "/server_info", None, admin=False, limit=INFO_MAX_BYTES)
        except SwapError as error:
            return f"SGLang cannot be asked for its configuration: {error}"
        if status in (401, 403):
            return (
                f"GET /server_info at {self.base_url} answered {status} ({_message(body)!r}): set api_key to the "
                "--api-key SGLang was started with"
            )
        if status != 200:
            return (
                f"GET /server_info at {self.base_url} answered {status} ({_message(body)!r}): expected 200 from "
                "an SGLang server"
            )
        info = _json_object(body)
        if info is None:
            return f"GET /server_info at {self.base_url} answered no JSON object: expected SGLang's server info"
        mode = info.get("weight_cache_mode")
        if mode not in (None, "off"):
            # The refusal is raised, not answered (model_runner_components/weight_updater.py:159-172, 182), and the
            # scheduler's dispatch catches nothing (managers/scheduler.py:2253): it would not survive the call.
            return (
                f"SGLang runs with --weight-cache-mode {str(mode)[:40]}, which shares its weights with a cache "
                "daemon and refuses in-place updates: start it with --weight-cache-mode off"
            )
        if info.get("model_checksum") is not None:
            return (
                "SGLang runs with --model-checksum, which checks every weight directory against the model's "
                "checksums (model_loader/loader.py:541-545) and so refuses a router-only one: start it without"
            )
        return None

    def swap(self, weights_path: Path) -> SwapResult:
        path = checked_router_dir(weights_path, "SGLang")
        request = {
            "model_path": str(path),
            "load_format": LOAD_FORMAT,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        paused_at = time.perf_counter()
        reload_seconds = 0.0
        answer: dict[str, Any] = {}
        failure: BaseException | None = None
        try:
            self._control("/pause_generation", {"mode": PAUSE_MODE}, expected="200 once generation is paused")
            reload_started = time.perf_counter()
            try:
                answer = self._update(request)
            finally:
                reload_seconds = time.perf_counter() - reload_started
        except BaseException as error:
            failure = error
            raise
        finally:
            # Sent whatever happened before: a pause that timed out here may have reached the engine, and
            # continuing an engine that is not paused only clears the flag (tokenizer_manager.py:2282-2286).
            try:
                self._control("/continue_generation", {}, expected="200 once generation continues")
            except SwapError as error:
                if failure is None:
                    raise SwapError(
                        f"{error}; the new routers are loaded but the engine may still hold its "
                        "requests: POST /continue_generation to it"
                    ) from None
                if isinstance(failure, Exception):  # an interrupt goes on as it is
                    raise SwapError(
                        f"{error}; the engine may still hold its requests (POST /continue_generation "
                        f"to it); before that: {failure}"
                    ) from failure
        paused_seconds = time.perf_counter() - paused_at
        detail: dict[str, Any] = {
            "engine": self.name,
            "pause_mode": PAUSE_MODE,
            "load_format": LOAD_FORMAT,
            "engine_message": engine_said(answer.get("message")),
        }
        paused = answer.get("num_paused_requests")
        if isinstance(paused, int) or (isinstance(paused, list) and all(isinstance(n, int) for n in paused)):
            detail["num_paused_requests"] = paused
        return SwapResult(str(path), paused_seconds, reload_seconds, detail)

    def score(self, samples: Sequence[Sequence[int]]) -> list[SampleScore]:
        # Checked first: no request is sent for a list that cannot be scored whole.
        checked = [_token_ids(index, sample) for index, sample in enumerate(samples)]
        return [self._score_one(index, ids) for index, ids in enumerate(checked)]

    def tokenize(self, text: str) -> list[int]:
        status, body = self._call("POST", "/tokenize", {"prompt": text}, admin=False, limit=MAX_TOKENIZE_ANSWER_BYTES)
        if status != 200:
            raise SwapError(
                f"POST /tokenize at {self.base_url} answered {status}: {_message(body)!r}; expected 200 "
                f"with the prompt's token ids{_key_hint(status)}"
            )
        return tokens_of_answer(_json_object(body), f"POST /tokenize at {self.base_url}")

    # ------------------------------------------------------------------ internals
    def _call(self, method: str, path: str, payload: Any, *, admin: bool, limit: int) -> tuple[int, bytes]:
        """Status and body (at most ``limit`` bytes, decompressed) of one request; SwapError when there is none."""
        headers = self._admin if admin else self._normal
        try:
            with self._client.stream(method, path, json=payload, headers=headers) as response:
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise SwapError(
                            f"{method} {path} at {self.base_url} answered {response.status_code} with "
                            f"more than {limit} bytes: expected at most that"
                        )
                return response.status_code, bytes(body)
        except httpx.TimeoutException as error:
            raise SwapError(
                f"{method} {path} at {self.base_url}: no answer within {self.timeout:g} s "
                f"({type(error).__name__}); the engine may still be working on it"
            ) from None
        except httpx.HTTPError as error:
            raise SwapError(
                f"{method} {path} at {self.base_url}: {type(error).__name__}: {engine_said(str(error))}"
            ) from None

    def _control(self, path: str, payload: dict[str, Any], *, expected: str) -> None:
        status, body = self._call("POST", path, payload, admin=True, limit=CONTROL_MAX_BYTES)
        if status != 200:
            raise SwapError(
                f"POST {path} at {self.base_url} answered {status}: {_message(body)!r}; "
                f"expected {expected}{_key_hint(status)}"
            )

    def _update(self, request: dict[str, Any]) -> dict[str, Any]:
        status, body = self._call("POST", "/update_weights_from_disk", request, admin=True, limit=CONTROL_MAX_BYTES)
        answer = _json_object(body)
        if status != 200 or answer is None or answer.get("success") is not True:
            raise SwapError(
                f"POST /update_weights_from_disk at {self.base_url} (model_path {request['model_path']!r})"
                f" answered {status}: {_message(body)!r}; expected 200 with success true"
                f"{_key_hint(status)}"
            )
        return answer

    def _score_one(self, index: int, ids: list[int]) -> SampleScore:
        payload: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        per_token = LOGPROB_ENTRY_BYTES
        if self.geometry is not None:
            payload["return_routed_experts"] = True
            # base64 of int32 [tokens, num_hidden_layers, top_k] (formats.py's SGLang decoder reads it)
            per_token += math.ceil(4 * self.geometry.num_hidden_layers * self.geometry.top_k / 3) + 4
        limit = SCORE_BASE_BYTES + (len(ids) + 1) * per_token
        status, body = self._call("POST", "/generate", payload, admin=False, limit=limit)
        where = f"POST /generate at {self.base_url}, sample {index} ({len(ids)} tokens)"
        if status != 200:
            raise SwapError(
                f"{where} answered {status}: {_message(body)!r}; expected 200 with its logprobs{_key_hint(status)}"
            )
        document = _json_object(body)
        meta = document.get("meta_info") if document is not None else None
        if not isinstance(meta, dict):
            raise SwapError(f"{where}: the answer has no meta_info object: expected SGLang's /generate answer")
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise SwapError(
                f"{where}: the engine aborted it ({engine_said(finish.get('message'))!r}); expected it scored"
            )
        entries = meta.get("input_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = f"{len(entries)} entries" if isinstance(entries, list) else f"a {type(entries).__name__}"
            raise SwapError(
                f"{where}: meta_info.input_token_logprobs is {got}: expected one per input token "
                f"({len(ids)}; a shorter list is a truncated prompt, as --allow-auto-truncate does)"
            )
        logprobs: list[float] = []
        for position in range(1, len(ids)):
            entry = entries[position]
            logprob = entry[0] if isinstance(entry, list) and len(entry) >= 2 else None
            token = entry[1] if isinstance(entry, list) and len(entry) >= 2 else None
            if not is_number(logprob, finite=True):
                shown = repr(logprob) if logprob is None or isinstance(logprob, int | float) else type(logprob).__name__
                raise SwapError(
                    f"{where}: input_token_logprobs[{position}] has logprob {shown}: expected a finite "
                    "number (SGLang sends -inf and NaN as null)"
                )
            # SGLang reports an id at or past vocab_size - 1 as 0 (logprob_result_processor.py:51-55).
            if token != ids[position] and token != 0:
                raise SwapError(
                    f"{where}: input_token_logprobs[{position}] is for token {token!r}: expected "
                    f"{ids[position]}, the id sent there"
                )
            logprobs.append(float(logprob))
        routing = self._routing(where, meta, len(ids)) if self.geometry is not None else None
        return SampleScore(loss=-math.fsum(logprobs), tokens=len(ids) - 1, routing=routing)

    def _routing(self, where: str, meta: dict[str, Any], tokens: int) -> np.ndarray | None:
        """``meta_info.routed_experts`` as ``[rows, MoE layers, top_k]``; None where the engine sent none."""
        geometry = self.geometry
        assert geometry is not None
        value = meta.get("routed_experts")
        if value is None:
            return None  # SGLang runs without --enable-return-routed-experts: it ignores the request field
        try:
            ids = sglang_routing_decoder(meta)(value, geometry)
            routing_counts(ids, geometry)  # shape, expert ids and distinct top-k checked as the proxy checks them
        except DataError as error:
            raise SwapError(f"{where}: meta_info.routed_experts: {error} ({error.reason})") from None
        # Positions [0, prompt + 1 - 1) for one new token: one row per input token, fewer without padded rows.
        if ids.shape[0] > tokens:
            raise SwapError(
                f"{where}: meta_info.routed_experts has {ids.shape[0]} rows: expected at most {tokens}, "
                "one per input token"
            )
        if ids.shape[1] == geometry.num_hidden_layers and ids.shape[1] != len(geometry.moe_layers):
            ids = ids[:, list(geometry.moe_layers), :]
        return np.array(ids, dtype=np.int32)  # a copy: the decoded view is read-only over the answer's bytes


def _token_ids(index: int, sample: Sequence[int]) -> list[int]:
    if isinstance(sample, str | bytes) or not isinstance(sample, Sequence | np.ndarray):
        raise ValueError(f"samples[{index}] is a {type(sample).__name__}: expected a sequence of token ids")
    ids: list[int] = []
    for position, value in enumerate(sample):
        try:
            token = operator.index(value)
        except TypeError:
            raise ValueError(
                f"samples[{index}][{position}] is a {type(value).__name__}: expected a token id (an integer)"
            ) from None
        if isinstance(value, bool | np.bool_) or not 0 <= token <= MAX_TOKEN_ID:
            shown = repr(bool(value)) if isinstance(value, bool | np.bool_) else str(token)  # not np.int64(-1)
            raise ValueError(f"samples[{index}][{position}] is {shown}: expected a token id in [0, {MAX_TOKEN_ID}]")
        ids.append(token)
    if not ids:
        raise ValueError(f"samples[{index}] is empty: expected at least one token id")
    return ids


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _message(body: bytes) -> str:
    """What an engine said, in at most :data:`~mla_watch.engines.swap.ENGINE_MESSAGE_CHARS` characters: SGLang
    answers ``{"error": {"message"}}``, ``{"error": "..."}``, ``{"message"}`` (weight endpoints), FastAPI's
    ``{"detail"}`` or plain text (/flush_cache)."""
    document = _json_object(body)
    if document is None:
        return engine_said(body[: 4 * ENGINE_MESSAGE_CHARS].decode("utf-8", errors="replace").strip())
    error = document.get("error")
    for said in (
        error.get("message") if isinstance(error, dict) else error,
        document.get("message"),
        document.get("detail"),
    ):
        if isinstance(said, str) and said:
            return engine_said(said)
        if said is not None and not isinstance(said, str):
            return engine_said(json.dumps(said)[: 4 * ENGINE_MESSAGE_CHARS])
    return engine_said(json.dumps(document)[: 4 * ENGINE_MESSAGE_CHARS])


def _key_hint(status: int) -> str:
    if status in (401, 403):
        return " (set api_key, or admin_api_key where SGLang runs with --admin-api-key)"
    return ""
