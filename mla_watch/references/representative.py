"""Whether a learned healthy baseline is its line's traffic, judged by the line's reference prompts (numpy only).

The client bar (:mod:`mla_watch.routing.client_mix`) keeps one client's window from becoming a baseline, but a
baseline may still not be the line's traffic: learned before the bar, under a looser one, or from a window that
passed it and was still odd. The sidecar holds evidence no client writes: the line's reference prompts, read
through the routers serving. Where those routers route the prompts as they did while healthy (within the
reference tolerance: the model has not changed), the prompts' routing is the line's content through healthy
routers. A learned baseline that sits much further from it than the line's live window does - a window that
is itself the line's traffic by its clients - was not the line's traffic: :class:`BaselineCheck` drops it, to
be learned again (:meth:`~mla_watch.routing.baselines.Baselines.found_unrepresentative`).

Only expert routers are judged, on lines with a set of their own (the mixed default set describes no one
line). Measured on the bundled model (``python -m bench.baselines``): a line's reference prompts sit
0.0015-0.005 bits (Jensen-Shannon) from healthy windows of the line's traffic and from the baselines learned
from them, and 0.44-0.65 bits from a window of one client's flood. An indexer's choices over positions follow
how long the texts are, which the reference prompts do not share with the traffic: a healthy baseline of
doc_summary's indexers sits 2.4 times as far from them as the live window does, a window of one client's flood
of customer_service as little as 1.1 times - so an indexer's baseline rests on the client bar alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mla_watch.references.prompts import DEFAULT_SET
from mla_watch.references.readings import ReferenceBaseline, ReferenceReading
from mla_watch.routing.baselines import BY_REFERENCE, Baselines
from mla_watch.routing.client_mix import ClientMix
from mla_watch.routing.stats import js_divergence_bits
from mla_watch.routing.windows import RouterStats

__all__ = ["UNREPRESENTATIVE_MARGIN_BITS", "UNREPRESENTATIVE_RATIO", "BaselineCheck", "Finding"]

log = logging.getLogger("mla_watch.references")

# A baseline is not its line's traffic when the reference prompts sit more than RATIO times as far from it as from
# the live window, and MARGIN bits further. Healthy baselines read 0.66-1.42 times the live window's distance (both
# under 0.005 bits), a flood's window 108 times and more; the margin is RoutingDrift's own threshold: a baseline
# that far off would page healthy traffic as drift.
UNREPRESENTATIVE_RATIO = 4.0
UNREPRESENTATIVE_MARGIN_BITS = 0.05


@dataclass(frozen=True)
class Finding:
    """One expert router's learned baseline of one line against the line's reference prompts and live window."""

    router: str
    business_line: str
    baseline_bits: float  # Jensen-Shannon divergence of the reference routing from the baseline
    window_bits: float  # ... and from the live window

    @property
    def unrepresentative(self) -> bool:
        return (
            self.baseline_bits - self.window_bits > UNREPRESENTATIVE_MARGIN_BITS
            and self.baseline_bits > UNREPRESENTATIVE_RATIO * self.window_bits
        )

    def describe(self, set_name: str) -> str:
        return (
            f"the reference prompts of {set_name}, routed as while healthy, sit {self.baseline_bits:.3f} bits "
            f"(Jensen-Shannon) from this baseline and {self.window_bits:.3f} from the line's live window, itself "
            "the line's traffic by its clients"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "baseline_bits": round(self.baseline_bits, 6),
            "window_bits": round(self.window_bits, 6),
            "ratio": UNREPRESENTATIVE_RATIO,
            "margin_bits": UNREPRESENTATIVE_MARGIN_BITS,
        }


class BaselineCheck:
    """After each reading of a line's reference prompts, the line's learned expert baselines judged against it.

    ``records(line)``: the live windows of the line (:class:`~mla_watch.windows.RouterStats`); ``clients()``: whose
    tokens each window holds (``RoutingSources.window_clients``); ``tolerance_bits``: how far the reading may sit
    from its set's healthy baseline with the routers still routing as while healthy (``--reference-tolerance``).
    """

    def __init__(
        self,
        baselines: Baselines,
        records: Callable[[str], Sequence[RouterStats]],
        clients: Callable[[], Callable[[RouterStats], ClientMix | None]],
        *,
        tolerance_bits: float,
    ) -> None:
        self.baselines = baselines
        self._records = records
        self._clients = clients
        self.tolerance_bits = tolerance_bits

    def after(self, reading: ReferenceReading, healthy: ReferenceBaseline | None) -> list[Finding]:
        """Judge the baselines of the line ``reading`` describes; drop (and report) those not its traffic; every
        finding made."""
        line = reading.set_name
        if line == DEFAULT_SET or healthy is None or healthy.digest != reading.digest:
            return []
        mix = self._clients()
        findings: list[tuple[Finding, Any]] = []
        for record in self._records(line):
            baseline = self.baselines.get(record.router.name, line)
            if record.router.kind != "expert" or baseline is None or baseline.source != "learned":
                continue
            found = reading.counts(record.router.name)
            routed = healthy.counts.get(record.router.name)
            window = record.counts
            if (
                found is None
                or routed is None
                or window is None
                or not _comparable(found[0], routed, window, baseline.counts)
            ):
                continue
            if js_divergence_bits(found[0], routed) > self.tolerance_bits:
                continue  # the routers changed: the readings say so (the cause of an alert), not the baselines
            if record.stats.no_signal is not None or record.stats.tokens < self.baselines.learn_tokens:
                continue
            clients = mix(record)
            if clients is None or self.baselines.gate.judge(clients) is not None:
                continue  # the live window is not the line's traffic either: it proves nothing
            finding = Finding(
                record.router.name,
                line,
                js_divergence_bits(found[0], baseline.counts),
                js_divergence_bits(found[0], window),
            )
            findings.append((finding, baseline))
        gone = {
            id(baseline)
            for baseline in self.baselines.found_unrepresentative(
                (
                    baseline,
                    BY_REFERENCE,
                    finding.describe(line),
                    {
                        **finding.as_dict(),
                        "set": line,
                        "set_version": reading.set_version,
                        "reading_at": reading.taken_at,
                    },
                )
                for finding, baseline in findings
                if finding.unrepresentative
            )
        }
        dropped = [finding for finding, baseline in findings if id(baseline) in gone]
        if dropped:
            log.warning(
                "healthy baselines of %s are not the line's traffic: %s; learned again from the line's traffic (%s)",
                line,
                dropped[0].describe(line),
                ", ".join(
                    f"{finding.router}: {finding.baseline_bits:.3f} vs {finding.window_bits:.3f} bits"
                    for finding in dropped
                ),
            )
        return [finding for finding, _ in findings]


def _comparable(*counts: np.ndarray) -> bool:
    """One shape and some selections in each: what a divergence is measured between."""
    return len({c.shape for c in counts}) == 1 and all(float(np.sum(c)) > 0 for c in counts)
