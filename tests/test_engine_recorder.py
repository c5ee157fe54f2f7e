"""The SGLang expert-distribution recorder poller against a fake engine on loopback, writing real torch files.

The format is pinned by SGLang's ``python/sglang/srt/eplb/expert_distribution.py``: in ``stat``
mode ``_StatAccumulator`` keeps a ``_CircularBuffer`` of ``torch.zeros((buffer_size, L, E))``,
one row per forward pass written at ``index % buffer_size``, and ``_dump_to_file`` has rank 0
``torch.save`` ``dict(rank, logical_count (int32 [buffer_size, num_hidden_layers,
num_logical_experts]), average_utilization_rate_over_window)`` as
``f"expert_distribution_recorder_{time.time()}.pt"`` (per_pass / per_token add ``_{rank}``),
then resets. ``python/sglang/srt/entrypoints/http_server.py`` serves
``/start_expert_distribution_record`` and ``/dump_expert_distribution_record`` for GET or POST.
The fake engine below builds that ring buffer from routing it drew itself, so the counts the
poller reports can be compared exactly.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from mla_watch.engines import recorder
from mla_watch.engines.geometry import EngineGeometry, parse_geometry
from mla_watch.engines.recorder import DUMP_PATH, START_PATH, RecorderPoller
from mla_watch.engines.watch import UNATTRIBUTED_LINE, EngineMetrics, EngineRouting
from tests.conftest import free_port, wait_until

LAYERS, EXPERTS, TOP_K = 4, 16, 4
CONFIG = {"model_type": "deepseek_v3", "num_hidden_layers": LAYERS, "first_k_dense_replace": 1,
          "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K}
LOGGER = "mla_watch.engines.recorder"


@pytest.fixture()
def geometry() -> EngineGeometry:
    return parse_geometry(CONFIG)


@pytest.fixture()
def routing(geometry: EngineGeometry) -> EngineRouting:
    return EngineRouting("sglang", geometry, EngineMetrics(CollectorRegistry()), window_tokens=None)


def dumps(routing: EngineRouting, outcome: str) -> float:
    """``mla_watch_engine_recorder_dumps_total{outcome=...}`` (0 before the first)."""
    for family in routing.metrics.recorder_dumps.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == {"outcome": outcome}:
                return sample.value
    return 0.0


class FakeSGLang:
    """SGLang's stat-mode recorder: a ring buffer of per-pass counts, dumped to a file and reset on request."""

    def __init__(self, directory: Path, geometry: EngineGeometry, buffer_size: int, *, moe_axis: bool = False,
                 passes_per_dump: int = 0, start_failures: int = 0, seed: int = 0) -> None:
        self.directory = directory
        self.geometry = geometry
        self.buffer_size = buffer_size
        self.moe_axis = moe_axis  # the layer axis holds MoE layers only, not every hidden layer
        self.passes_per_dump = passes_per_dump
        self.start_failures = start_failures
        self.rng = np.random.default_rng(seed)
        self.passes: list[np.ndarray] = []  # [hidden layers, experts] counts of each pass since the last reset
        self.calls: Counter[str] = Counter()
        self.times = itertools.count(1_700_000_000)
        self.dumped = np.zeros((len(geometry.moe_layers), geometry.num_experts), dtype=np.int64)
        self.dumped_tokens = 0
        self.lock = threading.Lock()

    def run_passes(self, count: int) -> None:
        """``count`` forward passes of 1-9 tokens, each choosing ``top_k`` distinct experts per MoE layer."""
        for _ in range(count):
            tokens = int(self.rng.integers(1, 10))
            counts = np.zeros((self.geometry.num_hidden_layers, self.geometry.num_experts), dtype=np.int64)
            for layer in self.geometry.moe_layers:
                ids = np.argsort(self.rng.random((tokens, self.geometry.num_experts)), axis=1)[:, :self.geometry.top_k]
                counts[layer] = np.bincount(ids.ravel(), minlength=self.geometry.num_experts)
            self.passes.append(counts)

    def expected(self) -> tuple[np.ndarray, int]:
        """Counts ``[moe layers, experts]`` and tokens of the passes the ring still holds."""
        kept = self.passes[-self.buffer_size:]
        moe = list(self.geometry.moe_layers)
        counts = sum((p[moe] for p in kept), np.zeros((len(moe), self.geometry.num_experts), dtype=np.int64))
        return counts, int(sum(p[moe[0]].sum() for p in kept)) // self.geometry.top_k

    def dump(self, when: float | None = None) -> Path:
        buffer = np.zeros((self.buffer_size, self.geometry.num_hidden_layers, self.geometry.num_experts),
                          dtype=np.int32)
        for index, counts in enumerate(self.passes):
            buffer[index % self.buffer_size] = counts
        if self.moe_axis:
            buffer = buffer[:, list(self.geometry.moe_layers)]
        counts, tokens = self.expected()
        self.dumped += counts
        self.dumped_tokens += tokens
        when = next(self.times) + 0.5 if when is None else when
        path = self.directory / f"expert_distribution_recorder_{when}.pt"
        torch.save({"rank": 0, "logical_count": torch.from_numpy(buffer),
                    "average_utilization_rate_over_window": None}, path)
        self.passes = []
        return path

    def handle(self, path: str) -> int:
        with self.lock:
            self.calls[path] += 1
            if path == START_PATH:
                if self.start_failures:
                    self.start_failures -= 1
                    return 503
                self.passes = []
                return 200
            if path == DUMP_PATH:
                self.run_passes(self.passes_per_dump)
                self.dump()
                return 200
            return 404


