"""The policies and alert rules mla_watch ships, inside the package so that a wheel serves them too.

The repository's top-level ``policies/`` and ``rules/`` are links to these directories.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHIPPED_POLICIES", "SHIPPED_RULES"]

SHIPPED_POLICIES = Path(__file__).resolve().parent / "policies"
SHIPPED_RULES = Path(__file__).resolve().parent / "rules"
