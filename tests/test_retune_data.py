"""Re-tuning data: the opt-in traffic capture (a real SQLite file), JSONL datasets, splits and batches."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch

from harness.helpers import FakeClock
from harness.support import tmpfs
from mla_watch.quality.local_model import make_batches
from mla_watch.retune.capture import CaptureError, TokenSample, TrafficCapture
from mla_watch.retune.data import (
    DatasetError,
    distinct_count,
    load_jsonl_dataset,
    scored_text,
    split_held_out,
)

T0 = 1_000_000.0


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mla_watch.models import BUNDLED_DIR

    return AutoTokenizer.from_pretrained(BUNDLED_DIR, local_files_only=True)


# -- traffic capture ---------------------------------------------------------------------------


def test_add_and_read_back_in_order(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    with TrafficCapture(tmp_path / "state" / "capture.sqlite", clock=clock) as cap:  # creates the directory
        for i in range(5):
            clock.now += 1
            cap.add("billing", [1, 10 + i, 20 + i])
        cap.add("shipping", [1, 99])
        assert cap.counts() == {"billing": 5, "shipping": 1}
        assert cap.samples("billing") == [[1, 10 + i, 20 + i] for i in range(5)]
        assert cap.samples("billing", limit=2) == [[1, 13, 23], [1, 14, 24]]  # newest 2, oldest first
        assert cap.samples(limit=2) == [[1, 14, 24], [1, 99]]
        assert cap.samples() == [*([1, 10 + i, 20 + i] for i in range(5)), [1, 99]]
        assert cap.samples("nobody") == []
        assert cap.samples(limit=0) == []
        assert cap.size_bytes() == (5 * 3 + 2) * 4
    mode = os.stat(tmp_path / "state" / "capture.sqlite").st_mode & 0o777
    assert mode == 0o600  # customer traffic: owner only


def test_the_prompt_length_is_kept_so_that_only_client_text_is_scored(tmp_path: Path) -> None:
    with TrafficCapture(tmp_path / "capture.sqlite", max_tokens_per_sample=4) as cap:
        cap.add("billing", [1, 10, 11, 50, 51], prompt_tokens=3)  # 3 sent by the client, 2 generated
        cap.add("billing", [1, 12, 13, 14, 52], prompt_tokens=9)  # cut to 4 tokens: all of them prompt
        cap.add("billing", [1, 99])  # unknown: every token counts
        samples = cap.samples("billing")
        assert samples == [[1, 10, 11, 50], [1, 12, 13, 14], [1, 99]]
        assert all(isinstance(s, TokenSample) for s in samples)
        assert [s.scored_tokens for s in samples] == [3, 4, None]
        assert "10" not in repr(samples[0])  # a repr in a log line shows no token content
        with pytest.raises(ValueError, match="prompt_tokens = -1: expected None or a non-negative int"):
            cap.add("billing", [1, 2], prompt_tokens=-1)


def test_a_capture_file_from_before_prompt_lengths_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "capture.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE samples (id INTEGER PRIMARY KEY AUTOINCREMENT, business_line TEXT NOT NULL,
                        created_at REAL NOT NULL, n_tokens INTEGER NOT NULL, token_ids BLOB NOT NULL);""")
    db.execute(
        "INSERT INTO samples (business_line, created_at, n_tokens, token_ids) VALUES (?, ?, ?, ?)",
        ("billing", time.time() - 60, 2, bytes([1, 0, 0, 0, 7, 0, 0, 0])),
    )
    db.commit()
    db.close()
    with TrafficCapture(path) as cap:
        cap.add("billing", [1, 8, 9], prompt_tokens=2)
        assert [(list(s), s.scored_tokens) for s in cap.samples()] == [([1, 7], None), ([1, 8, 9], 2)]


def test_tokens_are_truncated_and_validated(tmp_path: Path) -> None:
    with TrafficCapture(tmp_path / "c.sqlite", max_tokens_per_sample=4) as cap:
        cap.add("a", list(range(10)))
        cap.add("a", torch.tensor([7, 8, 9]))
        assert cap.samples("a") == [[0, 1, 2, 3], [7, 8, 9]]
        with pytest.raises(ValueError, match="token_ids: empty"):
            cap.add("a", [])
        with pytest.raises(ValueError, match=r"token_ids\[1\]: got float"):
            cap.add("a", [1, 2.5])
        with pytest.raises(ValueError, match=r"token_ids\[0\]: got str"):
            cap.add("a", ["secret prompt"])
        with pytest.raises(ValueError, match="token_ids: got str"):
            cap.add("a", "hello")
        with pytest.raises(ValueError, match=r"token_ids\[2\]: out of range"):
            cap.add("a", [1, 2, -3])
        with pytest.raises(ValueError, match="business_line"):
            cap.add("", [1, 2])
        assert cap.counts() == {"a": 2}


