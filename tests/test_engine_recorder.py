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
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from harness.support import free_port, wait_until
from mla_watch.engines import recorder
from mla_watch.engines.geometry import EngineGeometry, parse_geometry
from mla_watch.engines.recorder import DUMP_PATH, START_PATH, RecorderPoller
from mla_watch.engines.watch import UNATTRIBUTED_LINE, EngineMetrics, EngineRouting
from mla_watch.routing.windows import RouterWindows

LAYERS, EXPERTS, TOP_K = 4, 16, 4
CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": LAYERS,
    "first_k_dense_replace": 1,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
}
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


def rejected(routing: EngineRouting, reason: str) -> float:
    """``mla_watch_engine_recorder_rejected_total{reason=...}`` (0 before the first)."""
    for family in routing.metrics.recorder_rejected.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == {"reason": reason}:
                return sample.value
    return 0.0


class FakeSGLangRecorder:
    """SGLang's stat-mode recorder: a ring buffer of per-pass counts, dumped to a file and reset on request."""

    def __init__(
        self,
        directory: Path,
        geometry: EngineGeometry,
        buffer_size: int,
        *,
        moe_axis: bool = False,
        passes_per_dump: int = 0,
        start_failures: int = 0,
        seed: int = 0,
    ) -> None:
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
                ids = np.argsort(self.rng.random((tokens, self.geometry.num_experts)), axis=1)[:, : self.geometry.top_k]
                counts[layer] = np.bincount(ids.ravel(), minlength=self.geometry.num_experts)
            self.passes.append(counts)

    def expected(self) -> tuple[np.ndarray, int]:
        """Counts ``[moe layers, experts]`` and tokens of the passes the ring still holds."""
        kept = self.passes[-self.buffer_size :]
        moe = list(self.geometry.moe_layers)
        counts = sum((p[moe] for p in kept), np.zeros((len(moe), self.geometry.num_experts), dtype=np.int64))
        return counts, int(sum(p[moe[0]].sum() for p in kept)) // self.geometry.top_k

    def dump(self, when: float | None = None) -> Path:
        buffer = np.zeros(
            (self.buffer_size, self.geometry.num_hidden_layers, self.geometry.num_experts), dtype=np.int32
        )
        for index, counts in enumerate(self.passes):
            buffer[index % self.buffer_size] = counts
        if self.moe_axis:
            # SGLang's buffer is a torch.zeros, C-contiguous; numpy's fancy indexing on axis 1 may not be.
            buffer = np.ascontiguousarray(buffer[:, list(self.geometry.moe_layers)])
        counts, tokens = self.expected()
        self.dumped += counts
        self.dumped_tokens += tokens
        when = next(self.times) + 0.5 if when is None else when
        path = self.directory / f"expert_distribution_recorder_{when}.pt"
        torch.save(
            {"rank": 0, "logical_count": torch.from_numpy(buffer), "average_utilization_rate_over_window": None}, path
        )
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
def engine_server() -> Iterator[Callable[[FakeSGLangRecorder], str]]:
    servers: list[ThreadingHTTPServer] = []

    def serve(fake: FakeSGLangRecorder) -> str:
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
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8, moe_axis=moe_axis)
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
    poller = RecorderPoller(tmp_path, engine_server(FakeSGLangRecorder(tmp_path, geometry, 8)), routing, buffer_size=8)
    assert poller.poll_once() == ["empty"]
    assert recorder_files(tmp_path) == []
    assert dumps(routing, "empty") == 1
    assert routing.windows.business_lines == []
    poller.stop()


