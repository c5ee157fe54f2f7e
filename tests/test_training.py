"""The training script is deterministic and writes a loadable model with its card."""

from __future__ import annotations

import hashlib
import json

import pytest

import mla_watch
from mla_watch.models.train import TrainSettings, train

pytestmark = pytest.mark.slow

TINY = {
    "steps": 3,
    "batch_size": 2,
    "seq_len": 64,
    "vocab_size": 400,
    "train_samples_per_domain": 30,
    "heldout_samples_per_domain": 2,
    "completion_tokens": 4,
    "warmup": 2,
}


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_runs_with_one_seed_write_identical_files(tmp_path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    train(first, TrainSettings(**TINY), log_every=1)
    train(second, TrainSettings(**TINY), log_every=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(first / name) == digest(second / name), name
    other = tmp_path / "other"
    train(other, TrainSettings(**{**TINY, "seed": 7}), log_every=1)
    assert digest(other / "model.safetensors") != digest(first / "model.safetensors")


def test_the_written_model_loads_and_its_card_holds_the_measured_figures(tmp_path) -> None:
    report = train(tmp_path, TrainSettings(**TINY), log_every=1)
    model, tokenizer = mla_watch.load_model(str(tmp_path), device="cpu")
    assert model.config.model_type == "deepseek_v32"
    assert model.config.index_topk == 64  # dense warm-up in training, sparse selection when served
    assert tokenizer.padding_side == "left"
    card = (tmp_path / "MODEL_CARD.md").read_text()
    saved = json.loads((tmp_path / "training_report.json").read_text())
    assert saved["heldout_perplexity"] == report["heldout_perplexity"]
    for domain, value in report["heldout_perplexity"].items():
        assert f"| {domain} | {value} |" in card
    assert len(report["history"]) == 3
