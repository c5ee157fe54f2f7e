"""Why an alert fires: the model changed, or the traffic did. The alert engine asks; it never measures.

Every routing statistic mixes the router and the tokens it was given. A :class:`CauseJudge` (the sidecar's
reference prompts, :mod:`mla_watch.references.prober`) tells the two apart for one alert instance: ``model`` when
routing the sidecar controls has changed too, ``traffic`` when it routes as it did while healthy and only
the live traffic reads otherwise, ``undetermined`` when no reading says either.

The engine asks for a reading when an instance goes pending (:meth:`CauseJudge.request`), and decides the
cause when it would fire (:meth:`CauseJudge.judge`): an instance whose reading is still on its way stays
pending, for at most :attr:`CauseJudge.wait_seconds` past its ``for``, then fires ``undetermined``. The cause
is a label (``cause``) of the alert and the first words of its summary; only ``model`` starts a re-tune.
``serve`` always gives its alert engine a judge (one that answers ``undetermined``, saying why, where no
reference prompts can be read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mla_watch.common.values import is_number
from mla_watch.routing.windows import RouterStats

__all__ = ["CAUSES", "CAUSE_HEADLINES", "CAUSE_LABEL", "Cause", "CauseJudge", "CauseName", "undetermined"]

CauseName = Literal["model", "traffic", "undetermined"]
CAUSES: tuple[CauseName, ...] = ("model", "traffic", "undetermined")
CAUSE_LABEL = "cause"
# The first words of every page: what on-call asks first.
CAUSE_HEADLINES: Mapping[str, str] = {
    "model": "MODEL CHANGED",
    "traffic": "TRAFFIC CHANGED (the model routes its reference prompts as when healthy)",
    "undetermined": "CAUSE UNDETERMINED",
}


@dataclass(frozen=True)
class Cause:
    """The cause of one alert instance, with the figures that decided it."""

    name: CauseName
    summary: str  # one sentence with the reference figures (the ``cause`` annotation)
    reading_at: float | None = None  # when the reading it was judged on was taken (wall clock)
    details: Mapping[str, Any] = field(default_factory=dict)  # JSON-able figures (GET /v1/alerts)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "reading_at": self.reading_at,
            "details": dict(self.details),
        }

    @classmethod
    def from_json(cls, data: Any) -> Cause:
        if not isinstance(data, dict) or data.get("name") not in CAUSES or not isinstance(data.get("summary"), str):
            raise ValueError("cause: expected an object with name (model, traffic or undetermined) and summary")
        reading_at = data.get("reading_at")
        if reading_at is not None and not is_number(reading_at):
            raise ValueError("cause: reading_at is not a number")
        details = data.get("details") or {}
        return cls(
            data["name"],
            data["summary"],
            None if reading_at is None else float(reading_at),
            details if isinstance(details, dict) else {},
        )


def undetermined(why: str) -> Cause:
    return Cause("undetermined", why)


class CauseJudge(Protocol):
    """What the alert engine asks of a source of reference readings."""

    @property
    def wait_seconds(self) -> float:
        """How long past its `for` an instance waits for the reading it asked for."""

    def request(self, business_line: str | None, since: float) -> None:
        """A reading of ``business_line``'s reference prompts (every line's for ``None``) newer than ``since`` is
        wanted: take one soon, unless one is already that new."""

    def latest(self, business_line: str | None) -> float | None:
        """When the newest reading that describes ``business_line`` was taken (``None``: none yet)."""

    def judge(self, rule: Any, record: RouterStats, since: float) -> Cause | None:
        """The cause of ``rule``'s alert on ``record``, from a reading taken at or after ``since``; ``None`` while
        no such reading exists but one is coming."""
