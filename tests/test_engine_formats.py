"""The engines' routing formats and the model-config geometry, pinned to the engines' own source.

Fixtures are built to the shapes the engines' code writes (read in their released wheels):

* vLLM >= 0.22: ``vllm/entrypoints/openai/chat_completion/protocol.py`` and
  ``completion/protocol.py`` (``routed_experts: str`` per choice, "base64-encoded ``.npy``
  bytes ... (num_tokens - 1, num_layers, num_experts_per_tok)"), filled by
  ``vllm/utils/serial_utils.py::numpy2base64`` (``np.save(..., allow_pickle=False)``); uint8 up
  to 256 experts, else uint16 (``model_executor/layers/fused_moe/routed_experts_capturer.py``);
  the layer axis is ``get_total_num_hidden_layers()``, dense layers left zero.
* vLLM <= 0.21: top-level ``prompt_routed_experts`` ``[prompt_len, num_moe_layers, top_k]`` and
  ``choices[i].routed_experts`` ``[gen_len - 1, num_moe_layers, top_k]`` as nested lists
  (``split_routed_experts`` in ``routed_experts_capturer.py``; ``.tolist()`` in ``serving.py``).
* SGLang >= 0.5.9: ``python/sglang/srt/entrypoints/openai/protocol.py`` ``SglExt.routed_experts``
  at the response's top level (``sglext``), base64 of raw int32 bytes
  (``managers/detokenizer_manager.py::_b64_encode_per_request``), ``[seq_len - 1,
  num_hidden_layers, top_k]`` (``test/registered/rl/test_return_routed_experts.py`` reshapes
  ``(-1, 48, 8)``); a stream sends it in one chunk with ``choices: []`` (``serving_chat.py``).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle

import numpy as np
import pytest
import torch

import mla_watch
from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.formats import (
    DataError,
    RoutingPlan,
    add_extra,
    decode_chunk,
    decode_response,
    encode_sglang,
    encode_vllm,
    every_layer,
)
from mla_watch.engines.geometry import GeometryError, load_geometry, parse_geometry
from tests.tiny_models import FAMILIES, build

# DeepSeek-V3's own config.json (the keys that matter): 61 layers, the first 3 dense, 256 experts, top-8.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "num_nextn_predict_layers": 1,
}
TINY = parse_geometry(
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 5,
        "first_k_dense_replace": 2,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
    }
)


def reference_counts(ids: np.ndarray, experts: int) -> np.ndarray:
    """Counted one id at a time: what the vectorised count must equal."""
    counts = np.zeros((ids.shape[1], experts), dtype=np.int64)
    for token in ids:
        for layer, chosen in enumerate(token):
            for expert in chosen:
                counts[layer, expert] += 1
    return counts


def random_ids(tokens: int, geometry=TINY, seed: int = 0) -> np.ndarray:
    """[tokens, moe_layers, top_k] distinct experts per token, as a router picks them."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            [rng.choice(geometry.num_experts, geometry.top_k, replace=False) for _ in geometry.moe_layers]
            for _ in range(tokens)
        ]
    ).astype(np.int64)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


# ---------------------------------------------------------------------- geometry
def test_deepseek_v3_geometry_has_58_moe_layers_named_as_transformers_names_them() -> None:
    geometry = parse_geometry(DEEPSEEK_V3)
    assert geometry.moe_layers == tuple(range(3, 61)) and geometry.num_experts == 256 and geometry.top_k == 8
    assert geometry.router_names[0] == "model.layers.3.mlp.gate"
    assert geometry.router_names[-1] == "model.layers.60.mlp.gate"


