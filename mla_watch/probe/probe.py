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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mla_watch.probe.agent import Shipper
from mla_watch.probe.discovery import RouterInfo, RouterRegistry, RouterSpec, discover_routers
from mla_watch.windows import CountDelta, RouterWindows

__all__ = ["DEFAULT_LINE", "Probe", "RoutingRecording", "attach"]

DEFAULT_LINE = "default"
_COMPANIONS = 3  # tokens, choice selections, local selections
_TOKENS, _CHOICE, _LOCAL = 0, 1, 2


class _Router:
    def __init__(self, info: RouterInfo, spec: RouterSpec, offset: int, check_range: bool) -> None:
        self.info = info
        self.spec = spec
        self.offset = offset
        self.check_range = check_range  # indices may be -1 or beyond the counters
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
            positions = int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 0)
            check_range = spec.may_pad or (info.kind == "indexer" and info.num_slots < positions)
            router = _Router(info, spec, width, check_range)
            width += info.num_slots + _COMPANIONS
            router.handle = module.register_forward_hook(self._make_hook(router), with_kwargs=True)
            self._routers.append(router)
        self._width = width
        self._device = _device_of(model)
        self._buffer = torch.zeros((max(1, line_capacity), width), dtype=torch.int64, device=self._device)
        self._lines: dict[str, int] = {DEFAULT_LINE: 0}
        self._row_lines: torch.Tensor | None = None
        self._forward: _Forward | None = None
        self._constants: dict[tuple[int, ...], _GroupConstants] = {}
        self._constants_by_shape: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self._pre_handle = model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
        self._post_handle = model.register_forward_hook(self._end_forward)
        self._host_lock = threading.Lock()
        self._recording = threading.local()  # per thread: a re-tune's forwards never land in a request's routing
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

    @contextmanager
    def record_routing(self) -> Iterator[RoutingRecording]:
        """Keep the expert ids every expert router chose in this thread's forward passes inside the block.

        What is recorded is exactly what is counted (same passes, same rows), so a server can return
        each request's routing per token, as vLLM and SGLang do.
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
                    # Every token picks exactly top_k experts, so expert routers need no token counter.
                    tokens = slots.sum() // router.info.top_k if router.info.kind == "expert" else companions[_TOKENS]
                    self._sink(router.info.name, line, CountDelta(slots, int(tokens), int(companions[_LOCAL]),
                                                                  int(companions[_CHOICE])))

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
    # Router hooks only keep a reference to the indices; the model's own post-forward hook then
    # counts every router of the pass in a few batched tensor ops (stack, add, one scatter_add_
    # per kind). On a CPU a tensor op costs microseconds of dispatch whatever its size, so a
    # dozen ops per router per token would cost more than the counting itself.
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
        row_lines = self._row_lines
        if row_lines is None:
            row_base = self._constant(0, (batch,))
        elif row_lines.numel() == batch:
            row_base = row_lines * self._width
        elif batch % row_lines.numel() == 0:
            row_base = row_lines.repeat_interleave(batch // row_lines.numel()) * self._width
        else:
            raise ValueError(
                f"mla_watch probe: {row_lines.numel()} business lines were given for a batch of "
                f"{batch} rows; expected one line, one per row, or a divisor of the batch size"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch:
            valid = (mask[:, -seq:] != 0).to(torch.int64)
        else:
            valid = self._constant(1, (batch, seq))
        self._forward = _Forward(batch, seq, row_base, valid)

    def _constant(self, value: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A cached read-only int64 tensor filled with ``value`` (decoding reuses a few shapes)."""
        key = (value, shape)
        tensor = self._constants_by_shape.get(key)
        if tensor is None:
            if len(self._constants_by_shape) > 64:
                self._constants_by_shape.clear()
            tensor = torch.full(shape, value, dtype=torch.int64, device=self._device)
            self._constants_by_shape[key] = tensor
        return tensor

    def _end_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        forward, self._forward = self._forward, None
        if forward is not None:
            self._flush(forward)

    def _flush(self, forward: _Forward) -> None:
        recording = getattr(self._recording, "current", None)
        if recording is not None and forward.experts:
            recording.add(forward.batch, forward.seq, [indices for _, indices in forward.experts])
        for group in _groups(forward.experts, lambda item: item[1].shape):
            self._count_experts(forward, group)
        for group in _groups(forward.indexers, lambda item: (item[1].shape, _mask_identity(item[2]))):
            self._count_indexers(forward, group)

    def _make_hook(self, router: _Router) -> Callable[..., None]:
        expert = router.info.kind == "expert"

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            indices = router.spec.indices(output).detach()
            forward = self._forward
            if expert:
                if forward is not None and indices.numel() == forward.batch * forward.seq * indices.shape[-1]:
                    forward.experts.append((router, indices))
                else:  # called outside the attached module's forward: count now, unattributed
                    tokens = indices.numel() // indices.shape[-1]
                    self._count_experts(self._unattributed(1, tokens), [(router, indices)])
                return
            if indices.dim() == 2:
                indices = indices.unsqueeze(0)
            mask = _call_argument(router.spec.mask_argument, args, kwargs)
            if forward is not None and tuple(indices.shape[:2]) == (forward.batch, forward.seq):
                forward.indexers.append((router, indices, mask))
            else:
                self._count_indexers(self._unattributed(indices.shape[0], indices.shape[1]), [(router, indices, mask)])

        return hook

    def _unattributed(self, batch: int, seq: int) -> _Forward:
        return _Forward(batch, seq, self._constant(0, (batch,)), self._constant(1, (batch, seq)))

    def _group_constants(self, routers: Sequence[_Router]) -> _GroupConstants:
        key = tuple(router.offset for router in routers)
        constants = self._constants.get(key)
        if constants is None:
            def column(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=self._device).view(-1, 1, 1, 1)

            offsets = column([router.offset for router in routers])
            slots = column([router.info.num_slots for router in routers])
            constants = _GroupConstants(
                offsets=offsets,
                slots=slots,
                top_k=column([router.info.top_k for router in routers]),
                companions=(offsets + slots).view(-1, 1, 1) + torch.arange(_COMPANIONS, device=self._device),
                check_range=any(router.check_range for router in routers),
            )
            self._constants[key] = constants
        return constants

    def _count_experts(self, forward: _Forward, group: list[tuple[_Router, torch.Tensor]]) -> None:
        constants = self._group_constants([router for router, _ in group])
        batch, seq = forward.batch, forward.seq
        chosen = torch.stack([indices.view(batch, seq, -1) for _, indices in group])  # [R, B, S, k]
        weight = forward.valid.view(1, batch, seq, 1).expand(chosen.shape)
        if constants.check_range:
            weight = weight * ((chosen >= 0) & (chosen < constants.slots))
            chosen = torch.minimum(chosen.clamp(min=0), constants.slots - 1)
        index = chosen + (forward.row_base.view(1, batch, 1, 1) + constants.offsets)
        self._buffer.view(-1).scatter_add_(0, index.view(-1), weight.reshape(-1))

    def _count_indexers(self, forward: _Forward, group: list[tuple[_Router, torch.Tensor, Any]]) -> None:
        constants = self._group_constants([router for router, _, _ in group])
        chosen = torch.stack([indices for _, indices, _ in group])  # [R, B, S, picks]
        routers, batch, seq, _ = chosen.shape
        counted = forward.valid_bool.view(1, batch, seq, 1)
        safe = chosen
        if constants.check_range:
            counted = counted & (chosen >= 0) & (chosen < constants.slots)
            safe = torch.minimum(chosen.clamp(min=0), constants.slots - 1)
        mask = group[0][2]
        allowed = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[1] == seq and mask.shape[0] in (1, batch):
            allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
            keys = allowed.shape[-1]
            picked = allowed.expand(batch, seq, keys).unsqueeze(0).expand(routers, batch, seq, keys)
            counted = counted & picked.gather(-1, safe.to(torch.int64))
        row_base = forward.row_base.view(1, batch, 1, 1)
        flat = self._buffer.view(-1)
        flat.scatter_add_(0, (row_base + constants.offsets + safe).reshape(-1), counted.to(torch.int64).reshape(-1))
        tokens = forward.valid_rows.view(1, batch).expand(routers, batch)
        if allowed is not None:
            # Locality only means something for queries that saw more keys than they may pick.
            visible = allowed.sum(-1).view(1, -1, seq, 1)
            had_choice = counted & (visible > constants.top_k)
            recent = torch.arange(keys - seq, keys, device=chosen.device).view(1, 1, seq, 1) - constants.top_k
            local = had_choice & (chosen > recent)
            companions = torch.cat([tokens.unsqueeze(-1), torch.stack([had_choice, local], -1).sum((2, 3))], dim=-1)
        else:
            companions = torch.stack([tokens, torch.zeros_like(tokens), torch.zeros_like(tokens)], dim=-1)
        flat.scatter_add_(0, (forward.row_base.view(1, batch, 1) + constants.companions).reshape(-1),
                          companions.reshape(-1))


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