def test_a_wrapped_ring_is_reported_and_what_it_held_is_counted(
    tmp_path, geometry, routing, engine_server, caplog
) -> None:
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=4)
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
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=6)
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
    "wrong-experts": (
        {"rank": 0, "logical_count": torch.zeros((3, LAYERS, 8), dtype=torch.int32)},
        "has shape [3, 4, 8]",
    ),
    "wrong-layers": (
        {"rank": 0, "logical_count": torch.ones((3, 5, EXPERTS), dtype=torch.int32)},
        "has shape [3, 5, 16]",
    ),
    "two-dimensional": ({"logical_count": torch.ones((LAYERS, EXPERTS), dtype=torch.int32)}, "has shape [4, 16]"),
    "missing-key": ({"rank": 0, "records": []}, "key 'logical_count' missing (a dict of 2 keys)"),
    "not-a-dict": (torch.ones((3, LAYERS, EXPERTS), dtype=torch.int32), "missing (a Tensor)"),
    "not-a-tensor": ({"logical_count": [[1, 2], [3, 4]]}, "key 'logical_count' is a list"),
    "float-tensor": ({"logical_count": torch.ones((3, LAYERS, EXPERTS))}, "is a torch.float32 tensor"),
    "negative": (
        {"logical_count": torch.full((3, LAYERS, EXPERTS), -1, dtype=torch.int32)},
        "negative counts (lowest -1)",
    ),
    "unsafe-pickle": ({"logical_count": Trap()}, "cannot be read by torch.load(weights_only=True)"),
    "not-torch": (None, "not the zip archive torch.save writes (BadZipFile)"),
}


# mla_watch_engine_recorder_rejected_total{reason} of each of BAD_DUMPS.
BAD_DUMP_REASONS = {
    "wrong-experts": "shape",
    "wrong-layers": "shape",
    "two-dimensional": "shape",
    "missing-key": "format",
    "not-a-dict": "format",
    "not-a-tensor": "format",
    "float-tensor": "dtype",
    "negative": "negative",
    "unsafe-pickle": "unreadable",
    "not-torch": "unreadable",
}


@pytest.mark.parametrize("case", list(BAD_DUMPS))
def test_a_dump_that_cannot_be_counted_is_an_error_and_is_deleted(tmp_path, routing, caplog, case) -> None:
    content, found = BAD_DUMPS[case]
    path = tmp_path / "expert_distribution_recorder_1700000000.25.pt"
    if content is None:
        path.write_bytes(b"not a zip archive, nor a pickle")
    else:
        torch.save(content, path)
    # A file that is no dump is set aside once settled: at once here (the settling has tests of its own).
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, settle_seconds=0)
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
    assert rejected(routing, BAD_DUMP_REASONS[case]) == 1


def test_a_file_too_large_is_left_and_not_retried(tmp_path, geometry, routing, caplog, monkeypatch) -> None:
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)
    fake.run_passes(2)
    path = fake.dump()
    poller = RecorderPoller(
        tmp_path, "http://127.0.0.1:9", routing, buffer_size=8, max_dump_bytes=path.stat().st_size - 1
    )
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["error"]
        assert poller.consume() == []
    assert path.exists()
    assert caplog.text.count(str(path)) == 1 and "larger than" in caplog.text
    assert dumps(routing, "error") == 1
    assert routing.windows.business_lines == []


def test_a_file_that_cannot_be_deleted_is_counted_once(tmp_path, geometry, routing, caplog, monkeypatch) -> None:
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)
    fake.run_passes(3)
    path = fake.dump()

    def refuse(target: object) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=8, unlink=refuse)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["counted"]
        assert poller.consume() == []
    assert path.exists()
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert caplog.text.count("cannot be deleted") == 1
    assert dumps(routing, "counted") == 1


def test_per_rank_files_symlinks_and_other_names_are_left_alone(tmp_path, geometry, routing, caplog) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    directory = tmp_path / "dumps"
    directory.mkdir()
    fake = FakeSGLangRecorder(outside, geometry, buffer_size=8)
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


