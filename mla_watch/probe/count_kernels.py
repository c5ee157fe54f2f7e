"""The counter buffer's column layout, and the batched kernels that count router picks into it.

Every router owns a column range of the probe's one preallocated ``int64`` buffer (one row per
business line): ``num_slots`` selection counters followed by four companions (tokens, selections
made by queries that had a choice, the local ones among those, and picks outside ``[0, num_slots)``
that were dropped). The kernels turn picks into flat offsets in that buffer and ``scatter_add_``
them, with nothing that waits for the host; eager flushes (:mod:`mla_watch.probe.deferral`) and
compiled graphs (:mod:`mla_watch.probe.graph_counting`) both count through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors
from torch.nn import functional as F

from mla_watch.probe.wrappers import CountedRouter

__all__ = [
    "CHOICE_COLUMN",
    "COMPANION_COLUMNS",
    "DROPPED_COLUMN",
    "LOCAL_COLUMN",
    "TOKENS_COLUMN",
    "CountingKernels",
    "usable_mask",
]

COMPANION_COLUMNS = 4  # tokens, choice selections, local selections, dropped picks
TOKENS_COLUMN, CHOICE_COLUMN, LOCAL_COLUMN, DROPPED_COLUMN = 0, 1, 2, 3


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


def usable_mask(mask: Any, batch: int, seq: int) -> torch.Tensor | None:
    """The indexer's ``[B or 1, S, keys]`` mask, or ``None`` when it has another form (then not consulted)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[1] == seq and mask.shape[0] in (1, batch):
        return mask
    return None


# On a CPU a tensor op costs microseconds of dispatch whatever its size, so the passes that
# wait together are counted in a fixed number of ops: one stack (experts) or one flatten
# (indexers, whose pick counts differ) of every router's choices, range checks as one clamp
# and one comparison, one scatter_add_ for the picks and one for the companions.
class CountingKernels:
    """The probe's counting into its buffer (a base of :class:`~mla_watch.probe.Probe`, which sets this state)."""

    _buffer: torch.Tensor  # [max_business_lines + 1, width], allocated once
    _width: int  # columns of one line's row
    _device: torch.device
    _one: torch.Tensor  # [1] int64 one, expanded into scatter weights
    _constants: dict[Any, Any]  # cached device constants (columns, ...), keyed by what they depend on

    def _cache(self, key: Any, value: Any) -> None:
        if len(self._constants) > 256:  # shapes and attributions come and go; keep the cache bounded
            self._constants.clear()
        self._constants[key] = value

    def _router_columns(
        self, routers: Sequence[CountedRouter], lines: tuple[int, ...] | None = None, batch: int = 1
    ) -> _Columns:
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
            companions = [
                [
                    [column + slot + kind for column in router_rows]
                    for router_rows, slot in zip(placed, slots, strict=True)
                ]
                for kind in range(LOCAL_COLUMN + 1)
            ]  # [3, R, rows]
            columns = _Columns(
                routers=routers_count,
                offsets=tensor(placed, 1, routers_count, placed_rows, 1, 1),
                first=torch.zeros((), dtype=torch.int64, device=self._device),
                last=tensor([slot - 1 for slot in slots], 1, routers_count, 1, 1, 1),
                top_k=tensor([router.info.top_k for router in routers], 1, routers_count, 1, 1, 1),
                dropped=tensor(
                    [
                        [column + slot + DROPPED_COLUMN for column in router_rows]
                        for router_rows, slot in zip(placed, slots, strict=True)
                    ],
                    1,
                    routers_count,
                    placed_rows,
                    1,
                    1,
                ),
                companions=tensor(companions, LOCAL_COLUMN + 1, routers_count, placed_rows),
            )
            if not torch.compiler.is_compiling():
                self._cache(key, columns)
        return columns

    def _mask_constants(
        self, keys: list[int], rows: int, seq: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
            return tuple(
                torch.tensor(value, dtype=torch.int64, device=self._device).view(shape)  # type: ignore[return-value]
                for value, shape in zip(values, shapes, strict=True)
            )
        array = np.asarray(keys, dtype=np.int64)
        blocks = rows * seq * array
        starts = ((np.cumsum(blocks) - blocks)[:, None] + np.arange(rows * seq)[None, :] * array[:, None]).ravel()
        parts = [
            array - 1,
            starts,
            np.concatenate([starts, starts + np.repeat(array, rows * seq)]),
            (array[:, None] - seq + np.arange(seq)[None, :]).ravel(),
        ]
        if self._device.type == "cpu":
            return tuple(
                torch.from_numpy(part.reshape(shape))  # type: ignore[return-value]
                for part, shape in zip(parts, shapes, strict=True)
            )
        sizes = [part.size for part in parts]
        together = torch.from_numpy(np.concatenate(parts)).to(self._device)
        return tuple(piece.view(shape) for piece, shape in zip(together.split(sizes), shapes, strict=True))

    def _count_experts(
        self,
        columns: _Columns,
        chosen: list[torch.Tensor],
        count: int,
        batch: int,
        seq: int,
        row_base: torch.Tensor | None,
        valid: torch.Tensor | None,
    ) -> None:
        """Count ``chosen`` (pass-major: ``count`` passes x the routers of ``columns``) into the buffer; ``row_base``
        (compiled passes) is each row's line offset when ``columns`` are not placed in the rows' lines."""
        picks = (torch.stack(chosen) if len(chosen) > 1 else chosen[0].unsqueeze(0)).reshape(
            count, columns.routers, batch, seq, -1
        )
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

    def _count_indexers(
        self,
        columns: _Columns,
        chosen: list[torch.Tensor],
        widths: Sequence[int],
        masks: list[torch.Tensor] | None,
        count: int,
        batch: int,
        seq: int,
        row_base: torch.Tensor | None,
        valid: torch.Tensor | None,
    ) -> None:
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
                torch.from_numpy(keep).to(self._device), picks
            )
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
            last_key, firsts, bounds, positions = self._mask_constants(
                [int(mask.shape[-1]) for mask in masks], rows, seq
            )
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
        tokens = (
            valid.sum((0, 2))
            if valid is not None
            else torch.full((batch,), count * seq, dtype=torch.int64, device=self._device)
        )
        tokens = tokens.view(1, 1, batch).expand(1, routers_count, batch)
        index = columns.companions  # [tokens, choice, local] x R x (B or 1)
        if choices is None:
            values, index = tokens, index[TOKENS_COLUMN : TOKENS_COLUMN + 1]
        else:
            values = torch.cat([tokens, choices])
        index = index + row_base.view(1, 1, batch) if row_base is not None else index.expand(-1, routers_count, batch)
        flat.scatter_add_(0, index.reshape(-1), values.reshape(-1))