def test_qwen_sparse_steps_and_dense_layers_and_nested_text_configs() -> None:
    qwen = parse_geometry(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 6,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert qwen.moe_layers == (1, 5)
    nested = parse_geometry(
        {
            "model_type": "qwen3_vl_moe",
            "text_config": {
                "model_type": "qwen3_vl_moe_text",
                "num_hidden_layers": 2,
                "num_experts": 8,
                "num_experts_per_tok": 2,
            },
        }
    )
    assert nested.moe_layers == (0, 1) and nested.num_experts == 8


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_geometry_from_config_names_the_routers_the_probe_finds(family: str) -> None:
    model = build(family)
    probe = mla_watch.attach(model)
    try:
        found = [info for info in probe.routers if info.kind == "expert"]
        assert parse_geometry(model.config.to_dict()).routers() == found
    finally:
        probe.detach()


def test_the_bundled_models_config_describes_its_three_moe_layers() -> None:
    geometry = load_geometry(mla_watch.__path__[0] + "/models/bundled")
    assert geometry.router_names == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    assert (geometry.num_experts, geometry.top_k) == (64, 6)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"num_hidden_layers": 4, "num_experts_per_tok": 2}, "none of the keys n_routed_experts"),
        ({"num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 9}, "'num_experts_per_tok' = 9"),
        (
            {"num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": "3"},
            "'first_k_dense_replace' = \"3\": expected an integer in [0, 4]",
        ),
        (
            {"num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 4},
            "no layer of the 4 is a MoE layer",
        ),
        (
            {"num_hidden_layers": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "mlp_layer_types": ["dense"]},
            "'mlp_layer_types'",
        ),
    ],
)
def test_a_config_that_cannot_describe_the_routers_names_the_key_and_the_expectation(config, expected) -> None:
    with pytest.raises(GeometryError) as caught:
        parse_geometry(config, "/models/x/config.json")
    assert expected in str(caught.value) and "/models/x/config.json" in str(caught.value)


def test_an_unreadable_config_file_is_named_without_its_contents(tmp_path) -> None:
    (tmp_path / "config.json").write_text("secret-token-abc {")
    with pytest.raises(GeometryError) as caught:
        load_geometry(tmp_path)
    assert str(tmp_path / "config.json") in str(caught.value) and "secret" not in str(caught.value)
    with pytest.raises(GeometryError, match="cannot be read"):
        load_geometry(tmp_path / "missing.json")


# ---------------------------------------------------------------------- vLLM
def test_vllm_current_format_counts_moe_rows_and_strips_the_field() -> None:
    prompt, generated = random_ids(7, seed=1), random_ids(4, seed=2)
    rows = np.concatenate([prompt, generated])  # prompt + generated - 1 rows, as vLLM returns them
    full = every_layer(rows, list(TINY.moe_layers), TINY.num_hidden_layers).astype(np.uint8)
    assert full[:, :2].max() == 0  # dense layers: zero rows
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length", "routed_experts": npy_b64(full)}],
    }
    extra = {"policy": "code_assistant/code", "adjustments": []}
    decoded = decode_response(RoutingPlan("vllm", TINY, keep=False, extra=extra), json.dumps(body).encode())
    assert decoded.error is None and decoded.tokens == 11
    assert np.array_equal(decoded.counts, reference_counts(rows, TINY.num_experts))
    sent = json.loads(decoded.body)
    assert "routed_experts" not in sent["choices"][0] and sent["choices"][0]["text"] == "x"
    assert sent["mla_watch"] == extra
    kept = decode_response(RoutingPlan("vllm", TINY, keep=True), json.dumps(body).encode())
    assert json.loads(kept.body)["choices"][0]["routed_experts"] == body["choices"][0]["routed_experts"]
    # What serve --return-routed-experts writes:
    assert encode_vllm(full, TINY.num_experts) == body["choices"][0]["routed_experts"]


def test_vllm_021_nested_lists_count_the_prompt_once_and_each_choice() -> None:
    prompt, first, second = random_ids(5, seed=3), random_ids(3, seed=4), random_ids(2, seed=5)
    body = {
        "prompt_routed_experts": prompt.tolist(),
        "choices": [
            {"index": 0, "text": "a", "routed_experts": first.tolist()},
            {"index": 1, "text": "b", "routed_experts": second.tolist()},
        ],
    }
    decoded = decode_response(RoutingPlan("vllm", TINY, keep=False), json.dumps(body).encode())
    expected = reference_counts(np.concatenate([prompt, first, second]), TINY.num_experts)
    assert np.array_equal(decoded.counts, expected) and decoded.tokens == 10
    sent = json.loads(decoded.body)
    assert "prompt_routed_experts" not in sent and all("routed_experts" not in c for c in sent["choices"])


