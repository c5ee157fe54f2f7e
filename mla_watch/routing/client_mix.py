"""Whose traffic a routing window is: its clients' shares of the tokens, and whether they let it speak for its line
(no torch).

A healthy baseline is what every later window of its series is judged against, so it must be the line's traffic,
not one client's: :class:`ClientGate` takes a window only where no client sent more than ``max_share`` of its
tokens and at least ``min_clients`` clients sent some. For an indexer only the tokens that carry its signal
count - those of queries that saw at least ``2 x index_topk`` keys (:attr:`ClientMix.keys_seen`) - since the
short prompts around one client's long ones tell it nothing: a window of three clients' short questions and one
client's long texts is, to an indexer, that one client's. ``(other)`` (clients past the ones kept per line) and
``(unknown)`` (requests that name none) count as one client each, which errs on the side of not learning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mla_watch.common.describe import describe_value
from mla_watch.common.setting_errors import SettingProblem
from mla_watch.common.values import is_integer, is_number

__all__ = ["DEFAULT_MAX_CLIENT_SHARE", "DEFAULT_MIN_CLIENTS", "MAX_CLIENTS_KEPT", "ClientGate", "ClientMix"]

DEFAULT_MAX_CLIENT_SHARE = 0.5  # more than half from one client: the window is that client's
DEFAULT_MIN_CLIENTS = 3  # two clients can still be one application and its retry; three make a line
MAX_CLIENTS_KEPT = 32  # clients a mix names (the largest): what a baseline file and a view carry


@dataclass(frozen=True)
class ClientMix:
    """The clients of a window's ``tokens``, by share (largest first, at most :data:`MAX_CLIENTS_KEPT` named) and
    how many there were in all. ``keys_seen`` > 0: only the tokens of queries that saw at least that many keys."""

    tokens: int
    clients: tuple[tuple[str, float], ...]
    count: int
    keys_seen: int = 0

    @classmethod
    def of(cls, tokens_by_client: Mapping[str, int], *, keys_seen: int = 0) -> ClientMix:
        """The mix of ``tokens_by_client`` (clients with no tokens left out)."""
        sent = sorted(
            ((name, count) for name, count in tokens_by_client.items() if count > 0),
            key=lambda item: (-item[1], item[0]),
        )
        total = sum(count for _, count in sent)
        return cls(total, tuple((name, count / total) for name, count in sent[:MAX_CLIENTS_KEPT]), len(sent), keys_seen)

    @property
    def what(self) -> str:
        """The tokens the shares are of, in words."""
        if self.keys_seen > 0:
            return f"the line's tokens that saw {self.keys_seen} keys or more"
        return "the line's tokens"

    def describe(self, shown: int = 4) -> str:
        """``4 clients: app-1 31%, app-2 27%, app-3 22%, app-4 20% of the line's last 4096 tokens``."""
        if not self.count:
            return f"no client in {self.what}"
        named = ", ".join(f"{name} {share:.0%}" for name, share in self.clients[:shown])
        more = f", and {self.count - shown} more" if self.count > shown else ""
        return (
            f"{self.count} client{'s' if self.count != 1 else ''}: {named}{more} of {self.what} "
            f"({self.tokens} in the window)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "count": self.count,
            "keys_seen": self.keys_seen,
            "clients": [{"client": name, "share": round(share, 4)} for name, share in self.clients],
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> ClientMix:
        """The mix :meth:`to_json` wrote; ``ValueError`` naming ``where``, the key and what was expected."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object with tokens, count, keys_seen and clients")
        for key in ("tokens", "count", "keys_seen"):
            value = data.get(key)
            if not is_integer(value) or value < 0:
                raise ValueError(f"{where}.{key} = {describe_value(value, form='repr')}: expected an integer >= 0")
        entries = data.get("clients")
        if not isinstance(entries, list) or len(entries) > MAX_CLIENTS_KEPT or len(entries) > data["count"]:
            raise ValueError(
                f"{where}.clients: expected a list of at most {MAX_CLIENTS_KEPT} clients (and at most count)"
            )
        clients = []
        for index, entry in enumerate(entries):
            name = entry.get("client") if isinstance(entry, dict) else None
            share = entry.get("share") if isinstance(entry, dict) else None
            if (
                not isinstance(name, str)
                or not name
                or len(name) > 128
                or not is_number(share, finite=True)
                or not 0 <= share <= 1
            ):
                raise ValueError(f"{where}.clients[{index}]: expected client (a name) and share (from 0 to 1)")
            clients.append((name, float(share)))
        return cls(int(data["tokens"]), tuple(clients), int(data["count"]), int(data["keys_seen"]))


@dataclass(frozen=True)
class ClientGate:
    """Which windows may become a baseline, by their clients: at most ``max_share`` of the tokens from one client,
    and at least ``min_clients`` clients."""

    max_share: float = DEFAULT_MAX_CLIENT_SHARE
    min_clients: int = DEFAULT_MIN_CLIENTS

    def problems(self) -> list[SettingProblem]:
        """What is wrong with the settings, each named as :class:`~mla_watch.server.config.ServerConfig` holds it."""
        problems = []
        if not is_number(self.max_share, finite=True) or not 0 < self.max_share <= 1:
            problems.append(SettingProblem("baseline_max_client_share", repr(self.max_share), "a share in (0, 1]"))
        if not is_integer(self.min_clients) or self.min_clients < 1:
            problems.append(SettingProblem("baseline_min_clients", repr(self.min_clients), "an integer >= 1"))
        return problems

    def judge(self, mix: ClientMix) -> str | None:
        """Why the window of ``mix`` is not its line's traffic, or ``None`` when it may be learned."""
        if not mix.count:
            return f"no client sent {mix.what} yet"
        client, share = mix.clients[0]
        if share > self.max_share:
            return (
                f"client {client} sent {share:.0%} of {mix.what} ({mix.tokens} in the window): a baseline takes "
                f"at most {self.max_share:.0%} from one client"
            )
        if mix.count < self.min_clients:
            return f"only {mix.describe()}: a baseline needs at least {self.min_clients} clients"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"max_client_share": self.max_share, "min_clients": self.min_clients}