@pytest.mark.parametrize("name", ["max_samples_per_line", "max_age_seconds", "max_bytes", "max_tokens_per_sample"])
def test_limits_must_be_positive(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} = 0"):
        TrafficCapture(tmp_path / "c.sqlite", **{name: 0})
    with pytest.raises(ValueError, match=f"{name} = -1"):
        TrafficCapture(tmp_path / "c.sqlite", **{name: -1})


def test_age_expiry_with_a_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    with TrafficCapture(tmp_path / "c.sqlite", max_age_seconds=100, clock=clock) as cap:
        cap.add("a", [1, 2])
        clock.now += 60
        cap.add("a", [1, 3])
        cap.add("b", [1, 4])
        clock.now += 50  # the first sample is now 110 s old
        assert cap.samples("a") == [[1, 3]]  # never returned once expired, even before a prune
        assert cap.counts() == {"a": 1, "b": 1}
        clock.now += 60
        assert cap.samples() == []
        assert cap.prune() == 2
        assert cap.counts() == {}
        assert cap.size_bytes() == 0


def test_expired_samples_are_dropped_on_add(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    path = tmp_path / "c.sqlite"
    with TrafficCapture(path, max_age_seconds=10, clock=clock) as cap:
        for _ in range(20):
            cap.add("a", [1, 2, 3])
        clock.now += 11  # > a few seconds since the last age check: the next add prunes
        cap.add("a", [1, 5])
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 1
        assert cap.size_bytes() == 8


def test_per_line_and_byte_bounds_hold_after_many_adds(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    with TrafficCapture(
        tmp_path / "c.sqlite", max_samples_per_line=25, max_bytes=4000, max_tokens_per_sample=16, clock=clock
    ) as cap:
        for i in range(600):
            clock.now += 0.001
            cap.add(f"line{i % 3}", [1, *([i] * 15), 2])  # 17 tokens, kept 16 -> 64 bytes
            counts = cap.counts() if i % 50 == 0 else None
            assert cap.size_bytes() <= 4000
            if counts is not None:
                assert all(n <= 25 for n in counts.values())
        counts = cap.counts()
        assert all(n <= 25 for n in counts.values())
        assert sum(counts.values()) == 4000 // 64  # the byte budget binds first: 62 samples
        newest = cap.samples("line2")
        assert newest[-1][1] == 599 and all(len(s) == 16 for s in newest)  # the oldest were dropped
    with TrafficCapture(tmp_path / "d.sqlite", max_samples_per_line=10, clock=clock) as cap:
        for i in range(200):
            cap.add("a" if i % 4 else "b", [1, i])
        assert cap.counts() == {"a": 10, "b": 10}
        assert [s[1] for s in cap.samples("b")] == list(range(160, 200, 4))


def test_prune_enforces_smaller_limits_of_a_reopened_file(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    clock = FakeClock(T0)
    with TrafficCapture(path, clock=clock) as cap:
        for i in range(30):
            clock.now += 1
            cap.add("a", [1, i])
    with TrafficCapture(path, max_samples_per_line=5, max_bytes=5 * 8, clock=clock) as cap:
        assert cap.prune() == 25
        assert cap.samples("a") == [[1, i] for i in range(25, 30)]
        assert cap.prune() == 0


def test_data_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    cap = TrafficCapture(path)
    cap.add("billing", [1, 2, 3])
    cap.add("shipping", [1, 4])
    cap.close()
    cap.close()  # idempotent
    with pytest.raises(CaptureError, match="closed"):
        cap.samples()
    with TrafficCapture(path) as again:
        assert again.counts() == {"billing": 1, "shipping": 1}
        assert again.samples("billing") == [[1, 2, 3]]
        assert again.size_bytes() == 20


def test_two_threads_adding_concurrently(tmp_path: Path) -> None:
    per_thread = 200
    with TrafficCapture(tmp_path / "c.sqlite") as cap:
        errors: list[BaseException] = []

        def worker(line: str) -> None:
            try:
                for i in range(per_thread):
                    cap.add(line, [1, i])
                    if i % 50 == 0:
                        cap.samples(line, limit=5)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors
        assert cap.counts() == {"a": per_thread, "b": per_thread}
        assert sorted(s[1] for s in cap.samples("a")) == list(range(per_thread))


def test_parent_is_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    path = blocker / "capture.sqlite"
    with pytest.raises(CaptureError) as info:
        TrafficCapture(path)
    assert str(path) in str(info.value) and "cannot create the state directory" in str(info.value)


def test_read_only_directory(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as directory:  # root ignores chmod; a read-only mount stops it
        with pytest.raises(CaptureError) as info:
            TrafficCapture(directory / "capture.sqlite")
        assert str(directory / "capture.sqlite") in str(info.value) and "not writable" in str(info.value)


def test_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "capture.sqlite"
    path.write_bytes(b"this is not an sqlite file at all, just text " * 40)
    with pytest.raises(CaptureError) as info:
        TrafficCapture(path)
    assert str(path) in str(info.value) and "not a database" in str(info.value)


def test_a_directory_in_place_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "capture.sqlite"
    path.mkdir()
    with pytest.raises(CaptureError, match="cannot open the file"):
        TrafficCapture(path)


def test_token_content_never_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(T0)
    caplog.set_level(logging.DEBUG, logger="mla_watch")
    with TrafficCapture(tmp_path / "c.sqlite", max_bytes=64, max_age_seconds=5, clock=clock) as cap:
        for _ in range(10):
            cap.add("a", [1, 424242, 171717])
        clock.now += 10
        cap.add("a", [1, 424242, 171717])
        cap.prune()
        with pytest.raises(ValueError) as info:
            cap.add("a", [1, 2, "password123"])
    assert caplog.records  # the drops were reported ...
    assert "424242" not in caplog.text and "171717" not in caplog.text  # ... by count only
    assert "password123" not in str(info.value)


# -- JSONL datasets ----------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_dataset_row_kinds(tmp_path: Path, tokenizer) -> None:
    bos = tokenizer.bos_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input_ids": [5, 6, 7]},
            "",
            {"input_ids": [bos, 8]},
            {"text": "where is my parcel", "id": 17},  # other keys are ignored
            {"prompt": "refund please", "completion": " sure"},
            {"input_ids": [9]},  # [bos, 9]
            {"input_ids": []},  # just [bos]: too short, skipped
        ],
    )
    samples = load_jsonl_dataset(path, tokenizer)
    assert samples == [
        [bos, 5, 6, 7],
        [bos, 8],
        [bos, *encode("where is my parcel")],
        [bos, *encode("refund please"), *encode(" sure")],
        [bos, 9],
    ]
    no_bos = load_jsonl_dataset(path, tokenizer, add_bos=False)
    assert no_bos[0] == [5, 6, 7] and [9] not in no_bos  # one token: skipped without a BOS
    assert load_jsonl_dataset(str(path), tokenizer, max_samples=2) == samples[:2]
    assert [s.scored_tokens for s in samples] == [None] * 5  # a dataset is text to learn from, all of it


def test_dataset_rows_may_say_how_many_tokens_count(tmp_path: Path, tokenizer) -> None:
    bos = tokenizer.bos_token_id
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"input_ids": [5, 6, 7, 8], "scored_tokens": 2}, {"input_ids": [bos, 5, 6], "scored_tokens": 9}],
    )
    samples = load_jsonl_dataset(path, tokenizer)
    assert samples == [[bos, 5, 6, 7, 8], [bos, 5, 6]]
    assert [s.scored_tokens for s in samples] == [3, 3]  # the prepended BOS counts; capped at the length
    written = write_jsonl(tmp_path / "written.jsonl", [s.as_record() for s in [*samples, TokenSample([bos, 7])]])
    again = load_jsonl_dataset(written, tokenizer, add_bos=False)  # what an external command reads
    assert again == [*samples, [bos, 7]] and [s.scored_tokens for s in again] == [3, 3, None]


