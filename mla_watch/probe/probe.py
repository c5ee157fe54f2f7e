"""Count router selections on the model's device, cheaply enough to leave on in production.

Every router owns a column range of one preallocated ``int64`` buffer of shape
``[max_business_lines + 1, width]``: ``num_slots`` selection counters followed by four
companions (tokens, selections made by queries that had a choice, the local ones among
those, and picks outside ``[0, num_slots)`` that were dropped). The last row is the
``overflow`` line. The buffer is allocated once and never replaced, and the attribution of
batch rows to lines is written in place into another preallocated tensor, so a captured CUDA
graph or a compiled model keeps counting into the memory it was built against.

How the counting is wired (each choice is a measured cost; see bench/README.md):

* Routers and the model are watched by replacing the instance's ``forward`` with a small
  callable (restored exactly on :meth:`Probe.detach`), not with module hooks: a module with
  hooks takes ``nn.Module``'s slow call path, which on a CPU cost more than the counting.
* In eager mode a watched router only keeps a reference to its output (and an indexer, to its
  mask): inside a forward pass the probe's Python runs between the model's ops with cold caches,
  where each line costs several times what it costs in a loop. Passes wait, ``flush_every`` at a
  time, and are counted together at the flush: the picks are read then, and consecutive passes
  of one layout (batch, sequence length, attribution, index shapes) are counted in a few batched
  tensor ops. The 2-D attention mask that marks padding is read then too; its version counter
  shows a caller that changed it in place before (a warning: call :meth:`Probe.count_pending`
  first). Every reader (:meth:`Probe.collect`, hence ``stats``/``counts``/baselines/shipping)
  counts what is pending first, so no reader ever sees stale counts. Passes of more than 256
  tokens are counted at their end.
* Under ``torch.compile`` (``torch.compiler.is_compiling()``) every router counts in the
  graph itself, with in-place ``scatter_add_`` into the static buffer: no references outlive
  a pass, which CUDA graphs would overwrite.

Nothing waits for the host inside a forward pass: no ``.item()``, ``.cpu()`` or ``.tolist()``.
The host reads the buffer with one copy when statistics are asked for, and pushes the
difference since the previous read into rolling windows (:class:`mla_watch.windows.RouterWindows`).
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._utils import _flatten_dense_tensors
from torch.nn import functional as F

from mla_watch.probe.agent import Shipper
from mla_watch.probe.discovery import RouterInfo, RouterRegistry, RouterSpec, discover_routers
from mla_watch.windows import CountDelta, RouterWindows

__all__ = ["DEFAULT_LINE", "MAX_ATTRIBUTED_ROWS", "OVERFLOW_LINE", "Probe", "RoutingRecording", "attach"]

DEFAULT_LINE = "default"
OVERFLOW_LINE = "overflow"  # where business lines past max_business_lines are counted
MAX_ATTRIBUTED_ROWS = 4096  # longest per-row list attribute() takes (the in-place attribution tensor's size)
_COMPANIONS = 4  # tokens, choice selections, local selections, dropped picks
_TOKENS, _CHOICE, _LOCAL, _DROPPED = 0, 1, 2, 3
# Passes of at most this many tokens (decode steps) wait to be counted together; a bigger pass
# pays for its own counting many times over, and holding its outputs would hold real memory.
_DEFER_MAX_TOKENS = 256
_PADDING_READ = -1  # a pass's attention is already the padding it marks (inference tensors have no version)
_DEFER_MAX_MASK_ELEMENTS = 1 << 22  # indexer masks the pending passes may keep alive (16 MiB of float32)


class _Router:
    def __init__(self, index: int, module: nn.Module, info: RouterInfo, spec: RouterSpec, offset: int) -> None:
        self.index = index  # position among the probe's routers (a stable key for cached constants)
        self.module = module
        self.info = info
        self.spec = spec
        self.offset = offset
        self.expert = info.kind == "expert"
        self.watch: _WatchedRouter | None = None


class _WatchedForward:
    """Stands in for a module's ``forward`` while a probe is attached (subclasses say what a call does).

    A plain instance attribute keeps ``nn.Module.__call__`` on its fast path (no hooks).
    A deep copy of the watched module gets the original ``forward`` back, bound to the copy,
    so a copy (a re-tune's working model) computes like the original and is not counted.
    """

    __slots__ = ("__wrapped__", "had_own", "module", "original", "probe")

    def __init__(self, module: nn.Module, probe: Probe) -> None:
        self.module = module
        self.probe = probe
        self.had_own = "forward" in module.__dict__  # someone patched forward before us: restore theirs
        self.original = module.forward
        # inspect.signature follows __wrapped__: callers that read forward's parameters (generate()
        # asks whether the model takes logits_to_keep, position_ids, ...) must see the real ones, or
        # they change what the watched model computes.
        self.__wrapped__ = self.original

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.original, memo)

    def install(self) -> None:
        self.module.forward = self

    def restore(self) -> None:
        current = self.module.__dict__.get("forward")
        if current is self:
            if self.had_own:
                self.module.forward = self.original
            else:
                del self.module.__dict__["forward"]
            return
        # Probes attached later wrapped this one (a shipping probe beside a local one): probes may be
        # detached in any order, so take this one out of the chain and leave theirs in place.
        while isinstance(current, _WatchedForward):
            if current.original is self:
                current.original = current.__wrapped__ = self.original
                current.had_own = self.had_own
                return
            current = current.original
        raise RuntimeError(
            f"mla_watch probe: the forward of {type(self.module).__name__} was replaced after attach(); "
            "detach() the probe before patching forward, or patch it before attach()"
        )


class _WatchedModel(_WatchedForward):
    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.probe._model_call(self.original, args, kwargs)


class _WatchedRouter(_WatchedForward):
    """A router's forward: runs it and, inside a watched pass, keeps a reference to its picks.

    This runs once per router per forward pass, between the model's own ops, where the interpreter's
    caches are cold: measured in a real generation, each line here costs several times what it costs
    in a loop. So it only reads the picks out of the output and appends them; checking shapes and
    grouping passes happen at the flush, for many passes at once (see :meth:`Probe._flush_pending_locked`).
    """

    __slots__ = ("mask_argument", "read", "router", "unchecked")

    def __init__(self, module: nn.Module, probe: Probe, router: _Router) -> None:
        super().__init__(module, probe)
        self.router = router
        self.read = router.spec.indices
        self.mask_argument = None if router.expert else router.spec.mask_argument
        self.unchecked = True  # the first output goes through the slow path (spec checks, clear errors)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.original(*args, **kwargs)
        current = self.probe._current
        if (current is None or self.unchecked) and self.probe._router_call(self, output, args, kwargs):
            return output
        if self.mask_argument is None:
            # The picks, not the output: a router's logits are many times the size of its choices.
            current.outputs.append((self.router, self.read(output), None))
        else:
            mask = _call_argument(self.mask_argument, args, kwargs)
            current.outputs.append((self.router, self.read(output), mask))
            if mask is not current.last_mask:  # one mask object is usually handed to every layer
                current.last_mask = mask
                if isinstance(mask, torch.Tensor):
                    current.mask_elements += mask.numel()
        return output


class Probe:
    """Counts what every router of a model selects; see :func:`attach`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        registry: RouterRegistry | None = None,
        ignore: Sequence[str] = (),
        window_tokens: int | None = 4096,
        window_seconds: float | None = None,
        max_indexer_slots: int | None = 8192,
        max_business_lines: int = 16,
        flush_every: int = 128,
        clock: Callable[[], float] = time.monotonic,
        agent_url: str | None = None,
        agent_token: str | None = None,
        agent_source: str | None = None,
        ship_interval: float = 5.0,
    ) -> None:
        if max_business_lines < 1:
            raise ValueError(f"max_business_lines={max_business_lines}; expected at least 1 (the default line)")
        if flush_every < 1:
            raise ValueError(f"flush_every={flush_every}; expected at least 1")
        self.model = model
        self._routers: list[_Router] = []
        width = 0
        for module, info, spec in discover_routers(
            model, registry=registry, ignore=ignore, max_indexer_slots=max_indexer_slots
        ):
            self._routers.append(_Router(len(self._routers), module, info, spec, width))
            width += info.num_slots + _COMPANIONS
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
        self._current: _Pass | None = None
        self._graph_pass: tuple[int, int, torch.Tensor, torch.Tensor | None] | None = None
        self._pending: list[_Pass] = []
        self._pending_mask_elements = 0
        self._pending_lock = threading.Lock()
        self._constants: dict[Any, Any] = {}
        self._host_lock = threading.Lock()
        self._recording = threading.local()  # per thread: a re-tune's forwards never land in a request's routing
        self._last_read = np.zeros((self._buffer.shape[0], width), dtype=np.int64)
        self._dropped = np.zeros(len(self._routers), dtype=np.int64)
        self.windows = RouterWindows(self.routers, window_tokens=window_tokens, window_seconds=window_seconds,
                                     clock=clock)
        for router in self._routers:
            router.watch = _WatchedRouter(router.module, self, router)
            router.watch.install()
        self._model_watch = _WatchedModel(model, self)
        self._model_watch.install()
        self.shipper: Shipper | None = None
        self._sink = self.windows.add
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
    def attribute(self, business_lines: str | Sequence[str]) -> Iterator[None]:
        """Attribute the forward passes inside the block to business lines.

        One name attributes every sequence; a list names the line of each row of the batch
        (a batch expanded by ``num_return_sequences`` repeats each row's line). Lines past
        ``max_business_lines`` are counted as ``overflow`` (with one warning).
        """
        names = [business_lines] if isinstance(business_lines, str) else list(business_lines)
        if not names:
            raise ValueError("attribute(): business_lines is empty; expected a name or one per batch row")
        if len(names) > MAX_ATTRIBUTED_ROWS:
            raise ValueError(f"attribute(): {len(names)} business lines; at most {MAX_ATTRIBUTED_ROWS} rows per batch")
        ids = tuple(self._line_id(name) for name in names)
        previous = self._attribution
        self._set_attribution(ids)
        try:
            yield
        finally:
            self._set_attribution(previous)

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
        self.collect()
        return self.windows.stats(business_line)

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
                    companions = delta[row, start + slots : start + slots + _COMPANIONS]
                    self._dropped[router.index] += companions[_DROPPED]
                    # Every token picks exactly top_k experts (counted or dropped): no token counter needed.
                    tokens = ((counts.sum() + companions[_DROPPED]) // router.info.top_k if router.expert
                              else companions[_TOKENS])
                    self._sink(router.info.name, line, CountDelta(counts, int(tokens), int(companions[_LOCAL]),
                                                                  int(companions[_CHOICE])))

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

    def _router_call(self, watch: _WatchedRouter, output: Any, args: tuple, kwargs: dict) -> bool:
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
        mask = None if router.expert else _call_argument(router.spec.mask_argument, args, kwargs)
        with self._pending_lock:
            self._count_alone(router, watch.read(output), mask)
        return True

    def _begin(self, args: tuple, kwargs: dict) -> _Pass | None:
        tokens_input = _tokens_input(args, kwargs)
        if tokens_input is None:
            return None
        batch, seq = int(tokens_input.shape[0]), int(tokens_input.shape[1])
        lines = self._attribution
        if batch % len(lines):
            raise ValueError(
                f"mla_watch probe: {len(lines)} business lines were given for a batch of "
                f"{batch} rows; expected one line, one per row, or a divisor of the batch size"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] >= seq:
            if mask.is_inference():  # no version counter to consult later: read the padding now
                return _Pass(batch, seq, lines, mask[:, -seq:] != 0, _PADDING_READ)
            # Read when the pass is counted (one op for many passes, not two per pass); its version
            # counter says whether the caller changed it in place before then.
            return _Pass(batch, seq, lines, mask, mask._version)
        return _Pass(batch, seq, lines, None, 0)

    def _end(self, current: _Pass) -> None:
        recording = getattr(self._recording, "current", None)
        with self._pending_lock:
            if recording is not None:
                self._resolve(current)
                if current.experts:
                    recording.add(current.batch, current.seq, current.experts)
            if current.tokens > _DEFER_MAX_TOKENS or current.mask_elements > _DEFER_MAX_MASK_ELEMENTS:
                # A big pass pays for its own counting many times over, and holding it would hold real memory.
                self._count_group([current])
                return
            self._pending.append(current)
            self._pending_mask_elements += current.mask_elements
            if len(self._pending) >= self._flush_every or self._pending_mask_elements > _DEFER_MAX_MASK_ELEMENTS:
                self._flush_pending_locked()

    def _flush_pending(self) -> None:
        with self._pending_lock:
            self._flush_pending_locked()

    def _flush_pending_locked(self) -> None:
        """Count the waiting passes, every pass of one layout together.

        A pass's counts do not depend on when it is counted, so the passes of a layout are gathered
        wherever they lie: the decode steps of many requests make one group, their prefills another.
        """
        passes, self._pending, self._pending_mask_elements = self._pending, [], 0
        groups: dict[tuple, list[_Pass]] = {}
        for item in passes:
            groups.setdefault(self._resolve(item), []).append(item)
        for group in groups.values():
            self._count_group(group)

    def _resolve(self, item: _Pass) -> tuple:
        """Sort a pass's picks by kind (once); picks that do not fit the pass are counted alone. Returns the
        pass's layout key."""
        if item.key is not None:
            return item.key
        tokens, batch, seq = item.tokens, item.batch, item.seq
        item.clear_picks()
        for router, indices, mask in item.outputs:
            if router.expert:
                shape = indices.shape
                if indices.numel() == tokens * shape[-1]:
                    item.experts.append(indices)
                    item.expert_routers.append(router)
                    item.expert_shapes.append(shape)
                    continue
            else:
                if indices.dim() == 2:
                    indices = indices.unsqueeze(0)
                shape = indices.shape
                if shape[0] == batch and shape[1] == seq:
                    item.indexers.append(indices)
                    item.indexer_routers.append(router)
                    item.indexer_shapes.append(shape)
                    item.masks.append(mask)
                    continue
            self._count_alone(router, indices, mask)
        item.outputs = []
        item.key = item.layout()
        return item.key

    def _count_group(self, passes: list[_Pass]) -> None:
        for item in passes:
            self._resolve(item)
        if passes[0].experts or passes[0].indexers:
            self._count_passes(passes)

    def _count_alone(self, router: _Router, indices: torch.Tensor, mask: Any) -> None:
        """A router output that is not part of a watched pass: its pass is its own, on the default line.
        The caller holds the pending lock."""
        if router.expert:
            single = _Pass(1, indices.numel() // indices.shape[-1], (0,), None, 0)
        else:
            batch, seq = (1, int(indices.shape[0])) if indices.dim() == 2 else (int(indices.shape[0]),
                                                                                  int(indices.shape[1]))
            single = _Pass(batch, seq, (0,), None, 0)
        single.outputs.append((router, indices, mask))  # fits its own pass by construction
        self._count_group([single])

    # ------------------------------------------------------------------ compiled passes
    # Under torch.compile the counting is traced into the graph: every pass scatters into the
    # static buffer at once, and the attribution is read from the in-place tensor, so a CUDA
    # graph replay counts the right lines without the host. No cache is written while tracing.
    def _graph_model_call(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        tokens_input = _tokens_input(args, kwargs)
        if tokens_input is None:
            return original(*args, **kwargs)
        batch, seq = int(tokens_input.shape[0]), int(tokens_input.shape[1])
        rows = self._attributed_rows
        if batch % rows:
            raise ValueError(
                f"mla_watch probe: {rows} business lines were given for a batch of "
                f"{batch} rows; expected one line, one per row, or a divisor of the batch size"
            )
        lines = self._row_lines[:rows]
        if rows != batch:
            lines = lines.repeat_interleave(batch // rows)
        mask = kwargs.get("attention_mask")
        valid = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch:
            valid = mask[:, -seq:] != 0
        previous = self._graph_pass
        self._graph_pass = (batch, seq, lines * self._width, valid)
        try:
            return original(*args, **kwargs)
        finally:
            self._graph_pass = previous

    def _graph_router_call(self, router: _Router, output: Any, args: tuple, kwargs: dict) -> None:
        indices = router.spec.indices(output)
        attributed = self._graph_pass
        if router.expert:
            if attributed is not None and indices.numel() == attributed[0] * attributed[1] * indices.shape[-1]:
                batch, seq, row_base, valid = attributed
            else:
                batch, seq, row_base, valid = 1, indices.numel() // indices.shape[-1], None, None
            self._count_experts(self._router_columns([router]), [indices], 1, batch, seq, row_base, valid)
            return
        if indices.dim() == 2:
            indices = indices.unsqueeze(0)
        mask = _usable_mask(_call_argument(router.spec.mask_argument, args, kwargs), indices.shape[0],
                            indices.shape[1])
        if attributed is not None and tuple(indices.shape[:2]) == (attributed[0], attributed[1]):
            batch, seq, row_base, valid = attributed
        else:
            batch, seq, row_base, valid = int(indices.shape[0]), int(indices.shape[1]), None, None
        self._count_indexers(self._router_columns([router]), [indices], [int(indices.shape[-1])],
                             None if mask is None else [mask], 1, batch, seq, row_base, valid)

    # ------------------------------------------------------------------ batched counting
    # On a CPU a tensor op costs microseconds of dispatch whatever its size, so the passes that
    # wait together are counted in a fixed number of ops: one stack (experts) or one flatten
    # (indexers, whose pick counts differ) of every router's choices, range checks as one clamp
    # and one comparison, one scatter_add_ for the picks and one for the companions.
    def _count_passes(self, passes: list[_Pass]) -> None:
        first = passes[0]
        count, batch, seq = len(passes), first.batch, first.seq
        valid = None if first.attention is None else self._valid(passes)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for position, shape in enumerate(first.expert_shapes):
            by_shape.setdefault(shape, []).append(position)
        for positions in by_shape.values():
            routers = [first.expert_routers[position] for position in positions]
            chosen = [item.experts[position] for item in passes for position in positions]
            columns = self._router_columns(routers, first.lines, batch)
            self._count_experts(columns, chosen, count, batch, seq, None, valid)
        if not first.indexers:
            return
        # Indexers scored against the same mask are counted together; the masks of every pass
        # are concatenated along the keys, so passes with growing contexts still batch.
        groups: dict[Any, list[int]] = {}
        for position, mask_slot in enumerate(first.mask_slots):
            groups.setdefault(mask_slot, []).append(position)
        for mask_slot, positions in groups.items():
            routers = [first.indexer_routers[position] for position in positions]
            chosen = [item.indexers[position] for item in passes for position in positions]
            widths = [item.indexer_shapes[position][-1] for item in passes for position in positions]
            masks = None
            if mask_slot is not None:
                masks = [item.usable_masks[mask_slot] for item in passes]
            columns = self._router_columns(routers, first.lines, batch)
            self._count_indexers(columns, chosen, widths, masks, count, batch, seq, None, valid)

    def _valid(self, passes: list[_Pass]) -> torch.Tensor:
        """Which tokens of each pass are real, ``[passes, B, S]``: the last ``S`` columns of its 2-D attention
        mask are non-zero. Masks grow by a column per decode step, so a group's masks are flattened and the
        wanted columns taken at offsets computed on the host."""
        if not self._mask_warned and any(item.attention_version != _PADDING_READ
                                         and item.attention._version != item.attention_version for item in passes):
            self._mask_warned = True
            warnings.warn(
                "mla_watch probe: an attention_mask was changed in place after the forward pass that used it and "
                "before the probe counted that pass, so its padding is read as the mask is now; call "
                "probe.count_pending() before reusing a mask in place",
                RuntimeWarning,
                stacklevel=2,
            )
        first = passes[0]
        batch, seq = first.batch, first.seq
        if any(item.attention_version == _PADDING_READ for item in passes):
            return torch.stack([item.attention if item.attention_version == _PADDING_READ
                                else item.attention[:, -seq:] != 0 for item in passes])
        if len(passes) == 1:
            return (first.attention[:, -seq:] != 0).unsqueeze(0)
        blocks = batch * np.asarray([item.attention.shape[1] for item in passes], dtype=np.int64)
        starts = (np.cumsum(blocks) - blocks)[:, None, None]
        lengths = blocks[:, None, None] // batch
        columns = starts + np.arange(batch)[None, :, None] * lengths + lengths - seq + np.arange(seq)[None, None, :]
        flat = _flatten_dense_tensors([item.attention for item in passes])
        index = torch.from_numpy(columns.reshape(-1))
        return flat.take(index if self._device.type == "cpu" else index.to(self._device)).view(
            len(passes), batch, seq) != 0

    def _cache(self, key: Any, value: Any) -> None:
        if len(self._constants) > 256:  # shapes and attributions come and go; keep the cache bounded
            self._constants.clear()
        self._constants[key] = value

    def _router_columns(self, routers: Sequence[_Router], lines: tuple[int, ...] | None = None,
                        batch: int = 1) -> _Columns:
        """The group's counter columns; with ``lines`` (eager passes), placed in each batch row's line, so the
        counting adds no row offsets (compiled passes add theirs from the in-place attribution tensor)."""
        key = ("columns", tuple(router.index for router in routers), lines, batch if lines else 0)
        columns = None if torch.compiler.is_compiling() else self._constants.get(key)
        if columns is None:
            # Plain Python, not numpy: this also runs while a graph is traced.
            rows = [0] if lines is None else [line * self._width for line in lines for _ in range(batch // len(lines))]
            offsets = [router.offset for router in routers]
            slots = [router.info.num_slots for router in routers]
            placed = [[offset + row for row in rows] for offset in offsets]  # [R, rows]

            def tensor(values: list, *shape: int) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=self._device).view(*shape)

            routers_count, placed_rows = len(routers), len(rows)
            companions = [[[column + slot + kind for column in router_rows] for router_rows, slot in
                           zip(placed, slots, strict=True)] for kind in range(_LOCAL + 1)]  # [3, R, rows]
            columns = _Columns(
                routers=routers_count,
                offsets=tensor(placed, 1, routers_count, placed_rows, 1, 1),
                first=torch.zeros((), dtype=torch.int64, device=self._device),
                last=tensor([slot - 1 for slot in slots], 1, routers_count, 1, 1, 1),
                top_k=tensor([router.info.top_k for router in routers], 1, routers_count, 1, 1, 1),
                dropped=tensor([[column + slot + _DROPPED for column in router_rows]
                                for router_rows, slot in zip(placed, slots, strict=True)],
                               1, routers_count, placed_rows, 1, 1),
                companions=tensor(companions, _LOCAL + 1, routers_count, placed_rows),
            )
            if not torch.compiler.is_compiling():
                self._cache(key, columns)
        return columns

    def _mask_constants(self, keys: list[int], rows: int,
                        seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each pass's mask lies among the flattened masks.

        ``keys[n]`` is pass ``n``'s mask length and every mask is ``[rows, seq, keys[n]]``. Returns each
        pass's last key ``[passes, 1, 1, 1, 1]``; the first position of the keys of each (pass, mask row,
        query) ``[passes, 1, rows, seq, 1]``; those first positions and then the end positions, 1-D; and
        each (pass, query)'s own key position ``keys[n] - seq + s`` ``[passes, 1, 1, seq, 1]``. Eager
        flushes do this arithmetic in numpy (``torch.tensor`` converts a list element by element) and
        hand the arrays over as they are on a CPU (no op) or in one copy to an accelerator; traced code
        (one pass) keeps plain Python, which a graph takes as constants.
        """
        passes, queries = len(keys), len(keys) * rows * seq
        shapes = ((passes, 1, 1, 1, 1), (passes, 1, rows, seq, 1), (2 * queries,), (passes, 1, 1, seq, 1))
        if torch.compiler.is_compiling():
            start, firsts, ends, positions = 0, [], [], []
            for key in keys:
                firsts += [start + row * key for row in range(rows * seq)]
                ends += [start + row * key + key for row in range(rows * seq)]
                positions += [key - seq + query for query in range(seq)]
                start += rows * seq * key
            values = [[key - 1 for key in keys], firsts, firsts + ends, positions]
            return tuple(torch.tensor(value, dtype=torch.int64, device=self._device).view(shape)  # type: ignore[return-value]
                         for value, shape in zip(values, shapes, strict=True))
        array = np.asarray(keys, dtype=np.int64)
        blocks = rows * seq * array
        firsts = ((np.cumsum(blocks) - blocks)[:, None] + np.arange(rows * seq)[None, :] * array[:, None]).ravel()
        parts = [array - 1, firsts, np.concatenate([firsts, firsts + np.repeat(array, rows * seq)]),
                 (array[:, None] - seq + np.arange(seq)[None, :]).ravel()]
        if self._device.type == "cpu":
            return tuple(torch.from_numpy(part.reshape(shape))  # type: ignore[return-value]
                         for part, shape in zip(parts, shapes, strict=True))
        sizes = [part.size for part in parts]
        together = torch.from_numpy(np.concatenate(parts)).to(self._device)
        return tuple(piece.view(shape)  # type: ignore[return-value]
                     for piece, shape in zip(together.split(sizes), shapes, strict=True))

    def _count_experts(self, columns: _Columns, chosen: list[torch.Tensor], count: int, batch: int,
                       seq: int, row_base: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """Count ``chosen`` (pass-major: ``count`` passes x the routers of ``columns``) into the buffer; ``row_base``
        (compiled passes) is each row's line offset when ``columns`` are not placed in the rows' lines."""
        picks = (torch.stack(chosen) if len(chosen) > 1 else chosen[0].unsqueeze(0)).reshape(
            count, columns.routers, batch, seq, -1)
        # Every expert router is range checked: a pick outside [0, num_slots) must never land in
        # another router's counters; it lands in this router's own dropped counter instead. A pick is
        # inside exactly when clamping to the range leaves it unchanged (two ops instead of four).
        clipped = picks.clamp(min=columns.first, max=columns.last)
        index = torch.where(clipped == picks, clipped + columns.offsets, columns.dropped)
        if row_base is not None:
            index = index + row_base.view(1, 1, batch, 1, 1)
        if valid is None:
            weight = self._ones(index.numel())
        else:
            weight = valid.view(count, 1, batch, seq, 1).expand(index.shape).to(torch.int64).reshape(-1)
        self._buffer.view(-1).scatter_add_(0, index.reshape(-1), weight)

    def _ones(self, size: int) -> torch.Tensor:
        return self._one.expand(size)  # a view: no allocation, whatever the size

    def _count_indexers(self, columns: _Columns, chosen: list[torch.Tensor], widths: Sequence[int],
                        masks: list[torch.Tensor] | None, count: int, batch: int, seq: int,
                        row_base: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """Count indexer picks: ``chosen`` is pass-major (``count`` passes x ``routers``), each ``[B, S, picks]``
        with ``widths`` picks; ``masks[n]`` is what pass ``n``'s indexers scored against (``[B or 1, S, keys]``),
        or ``None``.

        The picks are laid out densely as ``[pass, router, B, S, width]`` so that every per-router and
        per-pass constant is a broadcast view, not a per-pick lookup: on a CPU an op costs its dispatch
        whatever its size, and a gathered per-pick table cost more than all the comparisons together.
        Short contexts give fewer picks than ``index_topk`` (one more per decode step); those entries
        are padded with ``-1``, which no range check counts.
        """
        routers_count = columns.routers
        entries = len(chosen)
        width = max(widths)
        # Entry after entry, each [B, S, width] block flattened: flatten_dense_tensors views every input
        # as 1-D in C++ and concatenates with the serial kernel, where torch.cat of ragged [B, S, w]
        # blocks along the last dim copies input by input (3.5x slower for a flush of 48 decode steps).
        picks = _flatten_dense_tensors(chosen) if entries > 1 else chosen[0].reshape(-1)
        if width * entries * batch * seq != picks.numel():
            # masked_scatter_ fills the kept positions in row-major order: exactly the order of the blocks.
            keep = np.arange(width) < np.asarray(widths).reshape(-1, 1, 1, 1)
            picks = picks.new_full((entries, batch, seq, width), -1).masked_scatter_(
                torch.from_numpy(keep).to(self._device), picks)
        picks = picks.view(count, routers_count, batch, seq, width)
        # In range exactly when clamping leaves a pick unchanged; the clamped pick is its slot.
        clipped = picks.clamp(min=columns.first, max=columns.last)
        counted = clipped == picks
        if valid is not None:  # [passes, B, S]
            counted = counted & valid.view(count, 1, batch, seq, 1)
        choices = None
        if masks is not None:
            rows = int(masks[0].shape[0])  # 1 or B, the same in every pass (part of the layout key)
            allowed = _flatten_dense_tensors(masks) if count > 1 else masks[0].reshape(-1)
            if allowed.dtype != torch.bool:  # additive float mask: blocked keys hold a very negative number
                allowed = allowed > torch.finfo(allowed.dtype).min / 2
            queries = count * rows * seq
            last_key, firsts, bounds, positions = self._mask_constants([int(mask.shape[-1]) for mask in masks],
                                                                       rows, seq)
            # Keys a query was forced to return although its mask blocks them are not choices.
            counted = counted & torch.take(allowed, torch.minimum(clipped, last_key) + firsts)
            # Keys each query could see: differences of a running sum at its keys' first and end position.
            edges = F.pad(allowed.cumsum(0), (1, 0)).index_select(0, bounds)
            visible = (edges[queries:] - edges[:queries]).view(count, 1, rows, seq, 1)
            # Locality only means something for queries that saw at least twice the keys they may pick: with
            # fewer, even picks at random land mostly among the most recent top_k (top_k / visible > 1/2 of
            # them), and a healthy indexer reads as a sliding window.
            had_choice = counted & (visible >= 2 * columns.top_k)
            nearest = positions - columns.top_k
            local = had_choice & (clipped > nearest)
            # Per (kind, router, row): the companions are sums, so they are reduced before the scatter.
            choices = torch.stack([had_choice, local]).sum((1, 4, 5))  # [2, R, B]
        base = columns.offsets if row_base is None else columns.offsets + row_base.view(1, 1, batch, 1, 1)
        flat = self._buffer.view(-1)
        flat.scatter_add_(0, (clipped + base).view(-1), counted.view(-1).to(torch.int64))
        tokens = (valid.sum((0, 2)) if valid is not None
                  else torch.full((batch,), count * seq, dtype=torch.int64, device=self._device))
        tokens = tokens.view(1, 1, batch).expand(1, routers_count, batch)
        index = columns.companions  # [tokens, choice, local] x R x (B or 1)
        if choices is None:
            values, index = tokens, index[_TOKENS:_TOKENS + 1]
        else:
            values = torch.cat([tokens, choices])
        index = (index + row_base.view(1, 1, batch) if row_base is not None
                 else index.expand(-1, routers_count, batch))
        flat.scatter_add_(0, index.reshape(-1), values.reshape(-1))


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


class _Pass:
    """One forward pass of the watched model: its attribution and the router outputs it produced.

    Built on every forward pass, so it starts with the least: the wrappers append ``(router, picks,
    mask)`` to ``outputs``; they are sorted into the other lists at the flush (:meth:`Probe._resolve`).
    """

    __slots__ = ("attention", "attention_version", "batch", "expert_routers", "expert_shapes", "experts",
                 "indexer_routers", "indexer_shapes", "indexers", "key", "last_mask", "lines", "mask_elements",
                 "mask_slots", "masks", "outputs", "seq", "tokens", "usable_masks")

    def __init__(self, batch: int, seq: int, lines: tuple[int, ...], attention: torch.Tensor | None,
                 attention_version: int) -> None:
        self.batch = batch
        self.seq = seq
        self.tokens = batch * seq
        self.lines = lines  # line per row (one line, one per row, or a divisor of the batch)
        # The [batch, >= seq] attention mask (0: padding), or with _PADDING_READ its [batch, seq] != 0 already;
        # None: every token counts.
        self.attention = attention
        self.attention_version = attention_version
        self.outputs: list[tuple[_Router, torch.Tensor, Any]] = []  # (router, picks, mask argument) in call order
        self.last_mask: Any = None
        self.mask_elements = 0  # elements of the distinct indexer masks this pass keeps alive (a memory bound)
        self.key: tuple | None = None  # the layout, once the picks are read

    def clear_picks(self) -> None:
        self.experts: list[torch.Tensor] = []
        self.expert_routers: list[_Router] = []
        self.expert_shapes: list[torch.Size] = []
        self.indexers: list[torch.Tensor] = []
        self.indexer_routers: list[_Router] = []
        self.indexer_shapes: list[torch.Size] = []
        self.masks: list[Any] = []  # per indexer: the mask argument it was called with
        self.mask_slots: list[int | None] = []  # per indexer: its mask in usable_masks
        self.usable_masks: list[torch.Tensor] = []

    def layout(self) -> tuple:
        """What must match for passes to be counted together.

        Indexer pick counts and mask lengths may differ (a context grows by one key per decode step).
        """
        mask_layout = []
        if self.indexers:
            identities: dict[tuple, int] = {}
            batch, seq = self.batch, self.seq
            for mask in self.masks:
                usable = _usable_mask(mask, batch, seq)
                if usable is None:
                    self.mask_slots.append(None)
                    continue
                # Views of one mask (one per layer) are the same mask: gather against it once.
                identity = (mask.data_ptr(), mask.shape, mask.stride(), mask.dtype)
                slot = identities.get(identity)
                if slot is None:
                    slot = identities[identity] = len(self.usable_masks)
                    self.usable_masks.append(mask)
                    mask_layout.append((mask.shape[:-1], mask.dtype))
                self.mask_slots.append(slot)
        return (
            self.batch,
            self.seq,
            self.lines,
            self.attention is None,
            tuple(self.expert_routers),
            tuple(self.expert_shapes),
            tuple(self.indexer_routers),
            tuple(shape[:-1] for shape in self.indexer_shapes),
            tuple(self.mask_slots),
            tuple(mask_layout),
        )


@dataclass(frozen=True)
class _Columns:
    """Device tensors locating a group of routers' counters in a buffer row (cached per group)."""

    routers: int  # R
    offsets: torch.Tensor  # [1, R, B or 1, 1, 1] first counter column of each router (in each row's line)
    first: torch.Tensor  # 0-d zero: the lowest slot, as a tensor so that one clamp takes both bounds
    last: torch.Tensor  # [1, R, 1, 1, 1] highest slot (num_slots - 1)
    top_k: torch.Tensor  # [1, R, 1, 1, 1]
    dropped: torch.Tensor  # [1, R, B or 1, 1, 1] column of each router's dropped-picks counter
    companions: torch.Tensor  # [3, R, B or 1] columns of tokens, choice and local selections


def _usable_mask(mask: Any, batch: int, seq: int) -> torch.Tensor | None:
    """The indexer's ``[B or 1, S, keys]`` mask, or ``None`` when it has another form (then not consulted)."""
    if (isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[1] == seq
            and mask.shape[0] in (1, batch)):
        return mask
    return None


def _tokens_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``[batch, seq, ...]`` tensor a model forward was called with (ids or embeddings); None if none."""
    tokens_input = kwargs.get("input_ids")
    if tokens_input is None and args:
        tokens_input = args[0]
    if tokens_input is None:
        tokens_input = kwargs.get("inputs_embeds")
    return tokens_input if isinstance(tokens_input, torch.Tensor) and tokens_input.dim() >= 2 else None


def _call_argument(where: tuple[str, int] | None, args: tuple, kwargs: dict) -> Any:
    if where is None:
        return None
    name, position = where
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def attach(
    model: nn.Module,
    *,
    registry: RouterRegistry | None = None,
    ignore: Sequence[str] = (),
    window_tokens: int | None = 4096,
    window_seconds: float | None = None,
    max_indexer_slots: int | None = 8192,
    max_business_lines: int = 16,
    flush_every: int = 128,
    clock: Callable[[], float] = time.monotonic,
    agent_url: str | None = None,
    agent_token: str | None = None,
    agent_source: str | None = None,
    ship_interval: float = 5.0,
) -> Probe:
    """Watch every router of ``model`` and count what it selects.

    ``window_tokens`` / ``window_seconds`` bound the rolling window that :meth:`Probe.stats`
    reads (``None`` for no bound). Indexer counters cover key positions up to
    ``max_indexer_slots`` (or the model's context length, when smaller).

    The counters are allocated once for ``max_business_lines`` lines (``default`` included)
    plus one ``overflow`` line, which counts every line that arrives after the first
    ``max_business_lines`` (with one warning): the buffer's address never changes, which is
    what compiled models and CUDA graphs need. Eager decode steps are counted ``flush_every``
    passes at a time (and whenever anything reads the counts).

    With ``agent_url`` (a running sidecar's base URL) the probe keeps no windows of its own:
    every ``ship_interval`` seconds it ships its counts to the sidecar's ingestion endpoint,
    authenticated with ``agent_token`` (default: ``$MLA_WATCH_ADMIN_TOKEN``).
    """
    return Probe(
        model,
        registry=registry,
        ignore=ignore,
        window_tokens=window_tokens,
        window_seconds=window_seconds,
        max_indexer_slots=max_indexer_slots,
        max_business_lines=max_business_lines,
        flush_every=flush_every,
        clock=clock,
        agent_url=agent_url,
        agent_token=agent_token,
        agent_source=agent_source,
        ship_interval=ship_interval,
    )