class RecordingWindows(RouterWindows):
    """Router windows that also keep, in order, each router's tokens as they are added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.added: list[tuple[str, int]] = []

    def add(self, router: str, business_line: str, delta: Any) -> None:
        self.added.append((router, delta.tokens))
        super().add(router, business_line, delta)


def test_pending_files_are_all_counted_oldest_first(tmp_path, geometry) -> None:
    windows = RecordingWindows(geometry.routers(), window_tokens=None)
    routing = EngineRouting("sglang", geometry, EngineMetrics(CollectorRegistry()), window_tokens=None, windows=windows)
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)
    order = []
    # By name "10000..." < "999.5", by time 999.5 is first: the order must be the time's.
    for when, passes in ((999.5, 1), (1000.25, 2), (10000.0, 3)):
        fake.run_passes(passes)
        order.append(fake.expected()[1])
        fake.dump(when)
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=8)
    assert poller.consume() == ["counted"] * 3
    first = geometry.router_names[0]
    assert [tokens for router, tokens in windows.added if router == first] == order
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert recorder_files(tmp_path) == []
    assert dumps(routing, "counted") == 3


def test_an_unreachable_engine_still_has_its_files_counted(tmp_path, geometry, routing, caplog) -> None:
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)
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
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=64, passes_per_dump=3, start_failures=2)
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


@pytest.mark.parametrize(
    ("option", "value"), [("interval", 0), ("timeout", -1), ("buffer_size", 0), ("buffer_size", 1.5)]
)
def test_bad_settings_are_refused_by_name(tmp_path, routing, option, value) -> None:
    with pytest.raises(ValueError, match=option.replace("_", " ")):
        RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, **{option: value})


def test_an_unbounded_buffer_never_wraps(tmp_path, geometry, routing) -> None:
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=5)  # _InfiniteBuffer.get_all(): exactly the passes held
    fake.run_passes(5)
    fake.dump()
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, buffer_size=-1)
    assert poller.consume() == ["counted"]
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert os.listdir(tmp_path) == []


# -- what a co-tenant of the volume (or a buggy engine) may leave there -------------------------------------------


def peak_rss_growth(run: Callable[[], object]) -> tuple[object, int]:
    """``run()``'s result, and how many bytes the process's peak resident set grew by while it ran."""
    try:  # Linux: "5" resets VmHWM to the current RSS, so the peak is run's own
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = _status_kb("VmRSS")
        result = run()
        return result, (_status_kb("VmHWM") - before) * 1024
    except OSError:  # elsewhere the lifetime peak: growth past it still shows
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = run()
        return result, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def hostile(directory: Path, content: object, when: float = 1_600_000_000.5) -> Path:
    """A file under a dump's name, older than any FakeSGLangRecorder writes (so it is read first)."""
    path = directory / f"expert_distribution_recorder_{when}.pt"
    torch.save(content, path)
    return path


@pytest.mark.parametrize(
    ("max_passes", "reason"), [(None, "too_large"), (10_000_000, "not_dense")], ids=["past-the-pass-cap", "within-it"]
)
def test_a_stride_zero_tensor_is_refused_without_being_materialised(
    tmp_path, geometry, routing, engine_server, monkeypatch, caplog, max_passes, reason
) -> None:
    # 64 stored counts declaring 3,000,000 passes (768 MB once expanded), in a file of under 2 KB.
    expanded = torch.zeros((1, LAYERS, EXPERTS), dtype=torch.int32).expand(3_000_000, LAYERS, EXPERTS)
    path = hostile(tmp_path, {"rank": 0, "logical_count": expanded})
    assert path.stat().st_size < 4096
    # max_passes: let it past the pass cap (768 MB < MAX_DUMP_BYTES): the strides refuse it
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8, passes_per_dump=3)
    poller = RecorderPoller(
        tmp_path,
        engine_server(fake),
        routing,
        settle_seconds=0,
        buffer_size=8,
        max_passes=recorder.MAX_DUMP_PASSES if max_passes is None else max_passes,
    )
    with caplog.at_level(logging.WARNING, LOGGER):
        outcomes, growth = peak_rss_growth(poller.poll_once)
    assert outcomes == ["error", "counted"]
    assert growth < 100 << 20, f"peak RSS grew by {growth >> 20} MB"
    assert rejected(routing, reason) == 1
    assert "3000000 passes" in caplog.text if reason == "too_large" else "strides [0, 16, 1]" in caplog.text
    assert_counted(routing, fake.dumped, fake.dumped_tokens)  # the engine's own dump only
    assert recorder_files(tmp_path) == []
    poller.stop()