@pytest.fixture()
def engine_server() -> Iterator[Callable[[FakeSGLang], str]]:
    servers: list[ThreadingHTTPServer] = []

    def serve(fake: FakeSGLang) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                status = fake.handle(self.path)
                body = b"ok" if status == 200 else b"no"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def assert_counted(routing: EngineRouting, counts: np.ndarray, tokens: int) -> None:
    got = routing.windows.counts(UNATTRIBUTED_LINE)
    for j, name in enumerate(routing.geometry.router_names):
        np.testing.assert_array_equal(got[name], counts[j], err_msg=name)
        totals = routing.windows.window_totals(name, UNATTRIBUTED_LINE)
        assert (totals.tokens if totals else 0) == tokens, name


def recorder_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("moe_axis", [False, True], ids=["every-hidden-layer", "moe-layers-only"])
def test_a_dump_of_known_routing_is_counted_exactly(tmp_path, geometry, routing, engine_server, moe_axis) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=8, moe_axis=moe_axis)
    poller = RecorderPoller(tmp_path, engine_server(fake), routing, buffer_size=8)
    fake.run_passes(5)
    counts, tokens = fake.expected()
    assert tokens > 0

    assert poller.poll_once() == ["counted"]
    assert_counted(routing, counts, tokens)
    assert recorder_files(tmp_path) == []
    assert dumps(routing, "counted") == 1

    fake.run_passes(3)  # the dump reset the engine: the next file holds these passes only
    more, more_tokens = fake.expected()
    assert poller.poll_once() == ["counted"]
    assert_counted(routing, counts + more, tokens + more_tokens)
    assert fake.calls == {DUMP_PATH: 2}  # poll_once never (re)starts the recording
    assert dumps(routing, "counted") == 2
    poller.stop()


def test_an_empty_dump_adds_nothing(tmp_path, geometry, routing, engine_server) -> None:
    poller = RecorderPoller(tmp_path, engine_server(FakeSGLang(tmp_path, geometry, 8)), routing, buffer_size=8)
    assert poller.poll_once() == ["empty"]
    assert recorder_files(tmp_path) == []
    assert dumps(routing, "empty") == 1
    assert routing.windows.business_lines == []
    poller.stop()


def test_a_wrapped_ring_is_reported_and_what_it_held_is_counted(tmp_path, geometry, routing, engine_server,
                                                                caplog) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=4)
    poller = RecorderPoller(tmp_path, engine_server(fake), routing, buffer_size=4, interval=7)
    fake.run_passes(7)  # passes 0-2 were overwritten by 4-6
    counts, tokens = fake.expected()
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.poll_once() == ["ring_full"]
    assert_counted(routing, counts, tokens)
    assert dumps(routing, "ring_full") == 1
    assert "--sglang-recorder-interval" in caplog.text
    assert "--expert-distribution-recorder-buffer-size" in caplog.text
    poller.stop()