def test_dataset_business_line_filter(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input_ids": [5, 6], "business_line": "billing"},
            {"input_ids": [7, 8], "business_line": "shipping"},
            {"input_ids": [9, 10]},
        ],
    )
    assert load_jsonl_dataset(path, tokenizer, business_line="billing", add_bos=False) == [[5, 6], [9, 10]]
    assert load_jsonl_dataset(path, tokenizer, add_bos=False) == [[5, 6], [7, 8], [9, 10]]
    only_other = write_jsonl(
        tmp_path / "e.jsonl",
        [
            {"input_ids": [5, 6], "business_line": "billing"},
            {"input_ids": [], "business_line": "shipping"},
            {"text": "", "business_line": "shipping"},
        ],
    )
    with pytest.raises(DatasetError) as info:
        load_jsonl_dataset(only_other, tokenizer, business_line="shipping")
    message = str(info.value)
    assert str(only_other) in message and "read 3 row(s)" in message and "skipped 1 of business lines" in message
    assert "2 shorter than 2 tokens" in message


@pytest.mark.parametrize(
    ("line", "fragments"),
    [
        ("{not json", ["invalid JSON", "column"]),
        ("[1, 2, 3]", ["not a JSON object (got a list of 3 item(s))", "expected one JSON object per line"]),
        ({"input_id": [1, 2]}, ["none of the keys", "(1 other key(s))", "did you mean 'input_ids'"]),
        ({"input_ids": [1, 2], "text": "hi"}, ["several of the keys", "'input_ids', 'text'"]),
        ({"input_ids": "1 2 3"}, ["key 'input_ids': expected a list of token ids", "got a string of 5 character(s)"]),
        ({"input_ids": [1, 2048]}, ["key 'input_ids[1]'", "[0, 2048)", "got an integer out of that range"]),
        ({"input_ids": [1, -1]}, ["key 'input_ids[1]'", "got an integer out of that range"]),
        ({"input_ids": [1, 2.0]}, ["key 'input_ids[1]'", "got a float"]),
        ({"input_ids": [1, True]}, ["key 'input_ids[1]'", "got a boolean"]),
        ({"text": 42}, ["key 'text': expected a string, got an integer"]),
        ({"text": "hi", "completion": "x"}, ["several of the keys: 'text', 'completion'"]),
        ({"prompt": "hi"}, ["completion: missing"]),
        ({"completion": "hi"}, ["prompt: missing"]),
        ({"prompt": "hi", "completion": ["x"]}, ["key 'completion': expected a string, got a list of 1 item(s)"]),
        ({"text": "hi", "business_line": 3}, ["key 'business_line': expected a string, got an integer"]),
        (
            {"input_ids": [1, 2], "scored_tokens": -1},
            ["key 'scored_tokens'", "a non-negative int", "a negative integer"],
        ),
        ({"input_ids": [1, 2], "scored_tokens": 1.5}, ["key 'scored_tokens'", "a non-negative int", "got a float"]),
        ({"text": "hi", "scored_tokens": 1}, ["key 'scored_tokens'", "only next to 'input_ids'"]),
        ({"text": "y" * 500}, None),  # fine: a long text
    ],
)
def test_dataset_errors_name_path_line_key_value(tmp_path: Path, tokenizer, line, fragments) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6]}, "   ", line])
    if fragments is None:
        assert len(load_jsonl_dataset(path, tokenizer)) == 2
        return
    with pytest.raises(DatasetError) as info:
        load_jsonl_dataset(path, tokenizer)
    message = str(info.value)
    assert message.startswith(f"{path}:3: ")
    assert "expected" in message
    for fragment in fragments:
        assert fragment in message
    assert info.value.errors == [message]