def test_a_preempted_vllm_request_returns_null_routing_counted_as_none() -> None:
    body = {"choices": [{"index": 0, "text": "a", "routed_experts": None}]}
    decoded = decode_response(RoutingPlan("vllm", TINY, keep=False), json.dumps(body).encode())
    assert not decoded.found and decoded.counts is None


# ---------------------------------------------------------------------- SGLang
def test_sglang_response_and_its_routing_chunk() -> None:
    rows = random_ids(9, seed=6)
    raw = every_layer(rows, list(TINY.moe_layers), TINY.num_hidden_layers)
    encoded = base64.b64encode(raw.astype("<i4").tobytes()).decode()
    assert encode_sglang(raw) == encoded
    body = {"id": "c", "choices": [{"index": 0, "message": {"content": "hi"}}], "sglext": {"routed_experts": encoded}}
    decoded = decode_response(RoutingPlan("sglang", TINY, keep=False), json.dumps(body).encode())
    assert np.array_equal(decoded.counts, reference_counts(rows, TINY.num_experts)) and decoded.tokens == 9
    assert "sglext" not in json.loads(decoded.body)

    chunk = json.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": None,
            "sglext": {"routed_experts": encoded},
        }
    )
    dropped = decode_chunk(RoutingPlan("sglang", TINY, keep=False), chunk, first=False)
    assert dropped.body is None and dropped.tokens == 9  # the client did not ask: the chunk is not relayed
    kept = decode_chunk(RoutingPlan("sglang", TINY, keep=True), chunk, first=False)
    assert json.loads(kept.body)["sglext"]["routed_experts"] == encoded and kept.tokens == 9
    token = json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}]})
    first = decode_chunk(RoutingPlan("sglang", TINY, keep=False, extra={"policy": "p"}), token, first=True)
    assert json.loads(first.body)["mla_watch"] == {"policy": "p"} and not first.found


# ---------------------------------------------------------------------- data errors
def good_vllm(rows: np.ndarray) -> bytes:
    return json.dumps({"choices": [{"index": 0, "routed_experts": npy_b64(rows)}]}).encode()


@pytest.mark.parametrize(
    ("body", "reason", "words"),
    [
        (good_vllm(np.full((2, 5, 4), 16, dtype=np.uint8)), "expert_id", "expected [0, 15]"),
        (good_vllm(np.zeros((2, 5, 3), dtype=np.uint8)), "shape", "expected [tokens, layers, 4]"),
        (good_vllm(np.zeros((2, 4, 4), dtype=np.uint8)), "shape", "expected 5 (every layer) or 3 (MoE layers)"),
        (good_vllm(np.zeros((2, 5, 4), dtype=np.float32)), "encoding", "expected integers"),
        (json.dumps({"choices": [{"routed_experts": "%%% not base64"}]}).encode(), "encoding", "not"),
        (
            json.dumps({"choices": [{"routed_experts": base64.b64encode(pickle.dumps([1])).decode()}]}).encode(),
            "encoding",
            "not a .npy array",
        ),
        (json.dumps({"choices": [{"routed_experts": [[[1, 2]], [[1]]]}]}).encode(), "shape", "ragged"),
    ],
)
def test_routing_that_does_not_fit_the_config_is_a_data_error_and_counts_nothing(body, reason, words) -> None:
    decoded = decode_response(RoutingPlan("vllm", TINY, keep=False), body)
    assert decoded.counts is None and decoded.error is not None, decoded
    assert decoded.error.reason == reason and words in str(decoded.error)
    assert "routed_experts" not in decoded.body.decode()  # still stripped