def test_a_sparse_tensor_is_set_aside_and_the_dumps_after_it_are_counted(
    tmp_path, geometry, routing, engine_server, caplog
) -> None:
    dense = torch.zeros((3, LAYERS, EXPERTS), dtype=torch.int32)
    dense[0, 1, :TOP_K] = 1
    path = hostile(tmp_path, {"rank": 0, "logical_count": dense.to_sparse()})
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8, passes_per_dump=4)
    poller = RecorderPoller(tmp_path, engine_server(fake), routing, settle_seconds=0, buffer_size=8)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.poll_once() == ["error", "counted"]
        assert poller.poll_once() == ["counted"]
    assert not path.exists()
    assert rejected(routing, "not_dense") == 1 and dumps(routing, "error") == 1 and dumps(routing, "counted") == 2
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert "torch.sparse_coo tensor" in caplog.text
    assert not any(record.exc_info for record in caplog.records)  # no traceback, every poll or once
    poller.stop()


def overflowing_dump() -> torch.Tensor:
    """int64 counts of 2 passes of 2 tokens, fine in the first MoE layers; the last one's sum wraps int64."""
    counts = torch.zeros((2, LAYERS, EXPERTS), dtype=torch.int64)
    counts[:, 1:, :TOP_K] = 2  # 2 tokens x top-4 in each MoE layer of each pass
    counts[:, LAYERS - 1, :2] = 1 << 62  # 2^62 + 2^62 wraps to -2^63 once summed
    return counts


@pytest.mark.parametrize("deletable", [True, False], ids=["deleted", "undeletable"])
def test_an_overflowing_dump_adds_nothing_and_is_counted_once(
    tmp_path, geometry, routing, engine_server, monkeypatch, caplog, deletable
) -> None:
    path = hostile(tmp_path, {"rank": 0, "logical_count": overflowing_dump()})

    def refuse(target: Path) -> None:
        if not deletable and Path(str(target)) == path:
            raise PermissionError(13, "Permission denied", str(target))
        os.unlink(target)

    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)  # no passes: each poll dumps an empty file
    poller = RecorderPoller(tmp_path, engine_server(fake), routing, settle_seconds=0, buffer_size=8, unlink=refuse)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.poll_once() == ["error", "empty"]
        assert poller.poll_once() == ["empty"]
        assert poller.poll_once() == ["empty"]
    assert routing.windows.business_lines == []  # not one layer of it was added
    assert_counted(routing, np.zeros((len(geometry.moe_layers), EXPERTS), dtype=np.int64), 0)
    assert rejected(routing, "overflow") == 1 and dumps(routing, "error") == 1
    assert f"holds a count of {1 << 62}" in caplog.text
    assert path.exists() is not deletable
    poller.stop()


def counts_of(passes: list[list[list[int]]]) -> torch.Tensor:
    """A [passes, 4 layers, 16 experts] int32 dump; each pass lists the leading counts of MoE layers 1-3."""
    tensor = torch.zeros((len(passes), LAYERS, EXPERTS), dtype=torch.int32)
    for p, layers in enumerate(passes):
        for j, leading in enumerate(layers):
            tensor[p, 1 + j, : len(leading)] = torch.tensor(leading, dtype=torch.int32)
    return tensor


INCONSISTENT = {
    # 3 tokens x top-4 = 12 choices in layers 1 and 2, 8 in layer 3: not the same tokens.
    "layers-unlike": (counts_of([[[3, 3, 3, 3], [3, 3, 3, 3], [2, 2, 2, 2]]]), "layer 3 has 8 expert choices"),
    # 6 choices: not a whole number of tokens of top-4.
    "not-a-multiple": (counts_of([[[2, 2, 1, 1]] * 3]), "6 expert choices; expected a multiple of top-4"),
    # 2 tokens, but expert 0 chosen 5 times.
    "expert-twice-a-token": (counts_of([[[5, 1, 1, 1]] * 3]), "an expert chosen 5 times by 2 tokens"),
}


