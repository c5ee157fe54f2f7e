"""A fleet member's settings (``serve --fleet ...``): plain values, read by the flags and the member."""

from __future__ import annotations

from dataclasses import dataclass, field

from mla_watch.common.values import is_integer, is_number

__all__ = ["FLEET_URL_ENV", "FleetSettings", "fleet_url_problem"]

# Where `serve` takes --fleet from when the flag is not given: a password in a URL on the command line is in every
# process listing of the host, one in the environment is not.
FLEET_URL_ENV = "MLA_WATCH_FLEET_URL"


def fleet_url_problem(url: object) -> str | None:
    """Why ``url`` is not a PostgreSQL URL the fleet can use (``None``: it is). The URL itself is never repeated:
    it may hold a password."""
    if not isinstance(url, str) or not url.startswith(("postgresql://", "postgres://")):
        return "expected a postgresql:// URL (postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE)"
    if len(url) > 2048:
        return f"expected a URL of at most 2048 characters, not {len(url)}"
    return None


@dataclass(frozen=True)
class FleetSettings:
    url: str = field(repr=False)  # postgresql://...; it may hold a password: never shown
    name: str  # this replica's name in the fleet
    rollout_batch: int = 1  # members taking their step at once
    lease_seconds: float = 60.0  # the re-tuning lease expires this long after its last renewal
    poll_seconds: float = 5.0  # a member's round
    evidence_seconds: float = 600.0  # a peer's reference reading this recent tells whether it reads healthy

    @property
    def member_seconds(self) -> float:
        """A member not seen for this long is not waited for (its step is lost; it adopts on return)."""
        return max(3 * self.poll_seconds, self.lease_seconds)

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each naming the field (the command line names its flag)."""
        out = []
        if (problem := fleet_url_problem(self.url)) is not None:
            out.append(f"url: {problem}")
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 200 or not self.name.isprintable():
            out.append(f"name {self.name!r}: expected 1 to 200 printable characters")
        checks = [
            (
                "rollout_batch",
                self.rollout_batch,
                is_integer(self.rollout_batch) and self.rollout_batch >= 1,
                "an integer >= 1",
            ),
            (
                "lease_seconds",
                self.lease_seconds,
                is_number(self.lease_seconds, finite=True) and self.lease_seconds >= 1,
                "seconds >= 1",
            ),
            (
                "poll_seconds",
                self.poll_seconds,
                is_number(self.poll_seconds, finite=True) and 0 < self.poll_seconds <= self.lease_seconds / 2,
                "seconds > 0, at most half of the lease (a holder renews it twice before it expires)",
            ),
            (
                "evidence_seconds",
                self.evidence_seconds,
                is_number(self.evidence_seconds, finite=True) and self.evidence_seconds > 0,
                "seconds > 0",
            ),
        ]
        return out + [f"{key} {value!r}: expected {expected}" for key, value, ok, expected in checks if not ok]
