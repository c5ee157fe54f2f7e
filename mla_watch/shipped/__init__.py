"""The policies, alert rules and reference prompts mla_watch ships, inside the package so that a wheel serves them too.

The repository's top-level ``policies/``, ``rules/`` and ``references/`` are links to these directories.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHIPPED_POLICIES", "SHIPPED_REFERENCES", "SHIPPED_RULES"]

SHIPPED_POLICIES = Path(__file__).resolve().parent / "policies"
SHIPPED_RULES = Path(__file__).resolve().parent / "rules"
SHIPPED_REFERENCES = Path(__file__).resolve().parent / "references"