@pytest.mark.parametrize("case", list(INCONSISTENT))
def test_counts_no_forward_pass_could_make_are_refused_whole(tmp_path, routing, caplog, case) -> None:
    tensor, found = INCONSISTENT[case]
    good = counts_of([[[1, 1, 1, 1]] * 3])  # one valid pass before it: the file is refused whole all the same
    path = hostile(tmp_path, {"rank": 0, "logical_count": torch.cat([good, tensor])})
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, settle_seconds=0, buffer_size=2)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == ["error"]
    assert found in caplog.text and str(path) in caplog.text
    assert rejected(routing, "inconsistent") == 1
    assert routing.windows.business_lines == []
    assert not path.exists()


def test_an_unexpected_failure_sets_the_file_aside_and_polling_goes_on(
    tmp_path, geometry, routing, engine_server, monkeypatch, caplog
) -> None:
    path = hostile(tmp_path, {"rank": 0, "logical_count": counts_of([[[1, 1, 1, 1]] * 3])})
    read = recorder.read_dump

    def explode(handle, where, geometry, **kwargs):  # type: ignore[no-untyped-def]
        if where == path:
            raise TypeError("the secret content of the file")
        return read(handle, where, geometry, **kwargs)

    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8, passes_per_dump=2)
    poller = RecorderPoller(tmp_path, engine_server(fake), routing, settle_seconds=0, buffer_size=8, reader=explode)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.poll_once() == ["error", "counted"]
        assert poller.poll_once() == ["counted"]
    assert rejected(routing, "unexpected") == 1
    assert "TypeError" in caplog.text and "secret" not in caplog.text
    assert_counted(routing, fake.dumped, fake.dumped_tokens)
    assert recorder_files(tmp_path) == []
    poller.stop()


