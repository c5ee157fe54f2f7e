"""Counting under ``torch.compile`` and in captured CUDA graphs.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) every router counts in the graph itself,
with in-place ``scatter_add_`` into the static buffer: no references outlive a pass, which CUDA graphs
would overwrite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mla_watch.probe.count_kernels import CountingKernels, usable_mask
from mla_watch.probe.wrappers import CountedRouter, call_argument, tokens_argument

__all__ = ["CompiledCounting"]


class CompiledCounting(CountingKernels):
    """The probe's traced passes (a base of :class:`~mla_watch.probe.Probe`, which sets this state)."""

    _row_lines: torch.Tensor  # [MAX_ATTRIBUTED_ROWS] line per batch row, written in place by attribute()
    _attributed_rows: int  # rows of _row_lines the attribution uses
    _graph_pass: tuple[int, int, torch.Tensor, torch.Tensor | None] | None  # batch, seq, row bases, valid tokens

    # Under torch.compile the counting is traced into the graph: every pass scatters into the
    # static buffer at once, and the attribution is read from the in-place tensor, so a CUDA
    # graph replay counts the right lines without the host. No cache is written while tracing.
    def _graph_model_call(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        tokens_input = tokens_argument(args, kwargs)
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

    def _graph_router_call(self, router: CountedRouter, output: Any, args: tuple, kwargs: dict) -> None:
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
        mask = usable_mask(call_argument(router.spec.mask_argument, args, kwargs), indices.shape[0], indices.shape[1])
        if attributed is not None and tuple(indices.shape[:2]) == (attributed[0], attributed[1]):
            batch, seq, row_base, valid = attributed
        else:
            batch, seq, row_base, valid = int(indices.shape[0]), int(indices.shape[1]), None, None
        self._count_indexers(
            self._router_columns([router]),
            [indices],
            [int(indices.shape[-1])],
            None if mask is None else [mask],
            1,
            batch,
            seq,
            row_base,
            valid,
        )
