"""Counting SGLang's expert-distribution recorder: every token the engine routed, not only the ones it returned.

Responses carry routing only when a client asks for it; the recorder counts every forward
pass of the engine. In ``stat`` mode (``--expert-distribution-recorder-mode stat``) a POST to
``/dump_expert_distribution_record`` makes rank 0 write the counts since the last dump to
``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_{time.time()}.pt``
and resets them, so the files are disjoint and each is counted once, then deleted. A file
holds ``dict(rank, logical_count, average_utilization_rate_over_window)`` where
``logical_count`` is an int32 ring buffer ``[buffer_size, num_hidden_layers, experts]``: one
row per forward pass, summed over ranks, dense layers' rows zero, rows never written zero
(SGLang ``python/sglang/srt/eplb/expert_distribution.py``, ``_StatAccumulator``). The counts
go to the ``unattributed`` business line: no request can be told apart in them.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.watch import UNATTRIBUTED_LINE, EngineRouting
from mla_watch.windows import CountDelta

__all__ = ["DUMP_NAME_RE", "MAX_DUMP_BYTES", "OUTCOMES", "RecorderPoller"]

log = logging.getLogger("mla_watch.engines.recorder")

START_PATH = "/start_expert_distribution_record"
DUMP_PATH = "/dump_expert_distribution_record"
# Rank 0's file in stat mode; the group is the time.time() of the dump, the order files are read in.
DUMP_NAME_RE = re.compile(r"expert_distribution_recorder_([0-9]+(?:\.[0-9]+)?)\.pt")
# per_pass / per_token write one file per rank, of another layout (records, not counts).
RANK_DUMP_RE = re.compile(r"expert_distribution_recorder_[0-9]+(?:\.[0-9]+)?_[0-9]+\.pt")
# A stat dump of 1000 passes x 61 layers x 256 experts is 62 MB; far past that it is not one.
MAX_DUMP_BYTES = 1 << 30
OUTCOMES = ("counted", "empty", "ring_full", "error")
_INTEGER_DTYPES = ("torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.uint8")
_ORDER = "--expert-distribution-recorder-mode stat"


class DumpError(ValueError):
    """A recorder file that can never be counted (it is deleted all the same)."""


class RecorderPoller:
    """Dumps an SGLang engine's expert-distribution recorder every ``interval`` seconds and counts the files.

    ``directory`` is the engine's ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` as this process
    sees it (a shared volume); ``buffer_size`` the engine's
    ``--expert-distribution-recorder-buffer-size`` (``-1``: an unbounded buffer, which never
    wraps), used to tell when the ring wrapped and passes were lost.
    """

    def __init__(self, directory: Path, engine_url: str, routing: EngineRouting, *, interval: float = 10.0,
                 buffer_size: int = 1000, timeout: float = 10.0) -> None:
        if not interval > 0:
            raise ValueError(f"recorder interval {interval!r}: expected a number of seconds > 0")
        if not timeout > 0:
            raise ValueError(f"recorder timeout {timeout!r}: expected a number of seconds > 0")
        if type(buffer_size) is not int or not (buffer_size >= 1 or buffer_size == -1):
            raise ValueError(f"recorder buffer size {buffer_size!r}: expected the engine's "
                             "--expert-distribution-recorder-buffer-size, an integer >= 1 or -1 (unbounded)")
        self.directory = Path(directory)
        self.engine_url = engine_url.rstrip("/")
        self.routing = routing
        self.interval = float(interval)
        self.buffer_size = buffer_size
        self.timeout = float(timeout)
        self._lock = threading.Lock()  # one poll at a time: a file must not be counted by two
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()
        self._recording = False  # the engine answered the start request (again after it was unreachable)
        self._skipped: set[str] = set()  # too large, or could not be deleted: never read again
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()

    # -- the thread ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start recording on the engine, then poll every ``interval`` seconds, in a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mla-watch-recorder", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread and wait for it (a poll in flight finishes first)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._recording:
                # start resets the engine's counts: it is sent once, and again only after the engine was
                # unreachable (a restarted engine records nothing until asked).
                self._recording = self._post(START_PATH) is None
                if self._recording:
                    log.info("SGLang expert-distribution recorder started at %s; dumping every %g s into %s",
                             self.engine_url, self.interval, self.directory)
            else:
                try:
                    self.poll_once()
                except Exception:  # a bug must not end the thread: the next round may succeed
                    log.exception("SGLang recorder poll failed")
            self._stop.wait(self.interval)

    # -- one round -------------------------------------------------------------------------------------

    def poll_once(self) -> list[str]:
        """Ask the engine for a dump, then count every dump file there is; one outcome per file."""
        with self._lock:
            failure = self._post(DUMP_PATH)
            if failure is not None and not failure.startswith("HTTP "):
                self._recording = False  # unreachable: it may come back as a new process, not recording
            return self._consume()

    def consume(self) -> list[str]:
        """Count the dump files already in ``directory`` (no request); one outcome per file, oldest first."""
        with self._lock:
            return self._consume()

    def _consume(self) -> list[str]:
        outcomes = []
        for name in self._pending():
            outcome = self._consume_file(name)
            if outcome is None:
                continue
            self.routing.metrics.recorder_dumps.labels(outcome).inc()
            outcomes.append(outcome)
        return outcomes

    def _pending(self) -> list[str]:
        """Names of rank 0's stat dumps, oldest first; per-rank files and anything else are left alone."""
        found: list[tuple[float, str]] = []
        names: set[str] = set()
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    names.add(entry.name)
                    match = DUMP_NAME_RE.fullmatch(entry.name)
                    if match is None:
                        if RANK_DUMP_RE.fullmatch(entry.name):
                            self._warn_once("per_rank", "%s: a per_pass or per_token recorder dump; these modes "
                                            "are not supported and their files are left alone: expected the "
                                            "engine started with %s", self.directory / entry.name, _ORDER)
                        continue
                    if entry.name in self._skipped or not entry.is_file(follow_symlinks=False):
                        continue
                    found.append((float(match.group(1)), entry.name))
        except OSError as error:
            self._warn_once(f"scandir:{error.errno}", "%s: cannot list the recorder directory (%s); expected the "
                            "engine's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, readable and writable here",
                            self.directory, error.strerror or type(error).__name__)
            return []
        self._skipped &= names  # a name gone from the directory may come back as a new dump
        return [name for _, name in sorted(found)]

    def _consume_file(self, name: str) -> str | None:
        """Count one dump and delete it; its outcome, or ``None`` where it was no file to count."""
        path = self.directory / name
        # No symlink, and no FIFO to block on, even where the name changed since the listing.
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:  # deleted between the listing and now (by someone else): not ours
            return None
        except OSError as error:
            self._skipped.add(name)
            log.warning("%s: cannot be opened (%s); it is left there and not read again", path,
                        error.strerror or type(error).__name__)
            return "error"
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                return None
            if info.st_size > MAX_DUMP_BYTES:
                self._skipped.add(name)
                log.warning("%s: %d bytes, larger than %d; expected a stat-mode recorder dump; it is left there "
                            "and not read again", path, info.st_size, MAX_DUMP_BYTES)
                return "error"
            try:
                counts, passes = read_dump(handle, path, self.routing.geometry)
            except DumpError as error:
                log.warning("%s", error)
                outcome = "error"
            else:
                outcome = self._count(path, counts, passes)
        self._delete(path)
        return outcome

    def _count(self, path: Path, counts: np.ndarray, passes: tuple[int, int]) -> str:
        recorded, rows = passes
        if recorded == 0:
            return "empty"
        geometry = self.routing.geometry
        top_k = geometry.top_k
        for name, row in zip(geometry.router_names, counts, strict=True):
            tokens = int(row.sum()) // top_k
            if tokens > 0:
                self.routing.windows.add(name, UNATTRIBUTED_LINE, CountDelta(row, tokens))
        if self.buffer_size > 0 and rows != self.buffer_size:
            self._warn_once(f"rows:{rows}", "%s: key 'logical_count' has %d rows; expected %d, the configured "
                            "recorder buffer size: set it to the engine's --expert-distribution-recorder-buffer-"
                            "size (-1 for an unbounded buffer), or a wrapped ring goes unnoticed", path, rows,
                            self.buffer_size)
        if self.buffer_size > 0 and recorded >= self.buffer_size:
            log.warning("%s: all %d rows of the recorder's ring buffer are filled, so older forward passes were "
                        "overwritten and not counted; dump more often (a lower --sglang-recorder-interval than "
                        "%g s) or raise the engine's --expert-distribution-recorder-buffer-size", path, rows,
                        self.interval)
            return "ring_full"
        return "counted"

    def _delete(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self._skipped.add(path.name)  # counted already: never again
            self._warn_once(f"unlink:{error.errno}", "%s: counted, but cannot be deleted (%s); it and files like "
                            "it are not read again, but they fill the directory: expected the recorder directory "
                            "writable here", path, error.strerror or type(error).__name__)

    # -- HTTP and logging ------------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        with self._client_lock:
            if self._client is None:
                self._client = httpx.Client(base_url=self.engine_url,
                                            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 5.0)))
            return self._client

    def _post(self, path: str) -> str | None:
        """POST ``path`` to the engine; ``None`` on a 2xx answer, else the kind of failure (logged once)."""
        try:
            response = self._http().post(path)
        except httpx.HTTPError as error:
            kind, detail = type(error).__name__, str(error) or type(error).__name__
        else:
            if response.is_success:
                with self._log_lock:  # a later failure of a kind seen before is news again
                    self._logged = {key for key in self._logged if not key.startswith(path)}
                return None
            kind = f"HTTP {response.status_code}"
            detail = f"{kind}: {response.text[:200]!r}"
        self._warn_once(f"{path}:{kind}", "POST %s%s failed (%s); expected a 2xx answer from an SGLang server "
                        "started with %s; retrying every %g s", self.engine_url, path, detail, _ORDER, self.interval)
        return kind

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        with self._log_lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.warning(message, *args)


