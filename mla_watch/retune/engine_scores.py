"""What the gates of a job re-tuning an engine's routers read: the held-out samples of the job's line, the engine's
scores of them and of the line's reference prompts, and what a score or a gate report says of a router's band
(no torch).

:class:`mla_watch.retune.engine_retuning.EngineRetuner` scores the held-out samples through the engine before and
after each swap and judges the candidate by them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.swap import EngineWeights, SampleScore
from mla_watch.quality.score import engine_score
from mla_watch.references.gate import ReferenceGate
from mla_watch.references.readers import ReferenceReader
from mla_watch.retune.capture import TokenSample, TrafficCapture
from mla_watch.retune.data import distinct_count, evidence_digest, split_held_out
from mla_watch.retune.gates import Band, GateReport, ModelScore
from mla_watch.retune.jobs import RetuneSettings

__all__ = [
    "health_by_band",
    "held_out_samples",
    "loads_of",
    "no_routing_check",
    "reference_scores",
    "score_samples",
    "short_of_band",
    "worse",
]


def held_out_samples(
    capture: TrafficCapture | None, settings: RetuneSettings, line: str | None
) -> tuple[list[TokenSample] | str, dict[str, Any]]:
    """The distinct held-out samples of ``line`` (``None``: every line) that ``capture`` holds, or what is missing;
    with what the job's record says of its data."""
    if capture is None:
        return (
            "no data: traffic capture is off (serve with --capture to record the engine's traffic per business line)"
        ), {}
    samples = capture.samples(line, limit=settings.max_samples)
    data: dict[str, Any] = {
        "source": "capture",
        "business_line": line,
        "samples": len(samples),
        "distinct_samples": distinct_count(samples),
        "evidence": evidence_digest(samples),
    }
    if len(samples) < settings.min_samples or data["distinct_samples"] < 2:
        return (
            f"{len(samples)} captured samples ({data['distinct_samples']} distinct) of "
            f"{repr(line) if line else 'all business lines'}; the job needs at least "
            f"{settings.min_samples} (let more traffic be captured)"
        ), data
    _, held_out = split_held_out(samples, settings.held_out_fraction)
    held_out = [sample for sample in held_out if (sample.scored_tokens or len(sample)) >= 2]
    tokens = sum(min(sample.scored_tokens or len(sample), settings.max_tokens_per_sample) - 1 for sample in held_out)
    data.update(held_out_samples=len(held_out), held_out_tokens=tokens)
    if tokens < settings.min_held_out_tokens or len(held_out) < settings.min_held_out_samples:
        return (
            f"{tokens} scored held-out tokens in {len(held_out)} distinct samples; the gate decides on at "
            f"least {settings.min_held_out_tokens} tokens in {settings.min_held_out_samples} "
            f"distinct samples (let more traffic be captured: a repeated prompt counts once)"
        ), data
    return held_out, data


def score_samples(
    weights: EngineWeights,
    geometry: EngineGeometry,
    samples: Sequence[TokenSample],
    *,
    max_tokens: int,
    timeout: float,
    clock: Callable[[], float],
) -> ModelScore:
    """``samples`` scored by the engine, one at a time, each cut to its scored tokens and ``max_tokens``;
    ``TimeoutError`` once ``timeout`` seconds on ``clock`` have passed (--engine-gate-timeout)."""
    deadline = clock() + timeout
    scores: list[SampleScore] = []
    for sample in samples:
        if clock() > deadline:
            raise TimeoutError(
                f"the engine scored {len(scores)} of {len(samples)} held-out samples within "
                f"{timeout:g} s (--engine-gate-timeout)"
            )
        scored = sample[: (sample.scored_tokens or len(sample))][:max_tokens]
        scores.extend(weights.score([scored]))
    return engine_score(scores, geometry)


def reference_scores(
    prompts: ReferenceGate | None, reader: ReferenceReader | None, line: str | None
) -> dict[str, ModelScore]:
    """The reference prompts of ``line`` read through the engine as it serves now (none without both)."""
    if prompts is None or reader is None:
        return {}
    return {reference.name: reader.read(reference) for reference in prompts.sets_for(line)}


def no_routing_check(band: Band) -> dict[str, Any]:
    """The band check of a candidate whose held-out samples the engine returned no routing for (vLLM without
    --enable-return-routed-experts): undecided, and perplexity decides."""
    return {
        "gate": "band",
        "value": None,
        "limit": band.describe(),
        "decision": "insufficient",
        "passed": False,
        "binding": False,
        "message": "the engine returned no routing for the held-out samples (vLLM: "
        "--enable-return-routed-experts): the band is not judged, perplexity "
        "decides",
    }


def loads_of(score: ModelScore, router: str) -> np.ndarray | None:
    """A router's loads over the scored samples, from the engine's routing of them (``None``: not routed)."""
    record = score.routers.get(router)
    return None if record is None else record.counts


def health_by_band(score: ModelScore, routers: Sequence[str], band: Band) -> dict[str, Any]:
    """A restored router's own health through the engine: its band reading on the held-out samples."""
    measured = [
        router for router in routers if score.metric(router, band.metric) is not None and not score.too_small(router)
    ]
    if len(measured) < len(routers):
        return {
            "passed": False,
            "checked": False,
            "tokens": score.tokens,
            "reason": "the engine returned too little routing of the held-out samples to judge the routers",
        }
    breaches = [router for router in routers if not band.contains(score.metric(router, band.metric))]  # type: ignore[arg-type]
    return {
        "passed": not breaches,
        "checked": True,
        "tokens": score.tokens,
        "reason": "no router outside its band"
        if not breaches
        else "; ".join(
            f"{router}: {band.metric} {score.metric(router, band.metric):.3f} outside {band.describe()}"
            for router in breaches
        ),
    }


def short_of_band(report: GateReport) -> bool:
    """A band check read a router outside its band (as opposed to every band check passing or undecided)."""
    return any(check["gate"] == "band" and check["decision"] == "reject" for check in report.checks)


def worse(report: GateReport) -> bool:
    """The perplexity check rejected the candidate (a band reading short of the band is not worse)."""
    return report.perplexity.decision == "reject"
