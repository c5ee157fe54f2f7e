"""The command line's flag values: argparse types, ``STRATEGY.NAME=VALUE`` options, shared defaults.

Each type refuses a value that cannot work with an :class:`argparse.ArgumentTypeError`, which
argparse prints as a usage error naming the flag (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mla_watch.server.config import ServerConfig
from mla_watch.server.expert_counts import ExpertSelection

__all__ = [
    "DEFAULT_STATE_DIR",
    "DOCS",
    "REPOSITORY",
    "byte_size",
    "expert_selection",
    "fleet_url",
    "history_retention",
    "integer_in",
    "non_negative_float",
    "non_negative_int",
    "number_at_least",
    "parse_options",
    "perplexity_margin",
    "positive_float",
    "positive_int",
    "positive_share",
    "share",
    "tcp_port",
    "upstream_url",
]

DEFAULT_STATE_DIR: Path = ServerConfig.state_dir
# The manual's pages, where each command's --help points: named by their path in the repository, which reads the
# same offline (a checkout, a copy of docs/) and online; the top-level --help says where the repository is.
DOCS = "docs/"
REPOSITORY = "https://github.com/mla-watch/mla_watch"


def positive_int(text: str) -> int:
    """An argparse type: argparse names the flag in its error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def integer_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type for an integer from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text[:40])
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text[:40]!r}")
        return value

    return parse


def upstream_url(text: str) -> str:
    """An argparse type for --upstream; its errors never repeat the URL, which may hold a password."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            "expected an http:// or https:// URL with a host (and a port number in "
            "[1, 65535] if any); the value given is not shown, it may hold a password"
        )
    del port
    return text


def fleet_url(text: str) -> str:
    """An argparse type for --fleet; its errors never repeat the URL, which may hold a password."""
    from mla_watch.fleet.settings import fleet_url_problem

    problem = fleet_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}; the value given is not shown, it may hold a password")
    return text


def byte_size(text: str) -> int:
    """An argparse type for a size in bytes, with an optional K, M or G suffix (powers of 1024)."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 12) or int(digits) * scale < 1024:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes of at least 1024, optionally with a K, M or G suffix (512M), got {text[:40]!r}"
        )
    return int(digits) * scale


def history_retention(text: str) -> float:
    """An argparse type: argparse names the flag in its error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value == 0 or 1 <= value <= 365):
        raise argparse.ArgumentTypeError(
            f"expected 0 (no durable history) or a number of days in [1, 365], got {text!r}"
        )
    return value


def expert_selection(text: str) -> ExpertSelection:
    """An argparse type for --export-expert-counts (the syntax lives in ExpertSelection.parse, the one parser)."""
    try:
        return ExpertSelection.parse(text, "")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def non_negative_int(text: str) -> int:
    """An argparse type: argparse names the flag in its error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def number_at_least(low: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type for a finite number above ``low`` (or at it, when ``inclusive``)."""
    expected = f"a number >= {low:g}" if inclusive else ("a positive number" if low == 0 else f"a number > {low:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_float = number_at_least(0, inclusive=False)
non_negative_float = number_at_least(0, inclusive=True)


def client_id_sources(text: str) -> tuple[str, ...]:
    """``serve --client-id``: where a request's client is named (:func:`mla_watch.routing.clients.client_id`)."""
    from mla_watch.cli.setting_flags import flag_text
    from mla_watch.routing.clients import parse_client_id_sources

    try:
        return parse_client_id_sources(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(flag_text(error)) from None


def share(text: str) -> float:
    """An argparse type for a share of all, from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1 (0.25: one in four), got {text[:40]!r}")
    return value


def positive_share(text: str) -> float:
    """An argparse type for a share of all above 0, up to 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share above 0, up to 1 (0.05: one twentieth), got {text[:40]!r}")
    return value


def perplexity_margin(text: str) -> str | float:
    """The perplexity gate's margin: ``2%`` (kept as text) or ``0.3``."""
    from mla_watch.quality.paired import parse_margin

    try:
        margin = parse_margin(text[:40])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a relative margin (a percentage up to 100%, e.g. 2%) or an "
            f"absolute one (a number >= 0, e.g. 0.3), got {text[:40]!r}"
        ) from None
    return f"{margin.value * 100:g}%" if margin.relative else margin.value


def tcp_port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 5) or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}")
    return int(text)


def parse_options(items: Sequence[str], flag: str = "--option") -> dict[str, dict[str, Any]]:
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        strategy, dot, name = key.partition(".")
        if not sep or not dot or not strategy or not name:
            raise SystemExit(f"{flag} {item!r}: expected STRATEGY.NAME=VALUE, e.g. router_finetune.lr=0.001")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        options.setdefault(strategy, {})[name] = parsed
    return options
