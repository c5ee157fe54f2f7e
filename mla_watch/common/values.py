"""What kind of value a document holds, where Python's types say otherwise."""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard

__all__ = ["is_integer", "is_number"]


def is_number(value: object, *, finite: bool = False) -> TypeGuard[float]:
    """Whether ``value`` is a real number (an int, a float, a numpy scalar: one that reads as a float) and not a
    bool, which Python counts as an int but no document means as one; with ``finite``, not NaN or infinite either."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and (not finite or math.isfinite(value))


def is_integer(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer (an int, a numpy integer) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
