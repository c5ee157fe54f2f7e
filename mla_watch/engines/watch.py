"""The routers of an engine the sidecar stands beside: their windows, and what was and was not counted.

Counts decoded from the engine's responses (per business line) and from SGLang's recorder
(the ``unattributed`` line) land in one :class:`~mla_watch.windows.RouterWindows` whose
routers carry the transformers module names of the model config, so `/v1/routing`,
`/metrics`, the alert rules, the status page and baselines treat them as they treat the
embedded model's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from mla_watch.engines.formats import Decoded
from mla_watch.engines.geometry import EngineGeometry
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.footprint import FootprintSampler
from mla_watch.routing.positions import PositionCounts
from mla_watch.routing.routers import CountDelta
from mla_watch.routing.series import PREFIX
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS, RouterWindows

__all__ = ["UNATTRIBUTED_LINE", "EngineMetrics", "EngineRouting"]

log = logging.getLogger("mla_watch.engines")

# The business line of counts no request can be matched to: the SGLang recorder's, which sees all traffic.
UNATTRIBUTED_LINE = "unattributed"
LOG_EVERY_SECONDS = 60.0  # a data error is logged once a minute per reason, with how many there were
NO_ROUTING_IN_A_ROW = 3
# What the status page says of a problem the engine's answers show, by the reason it was seen.
PROBLEMS = {
    "no_routing": "{engine} answered without routing: start it with --enable-return-routed-experts (vLLM; "
    "SGLang also needs it), or nothing it serves is counted",
    "duplicate_ids": "{engine} returned routing that names one expert twice in a token's top-k (all zeros, "
    "mostly): its routing capture is misconfigured (vLLM on CPU needs --enforce-eager); none of "
    "it is counted",
}


class EngineMetrics:
    """What happened to the routing of each response (``mla_watch_engine_*``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = PREFIX + "engine_"
        self.responses = Counter(
            p + "responses",
            "Engine responses by what became of their routing: counted, "
            "no_routing (none returned: a stream vLLM cannot annotate, a flag not set), "
            "data_error (not counted).",
            ["engine", "outcome"],
            registry=registry,
        )
        self.data_errors = Counter(
            p + "routing_data_errors",
            "Engine routing refused, by reason (encoding, shape, expert_id, duplicate_ids, decoder).",
            ["engine", "reason"],
            registry=registry,
        )
        self.recorder_dumps = Counter(
            p + "recorder_dumps",
            "SGLang expert-distribution recorder dumps read, by outcome (counted, empty, ring_full, error).",
            ["outcome"],
            registry=registry,
        )
        self.count_dropped = Counter(
            p + "count_dropped",
            "Engine answers whose routing was not counted because the "
            "queue of answers still to count was full (queue_full) or the sidecar stopped "
            "(shutdown).",
            ["reason"],
            registry=registry,
        )
        self.stream_replays = Counter(
            p + "stream_replays",
            "Streamed vLLM requests, by what became of the replay "
            "that counts their routing (see mla_watch.engines.replay.REPLAY_OUTCOMES).",
            ["outcome"],
            registry=registry,
        )
        self.replay_tokens = Counter(
            p + "replay_tokens",
            "Tokens sent to the engine in stream replays (the prompt part mostly a prefix-cache hit).",
            registry=registry,
        )
        self.recorder_rejected = Counter(
            p + "recorder_rejected",
            "SGLang recorder dumps set aside uncounted (outcome "
            "error), by reason (see mla_watch.engines.recorder.REJECT_REASONS).",
            ["reason"],
            registry=registry,
        )


FOOTPRINT_TOKENS = 16  # decode rows of each answer's choice kept for the footprint of a batch


class EngineRouting:
    """Rolling windows of an engine's routers, fed by decoded responses and recorder dumps."""

    def __init__(
        self,
        engine: str,
        geometry: EngineGeometry,
        metrics: EngineMetrics,
        *,
        window_tokens: int | None = DEFAULT_WINDOW_TOKENS,
        window_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        windows: RouterWindows | None = None,
    ) -> None:
        """``windows``: the windows counted into (default: new ones of ``geometry``'s routers, of ``window_tokens``
        or ``window_seconds``)."""
        self.engine = engine
        self.geometry = geometry
        self.metrics = metrics
        self.windows = (
            windows
            if windows is not None
            else RouterWindows(
                geometry.routers(), window_tokens=window_tokens, window_seconds=window_seconds, clock=clock
            )
        )
        # Routing by position from the answers' per-position rows, where the config says the context length.
        self.positions = (
            PositionCounts(geometry.routers(), geometry.context_length, clock=clock)
            if geometry.context_length is not None
            else None
        )
        self.windows.positions = self.positions
        self.position_edges = None if self.positions is None else self.positions.buckets.edges
        self._pending_positions: dict[tuple[str, str], np.ndarray] = {}  # (line, client key) -> counts
        # The expert footprint of a batch: the decode rows of every answer's choices, each a request.
        self.footprint = FootprintSampler(geometry.num_experts, tokens_per_request=FOOTPRINT_TOKENS)
        self._names = geometry.router_names
        self._logged: dict[str, tuple[float, int]] = {}
        self._log_lock = threading.Lock()
        self._clock = clock
        # Counts of responses not yet in the windows, per line: one array add on the event loop per
        # response; readers move them into the windows (collect), as they do the probe's counters.
        self._pending: dict[str, tuple[np.ndarray, int]] = {}
        self._pending_lock = threading.Lock()
        self._problems: dict[str, float] = {}  # reason -> when last seen; cleared by counted routing
        self._without_routing = 0  # whole answers in a row that carried none
        self.answers = 0  # answers (and streams) counted in any outcome: what a test waits for
        self.clients: ClientShares | None = None  # each line's clients' token shares, where kept

    def problems(self) -> list[str]:
        """What the engine's recent answers say is wrong with its routing set-up (for the status page)."""
        return [PROBLEMS[reason].format(engine=self.engine) for reason in sorted(self._problems)]

    def add(self, business_line: str, counts: np.ndarray, tokens: int) -> None:
        """Counts of ``[moe_layers, experts]`` over ``tokens`` tokens into ``business_line``'s windows."""
        if tokens <= 0:
            return
        for name, row in zip(self._names, counts, strict=True):
            self.windows.add(name, business_line, CountDelta(np.asarray(row, dtype=np.int64), tokens))

    def collect(self) -> None:
        """Move the responses' counts into the windows (called by every reader before it reads)."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
            positions, self._pending_positions = self._pending_positions, {}
        for line, (counts, tokens) in pending.items():
            self.add(line, counts, tokens)
        if self.positions is not None:
            for (line, client), by_position in positions.items():
                for name, layer in zip(self._names, by_position, strict=True):
                    self.positions.add(name, line, layer, client=client)

    def counts(self, business_line: str | None = None) -> dict[str, np.ndarray]:
        """Each router's counts over its window, the responses counted so far included."""
        self.collect()
        return self.windows.counts(business_line)

    def count(
        self, business_line: str, decoded: Decoded | None, *, streamed: bool = False, client: str | None = None
    ) -> str:
        """Count one response's routing; returns the outcome (``counted``, ``no_routing``, ``data_error``). The
        tokens it routed count toward ``client``'s share of the line (:attr:`clients`)."""
        if decoded is not None and decoded.error is not None:
            outcome = "data_error"
            self.metrics.data_errors.labels(self.engine, decoded.error.reason).inc()
            self._log_error(decoded.error.reason, str(decoded.error))
            if decoded.error.reason in PROBLEMS:
                self._problems[decoded.error.reason] = self._clock()
        elif decoded is not None and decoded.counts is not None:
            outcome = "counted"
            with self._pending_lock:
                counts, tokens = self._pending.get(business_line, (0, 0))
                self._pending[business_line] = (decoded.counts + counts, decoded.tokens + tokens)
                for rows in decoded.footprint_rows or ():
                    self.footprint.add(business_line, rows)
                if (
                    decoded.position_counts is not None
                    and self.positions is not None
                    and decoded.prompt_tokens is not None
                ):
                    self.positions.add_prompt(business_line, decoded.prompt_tokens)
                    key = (business_line, self.positions.client_key(business_line, client, decoded.prompt_tokens))
                    earlier = self._pending_positions.get(key)
                    self._pending_positions[key] = (
                        decoded.position_counts if earlier is None else earlier + decoded.position_counts
                    )
            self._problems.clear()  # the engine's routing works (again)
            self._without_routing = 0
            if self.clients is not None and client is not None:
                self.clients.add(business_line, client, int(decoded.tokens))
        else:
            outcome = "no_routing"
            # vLLM never puts routing in a stream, and a preempted request's is null; whole answers without
            # any, one after another, are the engine's set-up.
            self._without_routing += not streamed
            if self._without_routing >= NO_ROUTING_IN_A_ROW and "no_routing" not in self._problems:
                self._problems["no_routing"] = self._clock()
                log.warning("%s", PROBLEMS["no_routing"].format(engine=self.engine))
        self.metrics.responses.labels(self.engine, outcome).inc()
        self.answers += 1
        return outcome

    def _log_error(self, reason: str, message: str) -> None:
        now = self._clock()
        with self._log_lock:
            last, suppressed = self._logged.get(reason, (float("-inf"), 0))
            if now - last < LOG_EVERY_SECONDS:
                self._logged[reason] = (last, suppressed + 1)
                return
            self._logged[reason] = (now, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        log.warning("%s routing not counted (%s): %s%s", self.engine, reason, message, more)
