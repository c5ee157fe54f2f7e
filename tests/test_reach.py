"""Reference readings that reach what they judge: long sets, the token budget of a set, the positions each reading
reached, and alerts on far positions (LongContextDrift, any DSA indexer alert) judged only by readings that
reached them - on a stand-in reader, on the bundled model and on a tiny DeepSeek-V3.2 whose indexers pick
``index_topk = 16`` keys. The sidecar end to end: tests/test_reach_sidecar.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from harness.helpers import router_stats
from mla_watch.alerting.vocabulary import Rule, Selector
from mla_watch.quality.score import ModelScore
from mla_watch.references.budget import plan_reading
from mla_watch.references.prober import ReferenceProber, ReferenceSettings
from mla_watch.references.prompts import (
    DEFAULT_SET_TOKENS,
    Generated,
    ReferenceSet,
    ReferenceSetError,
    ReferenceSets,
    load_reference_dir,
)
from mla_watch.references.readers import ModelReader, ReferenceReader
from mla_watch.references.readings import ReferenceBaseline, ReferenceBaselines, position_tokens
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import compute_stats
from mla_watch.routing.windows import RouterStats
from mla_watch.shipped import SHIPPED_REFERENCES
from tests.tiny_models import COMMON, FAMILIES

GATE = RouterInfo("model.layers.1.mlp.gate", 1, "expert", 64, 6)
EDGES = (64, 128, 256, 512)  # a 512-token model's position buckets: 0-63 ... 256-511, 512+

DRIFT = Rule(
    name="LongContextDrift",
    metric="long_context_drift",
    selector=Selector(kind="expert", business_line="*"),
    above=0.025,
    resolve_below=0.02,
    severity="warning",
    actions=("notify",),
    annotations={"summary": "{value:.3f} bits"},
)
DEGENERATE = Rule(
    name="IndexerDegenerate",
    metric="locality",
    selector=Selector(kind="indexer", business_line="*"),
    above=0.95,
    resolve_below=0.9,
    severity="warning",
    actions=("notify",),
    annotations={"summary": "{value:.2f}"},
)


def short_set(name: str = "code_assistant") -> ReferenceSet:
    return ReferenceSet(name, 1, tuple(f"{name} prompt {index}" for index in range(8)))


LONG = ReferenceSet("long_documents", 1, (), long=True, max_tokens=DEFAULT_SET_TOKENS, generate=Generated(4))


# --------------------------------------------------------------------------- files
def test_a_long_set_generates_its_documents_and_old_files_load_as_they_did(tmp_path: Path) -> None:
    (tmp_path / "default.yaml").write_text("business_line: default\nversion: 1\nprompts: [a, b, c, d]\n")
    (tmp_path / "far.yaml").write_text(
        "business_line: far\nversion: 2\nlong: true\nmax_tokens: 4096\ngenerate: {documents: 3, seed: 7}\n"
    )
    loaded = load_reference_dir(tmp_path)
    assert loaded.sets["default"].max_tokens == DEFAULT_SET_TOKENS and not loaded.sets["default"].long
    far = loaded.sets["far"]
    assert far.long and far.max_tokens == 4096 and far.generate == Generated(3, 7) and far.count == 3
    assert [r.name for r in loaded.for_line("far")] == ["default"]  # a long set is no business line's
    assert [r.name for r in loaded.long_sets()] == ["far"]
    texts = far.texts(5000)
    assert [len(text) for text in texts] == [5000] * 3 and len(set(texts)) == 3
    assert far.texts(9000)[0].startswith(texts[0])  # deterministic: each a prefix of its longer self
    assert far.digest == load_reference_dir(tmp_path).sets["far"].digest != LONG.digest
    assert far.as_dict()["generate"] == {"documents": 3, "seed": 7}


def test_bad_long_sets_name_the_file_the_key_the_value_and_the_expectation(tmp_path: Path) -> None:
    (tmp_path / "default.yaml").write_text("business_line: default\nversion: 1\nlong: true\nprompts: [a, b, c, d]\n")
    (tmp_path / "far.yaml").write_text(
        "business_line: far\nversion: 1\ngenerate: {documents: 0, sed: 1}\nprompts: [a, b, c, d]\nlong: 'yes'\n"
    )
    (tmp_path / "huge.yaml").write_bytes(b"#" * (16 * 1024 * 1024 + 1))
    with pytest.raises(ReferenceSetError) as raised:
        load_reference_dir(tmp_path)
    errors = raised.value.errors
    expected = [
        "default.yaml: long = true: expected false in default.yaml, the mixed set of the lines without a set of",
        "far.yaml: long = 'yes': expected true (a long set",
        "far.yaml: generate = '<with prompts>': expected either prompts or generate, not both",
        "far.yaml: generate = '<in a set without long: true>': expected generated documents in a long set only",
        "far.yaml: generate.sed: unknown key 'sed' (did you mean 'seed'?)",
        "far.yaml: generate.documents = 0: expected an integer from 1 to 64",
        "huge.yaml: file size = 16777217 bytes: expected at most 16777216 bytes",
    ]
    for text in expected:
        assert any(text in error for error in errors), (text, errors)


# --------------------------------------------------------------------------- the budget
def words(texts) -> list[list[int]]:
    """A tokenizer: one token a word."""
    return [[len(word) for word in text.split()] for text in texts]


def test_a_set_reads_within_its_budget_cuts_what_passes_the_limit_and_says_so() -> None:
    prompts = tuple(" ".join(["w"] * n) + f" p{index}" for index, n in enumerate((30, 99, 40, 50, 20)))
    reference = ReferenceSet("code_assistant", 1, prompts, source="refs/code_assistant.yaml", max_tokens=150)
    plan = plan_reading(reference, words, limit=64)
    # 31 tokens, the second cut to 64, the third whole: 136; the fourth (51) would pass 150: left out, the fifth too
    assert plan.lengths == (31, 64, 41) and plan.cut == 1 and plan.left_out == 2
    assert plan.note == (
        "refs/code_assistant.yaml: 1 prompts cut to 64 tokens (the reader's limit a prompt); 2 "
        "prompts left out past max_tokens = 150 (the set's token budget; 136 tokens read)"
    )
    whole = plan_reading(replace(reference, max_tokens=DEFAULT_SET_TOKENS), words, limit=128)
    assert whole.lengths == (31, 100, 41, 51, 21) and whole.note is None

    generated = plan_reading(replace(LONG, max_tokens=1000), words, limit=300)
    assert generated.lengths == (300, 300, 300) and generated.left_out == 1  # the fourth past the budget
    assert "1 prompts left out past max_tokens = 1000" in generated.note


# --------------------------------------------------------------------------- judging far positions
def balanced(tokens: int) -> np.ndarray:
    counts = np.full(64, tokens * 6 // 64, dtype=np.int64)
    counts[: tokens * 6 - int(counts.sum())] += 1
    return counts


def collapsed(tokens: int) -> np.ndarray:
    return np.concatenate([np.full(6, tokens, dtype=np.int64), np.zeros(58, dtype=np.int64)])


class Far(ReferenceReader):
    """The model: short sets' prompts are 100 tokens, long sets' 512; from ``damaged_from`` on it collapses."""

    where = "the test's model"
    limit = 512

    def __init__(self) -> None:
        self.damaged_from: int | None = None
        self.reads: list[str] = []

    def read(self, reference: ReferenceSet) -> ModelScore:
        self.reads.append(reference.name)
        lengths = [512] * 4 if reference.long else [100] * 8
        starts = (0, *EDGES)
        rows = [
            collapsed(tokens) if self.damaged_from is not None and start >= self.damaged_from else balanced(tokens)
            for start, tokens in zip(starts, position_tokens(lengths, EDGES), strict=True)
        ]
        by_position = np.stack(rows)
        total = by_position.sum(axis=0)
        tokens = sum(lengths)
        stats = compute_stats(total, kind="expert", top_k=6, tokens=tokens)
        return ModelScore(
            2.0,
            tokens - len(lengths),
            {GATE.name: RouterStats(GATE, reference.name, stats, total)},
            losses=[10.0] * len(lengths),
            counts=[n - 1 for n in lengths],
            positions={GATE.name: by_position},
            position_edges=EDGES,
        )


def drifting(edge: str = "256-511") -> RouterStats:
    record = router_stats(name=GATE.name, line="code_assistant", long_context_drift=0.06, long_context_edge=edge)
    return record


def test_a_drift_past_every_reading_is_undetermined_and_the_long_set_that_reaches_it_decides() -> None:
    reader = Far()
    sets = [ReferenceSets({"code_assistant": short_set()})]
    judge = ReferenceProber(lambda: sets[0], reader, ReferenceBaselines())
    judge.read_now()  # healthy: the baseline
    reader.damaged_from = 256  # broken past position 256 only: the short prompts route as they did
    judge.read_now()
    cause = judge.judge(DRIFT, drifting(), 0.0)
    assert cause.name == "undetermined", cause  # never traffic on a reading that did not reach 256
    assert cause.summary == (
        "no reading of the reference prompts reached positions 256 on (bucket 256-511, where "
        "model.layers.1.mlp.gate leaves in-range routing): the longest prompt each set read (code_assistant v1 100 "
        "tokens); add a long set (long: true, with prompts past position 256, or generate) to the reference prompt "
        "directory"
    )
    assert judge.judge(DRIFT, drifting("512+"), 0.0).summary.endswith(
        "those positions lie past what the test's model reads of a prompt (512 tokens: the model's context, or "
        "--reference-max-tokens beside an engine)"
    )

    reader.damaged_from = None
    sets[0] = ReferenceSets({"code_assistant": short_set(), "long_documents": LONG})
    judge.read_now(["long_documents"])  # healthy: its baseline, by position too
    since = time.time()
    judge.read_now(["long_documents"])
    cause = judge.judge(DRIFT, drifting(), since)
    assert cause.name == "traffic" and cause.details["changed"] is False, cause
    assert [entry["set"] for entry in cause.details["sets"]] == ["long_documents"]  # the short set reached nothing
    assert cause.details["reach"] == {
        "from_position": 256,
        "by_position": True,
        "what": ("positions 256 on (bucket 256-511, where model.layers.1.mlp.gate leaves in-range routing)"),
    }
    assert "positions 256 on" in cause.summary and "1024 tokens there" in cause.summary

    reader.damaged_from = 256
    judge.read_now()
    cause = judge.judge(DRIFT, drifting(), since)
    assert cause.name == "model" and "route differently now" in cause.summary and cause.details["js_bits"] > 0.5
    # an edge further in judges every position from it on: the damage past 256 is among them
    assert judge.judge(DRIFT, drifting("128-255"), since).name == "model"


def test_a_long_set_not_read_since_the_alert_is_asked_for_within_its_share_of_the_readers_time() -> None:
    reader = Far()
    gate = threading.Event()
    original = reader.read

    def slow(reference: ReferenceSet) -> ModelScore:
        if reference.long:
            gate.wait(5)
        return original(reference)

    reader.read = slow  # type: ignore[method-assign]
    sets = ReferenceSets({"code_assistant": short_set(), "long_documents": LONG})
    judge = ReferenceProber(
        lambda: sets,
        reader,
        ReferenceBaselines(),
        settings=ReferenceSettings(interval_seconds=0, long_interval_seconds=0, long_share=0.01, wait_seconds=60),
    )
    gate.set()
    judge.read_now()
    reader.reads.clear()
    since = time.time()
    judge.start()
    try:
        # the long set's last reading was brief: it may be read again within the alert's wait
        assert wait(lambda: judge.readings()["code_assistant"].taken_at >= since)
        cause = judge.judge(DRIFT, drifting(), since)
        assert cause is None  # coming
        assert wait(lambda: judge.judge(DRIFT, drifting(), since) is not None)
        assert judge.judge(DRIFT, drifting(), since).name == "traffic" and "long_documents" in reader.reads
        # a long reading that took 1 s or more at a share of 1%: the next waits 99 s, past the alert's wait of 60 s
        gate.clear()
        threading.Timer(1.0, gate.set).start()
        judge.read_now(["long_documents"])
        later = time.time()
        cause = judge.judge(DRIFT, drifting(), later)
        assert cause.name == "undetermined" and "(long_documents v1) are next read in" in cause.summary, cause
        assert "long sets take at most 1% of the test's model's time (--reference-long-share)" in cause.summary
        described = judge.describe()
        assert described["long_next_at"] > later + 90 and described["long_share"] == 0.01
    finally:
        judge.stop()


def wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_baseline_keeps_its_prompt_lengths_and_routing_by_position_and_one_from_before_fits_short_prompts(
    tmp_path: Path,
) -> None:
    reader = Far()
    baselines = ReferenceBaselines(tmp_path / "reference_baseline.json")
    judge = ReferenceProber(
        lambda: ReferenceSets({"long_documents": LONG, "code_assistant": short_set()}), reader, baselines
    )
    readings = {reading.set_name: reading for reading in judge.read_now()}
    again = ReferenceBaselines(tmp_path / "reference_baseline.json")
    (long,) = [baseline for baseline in again.all() if baseline.set_name == "long_documents"]
    assert long.lengths == (512,) * 4 and long.position_edges == EDGES
    assert long.positions[GATE.name].shape == (5, 64) and long.positions[GATE.name][3].sum() == 4 * 256 * 6
    assert again.of(readings["long_documents"]) is not None
    # a baseline written before readings kept their lengths: it stands for prompts the former 256-token cut kept whole
    legacy = ReferenceBaseline.from_json(
        {k: v for k, v in long.to_json().items() if k not in ("lengths", "positions", "position_edges")}, "sets[0]"
    )
    assert legacy.lengths is None and not legacy.fits(readings["long_documents"])
    short = ReferenceBaseline.of(readings["code_assistant"])
    old = ReferenceBaseline.from_json({k: v for k, v in short.to_json().items() if k != "lengths"}, "sets[1]")
    assert old.fits(readings["code_assistant"])
    with pytest.raises(ValueError, match=r"sets\[0\].positions\['model.layers.1.mlp.gate'\]: expected 5 rows of 64"):
        ReferenceBaseline.from_json({**long.to_json(), "positions": {GATE.name: [[1, 2]]}}, "sets[0]")
    summary = readings["long_documents"].summary()
    assert summary["reach"] == 512 and summary["positions"] == {
        "0-63": 256,
        "64-127": 256,
        "128-255": 512,
        "256-511": 1024,
        "512+": 0,
    }


# --------------------------------------------------------------------------- real models
@pytest.mark.slow
def test_on_the_bundled_model_long_context_drift_is_judged_by_the_long_set_past_the_trained_length(bundled) -> None:
    model, tokenizer = bundled
    reader = ModelReader(model, tokenizer, threading.Lock())
    assert reader.limit == 512  # the model's context
    short = ReferenceSet(
        "default",
        1,
        (
            "Document: the order shipped.\n\nSummary:",
            "SELECT id FROM orders;",
            "def total(items):",
            "<|user|>\nWhere is my parcel?\n<|assistant|>\n",
        ),
    )
    long = load_reference_dir(SHIPPED_REFERENCES).sets["long_documents"]
    sets = [ReferenceSets({"default": short})]
    judge = ReferenceProber(lambda: sets[0], reader, ReferenceBaselines())
    judge.read_now()
    cause = judge.judge(DRIFT, drifting(), 0.0)
    assert cause.name == "undetermined" and "reached positions 256 on" in cause.summary
    sets[0] = ReferenceSets({"default": short, "long_documents": long})
    since = time.time()
    (reading,) = judge.read_now(["long_documents"])  # its baseline, learned while healthy, and the alert's reading
    assert reading.reach == 512 and reading.positions()["256-511"] == 4 * 256  # 4 documents of the model's context
    cause = judge.judge(DRIFT, drifting(), since)
    assert cause.name == "traffic" and cause.details["js_bits"] == 0.0, cause  # the same routing, to the selection
    router = dict(model.named_modules())[GATE.name]
    with torch.no_grad():
        router.e_score_correction_bias[:6] += 10.0  # damaged in place
    judge.read_now(["long_documents"])
    cause = judge.judge(DRIFT, drifting(), since)
    assert cause.name == "model" and cause.details["js_bits"] > 0.05, cause


class Characters:
    """A tokenizer for a random model: one token a character."""

    pad_token_id = 0

    def __call__(self, text: str, **options) -> dict[str, list[int]]:
        return {"input_ids": [1 + ord(character) % 96 for character in text]}


def test_a_deepseek_v32_indexer_is_judged_only_by_a_reading_past_twice_its_index_topk() -> None:
    config = transformers.DeepseekV32Config(**{**COMMON, **FAMILIES["deepseek_v32"][2], "index_topk": 16})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    reader = ModelReader(model, Characters(), threading.Lock())
    assert reader.limit == 64
    short = ReferenceSet("default", 1, tuple(f"question {index:02d}" for index in range(8)))  # 11 tokens: all picked
    long = ReferenceSet("far", 1, (), long=True, generate=Generated(4))
    name = "model.layers.1.self_attn.indexer"
    record = router_stats(name=name, kind="indexer", num_slots=64, top_k=16, line="code_assistant", locality=0.99)
    short_only = ReferenceProber(lambda: ReferenceSets({"default": short}), reader, ReferenceBaselines())
    judge = ReferenceProber(lambda: ReferenceSets({"default": short, "far": long}), reader, ReferenceBaselines())
    judge.read_now()  # healthy: the baselines
    short_only.read_now()
    since = time.time()
    judge.read_now()
    assert judge.readings()["default"].reach == 11 and judge.readings()["far"].reach == 64  # the model's context
    cause = judge.judge(DEGENERATE, record, since)
    assert cause.name == "traffic" and [entry["set"] for entry in cause.details["sets"]] == ["far"], cause

    with torch.no_grad():  # the indexer damaged in place: its scores all alike, its picks no longer chosen
        dict(model.named_modules())[name].weights_proj.weight.zero_()
    healthy = short_only.readings()["default"].score.routers[name].counts
    short_only.read_now()
    # the short prompts route as they did - the indexer picks every key of 11 - and are not taken for traffic
    assert np.array_equal(short_only.readings()["default"].score.routers[name].counts, healthy)
    cause = short_only.judge(DEGENERATE, record, since)
    assert cause.name == "undetermined" and cause.summary.startswith(
        f"no reading of the reference prompts reached positions 31 on, where a query sees 2 x index_topk = 32 keys or "
        f"more and {name} chooses among them: the longest prompt each set read (default v1 11 tokens)"
    ), cause
    judge.read_now()
    cause = judge.judge(DEGENERATE, record, since)
    assert cause.name == "model" and cause.details["js_bits"] > 0.01, cause
