"""The expert footprint of a batch: distinct experts per MoE layer that one decode step of B requests reads (no torch).

In memory-bound decode an MoE layer reads the weights of every distinct expert the batch's tokens chose, so a
batch whose requests route alike (one business line) reads fewer expert bytes per step than a mixed one. From the
per-token routing of real requests (``[tokens, MoE layers, top_k]`` each, as the probe records it or vLLM and SGLang
return it), a decode step of ``B`` concurrent requests is drawn as ``B`` requests and one decode token of each; its
footprint is the mean over layers of the distinct experts they chose. Lines *batched apart* means every batch holds
one line's requests (each line weighted by its share of the requests); *mixed*, batches drawn from all of them.
The ratio apart / mixed is the share of expert weight bytes a step reads when lines are batched apart: below 1,
grouping saves that much memory traffic per step.

Memory is bounded: at most ``max_requests`` requests per line (the most recent ones) of at most
``tokens_per_request`` tokens (a random sample of each request's decode tokens), ``uint16`` expert ids.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BATCH_SIZES", "FootprintSampler", "FootprintTable", "distinct_experts"]

BATCH_SIZES: tuple[int, ...] = (1, 8, 32, 64)
MAX_EXPERT_ID = np.iinfo(np.uint16).max


def distinct_experts(step: np.ndarray, num_experts: int) -> np.ndarray:
    """Distinct experts per layer of one decode step ``[B, layers, top_k]``."""
    batch, layers, top_k = step.shape
    seen = np.zeros((layers, num_experts), dtype=bool)
    seen[np.repeat(np.arange(layers), batch * top_k), np.moveaxis(step, 1, 0).reshape(-1)] = True
    return seen.sum(axis=1)


@dataclass(frozen=True)
class FootprintTable:
    """Mean distinct experts per MoE layer of a decode step, per batch size: each line apart, all lines mixed."""

    batch_sizes: tuple[int, ...]
    lines: dict[str, tuple[float, ...]]  # per line: one mean per batch size
    mixed: tuple[float, ...]
    apart: tuple[float, ...]  # each line's footprint weighted by its share of the requests
    requests: dict[str, int]

    @property
    def ratio(self) -> tuple[float, ...]:
        """Expert weight bytes a step reads with lines batched apart, over mixed."""
        return tuple(a / m if m else float("nan") for a, m in zip(self.apart, self.mixed, strict=True))

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch_sizes": list(self.batch_sizes),
            "lines": {k: list(v) for k, v in self.lines.items()},
            "mixed": list(self.mixed),
            "apart": list(self.apart),
            "ratio_apart_to_mixed": list(self.ratio),
            "requests": dict(self.requests),
        }

    def format(self, expert_bytes: int | None = None) -> str:
        """A table: one row per line, then all lines mixed, lines apart and the ratio."""
        head = ["batch size B", *(str(size) for size in self.batch_sizes)]
        rows = [head]
        for line, values in self.lines.items():
            rows.append([f"{line} ({self.requests[line]} requests)", *(f"{value:.1f}" for value in values)])
        rows.append(["all lines mixed", *(f"{value:.1f}" for value in self.mixed)])
        rows.append(["lines batched apart", *(f"{value:.1f}" for value in self.apart)])
        rows.append(["bytes apart / mixed", *(f"{value:.3f}" for value in self.ratio)])
        if expert_bytes:
            rows.append(["MiB per layer, mixed", *(f"{value * expert_bytes / 2**20:.2f}" for value in self.mixed)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        return "\n".join(
            "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
            for row in rows
        )


class FootprintSampler:
    """Recent requests' per-token routing per business line, and the footprint of batches drawn from them."""

    def __init__(
        self, num_experts: int, *, max_requests: int = 256, tokens_per_request: int = 16, seed: int = 0
    ) -> None:
        if not 1 <= num_experts <= MAX_EXPERT_ID + 1:
            raise ValueError(f"num_experts = {num_experts}: expected 1 to {MAX_EXPERT_ID + 1}")
        self.num_experts = num_experts
        self.max_requests = max_requests
        self.tokens_per_request = tokens_per_request
        self._requests: dict[str, deque[np.ndarray]] = {}
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(rows.nbytes for requests in self._requests.values() for rows in requests)

    def add(self, business_line: str, rows: np.ndarray) -> None:
        """One request's decode tokens' routing ``[tokens, MoE layers, top_k]`` (expert ids)."""
        if rows.ndim != 3 or not rows.shape[0]:
            return
        if int(rows.min()) < 0 or int(rows.max()) >= self.num_experts:
            raise ValueError(
                f"expert ids in [{int(rows.min())}, {int(rows.max())}]: expected [0, {self.num_experts - 1}]"
            )
        with self._lock:
            if rows.shape[0] > self.tokens_per_request:
                rows = rows[np.sort(self._rng.choice(rows.shape[0], self.tokens_per_request, replace=False))]
            requests = self._requests.get(business_line)
            if requests is None:
                requests = self._requests[business_line] = deque(maxlen=self.max_requests)
            requests.append(rows.astype(np.uint16))

    @property
    def business_lines(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def table(self, batch_sizes: Sequence[int] = BATCH_SIZES, *, draws: int = 64, seed: int = 0) -> FootprintTable:
        """Footprints per line and mixed: ``draws`` decode steps per batch size, from a ``seed``-ed generator."""
        with self._lock:
            pools = {line: list(requests) for line, requests in self._requests.items() if requests}
        # Every pool draws from the same seeded stream per batch size (common random numbers): the ratio's noise is
        # the pools' difference, not the draws', and one line's pool reads exactly what all lines mixed read.
        lines = {
            line: tuple(self._mean(pool, size, draws, np.random.default_rng([seed, size])) for size in batch_sizes)
            for line, pool in pools.items()
        }
        everything = [rows for pool in pools.values() for rows in pool]
        mixed = tuple(
            self._mean(everything, size, draws, np.random.default_rng([seed, size])) if everything else 0.0
            for size in batch_sizes
        )
        total = sum(len(pool) for pool in pools.values())
        apart = tuple(
            sum(len(pools[line]) / total * lines[line][index] for line in pools) if total else 0.0
            for index in range(len(batch_sizes))
        )
        requests = {line: len(pool) for line, pool in pools.items()}
        return FootprintTable(tuple(batch_sizes), lines, mixed, apart, requests)

    def _mean(self, pool: list[np.ndarray], batch: int, draws: int, rng: np.random.Generator) -> float:
        """Mean distinct experts per layer of ``draws`` steps of ``batch`` requests of ``pool`` (one token each;
        requests repeat only when the pool holds fewer than ``batch``)."""
        total = 0.0
        for _ in range(draws):
            chosen = rng.choice(len(pool), batch, replace=len(pool) < batch)
            step = np.stack([pool[index][rng.integers(pool[index].shape[0])] for index in chosen])
            total += float(distinct_experts(step.astype(np.intp), self.num_experts).mean())
        return total / draws
