"""How a value someone sent appears in an error message: JSON as they wrote it, cut short."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["describe_value"]


def describe_value(value: Any, limit: int = 80) -> str:
    """``value`` in JSON, at most about ``limit`` characters (never raises: an error message must not fail)."""
    try:
        text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    except (TypeError, ValueError):  # not JSON, or an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
