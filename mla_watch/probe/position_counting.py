"""Counting expert picks per position bucket on the model's device (``attach(model, count_positions=True)``).

A second preallocated ``int64`` buffer holds, per business line row, ``buckets x num_slots`` counters for each
expert router. A token's position is its index in its sequence: ``position_ids`` when the forward pass was given
them; else the running sum of the 2-D attention mask (left padding is not a position); else the cache's length
(``cache_position``, or the KV cache's ``get_seq_length()``) plus the token's index in the pass. An inference-mode
mask (read at once, not kept) gives the pass's first position only: its length less the pass's, padding included.
Eager passes only: compiled graphs, router calls outside a watched forward pass and router outputs that do not fit
their pass's shape are counted in the windows, not by position.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mla_watch.probe.wrappers import CountedRouter
from mla_watch.routing.client_names import UNKNOWN
from mla_watch.routing.positions import UNJUDGED, PositionCounts

__all__ = ["DEFAULT_POSITION_ROWS", "PADDING_READ", "PositionCounting", "start_positions"]

_CACHE_KEYWORDS = ("cache", "past_key_values")
PADDING_READ = -1  # a pass's attention is already the padding it marks (inference tensors have no version)
# Device rows of the per-position counters: one per (business line, client) that sent long prompts since its row was
# last freed. Past them a pair is not counted by position (the windows count it), with one warning.
DEFAULT_POSITION_ROWS = 64
_EVERY_POSITION = 1 << 62  # a row's limit when no prompt length was given: every token counts


def start_positions(kwargs: dict, seq: int) -> int | torch.Tensor:
    """What a forward pass says about its tokens' positions, read without waiting for the device: a ``[B or 1,
    S]`` tensor of positions, or the first position (an int) - the 2-D attention mask is read at the count."""
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() in (1, 2) and position_ids.shape[-1] == seq:
        return position_ids.view(-1, seq)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= seq:
        return int(mask.shape[1]) - seq  # its running sum, at the count, also skips left padding
    cache_position = kwargs.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.dim() == 1 and cache_position.shape[0] == seq:
        return cache_position.view(1, seq)
    for keyword in _CACHE_KEYWORDS:
        cache = kwargs.get(keyword)
        length = getattr(cache, "get_seq_length", None)
        if callable(length):
            try:
                return int(length())
            except Exception:  # a cache of another shape: its length is not known here
                break
    return 0


class PositionCounting:
    """Per-position counters of the expert routers (a base of :class:`~mla_watch.probe.Probe`)."""

    _device: torch.device
    _routers: list[CountedRouter]
    _lines: dict[str, int]
    positions: PositionCounts | None

    def _init_positions(self, rows: int, context_length: int | None, clock: Callable[[], float]) -> None:
        self.positions = None
        self._position_buffer: torch.Tensor | None = None
        # (device row, last counted position + 1) per attributed batch row; () while positions are not counted
        self._position_attribution: tuple[tuple[int, int], ...] = ()
        self._position_rows: dict[tuple[int, str], int] = {}  # (line row, client) -> device row
        self._position_rows_warned = False
        if context_length is None:
            return
        rows = max(DEFAULT_POSITION_ROWS, 2 * rows)  # at least a line's short prompts and one client per line
        experts = [router for router in self._routers if router.expert]
        self.positions = PositionCounts([router.info for router in experts], context_length, clock=clock)
        buckets = len(self.positions.buckets)
        self._position_offsets: dict[int, int] = {}
        width = 0
        for router in experts:
            self._position_offsets[router.index] = width
            width += buckets * router.info.num_slots
        self._position_width = width
        self._position_buffer = torch.zeros((rows, width), dtype=torch.int64, device=self._device)
        self._position_edges = torch.tensor(self.positions.buckets.edges, dtype=torch.int64, device=self._device)
        self._position_read = np.zeros((rows, width), dtype=np.int64)

    @property
    def position_bytes(self) -> int:
        """Device memory held by the per-position counters (0 when positions are not counted)."""
        buffer = self._position_buffer
        return 0 if buffer is None else buffer.numel() * buffer.element_size()

    def _position_attribution_of(
        self,
        names: Sequence[str],
        line_rows: Sequence[int],
        clients: str | Sequence[str] | None,
        prompt_tokens: int | Sequence[int] | None,
    ) -> tuple[tuple[int, int], ...]:
        """attribute()'s rows as the per-position counters take them: each row's device row (-1: not counted by
        position) and the positions it counts (its prompt's, where given); the prompts given are recorded."""
        positions = self.positions
        if positions is None or self._position_buffer is None:
            return ()
        count = len(names)
        who = [clients] * count if clients is None or isinstance(clients, str) else list(clients)
        lengths = (
            [prompt_tokens] * count if prompt_tokens is None or isinstance(prompt_tokens, int) else list(prompt_tokens)
        )
        if len(who) != count or len(lengths) != count:
            raise ValueError(
                f"attribute(): {len(who)} clients and {len(lengths)} prompt lengths for {count} business "
                "lines; expected one value, or one per line"
            )
        placed = []
        for name, line_row, client, length in zip(names, line_rows, who, lengths, strict=True):
            if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 0):
                raise ValueError(f"attribute(): prompt_tokens={length!r}: expected an integer >= 0")
            if length is None:
                key, limit = client or UNKNOWN, _EVERY_POSITION
            else:
                key, limit = positions.client_key(name, client, length), length
                positions.add_prompt(name, length)
            placed.append((self._position_row(line_row, key), limit))
        return tuple(placed)

    def _position_row(self, line_row: int, key: str) -> int:
        """The device row of (line, client), taken from the free rows on first use; -1 once none is free."""
        found = self._position_rows.get((line_row, key))
        if found is not None:
            return found
        taken = set(self._position_rows.values())
        free = next((row for row in range(self._position_buffer.shape[0]) if row not in taken), None)  # type: ignore[union-attr]
        if free is None:
            if not self._position_rows_warned:
                warnings.warn(
                    f"mla_watch probe: every one of the {len(taken)} rows counting routing by position is "
                    "taken by a (business line, client) pair that sent long prompts; later pairs are not "
                    "counted by position until a client's counts decay away",
                    RuntimeWarning,
                    stacklevel=5,
                )
                self._position_rows_warned = True
            return -1
        self._position_rows[(line_row, key)] = free
        return free

    def _pass_positions(self, passes: list[Any], batch: int, seq: int) -> torch.Tensor:
        """Each token's position, ``[passes, B, S]``."""
        steps = torch.arange(seq, dtype=torch.int64, device=self._device)
        rows = []
        for item in passes:
            given = item.positions
            if isinstance(given, torch.Tensor):
                rows.append(given.to(self._device, torch.int64).expand(batch, seq))
            elif item.attention is not None and item.attention_version != PADDING_READ:
                running = (item.attention != 0).to(torch.int64).cumsum(-1)[:, -seq:] - 1
                rows.append(running.clamp(min=0))
            else:
                rows.append((steps + int(given)).view(1, seq).expand(batch, seq))
        return torch.stack(rows)

    def _count_positions(
        self,
        routers: list[CountedRouter],
        chosen: list[torch.Tensor],
        passes: list[Any],
        batch: int,
        seq: int,
        placed: tuple[tuple[int, int], ...],
        valid: torch.Tensor | None,
    ) -> None:
        """Count the picks of ``routers`` (``chosen``: pass-major) into the per-position counters: each batch row
        into its (line, client) row, its prompt's positions only."""
        buffer = self._position_buffer
        if buffer is None or not placed:
            return
        count, routers_count = len(passes), len(routers)
        picks = (torch.stack(chosen) if len(chosen) > 1 else chosen[0].unsqueeze(0)).reshape(
            count, routers_count, batch, seq, -1
        )
        positions = self._pass_positions(passes, batch, seq)  # [passes, B, S]
        bucket = torch.bucketize(positions, self._position_edges, right=True)
        slots = torch.tensor(
            [router.info.num_slots for router in routers], dtype=torch.int64, device=self._device
        ).view(1, routers_count, 1, 1, 1)
        offsets = torch.tensor(
            [self._position_offsets[router.index] for router in routers], dtype=torch.int64, device=self._device
        ).view(1, routers_count, 1, 1, 1)
        per_row = [entry for entry in placed for _ in range(batch // len(placed))]
        rows = torch.tensor([row for row, _ in per_row], dtype=torch.int64, device=self._device)
        limits = torch.tensor([limit for _, limit in per_row], dtype=torch.int64, device=self._device)
        counted = (rows.view(1, batch, 1) >= 0) & (positions < limits.view(1, batch, 1))  # [passes, B, S]
        inside = (picks >= 0) & (picks < slots) & counted.view(count, 1, batch, seq, 1)
        index = (
            rows.clamp(min=0).view(1, 1, batch, 1, 1) * self._position_width
            + offsets
            + bucket.view(count, 1, batch, seq, 1) * slots
            + picks.clamp(min=0) % slots
        )
        weight = inside
        if valid is not None:
            weight = weight & valid.view(count, 1, batch, seq, 1)
        buffer.view(-1).scatter_add_(0, index.reshape(-1), weight.reshape(-1).to(torch.int64))

    def _collect_positions(self, lines: dict[str, int]) -> None:
        """Move what the per-position counters counted since the last call into :attr:`positions` (host lock held)."""
        if self._position_buffer is None or self.positions is None:
            return
        current = self._position_buffer.to("cpu", copy=True).numpy()
        delta = current - self._position_read
        self._position_read = current
        buckets = len(self.positions.buckets)
        names = {row: line for line, row in lines.items()}
        attributed = {row for row, _ in self._position_attribution}
        for (line_row, key), row in list(self._position_rows.items()):
            line = names.get(line_row)
            if not delta[row].any():
                # A client whose counts decayed away gave its place up: its row is free again (not while attributed).
                if (
                    line is not None
                    and key not in UNJUDGED
                    and row not in attributed
                    and not self.positions.holds(line, key)
                ):
                    del self._position_rows[(line_row, key)]
                continue
            if line is None:
                continue
            for router in self._routers:
                start = self._position_offsets.get(router.index)
                if start is None:
                    continue
                size = buckets * router.info.num_slots
                self.positions.add(
                    router.info.name,
                    line,
                    delta[row, start : start + size].reshape(buckets, router.info.num_slots),
                    client=key,
                )

    def _reset_positions(self) -> None:
        if self._position_buffer is not None and self.positions is not None:
            self._position_buffer.zero_()
            self._position_read = np.zeros_like(self._position_read)
            self._position_rows.clear()
            self.positions.reset()