def test_routing_that_names_an_expert_twice_in_a_tokens_top_k_is_never_counted() -> None:
    # What vLLM's capture returns when misconfigured: every id 0, with the right shape.
    zeros = decode_response(RoutingPlan("vllm", TINY, keep=False), good_vllm(np.zeros((6, 5, 4), dtype=np.uint8)))
    assert zeros.counts is None and zeros.error.reason == "duplicate_ids"
    assert "6 of 6 tokens" in str(zeros.error) and "--enforce-eager" in str(zeros.error)
    rows = every_layer(random_ids(5, seed=11), list(TINY.moe_layers), TINY.num_hidden_layers).astype(np.uint8)
    rows[3, 4, 1] = rows[3, 4, 0]  # one token, one layer, one repeat
    one = decode_response(
        RoutingPlan("sglang", TINY, keep=False),
        json.dumps({"choices": [], "sglext": {"routing": 0, "routed_experts": encode_sglang(rows)}}).encode(),
    )
    assert one.counts is None and one.error.reason == "duplicate_ids" and "token 3, MoE layer 2" in str(one.error)


@pytest.mark.parametrize("top_k", [2, 8, 16, 17, 32])
def test_a_repeated_expert_is_found_at_every_top_k(top_k) -> None:
    from mla_watch.engines.routing_ids import refuse_duplicates

    rng = np.random.default_rng(top_k)
    ids = np.argsort(rng.random((50, 3, 64)), axis=2)[:, :, :top_k]
    refuse_duplicates(ids)  # distinct: no error
    ids[17, 2, top_k - 1] = ids[17, 2, 0]
    with pytest.raises(DataError) as raised:
        refuse_duplicates(ids)
    assert raised.value.reason == "duplicate_ids" and "1 of 50 tokens" in str(raised.value)
    assert f"token 17, MoE layer 2, expert {ids[17, 2, 0]}" in str(raised.value)


