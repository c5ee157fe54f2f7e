"""Forward hooks that count router selections on the model's device.

Every router owns a column range of one preallocated ``int64`` buffer of shape
``[line_capacity, width]``: ``num_slots`` selection counters followed by three companions
(tokens, selections made by queries that had a choice, and the local ones among those).
A hook turns the router's output into flat indices ``line * width + offset + slot`` and
``scatter_add_``s into the buffer, so a forward pass never waits for the host: no
``.item()``, ``.cpu()`` or ``.tolist()`` runs inside a hook. The host reads the buffer
with one copy when statistics are asked for, and pushes the difference since the previous
read into rolling windows (:class:`mla_watch.windows.RouterWindows`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mla_watch.probe.agent import Shipper
from mla_watch.probe.discovery import RouterInfo, RouterRegistry, RouterSpec, discover_routers
from mla_watch.windows import RouterWindows

__all__ = ["DEFAULT_LINE", "Probe", "attach"]

DEFAULT_LINE = "default"
_COMPANIONS = 3  # tokens, choice selections, local selections
_TOKENS, _CHOICE, _LOCAL = 0, 1, 2


@dataclass
class _Forward:
    """Attribution of the tokens of the forward pass in progress."""

    tokens: int
    lines: torch.Tensor  # [tokens] line index per token
    valid: torch.Tensor  # [tokens] int64, 0 for padding


class _Router:
    def __init__(self, info: RouterInfo, spec: RouterSpec, offset: int) -> None:
        self.info = info
        self.spec = spec
        self.offset = offset
        self.handle: torch.utils.hooks.RemovableHandle | None = None


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
        line_capacity: int = 8,
        clock: Callable[[], float] = time.monotonic,
        agent_url: str | None = None,
        agent_token: str | None = None,
        agent_source: str | None = None,
        ship_interval: float = 5.0,
    ) -> None:
        self.model = model
        self._routers: list[_Router] = []
        width = 0
        for module, info, spec in discover_routers(
            model, registry=registry, ignore=ignore, max_indexer_slots=max_indexer_slots
        ):
            router = _Router(info, spec, width)
            width += info.num_slots + _COMPANIONS
            router.handle = module.register_forward_hook(self._make_hook(router), with_kwargs=True)
            self._routers.append(router)
        self._width = width
        self._device = _device_of(model)
        self._buffer = torch.zeros((max(1, line_capacity), width), dtype=torch.int64, device=self._device)
        self._lines: dict[str, int] = {DEFAULT_LINE: 0}
        self._row_lines: torch.Tensor | None = None
        self._forward: _Forward | None = None
        self._pre_handle = model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
        self._post_handle = model.register_forward_hook(self._end_forward)
        self._host_lock = threading.Lock()
        self._last_read = np.zeros((self._buffer.shape[0], width), dtype=np.int64)
        self.windows = RouterWindows(self.routers, window_tokens=window_tokens, window_seconds=window_seconds,
                                     clock=clock)
        self.shipper: Shipper | None = None
        self._sink = self.windows.add
        if agent_url is not None:
            self.shipper = Shipper(agent_url, self.routers, token=agent_token, source=agent_source)
            self._sink = self.shipper.add
            self.shipper.start(self.collect, ship_interval)
        self._attached = True

    # ------------------------------------------------------------------ public API
    @property
    def routers(self) -> list[RouterInfo]:
        return [router.info for router in self._routers]

    @property
    def business_lines(self) -> list[str]:
        return list(self._lines)

    @property
    def counter_bytes(self) -> int:
        """Device memory held by the counters."""
        return self._buffer.numel() * self._buffer.element_size()

    def window_bytes(self) -> int:
        """Host memory held by the rolling windows (running sums plus buckets)."""
        return self.windows.nbytes

    @contextmanager
    def attribute(self, business_lines: str | Sequence[str]) -> Iterator[None]:
        """Attribute the forward passes inside the block to business lines.

        One name attributes every sequence; a list names the line of each row of the batch
        (a batch expanded by ``num_return_sequences`` repeats each row's line).
        """
        names = [business_lines] if isinstance(business_lines, str) else list(business_lines)
        if not names:
            raise ValueError("attribute(): business_lines is empty; expected a name or one per batch row")
        ids = [self._line_id(name) for name in names]
        previous = self._row_lines
        self._row_lines = torch.tensor(ids, dtype=torch.int64, device=self._device)
        try:
            yield
        finally:
            self._row_lines = previous

    def stats(self, business_line: str | None = None) -> list[dict[str, Any]]:
        """One record per router for the current window (all lines summed when ``None``)."""
        self.collect()
        return self.windows.stats(business_line)

    def counts(self, business_line: str | None = None) -> dict[str, np.ndarray]:
        """The selection counts of each router over the current window."""
        self.collect()
        return self.windows.counts(business_line)

    def collect(self) -> None:
        """Move what the device counted since the last call into the rolling windows."""
        with self._host_lock:
            current = self._buffer.to("cpu", copy=True).numpy()  # the one host synchronisation
            rows = current.shape[0]
            if self._last_read.shape[0] < rows:
                grown = np.zeros_like(current)
                grown[: self._last_read.shape[0]] = self._last_read
                self._last_read = grown
            delta = current - self._last_read[:rows]
            self._last_read = current
            for line, row in self._lines.items():
                if not delta[row].any():
                    continue
                for router in self._routers:
                    start = router.offset
                    slots = delta[row, start : start + router.info.num_slots]
                    companions = delta[row, start + router.info.num_slots : start + router.info.num_slots + 3]
                    self._sink(
                        router.info.name,
                        line,
                        slots,
                        int(companions[_TOKENS]),
                        local_selections=int(companions[_LOCAL]),
                        choice_selections=int(companions[_CHOICE]),
                    )

    def reset(self) -> None:
        """Forget every count (device counters and windows)."""
        with self._host_lock:
            self._buffer.zero_()
            self._last_read = np.zeros((self._buffer.shape[0], self._width), dtype=np.int64)
            self.windows.reset()

    def flush(self) -> bool:
        """With ``agent_url``: collect and ship now; ``True`` once the sidecar has everything."""
        self.collect()
        return self.shipper.flush() if self.shipper is not None else True

    def detach(self) -> None:
        """Remove every hook; the model computes exactly as it did before :func:`attach`.

        With ``agent_url``, the counts not yet shipped are shipped first.
        """
        if self.shipper is not None:
            self.shipper.stop()
            self.flush()
        for router in self._routers:
            if router.handle is not None:
                router.handle.remove()
                router.handle = None
        self._pre_handle.remove()
        self._post_handle.remove()
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
        if name not in self._lines:
            with self._host_lock:
                if len(self._lines) == self._buffer.shape[0]:
                    grown = torch.zeros(
                        (2 * self._buffer.shape[0], self._width), dtype=torch.int64, device=self._device
                    )
                    grown[: self._buffer.shape[0]] = self._buffer
                    self._buffer = grown
                self._lines[name] = len(self._lines)
        return self._lines[name]

    # ------------------------------------------------------------------ hooks (device side)
    def _begin_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens_input = kwargs.get("input_ids")
        if tokens_input is None and args:
            tokens_input = args[0]
        if tokens_input is None:
            tokens_input = kwargs.get("inputs_embeds")
        if not isinstance(tokens_input, torch.Tensor) or tokens_input.dim() < 2:
            self._forward = None
            return
        batch, seq = int(tokens_input.shape[0]), int(tokens_input.shape[1])
        device = self._device
        row_lines = self._row_lines
        if row_lines is None:
            lines = torch.zeros(batch, dtype=torch.int64, device=device)
        elif row_lines.numel() == batch:
            lines = row_lines
        elif row_lines.numel() == 1 or batch % row_lines.numel() == 0:
            lines = row_lines.repeat_interleave(batch // row_lines.numel())
        else:
            raise ValueError(
                f"mla_watch probe: {row_lines.numel()} business lines were given for a batch of "
                f"{batch} rows; expected one line, one per row, or a divisor of the batch size"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch:
            valid = (mask[:, -seq:] != 0).to(torch.int64)
        else:
            valid = torch.ones((batch, seq), dtype=torch.int64, device=device)
        self._forward = _Forward(
            tokens=batch * seq,
            lines=lines.repeat_interleave(seq),
            valid=valid.reshape(-1),
        )

    def _end_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._forward = None

    def _make_hook(self, router: _Router) -> Callable[..., None]:
        count = self._count_expert if router.info.kind == "expert" else self._count_indexer

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            count(router, router.spec.indices(output), args, kwargs)

        return hook

    def _attribution(self, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        forward = self._forward
        if forward is not None and forward.tokens == tokens:
            return forward.lines, forward.valid
        zeros = torch.zeros(tokens, dtype=torch.int64, device=device)
        return zeros, torch.ones(tokens, dtype=torch.int64, device=device)

    def _count_expert(self, router: _Router, indices: torch.Tensor, args: tuple, kwargs: dict) -> None:
        num_slots, top_k = router.info.num_slots, indices.shape[-1]
        chosen = indices.detach().reshape(-1, top_k).to(torch.int64)
        lines, valid = self._attribution(chosen.shape[0], chosen.device)
        in_range = (chosen >= 0) & (chosen < num_slots)
        weight = valid.unsqueeze(1) * in_range
        base = lines * self._width + router.offset
        flat = self._buffer.view(-1)
        flat.scatter_add_(0, (base.unsqueeze(1) + chosen.clamp(0, num_slots - 1)).reshape(-1), weight.reshape(-1))
        flat.scatter_add_(0, base + num_slots + _TOKENS, valid)

    def _count_indexer(self, router: _Router, indices: torch.Tensor, args: tuple, kwargs: dict) -> None:
        num_slots, top_k = router.info.num_slots, router.info.top_k
        chosen = indices.detach().to(torch.int64)  # [batch, seq, k]
        if chosen.dim() == 2:
            chosen = chosen.unsqueeze(0)
        batch, seq, picks = chosen.shape
        in_range = (chosen >= 0) & (chosen < num_slots)
        safe = chosen.clamp(min=0)
        mask = _call_argument(router.spec.mask_argument, args, kwargs)
        keys = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[:2] == (batch, seq):
            allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
            keys = allowed.shape[-1]
            in_range = in_range & allowed.gather(-1, safe.clamp(max=keys - 1))
            visible = allowed.sum(-1, keepdim=True)  # [batch, seq, 1]
        lines, valid = self._attribution(batch * seq, chosen.device)
        counted = in_range & valid.view(batch, seq, 1).bool()
        weight = counted.to(torch.int64)
        line_base = (lines * self._width + router.offset).view(batch, seq, 1)
        flat = self._buffer.view(-1)
        flat.scatter_add_(0, (line_base + safe.clamp(max=num_slots - 1)).reshape(-1), weight.reshape(-1))
        flat.scatter_add_(0, line_base.reshape(-1) + num_slots + _TOKENS, valid)
        if keys is not None:
            # Locality only means something for queries that saw more keys than they may pick.
            query_position = torch.arange(keys - seq, keys, device=chosen.device).view(1, seq, 1)
            had_choice = (visible > top_k) & counted
            local = had_choice & (query_position - chosen < top_k)
            flat.scatter_add_(
                0, (line_base + num_slots + _CHOICE).expand(batch, seq, picks).reshape(-1),
                had_choice.to(torch.int64).reshape(-1),
            )
            flat.scatter_add_(
                0, (line_base + num_slots + _LOCAL).expand(batch, seq, picks).reshape(-1),
                local.to(torch.int64).reshape(-1),
            )


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
    clock: Callable[[], float] = time.monotonic,
    agent_url: str | None = None,
    agent_token: str | None = None,
    agent_source: str | None = None,
    ship_interval: float = 5.0,
) -> Probe:
    """Hook every router of ``model`` and count what it selects.

    ``window_tokens`` / ``window_seconds`` bound the rolling window that :meth:`Probe.stats`
    reads (``None`` for no bound). Indexer counters cover key positions up to
    ``max_indexer_slots`` (or the model's context length, when smaller).

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
        clock=clock,
        agent_url=agent_url,
        agent_token=agent_token,
        agent_source=agent_source,
        ship_interval=ship_interval,
    )
