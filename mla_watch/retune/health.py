"""The start-up health check of the routers a server starts with (router version 0).

A model can be deployed broken, and then version 0 is the damage, not a reference to restore.
At start-up the routers are measured on a short, fixed, mixed-domain text
(:func:`mla_watch.models.corpus.generate`, every domain), in one pass over a hook-free copy, and
judged by the loaded alert rules' own thresholds (the rules on a routing metric with ``below`` /
``above``; windows under a rule's minimum are not judged, as live). Version 0 is *healthy*
when no rule is breached; without such a rule it is *unchecked*. Either way the result is kept
in version 0's manifest, and ``restore`` uses version 0 only when healthy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mla_watch.models import corpus
from mla_watch.retune.bias import copy_without_hooks
from mla_watch.retune.data import make_batches
from mla_watch.retune.gates import score_model

__all__ = ["HEALTH_SAMPLES_PER_DOMAIN", "startup_health"]

HEALTH_SAMPLES_PER_DOMAIN = 24  # x 4 domains, ~40 tokens each: ~4k tokens, over every router's trusted minimum
_SEED = 20261201


def _threshold_rules(rules: Iterable[Any]) -> list[Any]:
    # Trend and prediction rules judge a history, not one reading: not a start-up check.
    return [rule for rule in rules if (rule.below is not None or rule.above is not None) and rule.trend is None]


def startup_health(model: torch.nn.Module, tokenizer: Any, rules: Iterable[Any], *,
                   samples_per_domain: int = HEALTH_SAMPLES_PER_DOMAIN) -> dict[str, Any]:
    """``{"passed", "checked", "tokens", "rules", "breaches", "reason"}`` for the routers of ``model`` now."""
    judged = _threshold_rules(rules)
    if not judged:
        return {"passed": False, "checked": False,
                "reason": "no alert rule with a below / above threshold is loaded to judge the routers by"}
    texts = [text for domain in corpus.DOMAINS for text in corpus.generate(domain, samples_per_domain, seed=_SEED)]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    batches = make_batches([sample for sample in ids if len(sample) >= 2], batch_size=8, pad_id=pad, max_tokens=256)
    with torch.no_grad():
        score = score_model(copy_without_hooks(model).eval(), batches, business_line="health")
    breaches = []
    for record in score.routers.values():
        described = {key: value for key, value in record.items() if key != "business_line"}  # any line's rule
        for rule in judged:
            if not rule.selector.matches(described):
                continue
            value = record.get(rule.metric)
            minimum = rule.min_tokens if rule.min_tokens is not None else record.get("min_tokens") or 0
            if value is None or value != value or (record.get("tokens") or 0) < minimum:
                continue
            if (rule.below is not None and value < rule.below) or (rule.above is not None and value > rule.above):
                breaches.append({"rule": rule.name, "router": record["name"], "metric": rule.metric,
                                 "value": round(float(value), 4),
                                 "threshold": rule.below if rule.below is not None else rule.above})
    reason = ("; ".join(f"{b['router']}: {b['rule']} ({b['metric']} {b['value']:g}, threshold {b['threshold']:g})"
                        for b in breaches[:5]) + (f"; and {len(breaches) - 5} more" if len(breaches) > 5 else "")
              if breaches else "no rule breached")
    return {"passed": not breaches, "checked": True, "tokens": score.tokens, "rules": sorted({r.name for r in judged}),
            "breaches": breaches, "reason": reason}