def test_dataset_bad_values_are_described_not_quoted_and_all_problems_reported(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ["z" * 1000]}, {"input_ids": [1, 99999]}])
    path.write_bytes(path.read_bytes() + b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(DatasetError) as info:
        load_jsonl_dataset(path, tokenizer)
    errors = info.value.errors
    assert [e.split(": ")[0] for e in errors] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert "zzz" not in errors[0] and "got a list of 1 item(s)" in errors[0]  # what the value is, never the value
    assert "99999" not in errors[1]
    assert "UTF-8" in errors[2]
    assert str(info.value).startswith("3 problems:")


def test_dataset_missing_file(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match="cannot read the file") as info:
        load_jsonl_dataset(path, tokenizer)
    assert str(path) in str(info.value)
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match="read 0 row"):
        load_jsonl_dataset(empty, tokenizer)


# -- split and batches -------------------------------------------------------------------------


def test_split_held_out_is_deterministic_and_spread() -> None:
    samples = [[1, i] for i in range(20)]
    train, held = split_held_out(samples, 0.2)
    assert len(held) == 4 and len(train) == 16
    assert sorted(s[1] for s in train + held) == list(range(20))
    positions = [s[1] for s in held]
    assert positions == sorted(positions) and positions[0] < 5 and positions[-1] >= 15  # spread over the capture
    assert split_held_out(samples, 0.2) == (train, held)
    assert len(split_held_out(samples, 0.01, minimum=3)[1]) == 3
    assert split_held_out([[1, 2], [3, 4]], 0.9, minimum=5) == ([[1, 2]], [[3, 4]])  # one is left to train on
    for n in range(2, 40):
        train, held = split_held_out([[i] for i in range(n)], 0.3)
        assert train and held and len(train) + len(held) == n


