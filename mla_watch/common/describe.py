"""How a value someone sent appears in an error message: written in one of a few forms, cut short."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

__all__ = ["Form", "describe_value"]

# json: as a request wrote it; repr: Python's; yaml: as a YAML file writes it (null, true, false), strings quoted as
# repr does; words: its text with every run of whitespace one space (a path, a flag's value); text: its text as is.
Form = Literal["json", "repr", "yaml", "words", "text"]


def _render(value: Any, form: Form) -> str:
    if form == "json":
        return json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    if form == "yaml":
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        return repr(value)
    if form == "repr":
        return repr(value)
    if form == "words":
        return " ".join(str(value).split())
    return str(value)


def describe_value(
    value: Any, limit: int = 80, *, form: Form = "json", ellipsis: str = "...", ellipsis_after_limit: bool = False
) -> str:
    """``value`` written in ``form`` (:data:`Form`), at most ``limit`` characters: a longer text keeps its start
    and ends in ``ellipsis``, within the limit, or after ``limit`` characters with ``ellipsis_after_limit``.

    Never raises (an error message must not fail): a value the form cannot write reads ``<type name>``.
    """
    try:
        text = _render(value, form)
    except (TypeError, ValueError, RecursionError):  # not JSON, an int too long to print, a cycle
        text = f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return text[:limit] + ellipsis if ellipsis_after_limit else text[: limit - len(ellipsis)] + ellipsis