def test_a_npy_header_that_claims_more_than_it_holds_is_an_encoding_error_without_allocating() -> None:
    import tracemalloc

    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000000, 4, 4), }"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    lying = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(64)
    body = json.dumps({"choices": [{"index": 0, "routed_experts": base64.b64encode(lying).decode()}]}).encode()
    tracemalloc.start()
    try:
        decoded = decode_response(RoutingPlan("vllm", TINY, keep=False), body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded.error.reason == "encoding" and "(1000000000000, 4, 4)" not in str(decoded.error)
    assert "over 64 bytes" in str(decoded.error) and peak < 1 << 20
    assert "routed_experts" not in decoded.body.decode()


def test_with_n_choices_the_prompt_rows_every_choice_repeats_are_counted_once() -> None:
    prompt = random_ids(6, seed=12)
    first, second = random_ids(3, seed=13), random_ids(2, seed=14)

    def choice(index: int, generated: np.ndarray) -> dict:
        full = every_layer(np.concatenate([prompt, generated]), list(TINY.moe_layers), TINY.num_hidden_layers)
        return {"index": index, "text": "x", "routed_experts": encode_vllm(full, TINY.num_experts)}

    body = {
        "choices": [choice(0, first), choice(1, second)],
        "usage": {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13},
    }
    decoded = decode_response(RoutingPlan("vllm", TINY, keep=False), json.dumps(body).encode())
    assert decoded.error is None and decoded.tokens == 6 + 3 + 2
    assert np.array_equal(decoded.counts, reference_counts(np.concatenate([prompt, first, second]), TINY.num_experts))
    del body["usage"]  # without the prompt's length the rows cannot be told apart: nothing is guessed
    guessed = decode_response(RoutingPlan("vllm", TINY, keep=False), json.dumps(body).encode())
    assert guessed.counts is None and guessed.error.reason == "shape" and "usage.prompt_tokens" in str(guessed.error)


def test_a_client_that_sets_the_prompt_start_gets_its_rows_while_every_row_is_counted() -> None:
    rows = random_ids(9, seed=15)
    full = every_layer(rows, list(TINY.moe_layers), TINY.num_hidden_layers).astype(np.uint8)
    body = {"choices": [{"index": 0, "text": "x", "routed_experts": npy_b64(full)}], "usage": {"prompt_tokens": 7}}
    decoded = decode_response(RoutingPlan("vllm", TINY, keep=True, prompt_start=5), json.dumps(body).encode())
    assert decoded.tokens == 9 and np.array_equal(decoded.counts, reference_counts(rows, TINY.num_experts))
    kept = np.load(io.BytesIO(base64.b64decode(json.loads(decoded.body)["choices"][0]["routed_experts"])))
    assert kept.dtype == np.uint8 and np.array_equal(kept, full[5:])  # what vLLM returns for start 5


def test_sglang_bytes_that_fit_no_layer_count_are_a_shape_error() -> None:
    encoded = base64.b64encode(np.zeros(7, dtype="<i4").tobytes()).decode()
    decoded = decode_response(
        RoutingPlan("sglang", TINY, keep=False),
        json.dumps({"choices": [], "sglext": {"routed_experts": encoded}}).encode(),
    )
    assert decoded.error.reason == "shape" and "multiple of layers x top_k" in str(decoded.error)


def test_a_body_that_is_not_json_is_relayed_as_it_came() -> None:
    assert decode_response(RoutingPlan("vllm", TINY, keep=False), b"<html>502</html>").body == b"<html>502</html>"


@pytest.mark.parametrize(
    ("body", "sent"),
    [
        # as the engine wrote it, spaces and escapes included
        (b' {"id": "a",  "text": "\\u00e9"}\n', b'{"id": "a",  "text": "\\u00e9","mla_watch":{"policy":"p"}}'),
        (b"{}", b'{"mla_watch":{"policy":"p"}}'),
        (b'{"mla_watch": 1, "x": 2}', b'{"mla_watch":{"policy":"p"},"x":2}'),  # one key, ours: written anew
        ('{"x": "\u00e9"}'.encode("utf-16"), '{"x":"\u00e9","mla_watch":{"policy":"p"}}'.encode()),  # into UTF-8
        (b"[1, 2]", None),
        (b"<html>ok</html>", None),
        (b'{"x": 1} {"y": 2}', None),
        (b"[" * 100_000, None),
    ],
)
def test_an_answer_without_routing_is_marked_as_the_engine_wrote_it_or_refused(body, sent) -> None:
    assert add_extra(body, {"policy": "p"}) == sent


def test_data_errors_survive_the_trip_back_from_the_decoding_process() -> None:
    error = pickle.loads(pickle.dumps(DataError("shape", "routing has 4 layers")))
    assert error.reason == "shape" and str(error) == "routing has 4 layers"
    rows = np.zeros((3, 5, 4), dtype=np.uint8)
    rows[:, 2:, :] = np.arange(4)
    decoder = RoutingDecoder(workers=1)
    try:
        decoded = asyncio.run(decoder.response(RoutingPlan("vllm", TINY, keep=False), good_vllm(rows)))
        failed = asyncio.run(decoder.response(RoutingPlan("vllm", TINY, keep=False), good_vllm(rows + 20)))
    finally:
        decoder.close()
    assert decoded.tokens == 3 and decoded.counts[:, :4].sum() == 3 * 3 * 4
    assert failed.error.reason == "expert_id"


def test_the_embedded_servers_recording_matches_what_the_probe_counted() -> None:
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    probe = mla_watch.attach(model, window_tokens=None)
    ids = torch.tensor([tokenizer("SELECT id FROM orders")["input_ids"]])
    with torch.no_grad(), probe.attribute("sql"), probe.record_routing() as recording:
        model(input_ids=ids)
        model(input_ids=ids[:, :3])
    rows = recording.rows(0)
    assert rows.shape == (ids.shape[1] + 3, 3, 6)
    counted = probe.counts("sql")
    for index, info in enumerate(recording.routers):
        assert np.array_equal(np.bincount(rows[:, index].ravel(), minlength=64), counted[info.name])


def three_tokens() -> np.ndarray:
    """Three tokens of routing, each picking experts 0-3 at the MoE layers (dense layers zero)."""
    rows = np.zeros((3, 5, 4), dtype=np.uint8)
    rows[:, 2:, :] = np.arange(4)
    return rows


def test_an_idle_decoder_process_that_dies_is_replaced_and_no_response_is_lost() -> None:
    import os
    import signal

    rows, plan, decoder = three_tokens(), RoutingPlan("vllm", TINY, keep=False), RoutingDecoder(workers=1)

    async def scenario() -> tuple:
        (victim,) = await decoder.worker_pids()
        os.kill(victim, signal.SIGKILL)
        # The pool reaps a dead worker only after it marks itself broken: from then on no answer is handed to it.
        deadline = asyncio.get_running_loop().time() + 30
        while os.path.exists(f"/proc/{victim}") and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        decoded = await decoder.response(plan, good_vllm(rows))  # the pool is found broken here
        return victim, decoded, await decoder.worker_pids(), await decoder.response(plan, good_vllm(rows))

    try:
        victim, decoded, workers, again = asyncio.run(scenario())
    finally:
        decoder.close()
    assert decoded.tokens == 3 and again.tokens == 3 and workers and victim not in workers


def test_a_decoder_process_that_dies_holding_an_answer_counts_it_as_an_error_and_never_decodes_it_here() -> None:
    import os
    import signal

    rows, plan, decoder = three_tokens(), RoutingPlan("vllm", TINY, keep=False), RoutingDecoder(workers=1)

    async def scenario() -> tuple:
        (victim,) = await decoder.worker_pids()
        os.kill(victim, signal.SIGSTOP)  # it cannot take the answer before it dies: the answer is queued for it
        pending = asyncio.ensure_future(decoder.response(plan, good_vllm(rows)))
        await asyncio.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        died = await pending
        return victim, died, await decoder.worker_pids(), await decoder.response(plan, good_vllm(rows))

    try:
        victim, died, workers, again = asyncio.run(scenario())
    finally:
        decoder.close()
    # Decoded anywhere else (in this process, as it once was), it would have counted its 3 tokens.
    assert died.counts is None and died.body is None and died.error.reason == "decoder"
    assert workers and victim not in workers and again.tokens == 3


def test_routing_strings_are_cut_out_before_parsing_without_touching_anything_else() -> None:
    rows = random_ids(3, seed=7)
    full = every_layer(rows, list(TINY.moe_layers), TINY.num_hidden_layers)
    encoded = encode_sglang(full)
    text = 'the model said "routed_experts": "AAAA" and \\"routed_experts\\":\\"'
    body = {
        "choices": [{"index": 0, "message": {"content": text}}],
        "sglext": {"routed_experts": encoded},
        "meta": {"routed_experts": "b3RoZXI="},
    }  # a routing-like string where SGLang puts none
    decoded = decode_response(RoutingPlan("sglang", TINY, keep=False), json.dumps(body).encode())
    sent = json.loads(decoded.body)
    assert decoded.tokens == 3 and sent["choices"][0]["message"]["content"] == text
    assert sent["meta"] == {"routed_experts": "b3RoZXI="} and "sglext" not in sent
    # JSON encoders that escape '/' as '\/' (base64 holds '/'): parsed as a string, decoded all the same.
    escaped = json.dumps({"choices": [], "sglext": {"routed_experts": encoded}}).replace("/", "\\/")
    assert decode_response(RoutingPlan("sglang", TINY, keep=True), escaped.encode()).tokens == 3
    kept = decode_response(RoutingPlan("sglang", TINY, keep=True), json.dumps(body).encode())
    assert json.loads(kept.body)["sglext"]["routed_experts"] == encoded


def test_a_large_body_goes_to_the_worker_as_a_private_file_that_does_not_outlive_the_decode() -> None:
    import stat

    from mla_watch.engines.decoder import FILE_HANDOFF_BYTES

    geometry = parse_geometry(DEEPSEEK_V3)
    rows = np.argsort(np.random.default_rng(8).random((400, 58, 256)), axis=2)[:, :, :8]  # 8 distinct experts
    full = every_layer(rows, list(geometry.moe_layers), geometry.num_hidden_layers)
    body = json.dumps({"choices": [], "sglext": {"routed_experts": encode_sglang(full)}}).encode()
    assert len(body) > FILE_HANDOFF_BYTES
    plan = RoutingPlan("sglang", geometry, keep=False)
    decoder = RoutingDecoder(workers=1)
    try:
        decoded = asyncio.run(decoder.response(plan, body))
        handoff = decoder._handoff
        assert stat.S_IMODE(handoff.stat().st_mode) == 0o700 and list(handoff.iterdir()) == []
    finally:
        decoder.close()
    assert not handoff.exists()
    assert np.array_equal(decoded.counts, decode_response(plan, body).counts) and decoded.tokens == 400