def test_a_buffer_size_unlike_the_engines_is_reported(tmp_path, geometry, routing, caplog) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=6)
    fake.run_passes(2)
    fake.dump()
    fake.run_passes(2)
    fake.dump()
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=1000)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["counted", "counted"]
    assert caplog.text.count("has 6 rows; expected 1000") == 1


class Trap:
    """A pickle that would run code when loaded without weights_only."""

    ran: ClassVar[list[str]] = []

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Trap.ran.append, ("unpickled",))


BAD_DUMPS = {
    "wrong-experts": ({"rank": 0, "logical_count": torch.zeros((3, LAYERS, 8), dtype=torch.int32)},
                      "has shape [3, 4, 8]"),
    "wrong-layers": ({"rank": 0, "logical_count": torch.ones((3, 5, EXPERTS), dtype=torch.int32)},
                     "has shape [3, 5, 16]"),
    "two-dimensional": ({"logical_count": torch.ones((LAYERS, EXPERTS), dtype=torch.int32)}, "has shape [4, 16]"),
    "missing-key": ({"rank": 0, "records": []}, "key 'logical_count' missing (keys ['rank', 'records'])"),
    "not-a-dict": (torch.ones((3, LAYERS, EXPERTS), dtype=torch.int32), "missing (a Tensor)"),
    "not-a-tensor": ({"logical_count": [[1, 2], [3, 4]]}, "key 'logical_count' is a list"),
    "float-tensor": ({"logical_count": torch.ones((3, LAYERS, EXPERTS))}, "is a torch.float32 tensor"),
    "negative": ({"logical_count": torch.full((3, LAYERS, EXPERTS), -1, dtype=torch.int32)},
                 "negative counts (lowest -1)"),
    "unsafe-pickle": ({"logical_count": Trap()}, "cannot be read by torch.load(weights_only=True)"),
    "not-torch": (None, "cannot be read by torch.load(weights_only=True)"),
}


@pytest.mark.parametrize("case", list(BAD_DUMPS))
def test_a_dump_that_cannot_be_counted_is_an_error_and_is_deleted(tmp_path, routing, caplog, case) -> None:
    content, found = BAD_DUMPS[case]
    path = tmp_path / "expert_distribution_recorder_1700000000.25.pt"
    if content is None:
        path.write_bytes(b"not a zip archive, nor a pickle")
    else:
        torch.save(content, path)
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["error"]
    message = caplog.records[-1].getMessage()
    assert str(path) in message and found in message, message
    if case not in ("unsafe-pickle", "not-torch", "negative"):
        assert "[passes, 4, 16] (every hidden layer) or [passes, 3, 16] (MoE layers only)" in message
    assert Trap.ran == []
    assert recorder_files(tmp_path) == []
    assert dumps(routing, "error") == 1
    assert routing.windows.business_lines == []


def test_a_file_too_large_is_left_and_not_retried(tmp_path, geometry, routing, caplog, monkeypatch) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=8)
    fake.run_passes(2)
    path = fake.dump()
    monkeypatch.setattr(recorder, "MAX_DUMP_BYTES", path.stat().st_size - 1)
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=8)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["error"]
        assert poller.consume() == []
    assert path.exists()
    assert caplog.text.count(str(path)) == 1 and "larger than" in caplog.text
    assert dumps(routing, "error") == 1
    assert routing.windows.business_lines == []


def test_a_file_that_cannot_be_deleted_is_counted_once(tmp_path, geometry, routing, caplog, monkeypatch) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=8)
    fake.run_passes(3)
    path = fake.dump()
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=8)

    def refuse(target: object) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(recorder.os, "unlink", refuse)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["counted"]
        assert poller.consume() == []
    monkeypatch.undo()
    assert path.exists()
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert caplog.text.count("cannot be deleted") == 1
    assert dumps(routing, "counted") == 1


