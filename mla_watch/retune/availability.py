"""Why re-tuning is off: one explanation, quoted by every place that says so.

``mla-watch check``, ``serve``'s start-up line and ``GET /v1/status``, the ``retune`` annotation of a model-caused
alert and the admin API's 503 all say it in the same words: each reason that applies, one sentence each, with
what to do about it. What a place cannot know (``check`` runs without serve's flags or the engine) is said as
what re-tuning needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RetuneConditions", "no_job_note", "retune_reasons", "why_retune_is_off"]

SWAP_ENGINES = "--engine vllm or sglang"  # the engines whose routers are swapped in place (engines/backends.py)


@dataclass(frozen=True)
class RetuneConditions:
    """What re-tuning a router here depends on; ``None``: not known where the question is asked.

    ``routers``: ``"local"`` (the model served here), ``"engine"`` (an engine's, read beside it) or ``"none"``
    (neither: routing shipped by other processes is watched, never re-tuned).
    """

    routers: Literal["local", "engine", "none"]
    engine: str | None = None  # serve --engine, beside an engine
    swaps: bool | None = None  # whether that engine's routers can be swapped in place
    engine_retune: str | None = None  # serve --engine-retune: off, propose or apply
    capture: bool | None = None  # serve --capture: recorded traffic, the data of a job an alert starts
    checkpoint_problem: str | None = None  # why the engine's router weights cannot be read from its checkpoint
    engine_problem: str | None = None  # why the engine's swap endpoints cannot be used (its own words)


def retune_reasons(conditions: RetuneConditions) -> list[str]:
    """Each reason re-tuning is off (or, where unknown, each thing it needs), one sentence each, what to do in it."""
    c = conditions
    if c.routers == "none":
        return [
            "no router is re-tuned here: serve a model (--model) or read an engine's routing (--upstream with "
            f"{SWAP_ENGINES} and --model-config); routing other processes ship is watched, not re-tuned"
        ]
    reasons = []
    if c.routers == "engine":
        if c.engine_retune is None:
            reasons.append("serve --engine-retune propose (a version to review) or apply (off by default)")
        elif c.engine_retune == "off":
            reasons.append(
                "it was not asked for (--engine-retune off, the default): serve with --engine-retune "
                "propose (a version to review) or apply"
            )
        if c.swaps is None:
            reasons.append(
                f"an engine that swaps routers in place: {SWAP_ENGINES}, vLLM started with "
                "VLLM_SERVER_DEV_MODE=1 (its swap endpoints, on a pod-local port)"
            )
        elif not c.swaps:
            reasons.append(f"--engine {c.engine} cannot swap routers in place: re-tuning needs {SWAP_ENGINES}")
        if c.checkpoint_problem is not None:
            reasons.append(f"the engine's router weights cannot be read: {c.checkpoint_problem}")
        if c.engine_problem is not None:
            reasons.append(c.engine_problem)
    if c.capture is None:
        reasons.append("serve --capture (off by default): the recorded traffic a job an alert starts is fitted on")
    elif not c.capture:
        reasons.append(
            "traffic capture is off, so a job an alert starts would have no data: serve with --capture "
            "(or run `mla-watch retune run --dataset FILE` yourself)"
        )
    return reasons


def why_retune_is_off(conditions: RetuneConditions) -> str | None:
    """The reasons of :func:`retune_reasons` as one text, ``None`` when none applies: ``re-tuning is off: A; B``;
    ``an alert starts no re-tune job: A`` where only the traffic to re-tune from is missing; ``re-tuning needs:
    A; B`` where nothing is known to be wrong, only unknown."""
    reasons = retune_reasons(conditions)
    if not reasons:
        return None
    c = conditions
    if (
        c.routers == "none"
        or c.engine_retune == "off"
        or c.swaps is False
        or c.checkpoint_problem is not None
        or c.engine_problem is not None
    ):
        header = "re-tuning is off"
    elif c.capture is False:
        header = "an alert starts no re-tune job"
    else:
        header = "re-tuning needs"
    return f"{header}: {'; '.join(reasons)}"


def no_job_note(conditions: RetuneConditions, whose: str = "") -> str:
    """An alert's ``retune`` annotation where no job could start: ``no re-tune job[ whose]: A; B``."""
    return f"no re-tune job{whose}: {'; '.join(retune_reasons(conditions)) or 'nothing to re-tune'}"
