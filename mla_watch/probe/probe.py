"""Count router selections on the model's device, cheaply enough to leave on in production.

Every router owns a column range of one preallocated ``int64`` buffer of shape
``[max_business_lines + 1, width]``: ``num_slots`` selection counters followed by four
companions (tokens, selections made by queries that had a choice, the local ones among
those, and picks outside ``[0, num_slots)`` that were dropped). The last row is the
``overflow`` line. The buffer is allocated once and never replaced, and the attribution of
batch rows to lines is written in place into another preallocated tensor, so a captured CUDA
graph or a compiled model keeps counting into the memory it was built against.

This module is the public API: :func:`attach` and :class:`Probe`, which allocates the buffer,
installs the wrappers, attributes passes to business lines and reads the counts into the windows.
How the counting is wired (each choice is a measured cost; see bench/README.md), a module each:

* :mod:`mla_watch.probe.wrappers`: routers and the model are watched by replacing the instance's
  ``forward`` with a small callable (restored exactly on :meth:`Probe.detach`), not with module hooks.
* :mod:`mla_watch.probe.deferral`: in eager mode a watched router only keeps a reference to its
  output; passes wait, ``flush_every`` at a time, and are counted together at the flush.
* :mod:`mla_watch.probe.graph_counting`: under ``torch.compile`` every router counts in the graph itself.
* :mod:`mla_watch.probe.count_kernels`: the buffer's column layout and the batched kernels both count with.

Nothing waits for the host inside a forward pass: no ``.item()``, ``.cpu()`` or ``.tolist()``.
The host reads the buffer with one copy when statistics are asked for, and pushes the
difference since the previous read into rolling windows (:class:`mla_watch.windows.RouterWindows`).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mla_watch.probe.agent import Shipper
from mla_watch.probe.count_kernels import CHOICE_COLUMN, COMPANION_COLUMNS, DROPPED_COLUMN, LOCAL_COLUMN, TOKENS_COLUMN
from mla_watch.probe.deferral import EagerDeferral, WatchedPass
from mla_watch.probe.discovery import RouterInfo, RouterRegistry, discover_routers
from mla_watch.probe.graph_counting import CompiledCounting
from mla_watch.probe.wrappers import CountedRouter, WatchedModel, WatchedRouter, call_argument
from mla_watch.routing.routers import CountDelta
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS, RouterStats, RouterWindows

__all__ = ["DEFAULT_LINE", "MAX_ATTRIBUTED_ROWS", "OVERFLOW_LINE", "Probe", "RoutingRecording", "attach"]

DEFAULT_LINE = "default"
OVERFLOW_LINE = "overflow"  # where business lines past max_business_lines are counted
MAX_ATTRIBUTED_ROWS = 4096  # longest per-row list attribute() takes (the in-place attribution tensor's size)


class Probe(EagerDeferral, CompiledCounting):
    """Counts what every router of a model selects; :func:`attach` makes one.

    ``window_tokens`` / ``window_seconds`` bound the rolling window that :meth:`Probe.stats`
    reads (``None`` for no bound). Indexer counters cover key positions up to
    ``max_indexer_slots`` (or the model's context length, when smaller).

    The counters are allocated once for ``max_business_lines`` lines (``default`` included)
    plus one ``overflow`` line, which counts every line that arrives after the first
    ``max_business_lines`` (with one warning): the buffer's address never changes, which is
    what compiled models and CUDA graphs need. Eager decode steps are counted ``flush_every``
    passes at a time (and whenever anything reads the counts).

    With ``count_positions``, expert routers' picks are also counted per position bucket (power-of-two ranges of
    each token's index in its sequence, up to ``context_length``, default the model config's
    ``max_position_embeddings``): :attr:`positions`, a :class:`~mla_watch.positions.PositionCounts` that the
    windows' records read for their ``long_context_drift`` (eager passes only; not shipped with ``agent_url``).

    With ``agent_url`` (a running sidecar's base URL) the probe keeps no windows of its own:
    every ``ship_interval`` seconds it ships its counts to the sidecar's ingestion endpoint,
    authenticated with ``agent_token`` (default: ``$MLA_WATCH_ADMIN_TOKEN``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        registry: RouterRegistry | None = None,
        ignore: Sequence[str] = (),
        window_tokens: int | None = DEFAULT_WINDOW_TOKENS,
        window_seconds: float | None = None,
        max_indexer_slots: int | None = 8192,
        max_business_lines: int = 16,
        flush_every: int = 128,
        clock: Callable[[], float] = time.monotonic,
        agent_url: str | None = None,
        agent_token: str | None = None,
        agent_source: str | None = None,
        ship_interval: float = 5.0,
        count_positions: bool = False,
        context_length: int | None = None,
    ) -> None:
        if max_business_lines < 1:
            raise ValueError(f"max_business_lines={max_business_lines}; expected at least 1 (the default line)")
        if flush_every < 1:
            raise ValueError(f"flush_every={flush_every}; expected at least 1")
        self.model = model
        self._routers: list[CountedRouter] = []
        width = 0
        for module, info, spec in discover_routers(
            model, registry=registry, ignore=ignore, max_indexer_slots=max_indexer_slots
        ):
            self._routers.append(CountedRouter(len(self._routers), module, info, spec, width))
            width += info.num_slots + COMPANION_COLUMNS
        self._width = width
        self._device = _device_of(model)
        self._max_lines = max_business_lines
        self._overflow_row = max_business_lines
        self._flush_every = flush_every
        # Sized once: a compiled graph or a captured CUDA graph holds these addresses.
        self._buffer = torch.zeros((max_business_lines + 1, width), dtype=torch.int64, device=self._device)
        self._row_lines = torch.zeros(MAX_ATTRIBUTED_ROWS, dtype=torch.int64, device=self._device)
        torch._dynamo.mark_static_address(self._buffer)
        torch._dynamo.mark_static_address(self._row_lines)
        self._attribution: tuple[int, ...] = (0,)  # line per row, as written into _row_lines[:len]
        self._attributed_rows = 1
        self._lines: dict[str, int] = {DEFAULT_LINE: 0}
        self._overflowed: set[str] = set()
        self._mask_warned = False
        self._one = torch.ones(1, dtype=torch.int64, device=self._device)
        self._current: WatchedPass | None = None
        self._graph_pass: tuple[int, int, torch.Tensor, torch.Tensor | None] | None = None
        self._pending: list[WatchedPass] = []
        self._pending_mask_elements = 0
        self._pending_lock = threading.Lock()
        self._constants: dict[Any, Any] = {}
        self._host_lock = threading.Lock()
        self._recording = threading.local()  # per thread: a re-tune's forwards never land in a request's routing
        self._last_read = np.zeros((self._buffer.shape[0], width), dtype=np.int64)
        self._dropped = np.zeros(len(self._routers), dtype=np.int64)
        self.windows = RouterWindows(
            self.routers, window_tokens=window_tokens, window_seconds=window_seconds, clock=clock
        )
        if count_positions and context_length is None:
            context_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            if not isinstance(context_length, int) or context_length < 1:
                raise ValueError(
                    "attach(count_positions=True): the model's config has no max_position_embeddings; "
                    "pass context_length="
                )
        self._init_positions(self._buffer.shape[0], context_length if count_positions else None, clock)
        self.windows.positions = self.positions
        for router in self._routers:
            router.watch = WatchedRouter(router.module, self, router)
            router.watch.install()
        self._model_watch = WatchedModel(model, self)
        self._model_watch.install()
        self.shipper: Shipper | None = None
        self._sink: Callable[[str, str, CountDelta], None] = self.windows.add
        if agent_url is not None:
            self.shipper = Shipper(agent_url, self.routers, token=agent_token, source=agent_source)
            self._sink = self.shipper.add
            self.shipper.start(self.collect, ship_interval)
        # The constants of the usual groups (every expert router, every indexer; the default line) are built
        # now, so that the first requests do not pay for them.
        for kind in (True, False):
            group = [router for router in self._routers if router.expert is kind]
            if group:
                self._router_columns(group, self._attribution, 1)
        self._attached = True

    # ------------------------------------------------------------------ public API
    @property
    def routers(self) -> list[RouterInfo]:
        return [router.info for router in self._routers]

    @property
    def business_lines(self) -> list[str]:
        return list(self._lines)

    @property
    def max_business_lines(self) -> int:
        """Distinct business lines counted on their own (``default`` included); later ones go to ``overflow``."""
        return self._max_lines

    @property
    def overflowed_lines(self) -> list[str]:
        """Business lines that arrived past ``max_business_lines`` and are counted as ``overflow``."""
        return sorted(self._overflowed)

    @property
    def counter_bytes(self) -> int:
        """Device memory held by the counters (and the attribution tensor)."""
        return (self._buffer.numel() + self._row_lines.numel()) * self._buffer.element_size()

    def window_bytes(self) -> int:
        """Host memory held by the rolling windows (running sums plus buckets)."""
        return self.windows.nbytes

    def dropped(self) -> dict[str, int]:
        """Picks each expert router made outside ``[0, num_slots)`` since attach (or reset); never counted."""
        self.collect()
        return {router.info.name: int(self._dropped[router.index]) for router in self._routers if router.expert}

    @contextmanager
    def attribute(
        self,
        business_lines: str | Sequence[str],
        *,
        clients: str | Sequence[str] | None = None,
        prompt_tokens: int | Sequence[int] | None = None,
    ) -> Iterator[None]:
        """Attribute the forward passes inside the block to business lines.

        One name attributes every sequence; a list names the line of each row of the batch
        (a batch expanded by ``num_return_sequences`` repeats each row's line). Lines past
        ``max_business_lines`` are counted as ``overflow`` (with one warning).

        Routing by position (``count_positions``) also takes, each one value or one per row: ``clients``, who sent
        the sequence (each client's routing by position is judged against its own), and ``prompt_tokens``, the
        length of its prompt (only the prompt's tokens are counted by position: a generated token's routing follows
        what the model writes; each prompt given counts once towards the line's prompts by length). Without them
        every token counts, under one unnamed client.
        """
        names = [business_lines] if isinstance(business_lines, str) else list(business_lines)
        if not names:
            raise ValueError("attribute(): business_lines is empty; expected a name or one per batch row")
        if len(names) > MAX_ATTRIBUTED_ROWS:
            raise ValueError(f"attribute(): {len(names)} business lines; at most {MAX_ATTRIBUTED_ROWS} rows per batch")
        ids = tuple(self._line_id(name) for name in names)
        placed = self._position_attribution_of(names, ids, clients, prompt_tokens)
        previous, previous_placed = self._attribution, self._position_attribution
        self._set_attribution(ids)
        self._position_attribution = placed
        try:
            yield
        finally:
            self._set_attribution(previous)
            self._position_attribution = previous_placed

    @contextmanager
    def record_routing(self) -> Iterator[RoutingRecording]:
        """Keep the expert ids every expert router chose in this thread's forward passes inside the block.

        What is recorded is exactly what is counted (same passes, same rows), so a server can return
        each request's routing per token, as vLLM and SGLang do. Compiled forward passes are counted
        but not recorded (recording copies to the host, which a graph cannot do).
        """
        recording = RoutingRecording([router.info for router in self._routers if router.info.kind == "expert"])
        previous = getattr(self._recording, "current", None)
        self._recording.current = recording
        try:
            yield recording
        finally:
            self._recording.current = previous

    def stats(self, business_line: str | None = None) -> list[dict[str, Any]]:
        """One record per router for the current window (all lines summed when ``None``)."""
        return [record.as_dict() for record in self.router_stats(business_line)]

    def router_stats(self, business_line: str | None = None) -> list[RouterStats]:
        """:meth:`stats`, typed: what the alert engine, the history and the gates take."""
        self.collect()
        return self.windows.router_stats(business_line)

    def counts(self, business_line: str | None = None) -> dict[str, np.ndarray]:
        """The selection counts of each router over the current window."""
        self.collect()
        return self.windows.counts(business_line)

    def collect(self) -> None:
        """Move what the device counted since the last call into the rolling windows.

        Passes still waiting to be counted together are counted first, so nothing is stale.
        """
        with self._host_lock:
            self._flush_pending()
            current = self._buffer.to("cpu", copy=True).numpy()  # the one host synchronisation
            delta = current - self._last_read
            self._last_read = current
            for line, row in self._lines.items():
                if not delta[row].any():
                    continue
                for router in self._routers:
                    start, slots = router.offset, router.info.num_slots
                    counts = delta[row, start : start + slots]
                    companions = delta[row, start + slots : start + slots + COMPANION_COLUMNS]
                    self._dropped[router.index] += companions[DROPPED_COLUMN]
                    # Every token picks exactly top_k experts (counted or dropped): no token counter needed.
                    tokens = (
                        (counts.sum() + companions[DROPPED_COLUMN]) // router.info.top_k
                        if router.expert
                        else companions[TOKENS_COLUMN]
                    )
                    self._sink(
                        router.info.name,
                        line,
                        CountDelta(counts, int(tokens), int(companions[LOCAL_COLUMN]), int(companions[CHOICE_COLUMN])),
                    )
            self._collect_positions(self._lines)

    def count_pending(self) -> None:
        """Count now the eager passes still waiting to be counted together (every read does this first)."""
        self._flush_pending()

    def reset(self) -> None:
        """Forget every count (device counters, passes not yet counted, and windows)."""
        with self._host_lock:
            with self._pending_lock:
                self._pending, self._pending_mask_elements = [], 0
            self._buffer.zero_()
            self._last_read = np.zeros_like(self._last_read)
            self._dropped[:] = 0
            self.windows.reset()
            self._reset_positions()

    def flush(self) -> bool:
        """With ``agent_url``: collect and ship now; ``True`` once the sidecar has everything."""
        self.collect()
        return self.shipper.flush() if self.shipper is not None else True

    def detach(self) -> None:
        """Stop watching; the model computes exactly as it did before :func:`attach`.

        Pending passes are counted first; with ``agent_url``, the counts not yet shipped are shipped.
        """
        if not self._attached:
            return
        if self.shipper is not None:
            self.shipper.stop()
            self.flush()
        else:
            with self._host_lock:
                self._flush_pending()
        for router in self._routers:
            if router.watch is not None:
                router.watch.restore()
                router.watch = None
        self._model_watch.restore()
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

    def save_baseline(self, path: str | Path, business_line: str | None = None) -> dict[str, Any]:
        """Write the current window's counts as the healthy reference for drift (JSON)."""
        self.collect()
        return self.windows.save_baseline(path, business_line)

    def load_baseline(self, path: str | Path) -> None:
        """Use a file written by :meth:`save_baseline` for the ``js_divergence`` statistic."""
        self.windows.load_baseline(path)

    # ------------------------------------------------------------------ host side helpers
    def _line_id(self, name: str) -> int:
        if not isinstance(name, str) or not name:
            raise ValueError(f"business line {name!r}: expected a non-empty string")
        row = self._lines.get(name)
        if row is not None:
            return row
        with self._host_lock:
            if name in self._lines:
                return self._lines[name]
            if name == OVERFLOW_LINE:
                self._lines[name] = self._overflow_row
                return self._overflow_row
            named = len(self._lines) - (OVERFLOW_LINE in self._lines)
            if named < self._max_lines:
                self._lines[name] = named
                return named
            if not self._overflowed:
                warnings.warn(
                    f"mla_watch probe: business line {name!r} is past max_business_lines={self._max_lines}; "
                    f"it and every later new line are counted as {OVERFLOW_LINE!r} "
                    "(raise max_business_lines in attach() to count them apart)",
                    RuntimeWarning,
                    stacklevel=6,  # _line_id, genexpr, attribute, contextlib (2): the caller's with-statement
                )
            self._overflowed.add(name)
            self._lines.setdefault(OVERFLOW_LINE, self._overflow_row)
            return self._overflow_row

    def _set_attribution(self, ids: tuple[int, ...]) -> None:
        """Write the line of each batch row in place: compiled graphs read this very tensor."""
        if ids == self._attribution:
            return
        # Passes counted under the old attribution are keyed by it; write the tensor only for graphs.
        self._row_lines[: len(ids)].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=False)
        self._attribution = ids
        self._attributed_rows = len(ids)

    # ------------------------------------------------------------------ watched calls
    # The wrappers call these; each takes the compiled path while a graph is traced, else the eager one.
    def _model_call(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if torch.compiler.is_compiling():
            return self._graph_model_call(original, args, kwargs)
        current = self._begin(args, kwargs)
        previous, self._current = self._current, current
        try:
            output = original(*args, **kwargs)
        finally:
            self._current = previous
        if current is not None and current.outputs:
            self._end(current)
        return output

    def _router_call(self, watch: WatchedRouter, output: Any, args: tuple, kwargs: dict) -> bool:
        """What a router call does off the fast path (traced, first output, or outside a watched pass);
        ``False`` when the output is still to be kept by the fast path."""
        router = watch.router
        if torch.compiler.is_compiling():
            self._graph_router_call(router, output, args, kwargs)
            return True
        if watch.unchecked:
            router.spec.indices(output)  # a spec checked on the first real output raises its clear error here
            watch.unchecked = False
            watch.read = getattr(router.spec.indices, "__wrapped__", router.spec.indices)  # checked once is enough
        if self._current is not None:
            return False
        # Called outside the attached module's forward: count now, unattributed.
        mask = None if router.expert else call_argument(router.spec.mask_argument, args, kwargs)
        with self._pending_lock:
            self._count_alone(router, watch.read(output), mask)
        return True


class RoutingRecording:
    """Expert ids per forward pass, as :meth:`Probe.record_routing` keeps them (host copies, int32)."""

    def __init__(self, routers: Sequence[RouterInfo]) -> None:
        self.routers = list(routers)
        self._passes: list[torch.Tensor] = []  # [batch, seq, routers, top_k] each

    def add(self, batch: int, seq: int, indices: Sequence[torch.Tensor]) -> None:
        if len(indices) != len(self.routers) or len({chosen.shape[-1] for chosen in indices}) != 1:
            return  # part of the model ran, or routers of different top-k: no per-token table to keep
        stacked = torch.stack([chosen.reshape(batch, seq, -1) for chosen in indices], dim=2)
        self._passes.append(stacked.to("cpu", torch.int32))

    def rows(self, row: int) -> np.ndarray:
        """Batch row ``row``'s expert ids ``[tokens, expert routers, top_k]``, every pass in order."""
        if not self._passes:
            return np.zeros((0, len(self.routers), self.routers[0].top_k if self.routers else 0), dtype=np.int32)
        return torch.cat([chosen[row] for chosen in self._passes], dim=0).numpy()


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def attach(model: nn.Module, **options: Any) -> Probe:
    """Watch every router of ``model`` and count what it selects: ``Probe(model, **options)``.

    ``options`` are the keyword parameters of :class:`Probe` (documented there, and only there);
    a name that is not one of them raises a ``TypeError`` naming it.
    """
    return Probe(model, **options)
