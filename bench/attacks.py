"""Hostile requests replayed against a live sidecar (the bounds of docs/security.md put to the test), with
``/healthz`` watched meanwhile.

    python -m bench.attacks                           # about two minutes on 2 CPU cores
    python -m bench.attacks --requests 1000 --rounds 3
    python -m bench.attacks --json figures.json       # also write the figures as JSON

One ``mla-watch serve`` process on the bundled model, on a loopback port, as in production,
with a short ``--body-timeout`` (2 s) so that a trickling body is cut off quickly. Every attack
below that can be sent over HTTP is replayed in turn:

1. ``GET /v1/routing?business_line=<random>``, thousands of times (the sidecar's RSS growth
   per request);
2. ingestion bodies with huge, negative, overflowing, float, string and boolean numbers, wrong
   lengths, duplicate slots, unknown fields, refused part-way, over the body limit; thousands
   of business lines per request; many small deltas into wide windows (RSS growth per
   request); more sources than ``--ingest-max-sources``;
4. a remote router named like one of the sidecar's own;
5. re-tune datasets named by a path outside the dataset directory (an existing and a missing
   one must get the same answer, and the file's content is never shown);
7. a ~1 MB prompt, 28k chat messages, ``/metrics`` with tens of thousands of series;
8. JSON nested 50k deep, admin values that used to end in 500 (``version: 10**300``, a
   300-character dataset name, a business line with a newline, options of a strategy that does
   not exist), request bodies that trickle in over a raw socket (408 after ``--body-timeout``).

While an attack runs, a second thread polls ``/healthz`` every 20 ms. Per attack the bench
prints the statuses it got against the documented ones, ``/healthz`` p50/p99 during the attack,
at rest (before the first attack) and their difference (the goal: within 50 ms of the
usual latency). Requests go to 127.0.0.1 only; every attack is bounded in count and time.

The attacks themselves are in harness/attacks.py, which tests/test_reliability.py replays too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.server_overhead import sidecar_process
from harness.attacks import HEALTHZ_GOAL_MS, Plan, Target, render, replay

# --------------------------------------------------------------------------- the bench


def serve_for_attacks(
    state_dir: Path, body_timeout: float, admin_token: str, ingest_token: str
) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen]]:
    """``mla-watch serve`` on the bundled model, with both tokens and a short body timeout."""
    environ = {
        **{k: v for k, v in os.environ.items() if k != "MLA_WATCH_ONCALL_URL"},
        "MLA_WATCH_ADMIN_TOKEN": admin_token,
        "MLA_WATCH_INGEST_TOKEN": ingest_token,
    }
    return sidecar_process("--state-dir", str(state_dir), "--body-timeout", str(body_timeout), env=environ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=Plan.routing_gets, help="GETs of unknown business lines (attack 1)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=Plan.rounds,
        help="repetitions of each small attack, and trickling connections per endpoint",
    )
    parser.add_argument(
        "--bucket-requests", type=int, default=Plan.bucket_requests, help="ingestion requests of 16 x 4,096-slot deltas"
    )
    parser.add_argument(
        "--series-routers", type=int, default=Plan.series_routers, help="routers of the source that fills /metrics"
    )
    parser.add_argument("--series-lines", type=int, default=Plan.series_lines, help="... on this many lines")
    parser.add_argument("--body-timeout", type=float, default=2.0, help="the sidecar's --body-timeout, in seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    plan = Plan(
        routing_gets=args.requests,
        rounds=args.rounds,
        bucket_requests=args.bucket_requests,
        series_routers=args.series_routers,
        series_lines=args.series_lines,
    )
    admin_token, ingest_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    with (
        tempfile.TemporaryDirectory(prefix="mla-watch-attacks-") as state,
        serve_for_attacks(Path(state) / "state", args.body_timeout, admin_token, ingest_token) as (url, process),
    ):
        target = Target(url, process.pid, admin_token, ingest_token, args.body_timeout)
        started = time.monotonic()
        result = replay(target, plan, progress=lambda text: print(text, file=sys.stderr, flush=True))
        wall = time.monotonic() - started
    print(
        f"hostile requests against mla-watch serve (bundled model, --body-timeout {args.body_timeout:g}), {wall:.0f} s"
    )
    print(render(result))
    documented = sum(1 for report in result.attacks if report.ok)
    worst = max(result.attacks, key=lambda report: result.added_ms(report)[1])
    print(
        f"{documented} of {len(result.attacks)} attacks got their documented answers with /healthz answering "
        f"throughout; the worst /healthz p99 was +{result.added_ms(worst)[1]:.1f} ms over rest, during "
        f"'{worst.name}' (goal: within {HEALTHZ_GOAL_MS:g} ms)"
    )
    if args.json:  # milliseconds throughout
        figures = {
            "bench": "attacks",
            "args": vars(args),
            "wall_s": wall,
            "goal_added_ms": HEALTHZ_GOAL_MS,
            **result.as_dict(),
        }
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
