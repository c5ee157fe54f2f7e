"""Who sent the traffic: each request attributed to a client, and each line's token shares per client, bounded.

A client is named by the first of ``serve --client-id`` that a request carries (default
``header:X-Client-Id,user,api-key,remote``): a header's value, the OpenAI ``user`` field, a hash of the
API key (never the key), or the remote address. A name that is not short and printable is hashed, so a label,
a log line or a page never carries what a client chose to put there.

:class:`ClientShares` keeps, per business line, the tokens each client sent over the last ``window_tokens``
of that line (as the routing windows do) and over a long run (``long_run_tokens``, decayed): a traffic-caused
alert names the clients whose share moved most, and :meth:`ClientShares.mix` says whose traffic a line's window
is before it becomes a healthy baseline (:mod:`mla_watch.routing.client_mix`). At most ``max_clients`` clients are
kept per line; the others are counted as :data:`OTHER`.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.routing.client_mix import ClientMix
from mla_watch.routing.client_names import OTHER, UNKNOWN
from mla_watch.routing.windows import ALL_LINES

__all__ = [
    "CLIENT_ID_SOURCES",
    "DEFAULT_CLIENT_ID",
    "OTHER",
    "UNKNOWN",
    "ClientShares",
    "Mover",
    "client_id",
    "parse_client_id_sources",
]

DEFAULT_CLIENT_ID = "header:X-Client-Id,user,api-key,remote"
CLIENT_ID_SOURCES = ("header:NAME", "user", "api-key", "remote")
_SHOWN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")
_HEADER = re.compile(r"[A-Za-z0-9-]{1,64}")


def parse_client_id_sources(text: str) -> tuple[str, ...]:
    """``header:X-Client-Id,user,api-key,remote`` -> its sources; a ``SettingsError`` naming the bad part."""
    sources = []
    for part in str(text).split(","):
        part = part.strip()
        if part in ("user", "api-key", "remote"):
            sources.append(part)
        elif part.startswith("header:") and _HEADER.fullmatch(part[7:]):
            sources.append("header:" + part[7:].lower())
        else:
            raise SettingsError(
                [
                    SettingProblem(
                        "client_id",
                        repr(text[:100]),
                        "a comma-separated list of " + ", ".join(CLIENT_ID_SOURCES),
                        problem=f"{part[:80]!r} is not a source",
                    )
                ]
            )
    if not sources:
        raise SettingsError(
            [SettingProblem("client_id", repr(text[:100]), f"at least one of {', '.join(CLIENT_ID_SOURCES)}")]
        )
    return tuple(dict.fromkeys(sources))


def _shown(prefix: str, value: str) -> str:
    """``value`` as a client name: kept when short and printable, else a hash of it."""
    if _SHOWN.fullmatch(value):
        return f"{prefix}{value}"
    return f"{prefix}sha256:{hashlib.sha256(value.encode('utf-8', 'replace')).hexdigest()[:16]}"


def client_id(
    sources: Sequence[str], headers: Mapping[str, str], body: Mapping[str, Any] | None, remote: str | None
) -> str:
    """The client a request came from, by the first of ``sources`` it carries (``headers`` keyed lower-case)."""
    for source in sources:
        if source.startswith("header:"):
            value = headers.get(source[7:])
            if value:
                return _shown("", value[:1024])
        elif source == "user":
            user = body.get("user") if body is not None else None
            if isinstance(user, str) and user:
                return _shown("user:", user[:1024])
        elif source == "api-key":
            authorization = headers.get("authorization", "")
            if authorization[:7].lower() == "bearer " and authorization[7:].strip():
                digest = hashlib.sha256(authorization[7:].strip().encode("utf-8", "replace")).hexdigest()[:16]
                return f"key:{digest}"
        elif source == "remote" and remote:
            return _shown("addr:", remote[:128])
    return UNKNOWN


@dataclass(frozen=True)
class Mover:
    """A client whose share of a line's tokens moved: now (over the line's window) and over the long run."""

    client: str
    share: float
    long_run_share: float
    tokens: int

    def describe(self) -> str:
        return (
            f"client {self.client} sent {self.share:.0%} of the line's last {self.tokens} tokens "
            f"({self.long_run_share:.0%} over the long run)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "client": self.client,
            "share": round(self.share, 4),
            "long_run_share": round(self.long_run_share, 4),
            "window_tokens": self.tokens,
        }


class _Line:
    def __init__(self) -> None:
        # (client, tokens, context: the longest sequence's length, which the latest of its queries saw), oldest first
        self.window: deque[tuple[str, int, int]] = deque()
        self.window_tokens = 0
        self.in_window: dict[str, int] = {}
        self.long_run: dict[str, float] = {}  # decayed tokens per client


class ClientShares:
    """Per business line, the token shares of its clients now and over the long run (see the module docstring)."""

    def __init__(
        self,
        *,
        window_tokens: int = 4096,
        long_run_tokens: int = 1_000_000,
        max_clients: int = 32,
        max_lines: int = 256,
    ) -> None:
        self.window_tokens = window_tokens
        self.long_run_tokens = long_run_tokens
        self.max_clients = max_clients
        self.max_lines = max_lines
        self._lines: dict[str, _Line] = {}
        self._lock = threading.Lock()

    def add(self, business_line: str, client: str, tokens: int, *, context: int | None = None) -> None:
        """``client`` sent ``tokens`` tokens of ``business_line`` (prompt and answer), the longest of its sequences
        ``context`` tokens long (default ``tokens``: one sequence)."""
        if tokens <= 0:
            return
        with self._lock:
            line = self._lines.get(business_line)
            if line is None:
                if len(self._lines) >= self.max_lines:
                    return
                line = self._lines[business_line] = _Line()
            if client not in line.long_run and len(line.long_run) >= self.max_clients:
                client = OTHER
            decay = max(0.0, 1.0 - tokens / self.long_run_tokens)
            for name in line.long_run:
                line.long_run[name] *= decay
            line.long_run[client] = line.long_run.get(client, 0.0) + tokens
            line.window.append((client, tokens, tokens if context is None else max(0, int(context))))
            line.window_tokens += tokens
            line.in_window[client] = line.in_window.get(client, 0) + tokens
            while len(line.window) > 1 and line.window_tokens - line.window[0][1] >= self.window_tokens:
                old, count, _ = line.window.popleft()
                line.window_tokens -= count
                line.in_window[old] -= count
                if not line.in_window[old]:
                    del line.in_window[old]

    def shares(self, business_line: str | None) -> dict[str, Any]:
        """``{"tokens", "clients": [{client, share, long_run_share}]}`` of a line (every line for ``None``)."""
        window, long_run, tokens = self._totals(business_line)
        total = sum(long_run.values()) or 1.0
        return {
            "tokens": tokens,
            "clients": [
                {
                    "client": name,
                    "share": round(count / tokens, 4) if tokens else 0.0,
                    "long_run_share": round(long_run.get(name, 0.0) / total, 4),
                }
                for name, count in sorted(window.items(), key=lambda item: -item[1])
            ],
        }

    def mix(self, business_line: str | None, *, keys_seen: int = 0) -> ClientMix | None:
        """Whose tokens a line's window holds (every line's for ``None``); ``keys_seen`` > 1: only the tokens of
        queries that saw at least that many keys (positions ``keys_seen - 1`` on of each sequence). ``None`` where
        no client's tokens of the line were recorded here (routing reported by workers, or counted from an engine's
        recorder: its clients are not seen)."""
        with self._lock:
            lines = (
                list(self._lines.values())
                if business_line in (None, ALL_LINES)
                else ([self._lines[business_line]] if business_line in self._lines else [])
            )
            if not any(line.window for line in lines):
                return None
            sent: dict[str, int] = {}
            for line in lines:
                if keys_seen <= 1:
                    for name, count in line.in_window.items():
                        sent[name] = sent.get(name, 0) + count
                    continue
                for name, count, context in line.window:
                    reached = min(count, context - keys_seen + 1)
                    if reached > 0:
                        sent[name] = sent.get(name, 0) + reached
        return ClientMix.of(sent, keys_seen=keys_seen if keys_seen > 1 else 0)

    def movers(self, business_line: str | None, top: int = 3) -> list[Mover]:
        """The clients whose share of the line now exceeds their long-run share most (at most ``top``)."""
        window, long_run, tokens = self._totals(business_line)
        if not tokens:
            return []
        total = sum(long_run.values()) or 1.0
        movers = [
            Mover(name, count / tokens, long_run.get(name, 0.0) / total, tokens) for name, count in window.items()
        ]
        movers.sort(key=lambda mover: (-(mover.share - mover.long_run_share), -mover.share))
        return [mover for mover in movers if mover.share > 0][:top]

    def _totals(self, business_line: str | None) -> tuple[dict[str, int], dict[str, float], int]:
        with self._lock:
            lines = (
                list(self._lines.values())
                if business_line in (None, ALL_LINES)
                else ([self._lines[business_line]] if business_line in self._lines else [])
            )
            window: dict[str, int] = {}
            long_run: dict[str, float] = {}
            for line in lines:
                for name, count in line.in_window.items():
                    window[name] = window.get(name, 0) + count
                for name, value in line.long_run.items():
                    long_run[name] = long_run.get(name, 0.0) + value
            return window, long_run, sum(line.window_tokens for line in lines)
