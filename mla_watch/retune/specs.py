"""The one builder of re-tune :class:`~mla_watch.retune.jobs.JobSpec`\\ s, for a rule's ``retune`` action
(:meth:`~mla_watch.retune.service.RetuneService.on_alert`) and for ``POST /admin/retune``.

A job must bring its routers back into the band of the rule that asked for it
(:func:`~mla_watch.retune.gates.band_of_rule`), or into :data:`~mla_watch.retune.gates.DEFAULT_BAND` when
no rule did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mla_watch.retune.gates import DEFAULT_BAND, Band, band_of_rule
from mla_watch.retune.jobs import JobSpec
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER

__all__ = ["alert_job_spec", "job_band", "job_spec", "request_job_spec"]


def job_band(rule: Any | None) -> Band:
    """The band a job's routers must return to: ``rule``'s, or :data:`DEFAULT_BAND` without one."""
    return band_of_rule(rule) if rule is not None else DEFAULT_BAND


def job_spec(
    *,
    rule: Any | None,
    routers: Sequence[str],
    watched: Sequence[str],
    strategies: Sequence[str],
    business_line: str | None,
    max_perplexity_increase: float | str,
    trigger: Mapping[str, Any],
    dataset: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> JobSpec:
    """A job for ``routers``, gated in the band of ``rule`` (see :func:`job_band`)."""
    return JobSpec(
        routers=list(routers),
        watched=list(watched),
        strategies=list(strategies),
        business_line=business_line,
        band=job_band(rule).as_dict(),
        dataset=dataset,
        options={} if options is None else options,
        max_perplexity_increase=max_perplexity_increase,
        trigger=dict(trigger),
    )


def alert_job_spec(
    action: Any,
    *,
    watched: Sequence[str],
    default_strategies: Sequence[str],
    max_perplexity_increase: float | str,
    at: float,
) -> JobSpec:
    """A rule's ``retune`` action: one job for the alert's router, in the band of its rule, with the rule's
    strategies (else ``default_strategies``); the alert's business line (none for every line summed)."""
    labels = action.alert.labels
    line = labels.get(BUSINESS_LINE)
    rule = action.rule
    return job_spec(
        rule=rule,
        routers=[labels[ROUTER]],
        watched=watched,
        strategies=list(rule.retune_strategies or default_strategies),
        business_line=None if line in (None, "", "all") else line,
        max_perplexity_increase=max_perplexity_increase,
        trigger={
            "source": "alert",
            "alertname": labels.get("alertname"),
            "rule": rule.name,
            "router": labels.get(ROUTER),
            "layer": labels.get(LAYER),
            "business_line": line,
            "value": action.alert.value,
            "fingerprint": action.alert.fingerprint,
            "receivers": list(rule.receivers),
            "at": at,
        },
    )


def request_job_spec(
    *,
    rule: Any | None,
    routers: Sequence[str],
    watched: Sequence[str],
    strategies: Sequence[str],
    business_line: str | None,
    dataset: str | None,
    options: dict[str, dict[str, Any]],
    max_perplexity_increase: float | str,
    at: float,
) -> JobSpec:
    """A job an admin asked for (``POST /admin/retune``), checked by the caller; ``rule`` is the one whose band
    it meets (``None``: :data:`DEFAULT_BAND`)."""
    return job_spec(
        rule=rule,
        routers=routers,
        watched=watched,
        strategies=strategies,
        business_line=business_line,
        dataset=dataset,
        options=options,
        max_perplexity_increase=max_perplexity_increase,
        trigger={
            "source": "api",
            "rule": rule.name if rule else None,
            "receivers": list(rule.receivers) if rule else None,
            "at": at,
        },
    )