def test_a_dump_being_written_is_left_until_it_is_whole(tmp_path, geometry, routing, engine_server, caplog) -> None:
    engine = tmp_path / "engine"
    engine.mkdir()
    directory = tmp_path / "dumps"
    directory.mkdir()
    fake = FakeSGLangRecorder(engine, geometry, buffer_size=8)
    fake.run_passes(5)
    content = fake.dump().read_bytes()
    counts, tokens = fake.dumped.copy(), fake.dumped_tokens
    now = [time.time()]
    live = FakeSGLangRecorder(directory, geometry, buffer_size=8)  # the engine polled: its own dumps are empty
    poller = RecorderPoller(
        directory, engine_server(live), routing, settle_seconds=2, buffer_size=8, clock=lambda: now[0]
    )
    path = directory / "expert_distribution_recorder_1600000009.5.pt"

    def write(data: bytes) -> None:  # torch.save writes in place: the final name from the first byte on
        with open(path, "ab") as handle:
            handle.write(data)
        os.utime(path, (now[0], now[0]))

    with caplog.at_level(logging.WARNING, LOGGER):
        write(content[: len(content) // 2])  # half-written: it fails to load
        assert poller.poll_once() == ["empty"]
        now[0] += 1.5
        assert poller.poll_once() == ["empty"]  # still not 2 s old: left, not set aside
        assert path.read_bytes() == content[: len(content) // 2]
        write(content[len(content) // 2 :])  # the writer resumes and finishes
        assert poller.poll_once() == ["counted", "empty"]  # whole: counted at once, settled or not
    assert_counted(routing, counts, tokens)
    assert not path.exists() and recorder_files(directory) == []
    assert dumps(routing, "error") == 0 and caplog.text == ""
    poller.stop()


def test_a_broken_file_is_set_aside_only_once_it_settled(tmp_path, routing, caplog) -> None:
    now = [time.time()]
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, settle_seconds=2, clock=lambda: now[0])
    young = tmp_path / "expert_distribution_recorder_1600000001.5.pt"
    young.write_bytes(b"PK\x03\x04 half of a zip")
    skewed = tmp_path / "expert_distribution_recorder_1600000002.5.pt"
    skewed.write_bytes(b"PK\x03\x04 half of another")
    os.utime(skewed, (now[0] + 3600, now[0] + 3600))  # the volume's clock an hour ahead of ours
    with caplog.at_level(logging.WARNING, LOGGER):
        assert poller.consume() == []
        now[0] += 1
        assert poller.consume() == []
        assert young.exists() and skewed.exists() and caplog.text == ""
        now[0] += 1  # 2 s old by its mtime, and the skewed one unchanged for 2 s by our clock
        assert poller.consume() == ["error", "error"]
    assert not young.exists() and not skewed.exists()
    assert rejected(routing, "unreadable") == 2 and dumps(routing, "error") == 2


def test_a_dump_whose_writer_stalls_mid_write_is_counted_once_it_is_whole(tmp_path, geometry, routing) -> None:
    """Judged broken only after it stopped changing (size and mtime) for the settle time of serve's default."""
    from mla_watch.server.config import ServerConfig

    now = [time.time()]
    poller = RecorderPoller(
        tmp_path,
        "http://127.0.0.1:9",
        routing,
        buffer_size=8,
        settle_seconds=ServerConfig.sglang_recorder_settle,
        clock=lambda: now[0],
    )
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)
    fake.run_passes(3)
    path = fake.dump()
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # the writer stalls half-way
    for _ in range(4):  # 12 s without a change: a stall, not a broken file
        assert poller.consume() == [] and path.exists()
        now[0] += 3
    with path.open("ab") as handle:
        handle.write(whole[len(whole) // 2 :])
    assert poller.consume() == ["counted"] and not path.exists()
    counts = routing.counts(None)
    assert np.array_equal(np.stack([counts[name] for name in geometry.router_names]), fake.dumped)


def test_a_dump_changed_while_read_is_left_for_the_next_poll(tmp_path, geometry, routing, monkeypatch) -> None:
    fake = FakeSGLangRecorder(tmp_path, geometry, buffer_size=8)
    fake.run_passes(3)
    path = fake.dump()
    read = recorder.read_dump
    writes = [1]

    def written_meanwhile(handle, where, geometry, **kwargs):  # type: ignore[no-untyped-def]
        dump = read(handle, where, geometry, **kwargs)
        if writes:
            writes.pop()
            mtime = path.stat().st_mtime_ns + 1_000_000
            os.utime(path, ns=(mtime, mtime))
        return dump

    poller = RecorderPoller(
        tmp_path, "http://127.0.0.1:9", routing, settle_seconds=0, buffer_size=8, reader=written_meanwhile
    )
    assert poller.consume() == []
    assert path.exists() and routing.windows.business_lines == []
    assert poller.consume() == ["counted"]
    assert_counted(routing, fake.dumped, fake.dumped_tokens)


def test_a_thousand_junk_files_log_a_few_lines_and_none_of_their_content(tmp_path, routing, caplog) -> None:
    huge_key = "K" * 200_000
    hostile(tmp_path, {huge_key: 1, "rank": 0}, when=1_600_000_000.0)
    for number in range(1, 1000):
        path = tmp_path / f"expert_distribution_recorder_{1_600_000_000 + number}.5.pt"
        kind = number % 4
        if kind == 0:
            path.write_bytes(b"SECRET-BYTES " * number)
        elif kind == 1:
            torch.save({f"SECRET-KEY-{number}": number}, path)
        elif kind == 2:
            torch.save({"logical_count": torch.full((2, LAYERS, EXPERTS), float(number))}, path)
        else:
            torch.save({"logical_count": Trap()}, path)  # torch's error names the global: Trap
    now = [time.time()]
    poller = RecorderPoller(tmp_path, "http://127.0.0.1:9", routing, settle_seconds=0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, LOGGER):
        assert poller.consume() == ["error"] * 1000
        assert len(caplog.records) <= 10, len(caplog.records)
        now[0] += 61
        hostile(tmp_path, {"SECRET-KEY-late": 1}, when=1_700_000_000.5)
        assert poller.consume() == ["error"]
    assert len(caplog.records) <= 11
    text = caplog.text
    assert huge_key[:100] not in text and "SECRET" not in text and "Trap" not in text
    assert "key 'logical_count' missing (a dict of 2 keys)" in text
    assert "more like it since the last report" in text  # the suppressed ones are told, by number
    assert rejected(routing, "format") == 1 + 250 + 1 and rejected(routing, "unreadable") == 249 + 250
    assert rejected(routing, "dtype") == 250 and dumps(routing, "error") == 1001
    assert Trap.ran == [] and recorder_files(tmp_path) == []
