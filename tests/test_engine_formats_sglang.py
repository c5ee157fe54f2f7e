"""SGLang 0.5.23's routing answers, as its own code builds them (tests/fixtures/sglang/make_fixtures.py copies
that code from the wheel, file:line in its comments), decoded and counted.

Expected counts are computed here from the ids the fixture script fed its copy of SGLang's capture
(``counted_ids``), one id at a time, never from the encoded answer.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mla_watch.engines.formats import DataError, RoutingPlan, decode_chunk, decode_response, encode_sglang
from mla_watch.engines.geometry import EngineGeometry, parse_geometry

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
BODIES = [
    "chat",
    "chat_n2",
    "chat_n2_meta_info",
    "completions_start_len",
    "completions_n2",
    "generate",
    "padding_rows_synthetic",
]
STREAMS = ["chat_stream", "completions_stream"]


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def geometry_of(fixture: dict[str, Any]) -> EngineGeometry:
    return parse_geometry(fixture["config"])


def expected_counts(fixture: dict[str, Any]) -> np.ndarray:
    """Selections per (MoE layer, expert), counted one id at a time."""
    geometry = geometry_of(fixture)
    counts = np.zeros((len(geometry.moe_layers), geometry.num_experts), dtype=np.int64)
    for token in fixture["counted_ids"]:
        for layer, chosen in enumerate(token):
            for expert in chosen:
                counts[layer, expert] += 1
    return counts


def routing_paths(document: Any, path: str = "") -> list[str]:
    """Every ``routed_experts`` key anywhere in ``document``."""
    if isinstance(document, dict):
        found = [f"{path}.{key}" for key in document if key == "routed_experts"]
        return found + [p for key, value in document.items() for p in routing_paths(value, f"{path}.{key}")]
    if isinstance(document, list):
        return [p for index, value in enumerate(document) for p in routing_paths(value, f"{path}[{index}]")]
    return []


def without_routing(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` as the client gets it when it did not ask for the routing."""
    stripped = copy.deepcopy(document)
    for container in [
        stripped.get("sglext"),
        stripped.get("meta_info"),
        *(choice.get("meta_info") for choice in stripped.get("choices", [])),
    ]:
        if isinstance(container, dict):
            container.pop("routed_experts", None)
    if stripped.get("sglext") == {}:
        del stripped["sglext"]
    return stripped


def decode(fixture: dict[str, Any], body: dict[str, Any], *, keep: bool = False):
    return decode_response(RoutingPlan("sglang", geometry_of(fixture), keep=keep), json.dumps(body).encode())


# ---------------------------------------------------------------------- the fixtures are SGLang's code's output
def test_the_committed_fixtures_are_what_the_script_writes() -> None:
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = {item["name"]: json.loads(json.dumps(item)) for item in script.build()}
    assert sorted(built) == sorted(BODIES + STREAMS)
    for name, item in built.items():
        assert item == load(name), name


# ---------------------------------------------------------------------- answers
@pytest.mark.parametrize("name", BODIES)
def test_each_answer_counts_exactly_the_rows_sglang_returned_and_the_client_gets_it_without_them(name) -> None:
    fixture = load(name)
    decoded = decode(fixture, fixture["body"])
    assert decoded.error is None, decoded.error
    assert decoded.tokens == fixture["tokens"] == len(fixture["counted_ids"])
    assert np.array_equal(decoded.counts, expected_counts(fixture))
    sent = json.loads(decoded.body)
    assert routing_paths(sent) == [] and sent == without_routing(fixture["body"])


@pytest.mark.parametrize("name", BODIES)
def test_a_client_that_asked_for_the_routing_gets_it_as_sglang_sent_it(name) -> None:
    fixture = load(name)
    decoded = decode(fixture, fixture["body"], keep=True)
    assert decoded.error is None and decoded.tokens == fixture["tokens"]
    assert json.loads(decoded.body) == fixture["body"]


def test_the_row_counts_are_sglangs_own() -> None:
    # [start, prompt + generated - 1): 7 + 5 - 1; from position 4 of 8 + 4 - 1; a later choice's generated rows.
    assert load("chat")["tokens"] == 11 and load("completions_start_len")["tokens"] == 7
    assert load("chat_n2")["tokens"] == 6 + 4 - 1  # the first choice's only: sglext holds no other
    assert load("chat_n2_meta_info")["tokens"] == (6 + 4 - 1) + (3 - 1)
    assert load("padding_rows_synthetic")["tokens"] == 6  # 8 rows less the 2 padded ones


# ---------------------------------------------------------------------- streams
@pytest.mark.parametrize("name", STREAMS)
def test_a_stream_counts_its_sglext_chunk_and_relays_what_else_the_client_asked_for(name) -> None:
    fixture = load(name)
    plan = RoutingPlan("sglang", geometry_of(fixture), keep=False, extra={"policy": "p"})
    found = []
    for index, data in enumerate(fixture["chunks"]):
        if data == "[DONE]":
            continue
        decoded = decode_chunk(plan, data, first=index == 0)
        if index == 0:
            assert json.loads(decoded.body)["mla_watch"] == {"policy": "p"}
        if not decoded.found:
            assert routing_paths(json.loads(decoded.body)) == []
            continue
        found.append(index)
        assert decoded.error is None and decoded.tokens == fixture["tokens"]
        assert np.array_equal(decoded.counts, expected_counts(fixture))
        if fixture["other_sglext"]:  # cached_tokens_details the client asked for: relayed, routing stripped
            assert json.loads(decoded.body)["sglext"] == fixture["other_sglext"]
        else:  # routing only: the chunk is not relayed
            assert decoded.body is None
    assert found == [fixture["sglext_chunk"]]
    kept = decode_chunk(
        RoutingPlan("sglang", geometry_of(fixture), keep=True), fixture["chunks"][fixture["sglext_chunk"]], first=False
    )
    assert json.loads(kept.body) == json.loads(fixture["chunks"][fixture["sglext_chunk"]])
    assert kept.tokens == fixture["tokens"]


