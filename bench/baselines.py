"""Healthy baselines no single client writes: the client bar and the reference prompts on the bundled model.

    python -m bench.baselines                    # about 4 minutes on 2 CPU cores
    python -m bench.baselines --json baselines.json

One ``serve`` in this process on the bundled model, the shipped rules and reference prompts, defaults otherwise
(4096-token windows, baselines of 2048 tokens, at most 50% of a window from one client, at least 3 clients).

1. **A flood inside the trained length, before any baseline.** One client (``flood-1``) sends customer_service one
   word repeated 180 times (of the 256 positions the model was trained on), three requests for each of three
   other clients' usual short questions (answers of up to 96 tokens). Printed: the baselines learned meanwhile
   (the issue's sidecar learned every indexer's from the flood's first long prompts), the flooding client's share
   of the line's tokens, and of the tokens that carry an indexer's signal, and what ``GET /v1/baseline`` says.
2. **Healthy traffic of every shipped line** (a second, fresh ``serve``), each from three clients
   (customer_service's questions, code and SQL for code_assistant, doc_summary's documents with summaries of up to
   96 tokens), until every line's expert baselines are learned: their clients and the largest share.
3. **What a later reading of the reference prompts sees**, one window of healthy traffic later, per line and
   router kind: the Jensen-Shannon divergence of the line's reference reading from its learned baseline (``B``),
   from the line's live window (``W``), and from a window of one client's flood of the line (``F``, what a
   baseline learned from a flood holds); the ratios ``B/W`` and ``F/W`` that :mod:`mla_watch.references.representative`
   judges (a baseline is found unrepresentative past 4 times and 0.05 bits), and the baselines it found.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from harness.support import running_sidecar
from mla_watch.models import corpus
from mla_watch.references.representative import UNREPRESENTATIVE_MARGIN_BITS, UNREPRESENTATIVE_RATIO
from mla_watch.routing.stats import js_divergence_bits

LINES = {
    "customer_service": (("customer_service", "chat"),),
    "code_assistant": (("code", "code"), ("sql", "sql")),
    "doc_summary": (("doc_summary", "summarize"),),
}
FLOOD = " ".join(["select"] * 180)
MAX_TOKENS = 96


def post(url: str, line: str, task: str, prompt: str, client: str, max_tokens: int = MAX_TOKENS, seed: int = 0) -> int:
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "seed": seed},
        headers={"X-Business-Line": line, "X-Task": task, "X-Client-Id": client},
        timeout=120,
    )
    answer.raise_for_status()
    return int(answer.json()["usage"]["total_tokens"])


def healthy(url: str, seed: int, tokens_per_line: int) -> int:
    """Each line's usual traffic from three clients until each sent ``tokens_per_line``; the requests sent."""
    sent = 0
    for line, kinds in LINES.items():
        prompts = {domain: corpus.prompts(domain, 400, seed=seed) for domain, _ in kinds}
        tokens, index = 0, 0
        while tokens < tokens_per_line:
            domain, task = kinds[index % len(kinds)]
            tokens += post(url, line, task, prompts[domain][index], f"{line}-app-{index % 3}", seed=index)
            index += 1
        sent += index
    return sent


