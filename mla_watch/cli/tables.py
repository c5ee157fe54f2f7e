"""Tables the commands print: columns as wide as their widest cell, two spaces apart."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[Sequence[str]], *, numbers: bool = False) -> str:
    """``rows`` (the first the header) as lines; cells right-aligned with ``numbers``, else left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def cell(text: str, width: int) -> str:
        return text.rjust(width) if numbers else text.ljust(width)

    return "\n".join(
        "  ".join(cell(text, width) for text, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
