"""Eager passes wait, and are counted together at a flush.

In eager mode a watched router only keeps a reference to its output (and an indexer, to its mask):
inside a forward pass the probe's Python runs between the model's ops with cold caches, where each
line costs several times what it costs in a loop. Passes wait, ``flush_every`` at a time, and are
counted together at the flush: the picks are read then, and consecutive passes of one layout (batch,
sequence length, attribution, index shapes) are counted in a few batched tensor ops. The 2-D attention
mask that marks padding is read then too; its version counter shows a caller that changed it in place
before (a warning: call :meth:`Probe.count_pending` first). Every reader (:meth:`Probe.collect`, hence
``stats``/``counts``/baselines/shipping) counts what is pending first, so no reader ever sees stale
counts. Passes of more than 256 tokens are counted at their end.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, cast

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from mla_watch.probe.count_kernels import CountingKernels, usable_mask
from mla_watch.probe.position_counting import PADDING_READ, PositionCounting, start_positions
from mla_watch.probe.wrappers import CountedRouter, tokens_argument

__all__ = ["EagerDeferral", "WatchedPass"]

# Passes of at most this many tokens (decode steps) wait to be counted together; a bigger pass
# pays for its own counting many times over, and holding its outputs would hold real memory.
_DEFER_MAX_TOKENS = 256
_PADDING_READ = PADDING_READ  # a pass's attention is already the padding it marks (inference tensors have no version)
_DEFER_MAX_MASK_ELEMENTS = 1 << 22  # indexer masks the pending passes may keep alive (16 MiB of float32)


class WatchedPass:
    """One forward pass of the watched model: its attribution and the router outputs it produced.

    Built on every forward pass, so it starts with the least: the wrappers append ``(router, picks,
    mask)`` to ``outputs``; they are sorted into the other lists at the flush (:meth:`Probe._resolve`).
    """

    __slots__ = (
        "attention",
        "attention_version",
        "batch",
        "expert_routers",
        "expert_shapes",
        "experts",
        "indexer_routers",
        "indexer_shapes",
        "indexers",
        "key",
        "last_mask",
        "lines",
        "mask_elements",
        "mask_slots",
        "masks",
        "outputs",
        "placed",
        "positions",
        "seq",
        "tokens",
        "usable_masks",
    )

    def __init__(
        self, batch: int, seq: int, lines: tuple[int, ...], attention: torch.Tensor | None, attention_version: int
    ) -> None:
        self.batch = batch
        self.seq = seq
        self.tokens = batch * seq
        self.lines = lines  # line per row (one line, one per row, or a divisor of the batch)
        # The [batch, >= seq] attention mask (0: padding), or with _PADDING_READ its [batch, seq] != 0 already;
        # None: every token counts.
        self.attention = attention
        self.attention_version = attention_version
        self.outputs: list[tuple[CountedRouter, torch.Tensor, Any]] = []  # (router, picks, mask argument) in call order
        self.last_mask: Any = None
        self.mask_elements = 0  # elements of the distinct indexer masks this pass keeps alive (a memory bound)
        self.key: tuple | None = None  # the layout, once the picks are read
        # First position, or [B or 1, S] positions (counting positions); None: not known (a router called alone)
        self.positions: int | torch.Tensor | None = 0
        self.placed: tuple[tuple[int, int], ...] = ()  # per attributed row: its per-position row and prompt length

    def clear_picks(self) -> None:
        self.experts: list[torch.Tensor] = []
        self.expert_routers: list[CountedRouter] = []
        self.expert_shapes: list[torch.Size] = []
        self.indexers: list[torch.Tensor] = []
        self.indexer_routers: list[CountedRouter] = []
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
                usable = usable_mask(mask, batch, seq)
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
            self.placed,
            self.attention is None,
            tuple(self.expert_routers),
            tuple(self.expert_shapes),
            tuple(self.indexer_routers),
            tuple(shape[:-1] for shape in self.indexer_shapes),
            tuple(self.mask_slots),
            tuple(mask_layout),
        )


class EagerDeferral(CountingKernels, PositionCounting):
    """The probe's eager passes: begun and ended around the model's forward, kept, and counted at a flush
    (a base of :class:`~mla_watch.probe.Probe`, which sets this state)."""

    _attribution: tuple[int, ...]  # line per batch row, as attribute() set it
    _position_attribution: tuple[tuple[int, int], ...]  # per batch row: per-position row and prompt length
    _flush_every: int
    _pending: list[WatchedPass]  # passes waiting to be counted
    _pending_mask_elements: int  # indexer mask elements the pending passes keep alive
    _pending_lock: threading.Lock
    _mask_warned: bool  # the warning about a mask changed in place was given
    _recording: threading.local  # per thread: the RoutingRecording of record_routing(), if any

    def _begin(self, args: tuple, kwargs: dict) -> WatchedPass | None:
        tokens_input = tokens_argument(args, kwargs)
        if tokens_input is None:
            return None
        started = self._started(tokens_input, kwargs)
        if started is not None and self._position_buffer is not None:
            started.positions = start_positions(kwargs, started.seq)
            started.placed = self._position_attribution
        return started

    def _started(self, tokens_input: torch.Tensor, kwargs: dict) -> WatchedPass | None:
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
                return WatchedPass(batch, seq, lines, mask[:, -seq:] != 0, _PADDING_READ)
            # Read when the pass is counted (one op for many passes, not two per pass); its version
            # counter says whether the caller changed it in place before then.
            return WatchedPass(batch, seq, lines, mask, mask._version)
        return WatchedPass(batch, seq, lines, None, 0)

    def _end(self, current: WatchedPass) -> None:
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
        groups: dict[tuple, list[WatchedPass]] = {}
        for item in passes:
            groups.setdefault(self._resolve(item), []).append(item)
        for group in groups.values():
            self._count_group(group)

    def _resolve(self, item: WatchedPass) -> tuple:
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

    def _count_group(self, passes: list[WatchedPass]) -> None:
        for item in passes:
            self._resolve(item)
        if passes[0].experts or passes[0].indexers:
            self._count_passes(passes)

    def _count_alone(self, router: CountedRouter, indices: torch.Tensor, mask: Any) -> None:
        """A router output that is not part of a watched pass: its pass is its own, on the default line.
        The caller holds the pending lock."""
        if router.expert:
            single = WatchedPass(1, indices.numel() // indices.shape[-1], (0,), None, 0)
        else:
            batch, seq = (
                (1, int(indices.shape[0])) if indices.dim() == 2 else (int(indices.shape[0]), int(indices.shape[1]))
            )
            single = WatchedPass(batch, seq, (0,), None, 0)
        single.positions = None  # no forward pass said where its tokens sit
        single.outputs.append((router, indices, mask))  # fits its own pass by construction
        self._count_group([single])

    def _count_passes(self, passes: list[WatchedPass]) -> None:
        """Count passes of one layout together: every router group's picks of all of them in one kernel call."""
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
            if self._position_buffer is not None and first.positions is not None:
                self._count_positions(routers, chosen, passes, batch, seq, first.placed, valid)
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

    def _valid(self, passes: list[WatchedPass]) -> torch.Tensor:
        """Which tokens of each pass are real, ``[passes, B, S]``: the last ``S`` columns of its 2-D attention
        mask are non-zero. Masks grow by a column per decode step, so a group's masks are flattened and the
        wanted columns taken at offsets computed on the host."""
        masks = cast(list[torch.Tensor], [item.attention for item in passes])  # one layout: every pass has its mask
        if not self._mask_warned and any(
            item.attention_version != _PADDING_READ and mask._version != item.attention_version
            for item, mask in zip(passes, masks, strict=True)
        ):
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
            return torch.stack(
                [
                    mask if item.attention_version == _PADDING_READ else mask[:, -seq:] != 0
                    for item, mask in zip(passes, masks, strict=True)
                ]
            )
        if len(passes) == 1:
            return (masks[0][:, -seq:] != 0).unsqueeze(0)
        blocks = batch * np.asarray([mask.shape[1] for mask in masks], dtype=np.int64)
        starts = (np.cumsum(blocks) - blocks)[:, None, None]
        lengths = blocks[:, None, None] // batch
        columns = starts + np.arange(batch)[None, :, None] * lengths + lengths - seq + np.arange(seq)[None, None, :]
        flat = _flatten_dense_tensors(masks)
        index = torch.from_numpy(columns.reshape(-1))
        return (
            flat.take(index if self._device.type == "cpu" else index.to(self._device)).view(len(passes), batch, seq)
            != 0
        )
