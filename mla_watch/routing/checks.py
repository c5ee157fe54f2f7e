"""Validation of count vectors and integer arguments, shared by the routing statistics and the rolling windows.

Kept apart from :mod:`~mla_watch.routing.stats` and :mod:`~mla_watch.routing.rolling` so that both can use it
without importing each other.  Depends on numpy only (no torch).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from mla_watch.common.values import is_integer

__all__ = ["as_counts", "as_int_counts", "check_local_choice", "check_nonnegative_int", "check_positive_int"]


def as_counts(counts: ArrayLike, name: str = "counts") -> np.ndarray:
    """Return ``counts`` as a 1-D float64 array of finite, non-negative values."""
    arr = np.asarray(counts, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector, got an array of shape {arr.shape}")
    if arr.size and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got non-finite values")
    if arr.size and np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative, got minimum {float(arr.min())!r}")
    return arr


def as_int_counts(counts: ArrayLike, num_slots: int, name: str = "counts") -> np.ndarray:
    """Return ``counts`` as a 1-D int64 array of length ``num_slots`` with values >= 0."""
    raw = np.asarray(counts)
    if raw.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector, got an array of shape {raw.shape}")
    if raw.shape[0] != num_slots:
        raise ValueError(f"{name} has length {raw.shape[0]}, expected num_slots={num_slots}")
    if raw.dtype.kind in "iub":
        arr = raw.astype(np.int64)
    elif raw.dtype.kind == "f":
        if raw.size and not np.all(np.isfinite(raw)):
            raise ValueError(f"{name} must be finite, got non-finite values")
        if raw.size and not np.all(raw == np.floor(raw)):
            raise ValueError(f"{name} must hold whole numbers, got non-integral values")
        arr = raw.astype(np.int64)
    else:
        raise ValueError(f"{name} must be numeric integers, got dtype {raw.dtype}")
    if arr.size and np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative, got minimum {int(arr.min())}")
    return arr


def _check_int_at_least(value: int, name: str, lowest: int) -> int:
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lowest:
        raise ValueError(f"{name} must be >= {lowest}, got {value}")
    return int(value)


def check_positive_int(value: int, name: str) -> int:
    return _check_int_at_least(value, name, 1)


def check_nonnegative_int(value: int, name: str) -> int:
    return _check_int_at_least(value, name, 0)


def check_local_choice(local_selections: int, choice_selections: int) -> tuple[int, int]:
    local = check_nonnegative_int(local_selections, "local_selections")
    choice = check_nonnegative_int(choice_selections, "choice_selections")
    if local > choice:
        raise ValueError(f"local_selections={local} cannot exceed choice_selections={choice}")
    return local, choice