def baseline_view(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/baseline", timeout=30).json()


def flood_phase(url: str) -> dict[str, Any]:
    questions = corpus.prompts("customer_service", 60, seed=20261)
    requests = 0
    for index in range(12):
        for _ in range(3):
            post(url, "customer_service", "chat", FLOOD, "flood-1", max_tokens=16)
            requests += 1
        for client in range(3):
            post(
                url,
                "customer_service",
                "chat",
                questions[3 * index + client],
                f"customer_service-app-{client}",
                seed=index,
            )
            requests += 1
    view = baseline_view(url)
    waiting = {
        entry["clients"]["keys_seen"]: entry
        for entry in view["waiting"]
        if entry["business_line"] == "customer_service"
    }

    def flood_share(keys: int) -> float | None:
        entry = waiting.get(keys)
        return (
            None
            if entry is None
            else next((c["share"] for c in entry["clients"]["clients"] if c["client"] == "flood-1"), 0.0)
        )

    return {
        "requests": requests,
        "series_learned": len(view["series"]),
        "flood_share_of_tokens": flood_share(0),
        "flood_share_of_indexer_signal": flood_share(128),
        "not_learning": view["not_learning"],
    }


def padded_js(counts: np.ndarray, other: np.ndarray) -> float:
    """Jensen-Shannon divergence (bits); an indexer's position counts padded to one length, as drift is."""
    length = max(counts.size, other.size)
    return js_divergence_bits(np.pad(counts, (0, length - counts.size)), np.pad(other, (0, length - other.size)))


def divergences(
    reading: Any,
    windows: dict[str, dict[str, dict[str, np.ndarray]]],
    routers: list[Any],
    line: str,
) -> list[dict[str, Any]]:
    rows = []
    for info in routers:
        found = reading.counts(info.name)
        if found is None:
            continue
        b, w, f = (padded_js(found[0], windows[name][line][info.name]) for name in ("baseline", "live", "flood"))
        rows.append(
            {
                "line": line,
                "router": info.name,
                "kind": info.kind,
                "B": b,
                "W": w,
                "F": f,
                "B/W": b / w if w else float("inf"),
                "F/W": f / w if w else float("inf"),
            }
        )
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for line in LINES:
        for kind in ("expert", "indexer"):
            chosen = [row for row in rows if row["line"] == line and row["kind"] == kind]
            if not chosen:
                continue
            span = {
                key: (round(min(r[key] for r in chosen), 4), round(max(r[key] for r in chosen), 4))
                for key in ("B", "W", "F", "B/W", "F/W")
            }
            out.append({"line": line, "kind": kind, "routers": len(chosen), **span})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    started = time.monotonic()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work, running_sidecar(state_dir=Path(work) / "state") as (url, _):
        figures["flood_before_any_baseline"] = flood = flood_phase(url)
        print(f"== one client's flood of customer_service before any baseline: {json.dumps(flood)}")
    # A fresh sidecar: the flood's own alerts (pending or firing on customer_service) would hold its learning back.
    with tempfile.TemporaryDirectory() as work, running_sidecar(state_dir=Path(work) / "state") as (url, sidecar):
        windows = sidecar.probe.windows
        experts = {info.name for info in windows.routers if info.kind == "expert"}

        def expert_lines() -> set[str]:
            return {s["business_line"] for s in baseline_view(url)["series"] if s["router"] in experts}

        sent = 0
        while expert_lines() < {"all", *LINES}:
            sent += healthy(url, seed=1 + sent, tokens_per_line=1024)
        learned = [s for s in baseline_view(url)["series"] if s["router"] in experts]
        figures["healthy_learned"] = {
            "requests": sent,
            "series": len(learned),
            "clients": {
                line: {
                    "count": min(s["clients"]["count"] for s in learned if s["business_line"] == line),
                    "largest_share": max(
                        s["clients"]["clients"][0]["share"] for s in learned if s["business_line"] == line
                    ),
                }
                for line in LINES
            },
        }
        print(
            f"== healthy traffic, three clients a line, until every line's experts are learned: "
            f"{json.dumps(figures['healthy_learned'])}"
        )
        baseline = {
            line: {
                info.name: found.counts
                for info in windows.routers
                if (found := sidecar.baselines.get(info.name, line)) is not None
            }
            for line in LINES
        }
        healthy(url, seed=500, tokens_per_line=4200)  # a window later: the live windows are all new traffic
        live = {line: windows.counts(line) for line in LINES}
        readings = {reading.set_name: reading for reading in sidecar.references.prober.read_now(list(LINES))}
        found = [
            {
                "router": entry["router"],
                "line": entry["business_line"],
                "reason": entry["reason"],
                **{key: entry["details"].get(key) for key in ("baseline_bits", "window_bits")},
            }
            for entry in baseline_view(url)["unrepresentative"]
        ]
        flood_windows = {}
        for line, kinds in LINES.items():
            tokens = 0
            while tokens < 4200:
                tokens += post(url, line, kinds[0][1], FLOOD, "flood-1", max_tokens=16)
            flood_windows[line] = windows.counts(line)
        rows = [
            row
            for line in LINES
            for row in divergences(
                readings[line],
                {"baseline": baseline, "live": live, "flood": flood_windows},
                [info for info in windows.routers if info.name in baseline[line]],
                line,
            )
        ]
        figures["reference_divergence"] = summarise(rows)
        figures["found_unrepresentative"] = found
        figures["threshold"] = {"ratio": UNREPRESENTATIVE_RATIO, "margin_bits": UNREPRESENTATIVE_MARGIN_BITS}
        print(
            "== the reference reading's Jensen-Shannon divergence (bits) from the learned baseline (B), the live "
            "window (W) and one client's flood window (F), min-max per line and router kind:"
        )
        for entry in figures["reference_divergence"]:
            print("  " + json.dumps(entry))
        print(f"== learned baselines found unrepresentative by the reading: {json.dumps(found)}")
    figures["seconds"] = round(time.monotonic() - started, 1)
    print(f"== {figures['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
