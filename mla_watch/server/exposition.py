"""The text ``GET /metrics`` answers: prometheus_client's, with the per-expert families written from lines made once.

prometheus_client formats every sample's label set on every scrape, some microseconds a sample: the per-expert
window counts of four business lines of DeepSeek-V3, 59,624 samples, took a third of a second a scrape that way,
holding the GIL the sidecar's event loop needs. A :class:`PrewrittenFamily` keeps its samples' text, from label
strings its collector made once per router and line, and makes its samples only for a reader that asks for them
(prometheus_client's own exposition, say); :func:`exposition` writes the text as it is and hands every other
family to prometheus_client.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import Protocol

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

__all__ = ["PrewrittenFamily", "exposition", "sample_prefix"]


class _Collects(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def _escape(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def sample_prefix(name: str, labels: dict[str, str]) -> str:
    """``name{label="value",...} ``: a sample's line up to its value."""
    return name + "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items()) + "} "


class PrewrittenFamily(GaugeMetricFamily):
    """A gauge family whose samples are written as text (:meth:`write`), for :func:`exposition`; ``samples`` are
    made from them when read."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self._chunks: list[str] = []
        self._rows: list[tuple[Sequence[dict[str, str]], Sequence[int]]] = []
        super().__init__(name, documentation, labels=list(labels))

    @property
    def samples(self) -> list[Sample]:
        return [
            sample for label_sets, values in self._rows for sample in map(Sample, repeat(self.name), label_sets, values)
        ]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:  # Metric's constructor sets none; add_metric is not for these
        if samples:
            raise TypeError(f"{self.name}: samples of a prewritten family are added with write()")

    def write(self, label_sets: Sequence[dict[str, str]], prefixes: Sequence[str], values: Sequence[int]) -> None:
        """Samples of ``label_sets``, whose lines begin with ``prefixes`` (:func:`sample_prefix` of them), taking
        ``values``, in order."""
        self._rows.append((label_sets, values))
        self._chunks.append("\n".join(map(str.__add__, prefixes, map(str, values))) + "\n")

    def text(self) -> str:
        help_text = self.documentation.replace("\\", r"\\").replace("\n", r"\n")
        return f"# HELP {self.name} {help_text}\n# TYPE {self.name} gauge\n" + "".join(self._chunks)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(source: _Collects) -> bytes:
    """The Prometheus text (format 0.0.4) of every family ``source`` collects (a registry, or a view of one)."""
    families = list(source.collect())
    written = [family for family in families if isinstance(family, PrewrittenFamily)]
    rest = generate_latest(_Families([family for family in families if not isinstance(family, PrewrittenFamily)]))
    return rest + "".join(family.text() for family in written).encode()