def test_per_rank_files_symlinks_and_other_names_are_left_alone(tmp_path, geometry, routing, caplog) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    directory = tmp_path / "dumps"
    directory.mkdir()
    fake = FakeSGLang(outside, geometry, buffer_size=8)
    fake.run_passes(2)
    valid = fake.dump()
    (directory / "expert_distribution_recorder_1700000000.5_0.pt").write_bytes(valid.read_bytes())
    (directory / "expert_distribution_recorder_1700000001.5.pt").symlink_to(valid)
    (directory / "expert_distribution_recorder_1700000002.5.pt").mkdir()
    (directory / "expert_distribution_recorder_abc.pt").write_bytes(valid.read_bytes())
    (directory / "expert_distribution_recorder_1700000003.5.pt.tmp").write_bytes(valid.read_bytes())
    (directory / "other.pt").write_bytes(valid.read_bytes())
    before = recorder_files(directory)
    poller = RecorderPoller(directory, "http://127.0.0.1:9", routing, buffer_size=8)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == []
        assert poller.consume() == []
    assert recorder_files(directory) == before
    assert valid.exists()
    assert caplog.text.count("per_pass or per_token") == 1
    assert "--expert-distribution-recorder-mode stat" in caplog.text
    assert routing.windows.business_lines == []


def test_pending_files_are_all_counted_oldest_first(tmp_path, geometry, routing, monkeypatch) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=8)
    order = []
    # By name "10000..." < "999.5", by time 999.5 is first: the order must be the time's.
    for when, passes in ((999.5, 1), (1000.25, 2), (10000.0, 3)):
        fake.run_passes(passes)
        order.append(fake.expected()[1])
        fake.dump(when)
    added = []
    add = routing.windows.add
    monkeypatch.setattr(routing.windows, "add",
                        lambda router, line, delta: (added.append((router, delta.tokens)), add(router, line, delta)))
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=8)
    assert poller.consume() == ["counted"] * 3
    first = geometry.router_names[0]
    assert [tokens for router, tokens in added if router == first] == order
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert recorder_files(tmp_path) == []
    assert dumps(routing, "counted") == 3


def test_an_unreachable_engine_still_has_its_files_counted(tmp_path, geometry, routing, caplog) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=8)
    fake.run_passes(2)
    fake.dump()
    poller = RecorderPoller(tmp_path, f"http://127.0.0.1:{free_port()}", routing, buffer_size=8, timeout=5)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.poll_once() == ["counted"]
        assert poller.poll_once() == []
    assert caplog.text.count(DUMP_PATH) == 1  # one warning per kind of failure
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    poller.stop()


def test_the_thread_starts_recording_once_then_polls(tmp_path, geometry, routing, engine_server, caplog) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=64, passes_per_dump=3, start_failures=2)
    poller = RecorderPoller(tmp_path, engine_server(fake), routing, interval=0.05, buffer_size=64)
    with caplog.at_level(logging.WARNING, LOGGER):
        poller.start()
        try:
            assert wait_until(lambda: dumps(routing, "counted") >= 3, timeout=15)
        finally:
            poller.stop()
    assert poller._thread is None
    calls = dict(fake.calls)
    assert calls[START_PATH] == 3  # two refusals, then once only however many polls
    assert calls[DUMP_PATH] >= 3
    assert caplog.text.count("HTTP 503") == 1
    assert dumps(routing, "counted") == calls[DUMP_PATH]  # stop() waited for the poll in flight
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert recorder_files(tmp_path) == []


def test_the_thread_stops_while_the_engine_is_unreachable(tmp_path, routing, caplog) -> None:
    poller = RecorderPoller(tmp_path, f"http://127.0.0.1:{free_port()}", routing, interval=0.05)
    with caplog.at_level(logging.WARNING, LOGGER):
        poller.start()
        assert wait_until(lambda: START_PATH in caplog.text, timeout=15)
        poller.stop()
    assert caplog.text.count(START_PATH) == 1
    assert routing.windows.business_lines == []


@pytest.mark.parametrize(("option", "value"), [("interval", 0), ("timeout", -1), ("buffer_size", 0),
                                               ("buffer_size", 1.5)])
def test_bad_settings_are_refused_by_name(tmp_path, routing, option, value) -> None:
    with pytest.raises(ValueError, match=option.replace("_", " ")):
        RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, **{option: value})


def test_an_unbounded_buffer_never_wraps(tmp_path, geometry, routing) -> None:
    fake = FakeSGLang(tmp_path, geometry, buffer_size=5)  # _InfiniteBuffer.get_all(): exactly the passes held
    fake.run_passes(5)
    fake.dump()
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=-1)
    assert poller.consume() == ["counted"]
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert os.listdir(tmp_path) == []
