"""The demo's result, and what it writes and prints of it: ``summary.json``, ``timeline.png``, the summary lines.

:func:`mla_watch.cli.demo.run_demo` runs the loop and returns a :class:`DemoResult`; this module turns it into
the files in ``--out`` and the summary printed at the end. The router the demo breaks and the band its rule holds
it to are here, where both the run and its report read them.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_watch.common.output_file import write_file

__all__ = [
    "COLLAPSED",
    "FIRE_BELOW",
    "OUTPUT_ROOM",
    "RESOLVE_ABOVE",
    "DemoResult",
    "summary_lines",
    "timeline_png",
    "write_outputs",
]

COLLAPSED = "model.layers.1.mlp.gate"  # the router the demo's fault collapses
FIRE_BELOW, RESOLVE_ABOVE = 5.0, 5.2  # the demo rule's band (bits): fires below, resolves at or above


@dataclass
class DemoResult:
    steps: dict[str, bool]
    events: dict[str, float]  # event -> seconds since the start
    samples: list[dict[str, Any]]  # {t, bits: {layer: entropy}} over time
    requests: dict[str, int]
    adjustments: list[str]
    job: dict[str, Any] | None
    out_dir: Path
    notes: list[str] = field(default_factory=list)
    paged_bits: float | None = None  # the router's entropy as the page said it

    @property
    def ok(self) -> bool:
        return all(self.steps.values())

    def as_dict(self) -> dict[str, Any]:
        job = self.job or {}
        result = job.get("result") or {}
        return {
            "ok": self.ok,
            "steps": self.steps,
            "events_seconds": {k: round(v, 2) for k, v in self.events.items()},
            "requests": self.requests,
            "adjustments": len(self.adjustments),
            "job": {
                "id": job.get("id"),
                "status": job.get("status"),
                "strategy": result.get("strategy"),
                "version": result.get("version"),
                "timings": result.get("timings"),
            }
            if job
            else None,
            "entropy_bits": _phase_bits(self.samples, self.events, self.paged_bits),
            "notes": self.notes,
        }


OUTPUT_ROOM = 1 << 20  # bytes summary.json and timeline.png take at most (about 100 KB): checked free before the run


def write_outputs(result: DemoResult) -> None:
    """``summary.json`` and ``timeline.png`` into ``result.out_dir``; an ``OutputError`` in one line if refused."""
    write_file(
        result.out_dir / "summary.json",
        json.dumps(result.as_dict(), indent=2) + "\n",
        label=f"--out {result.out_dir / 'summary.json'}",
    )
    write_file(result.out_dir / "timeline.png", timeline_png(result), label=f"--out {result.out_dir / 'timeline.png'}")


def _phase_bits(
    samples: list[dict[str, Any]], events: dict[str, float], paged_bits: float | None
) -> dict[str, float | None]:
    """The collapsed router's entropy before the fault, as the page said it, and at the end."""

    def at(t: float | None) -> float | None:
        if t is None:
            return None
        before = [s for s in samples if s["t"] <= t and COLLAPSED in s["bits"]]
        return round(before[-1]["bits"][COLLAPSED], 3) if before else None

    return {
        "healthy": at(events.get("fault injected")),
        "at the page": None if paged_bits is None else round(paged_bits, 3),
        "after": round(samples[-1]["bits"].get(COLLAPSED, 0.0), 3) if samples else None,
    }