def read_dump(handle: Any, path: Path, geometry: EngineGeometry) -> tuple[np.ndarray, tuple[int, int]]:
    """The counts ``[moe_layers, experts]`` (int64) of a stat dump, and (passes recorded, rows in the file)."""
    import torch  # only here: the sidecar imports this module whether or not a recorder is polled

    try:
        data = torch.load(handle, map_location="cpu", weights_only=True)  # a shared volume: no arbitrary pickles
    except Exception as error:  # torch raises pickle, zip, EOF and runtime errors alike
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise DumpError(f"{path}: cannot be read by torch.load(weights_only=True) ({type(error).__name__}: "
                        f"{first}); expected a recorder dump written by {_ORDER}") from None
    layers, moe, experts = geometry.num_hidden_layers, len(geometry.moe_layers), geometry.num_experts
    expected = f"[passes, {layers}, {experts}]"
    if moe != layers:
        expected += f" (every hidden layer) or [passes, {moe}, {experts}] (MoE layers only)"
    expected = f"an integer tensor of shape {expected} for {geometry.describe()}"
    if not isinstance(data, dict) or "logical_count" not in data:
        found = f"keys {sorted(map(str, data))}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise DumpError(f"{path}: key 'logical_count' missing ({found}); expected a dict holding {expected}, "
                        f"as {_ORDER} writes")
    tensor = data["logical_count"]
    if not isinstance(tensor, torch.Tensor) or str(tensor.dtype) not in _INTEGER_DTYPES:
        found = f"a {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
        raise DumpError(f"{path}: key 'logical_count' is {found}; expected {expected}")
    shape = list(tensor.shape)
    if len(shape) != 3 or shape[1] not in (layers, moe) or shape[2] != experts:
        raise DumpError(f"{path}: key 'logical_count' has shape {shape}; expected {expected}")
    array = tensor.numpy()
    if shape[1] == layers and moe != layers:
        array = array[:, list(geometry.moe_layers), :]
    if array.size and int(array.min()) < 0:
        raise DumpError(f"{path}: key 'logical_count' holds negative counts (lowest {int(array.min())}); "
                        "expected counts of tokens, >= 0")
    recorded = int(np.count_nonzero(array.reshape(shape[0], -1).any(axis=1))) if array.size else 0
    return array.sum(axis=0, dtype=np.int64), (recorded, shape[0])