@dataclass
class _Forward:
    """Attribution of the forward pass in progress, and the router outputs it produced so far."""

    batch: int
    seq: int
    row_base: torch.Tensor  # [batch] line * width: where each row's counters start
    valid: torch.Tensor  # [batch, seq] int64, 0 for padding
    experts: list[tuple[_Router, torch.Tensor]] = field(default_factory=list)
    indexers: list[tuple[_Router, torch.Tensor, Any]] = field(default_factory=list)
    _valid_bool: torch.Tensor | None = None
    _valid_rows: torch.Tensor | None = None

    @property
    def valid_bool(self) -> torch.Tensor:
        if self._valid_bool is None:
            self._valid_bool = self.valid.bool()
        return self._valid_bool

    @property
    def valid_rows(self) -> torch.Tensor:
        """Real tokens per row."""
        if self._valid_rows is None:
            self._valid_rows = self.valid.sum(1)
        return self._valid_rows


@dataclass(frozen=True)
class _GroupConstants:
    """Device tensors describing a group of routers counted together (cached per group)."""

    offsets: torch.Tensor  # [R, 1, 1, 1]
    slots: torch.Tensor
    top_k: torch.Tensor
    companions: torch.Tensor  # [R, 1, 3] flat offsets of each router's companion counters
    check_range: bool


def _groups(items: list, key: Callable[[Any], Any]) -> list[list]:
    grouped: dict[Any, list] = {}
    for item in items:
        grouped.setdefault(key(item), []).append(item)
    return list(grouped.values())


def _mask_identity(mask: Any) -> Any:
    """Indexers scored against the same mask (views of one tensor) can be checked against it together."""
    if not isinstance(mask, torch.Tensor):
        return None
    return (mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask.dtype)


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