# ---------------------------------------------------------------------- what SGLang does not send
def chat_with(routed: str | None = None, **sglext: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    fixture = load("chat")
    body = copy.deepcopy(fixture["body"])
    if routed is not None:
        body["sglext"]["routed_experts"] = routed
    body["sglext"].update(sglext)
    return fixture, body


def raw_rows(fixture: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(fixture["body"]["sglext"]["routed_experts"]), dtype="<i4").reshape(-1, 4, 4)


def assert_error(fixture: dict[str, Any], body: dict[str, Any], reason: str, words: str) -> DataError:
    decoded = decode(fixture, body)
    assert decoded.counts is None and decoded.error is not None, decoded
    assert decoded.error.reason == reason and words in str(decoded.error), str(decoded.error)
    assert routing_paths(json.loads(decoded.body)) == []  # stripped all the same
    return decoded.error


@pytest.mark.parametrize(
    "sibling",
    [
        {"routed_experts_dtype": "uint8"},
        {"routed_experts_dtype": "int32"},
        {"routed_experts_start_len": 3},
        {"routed_experts_shape": [11, 4, 4]},
    ],
)
def test_a_dtype_or_offset_beside_the_routing_is_a_format_sglang_does_not_send_and_an_encoding_error(sibling):
    fixture, body = chat_with(**sibling)
    ((key, value),) = sibling.items()
    shown = repr(value) if isinstance(value, str) else (str(value) if isinstance(value, int) else "a list")
    assert_error(fixture, body, "encoding", f"{key}={shown}")


def test_a_dtype_beside_a_choices_routing_is_refused_the_same() -> None:
    fixture = load("chat_n2_meta_info")
    body = copy.deepcopy(fixture["body"])
    body["choices"][1]["meta_info"]["routed_experts_dtype"] = "uint16"
    assert_error(fixture, body, "encoding", "routed_experts_dtype='uint16'")


@pytest.mark.parametrize(
    ("cut", "reason", "words"),
    [
        (2, "encoding", "expected whole int32 values"),
        (4, "shape", "expected a multiple of layers x top_k = 4 x 4"),
    ],
)
def test_bytes_that_do_not_make_whole_rows_are_a_data_error(cut, reason, words) -> None:
    fixture = load("chat")
    raw = base64.b64decode(fixture["body"]["sglext"]["routed_experts"])
    fixture, body = chat_with(base64.b64encode(raw[:-cut]).decode())
    assert_error(fixture, body, reason, words)


@pytest.mark.parametrize(
    ("value", "where"), [(16, (3, 2, 1)), (-2, (0, 1, 0)), (2**31 - 1, (5, 3, 3)), (-1, (4, 2, 2))]
)  # one -1 among a real row's ids
def test_ids_out_of_range_are_expert_id_errors(value, where) -> None:
    fixture = load("chat")
    rows = raw_rows(fixture).copy()
    rows[where] = value
    fixture, body = chat_with(encode_sglang(rows))
    assert_error(fixture, body, "expert_id", "expected [0, 15] (16 experts)")


def test_a_row_of_minus_one_at_only_some_moe_layers_is_no_padding_and_an_expert_id_error() -> None:
    fixture = load("chat")
    rows = raw_rows(fixture).copy()
    rows[2, 1:3, :] = -1  # MoE layers 1 and 2, not 3
    fixture, body = chat_with(encode_sglang(rows))
    assert_error(fixture, body, "expert_id", "[-1, ")


def test_padding_rows_count_nothing_and_minus_one_in_a_dense_layer_is_never_read() -> None:
    fixture = load("chat")
    rows = raw_rows(fixture).copy()
    rows[:, 0, :] = -1  # the dense layer: not a MoE layer, not counted
    decoded = decode(*chat_with(encode_sglang(rows)))
    assert decoded.error is None and np.array_equal(decoded.counts, expected_counts(fixture))
    everything = np.full_like(rows, -1)  # every row padding: no token at all
    decoded = decode(*chat_with(encode_sglang(everything)))
    assert decoded.error is None and decoded.tokens == 0 and decoded.counts.sum() == 0


@pytest.mark.parametrize(
    ("completion", "words"),
    [
        (None, "completion_tokens is None"),
        (99, "completion_tokens is 99: expected an integer in [0, 9]"),
        ("3", "completion_tokens is a str"),
    ],
)
def test_a_later_choice_whose_generated_rows_cannot_be_told_is_a_shape_error(completion, words) -> None:
    fixture = load("chat_n2_meta_info")
    body = copy.deepcopy(fixture["body"])
    body["choices"][1]["meta_info"]["completion_tokens"] = completion
    assert_error(fixture, body, "shape", words)


def test_routing_both_in_sglext_and_in_the_choices_is_not_counted_twice() -> None:
    fixture = load("chat_n2_meta_info")
    body = copy.deepcopy(fixture["body"])
    body["sglext"] = {"routed_experts": body["choices"][0]["meta_info"]["routed_experts"]}
    assert_error(fixture, body, "shape", "one or the other")


def test_a_generate_batch_is_a_json_list_which_is_not_read() -> None:
    # /generate with several prompts or n > 1 answers a list of meta_info objects (tokenizer_manager.py):
    # decode_response reads JSON objects only; the proxy forwards no /generate.
    fixture = load("generate")
    decoded = decode_response(
        RoutingPlan("sglang", geometry_of(fixture), keep=False), json.dumps([fixture["body"], fixture["body"]]).encode()
    )
    assert decoded.not_json