def test_split_held_out_holds_out_each_distinct_text_once_and_never_trains_on_it() -> None:
    """Four prompts repeated 32 times are four pieces of evidence, not 128: a held-out text appears once,
    and none of its copies (even with another completion) is trained on."""
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    samples = [TokenSample([*prompts[i % 4], 100 + i], scored_tokens=3) for i in range(128)]
    assert distinct_count(samples) == 4
    train, held = split_held_out(samples, 0.25)
    assert len(held) == 1 and distinct_count(held) == 1
    assert scored_text(held[0]) not in {scored_text(sample) for sample in train}
    assert len(train) == 96 and distinct_count(train) == 3
    # Completions differ, the scored prompt does not: still one text. Without scored_tokens the whole sample counts.
    assert distinct_count([[1, 2, 3, 4], [1, 2, 3, 5]]) == 2
    assert distinct_count([TokenSample([1, 2, 3, 4], 3), TokenSample([1, 2, 3, 5], 3)]) == 1


def test_split_held_out_errors() -> None:
    with pytest.raises(ValueError, match=r"got 1 distinct sample\(s\) in 1: at least 2 are needed"):
        split_held_out([[1, 2]])
    with pytest.raises(ValueError, match=r"got 1 distinct sample\(s\) in 3"):
        split_held_out([[1, 2], [1, 2], [1, 2]])
    with pytest.raises(ValueError, match="got 0 distinct sample"):
        split_held_out([])
    for fraction in (0, 1, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            split_held_out([[1], [2]], fraction)


def test_make_batches_pads_right_and_keeps_order() -> None:
    samples = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10, 11]]
    batches = make_batches(samples, batch_size=3, pad_id=0)
    assert len(batches) == 2
    first, second = batches
    assert first["input_ids"].dtype == torch.long and first["attention_mask"].dtype == torch.long
    assert first["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    assert first["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert second["input_ids"].shape == (1, 5) and second["attention_mask"].sum() == 5
    cut = make_batches(samples, batch_size=8, pad_id=-1, max_tokens=2)
    assert len(cut) == 1
    assert cut[0]["input_ids"].tolist() == [[1, 2], [4, -1], [5, 6], [7, 8]]
    assert cut[0]["attention_mask"].tolist() == [[1, 1], [1, 0], [1, 1], [1, 1]]
    assert first["loss_mask"].tolist() == first["attention_mask"].tolist()  # plain lists: every token counts
    assert make_batches([]) == []
    with pytest.raises(ValueError, match="batch_size = 0"):
        make_batches(samples, batch_size=0)
    with pytest.raises(ValueError, match=r"samples\[1\]: empty"):
        make_batches([[1], []])


def test_generated_tokens_are_context_but_never_a_loss_target() -> None:
    from mla_watch.models.train import next_token_loss

    samples = [TokenSample([1, 2, 3, 4, 5], scored_tokens=3), TokenSample([6, 7], scored_tokens=None)]
    train, held_out = split_held_out([*samples, TokenSample([8, 9], scored_tokens=1)], fraction=0.3)
    assert [s.scored_tokens for s in train] == [3, 1] and [s.scored_tokens for s in held_out] == [None]
    batch = make_batches(samples, batch_size=2, pad_id=0)[0]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]

    class Uniform(torch.nn.Module):  # a model that predicts every token with the same logits
        def forward(self, input_ids, attention_mask, use_cache):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 10)})()

    loss, targets = next_token_loss(Uniform(), batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    assert targets == 2 + 1  # tokens 2, 3 of the first sample and 7 of the second; never 4, 5
    assert loss.item() == pytest.approx(3 * torch.log(torch.tensor(10.0)).item())
    assert next_token_loss(Uniform(), batch["input_ids"], batch["attention_mask"])[1] == 4 + 1