def timeline_png(result: DemoResult) -> bytes:
    """Entropy per layer over the run, the thresholds, and the events: a PNG's bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4.8), dpi=120)
    routers = sorted({name for s in result.samples for name in s["bits"]})
    for name in routers:
        points = [(s["t"], s["bits"][name]) for s in result.samples if name in s["bits"]]
        axis.plot(
            [t for t, _ in points],
            [b for _, b in points],
            label=name.replace("model.layers.", "layer ").replace(".mlp.gate", ""),
            linewidth=1.8,
        )
    axis.axhline(FIRE_BELOW, color="tab:red", linestyle="--", linewidth=1, label=f"fires below {FIRE_BELOW} bits")
    axis.axhline(
        RESOLVE_ABOVE, color="tab:green", linestyle=":", linewidth=1, label=f"resolves at {RESOLVE_ABOVE} bits"
    )
    axis.axhline(6.0, color="grey", linewidth=0.8, label="ceiling log2 64")
    axis.axhline(2.585, color="grey", linewidth=0.8, linestyle="-.", label="floor log2 6")
    colours = {
        "fault injected": "black",
        "on-call paged": "tab:red",
        "re-tune promoted": "tab:blue",
        "alert resolved": "tab:green",
    }
    for event, t in result.events.items():
        axis.axvline(t, color=colours.get(event, "grey"), linewidth=1.2, alpha=0.8)
        axis.text(t, 5.95, event + " ", rotation=90, va="top", ha="right", fontsize=8, color=colours.get(event, "grey"))
    axis.set_xlabel("seconds since the demo started")
    axis.set_ylabel("routing entropy, all lines (bits)")
    axis.set_ylim(2.4, 6.2)
    axis.set_title("mla-watch demo: a router collapses, on-call is paged, a re-tune is promoted, the alert resolves")
    axis.legend(loc="lower left", fontsize=8, ncol=3, framealpha=0.9)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    plt.close(figure)
    return png.getvalue()


def _seconds(timings: dict[str, Any]) -> list[str]:
    return [
        f"{k.removesuffix('_seconds').replace('_', ' ')} {v:g} s"
        if isinstance(v, (int, float))
        else f"{k.replace('_', ' ')} {v}"
        for k, v in timings.items()
        if v is not None
    ]


def _wrapped(key: str, value: str | list[str], pad: int, width: int) -> list[str]:
    """``key: value`` wrapped at word boundaries to ``width``, continued under the value; a list wraps
    between its items (a request count is not split from its name), inside one only where it is too long."""
    width = max(width - 1, pad + 30)
    room = width - pad - 2
    text = (
        value
        if isinstance(value, str)
        else ", ".join(item.replace(" ", "\0") if len(item) < room else item for item in value)
    )
    lines = textwrap.wrap(
        text or "none",
        width=width,
        initial_indent=f"  {key + ':':<{pad}}",
        subsequent_indent=" " * (pad + 2),
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [line.replace("\0", " ") for line in lines]


def summary_lines(result: DemoResult, width: int | None = None) -> list[str]:
    """The summary as aligned "key: value" lines, wrapped at word boundaries to ``width`` (the terminal's)."""
    summary = result.as_dict()
    width = width or shutil.get_terminal_size().columns
    lines = ["mla-watch demo summary"]
    for step, done in result.steps.items():
        lines.append(
            f"  [{'x' if done else ' '}] {step}" + (f"  ({result.events[step]:.1f} s)" if step in result.events else "")
        )
    rows: list[tuple[str, str | list[str]]] = [
        ("fault on", COLLAPSED),
        (
            "its entropy (bits)",
            [
                f"{phase} {'n/a' if value is None else f'{value:.3f}'}"
                for phase, value in summary["entropy_bits"].items()
            ],
        ),
    ]
    job = summary["job"]
    if job:
        rows.append(
            (
                "re-tune job",
                [
                    f"{job['id']}: {job['status']}",
                    *([job["strategy"]] if job["strategy"] else []),
                    *([f"router version {job['version']}"] if job["version"] else []),
                ],
            )
        )
        if job["timings"]:
            rows.append(("re-tune timings", _seconds(job["timings"])))
    refused = sum(": refused: " in a for a in result.adjustments)
    rows.append(
        ("policy", [f"{len(result.adjustments) - refused} requested values changed", f"{refused} requests refused"])
    )
    rows.append(("requests", [f"{key}: {count}" for key, count in sorted(result.requests.items())]))
    rows += [("note", note) for note in result.notes]
    rows.append(("wrote", [str(result.out_dir / "timeline.png"), str(result.out_dir / "summary.json")]))
    pad = max(len(key) for key, _ in rows) + 2
    for key, value in rows:
        lines += _wrapped(key, value, pad, width)
    return lines
