"""Run every benchmark of the project and print one table of figures against their anchors.

    python -m bench.run_all                        # quick arguments, 4-10 minutes on 2 shared CPU cores
    python -m bench.run_all --full                 # bench/README.md's arguments
    python -m bench.run_all --only rule_eval --only detection
    python -m bench.run_all --json table.json      # also write the whole table (and raw figures) as JSON

Each bench script runs as its own process (``sys.executable -m bench.NAME ... --json TMP``), one
after the other; its figures are read back from the JSON it writes, its printed output goes to a
log file (``--logs DIR`` keeps them; ``--verbose`` shows it as it runs). Every row gives the
benchmark, the figure, the measured value, the anchor it is compared with, the goal where
bench/README.md states one (with met / NOT met), and the command that reruns that benchmark alone.
If a bench fails, its rows say so, the others still run, and the exit status is 1 at the end.

The quick arguments are smaller than bench/README.md's (fewer alternations, requests, tokens,
scenarios), so their figures are noisier; ``--full`` regenerates bench/README.md's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Figures = dict[str, Any]


@dataclass
class Spec:
    """One row of the table: how to read its value (and whether the goal is met) from a bench's figures."""

    figure: str
    anchor: str
    value: Callable[[Figures], str]
    goal: str = ""
    met: Callable[[Figures], bool] | None = None


@dataclass
class Bench:
    name: str
    quick: list[str]
    full: list[str]
    specs: Callable[[list[str]], list[Spec]]  # the rows a run with these arguments produces


@dataclass
class Row:
    benchmark: str
    figure: str
    value: str
    anchor: str
    goal: str
    command: str
    ok: bool = True


@dataclass
class Result:
    name: str
    command: str
    rc: int | None = None
    wall_s: float = 0.0
    error: str | None = None
    log: str | None = None
    figures: Figures | None = field(default=None, repr=False)


def x(value: float, digits: int = 3) -> str:
    return f"x{value:.{digits}f}"


def arg_values(args: list[str], option: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == option]


# -- probe_overhead ------------------------------------------------------------------------------------------------

PROBE_MODELS = {"bundled": "bundled 3.1M", "large": "V3.2 config 98.8M"}


def probe_specs(args: list[str]) -> list[Spec]:
    models = arg_values(args, "--only") or list(PROBE_MODELS)
    specs = []
    for key in models:
        label = PROBE_MODELS[key]

        def ratio(figures: Figures, mode: str, key: str = key) -> str:
            r = figures["models"][key][f"{mode}_ratio"]
            low, high = r["ci95"]
            return (
                f"{x(r['median'])} median (95% CI {low:.4f}-{high:.4f}, spread {r['min']:.2f}-{r['max']:.2f}, "
                f"{len(r['values'])} alternations)"
            )

        def fastest(figures: Figures, key: str = key) -> str:
            m = figures["models"][key]
            return (
                f"probe {x(m['probe_fastest_ratio'], 4)}, naive {x(m['naive_fastest_ratio'], 4)}, "
                f"A/A {x(m['control_fastest_ratio'], 4)}"
            )

        def instructions(figures: Figures, key: str = key) -> str:
            counted = figures["models"][key].get("instructions")
            if counted is None:
                return "not counted (--instructions, needs valgrind)"
            return (
                f"{x(counted['ratio'], 4)} ({counted['probe_instructions'] / 1e6:.2f}M on "
                f"{counted['model_instructions'] / 1e6:.0f}M per generation)"
            )

        # The goal: the median of the per-alternation ratios at or below x1.01; where the instructions were
        # counted (the one figure noise cannot move), they must agree.
        def goal_met(f: Figures, key: str = key) -> bool:
            m = f["models"][key]
            counted = m.get("instructions")
            return m["probe_ratio"]["median"] <= 1.01 and (counted is None or counted["ratio"] <= 1.01)

        specs += [
            Spec(
                f"{label}: decode time ratio, probe / no probe",
                "no hooks, same prompt and alternation",
                lambda f, ratio=ratio: ratio(f, "probe"),
                "<= +1% (x1.01, median; instructions too when counted)" if key == "bundled" else "",
                goal_met if key == "bundled" else None,
            ),
            Spec(
                f"{label}: decode time ratio, no probe / no probe (A/A noise floor)",
                "no hooks, same prompt and alternation",
                lambda f, ratio=ratio: ratio(f, "control"),
            ),
            Spec(
                f"{label}: decode time ratio, naive hook / no probe",
                "no hooks, same prompt and alternation",
                lambda f, ratio=ratio: ratio(f, "naive"),
            ),
            Spec(f"{label}: fastest tenth of blocks, against no hooks", "no hooks' fastest tenth", fastest),
            Spec(
                f"{label}: instructions per generation, probe / no probe",
                "cachegrind, same imports and warm-up",
                instructions,
            ),
            Spec(
                f"{label}: probe memory",
                "absolute (device counters + host window)",
                lambda f, key=key: f"{f['models'][key]['probe_memory_bytes'] / 1024:.0f} KiB",
            ),
        ]
    return specs


# -- server_overhead -----------------------------------------------------------------------------------------------


def server_specs(args: list[str]) -> list[Spec]:
    def enforce(f: Figures) -> str:
        return f"{f['enforce_ms']['p99']:.3f} ms (p50 {f['enforce_ms']['p50']:.3f} ms)"

    def sidecar(f: Figures) -> str:
        a, b = f["in_process_ms"]["p50"], f["sidecar_ms"]["p50"]
        return f"{x(f['sidecar_ratio_p50'])} ({b:.1f} vs {a:.1f} ms, {b - a:+.1f} ms)"

    def proxy(f: Figures) -> str:
        b, c = f["sidecar_ms"]["p50"], f["proxy_ms"]["p50"]
        return f"{f['proxy_added_ms']['p50']:+.2f} ms ({c:.1f} vs {b:.1f} ms, {x(f['proxy_ratio_p50'])})"

    def throughput(f: Figures) -> str:
        t = f["throughput"]
        return (
            f"{t['requests_per_s']:.1f} req/s, {t['tokens_per_s']:.0f} tokens/s, statuses {t['statuses']}, "
            f"peak RSS {t['sidecar_peak_rss_mib']:.0f} MiB"
        )

    return [
        Spec(
            "policy enforcement p99",
            "absolute: enforce() on a request that needs clamping",
            enforce,
            "<= 1 ms at p99",
            lambda f: f["enforce_ms"]["p99"] <= 1.0,
        ),
        Spec(
            "1-token completion p50, sidecar / in-process", "in-process generate(), same attention, probe on", sidecar
        ),
        Spec(
            "proxy added p50",
            "straight to the upstream sidecar",
            proxy,
            "<= +2 ms at p50",
            lambda f: f["proxy_added_ms"]["p50"] <= 2.0,
        ),
        Spec("throughput, 8 clients x 16-token requests", "absolute", throughput),
    ]


# -- proxy_hop -----------------------------------------------------------------------------------------------------


def proxy_hop_specs(args: list[str]) -> list[Spec]:
    def added(arm: str, kind: str) -> Callable[[Figures], str]:
        def value(f: Figures) -> str:
            n = f"{arm}_{kind}"
            text = f"{f[f'{n}_added_p50_ms']:+.2f} ms (p95 {f[f'{n}_added_p95_ms']:+.2f} ms)"
            if arm == "mla_watch" and f"{n}_share_of_litellm" in f:
                text += f", {f[f'{n}_share_of_litellm']:.3f} of LiteLLM's {f[f'litellm_{kind}_added_p50_ms']:+.2f} ms"
            return text

        return value

    def plain_met(kind: str) -> Callable[[Figures], bool]:
        def met(f: Figures) -> bool:
            share = f.get(f"mla_watch_{kind}_share_of_litellm")
            return f[f"mla_watch_{kind}_added_p50_ms"] <= 2.0 and (share is None or share <= 0.15)

        return met

    def memory(f: Figures) -> str:
        rss = f["rss"]
        text = ", ".join(f"{arm} {kib / 1024:.0f} MiB in {count}" for arm, (kib, count) in rss.items())
        return text + (f" (x{rss['mla_watch'][0] / rss['litellm'][0]:.2f} LiteLLM's)" if "litellm" in rss else "")

    specs = [
        Spec(
            f"plain hop added, {kind}",
            "straight to the same fake engine, same round",
            added("mla_watch", kind),
            "<= +2 ms at p50 and <= 0.15 of LiteLLM's",
            plain_met(kind),
        )
        for kind in ("completion", "chat", "stream_end", "stream_first")
    ]
    specs.append(
        Spec(
            "resident memory after the run, process trees",
            "LiteLLM's proxy, same run",
            memory,
            "plain <= LiteLLM's",
            lambda f: "litellm" not in f["rss"] or f["rss"]["mla_watch"][0] <= f["rss"]["litellm"][0],
        )
    )
    if "--no-engine" not in args:
        specs += [
            Spec(
                f"--engine vllm added, {kind}, 2,000 tokens of routing",
                "straight to the same fake vLLM engine",
                added("mla_watch_vllm", kind),
            )
            for kind in ("completion", "chat", "stream_end")
        ]
    return specs


# -- detection -----------------------------------------------------------------------------------------------------


def detection_specs(args: list[str]) -> list[Spec]:
    def delay(f: Figures) -> str:
        if not f["detected"]:
            return f"NOT detected within {f['tokens_after_onset']:,} tokens"
        return f"{f['tokens_after_onset']:,} tokens ({f['seconds_after_onset']:.2f} s of replay)"

    return [
        Spec("detection delay, RoutingEntropyLow at the webhook", "fault onset (+10 bias, 6 experts, layer 2)", delay),
        Spec(
            "false alarms on healthy traffic",
            "held-out traffic of 4 lines, shipped rules, for: 0s",
            lambda f: f"{f['false_alarms']} pages on {f['healthy_tokens']:,} tokens",
            "0",
            lambda f: f["false_alarms"] == 0,
        ),
    ]


# -- rule_eval -----------------------------------------------------------------------------------------------------


def rule_specs(args: list[str]) -> list[Spec]:
    scenario = (arg_values(args, "--scenario") or ["both"])[-1]
    scenarios = ("steady", "churn") if scenario == "both" else (scenario,)
    about = {"steady": "no transitions", "churn": "hundreds of transitions"}
    specs = []
    for name in scenarios:

        def run(f: Figures, name: str = name) -> Figures:
            return next(r for r in f["runs"] if r["scenario"] == name and not r["state_file"])

        specs.append(
            Spec(
                f"rule evaluation, {name}: median CPU per evaluation",
                f"absolute: 2,880 checks, {about[name]}",
                lambda f, run=run: (
                    f"{run(f)['median_ms']:.2f} ms (p90 {run(f)['p90_ms']:.2f}, "
                    f"{run(f)['actions_per_evaluation']:.0f} actions/eval)"
                ),
                "< 5 ms",
                lambda f, run=run: run(f)["median_ms"] < 5.0,
            )
        )
    return specs


# -- retune --------------------------------------------------------------------------------------------------------

RETUNE_SCENARIOS = ("bias", "router_finetune", "restore")


def retune_specs(args: list[str]) -> list[Spec]:
    specs = []
    for name in arg_values(args, "--scenario") or RETUNE_SCENARIOS:

        def row(f: Figures, name: str = name) -> Figures:
            return next(r for r in f["scenarios"] if r["strategy"] == name)

        def promoted(f: Figures, row=row) -> str:
            r = row(f)
            if r["alert_to_promoted_s"] is None:
                bits = r.get("candidate_bits")
                return f"- ({r['outcome']}" + ("" if bits is None else f"; candidate {bits:.2f} bits on layer 1") + ")"
            resolved = r["fault_to_resolved_s"]
            return (
                f"{r['alert_to_promoted_s']:.1f} s ({r['outcome']}; fault -> resolved "
                f"{'-' if resolved is None else f'{resolved:.1f} s'})"
            )

        def ppl(f: Figures, row=row) -> str:
            r = row(f)
            return (
                f"{x(r['ppl_after_over_healthy'])} ({r['ppl_after']:.3f} / {r['ppl_healthy']:.3f}; "
                f"fault {r['ppl_fault']:.3f})"
            )

        specs += [
            Spec(f"retune {name}: alert -> promoted", "the RoutingEntropyLow alert (job trigger)", promoted),
            Spec(f"retune {name}: perplexity after / healthy", "healthy perplexity, 32 held-out code samples", ppl),
        ]
    return specs


def status_page_specs(args: list[str]) -> list[Spec]:
    def history(f: Figures) -> str:
        h = f["history"]
        return (
            f"{h['memory_mib']:.1f} MiB held; full reply {h['full_bytes'] / 2**20:.2f} MiB in "
            f"{h['full_ms']:.0f} ms; incremental {x(h['incremental_ratio'], 4)} of it"
        )

    def sample(f: Figures) -> str:
        return f"{f['sample']['sample_ms']:.2f} ms ({100 * f['sample']['core_share_at_10s']:.3f}% of a core at 10 s)"

    def serving(f: Figures) -> str:
        s = f["serving"]
        return (
            f"{x(s['ratio_median'])} median (spread {s['ratio_min']:.2f}-{s['ratio_max']:.2f}, "
            f"{s['rounds']} alternations)"
        )

    return [
        Spec("status page: 1 h of history, DeepSeek-V3.2 scale", "119 routers x 5 lines x 360 points", history),
        Spec("status page: one history sample", "the bundled model's routers x lines", sample),
        Spec(
            "status page: decode tokens/s, page polling every 1 s / none", "same sidecar, alternating rounds", serving
        ),
    ]


# -- attacks -------------------------------------------------------------------------------------------------------


def attack_specs(args: list[str]) -> list[Spec]:
    def attack(f: Figures, figure: str) -> Figures:
        return next(a for a in f["attacks"] if figure in a["figures"])

    def answered(f: Figures) -> str:
        wrong = [f"{a['number']} {a['name']}" for a in f["attacks"] if not a["ok"]]
        return f"{len(f['attacks']) - len(wrong)} of {len(f['attacks'])} as documented" + (
            f"; not: {'; '.join(wrong)}" if wrong else ""
        )

    def worst(f: Figures, key: str) -> Figures:
        return max(f["attacks"], key=lambda a: a["healthz_added_ms"][key])

    def added(f: Figures, key: str) -> str:
        a = worst(f, key)
        return (
            f"{a['healthz_added_ms'][key]:+.1f} ms during '{a['name']}' ({a['healthz'][key + '_ms']:.1f} vs "
            f"{f['rest_ms'][key + '_ms']:.1f} ms at rest)"
        )

    def get_growth(f: Figures) -> str:
        a = attack(f, "rss_growth_bytes_per_request")
        return f"{a['figures']['rss_growth_bytes_per_request']:+.0f} B/request over {a['requests']} requests"

    def ingest_growth(f: Figures) -> str:
        a = attack(f, "rss_growth_kib_per_request")
        return f"{a['figures']['rss_growth_kib_per_request']:+.0f} KiB/request over {a['requests']} requests"

    def series(f: Figures) -> str:
        a = attack(f, "metrics_series")
        return (
            f"{a['figures']['metrics_series']:,.0f} series, {a['figures']['metrics_bytes'] / 1e6:.1f} MB, "
            f"{a['figures']['metrics_seconds']:.2f} s to build"
        )

    return [
        Spec(
            "hostile requests: documented answers",
            "each attack of bench/attacks.py sent over HTTP",
            answered,
            "all",
            lambda f: all(a["ok"] for a in f["attacks"]),
        ),
        Spec(
            "hostile requests: /healthz p99 added, worst attack",
            "/healthz at rest, same sidecar",
            lambda f: added(f, "p99"),
            "<= +50 ms",
            lambda f: worst(f, "p99")["healthz_added_ms"]["p99"] <= 50.0,
        ),
        Spec(
            "hostile requests: /healthz p50 added, worst attack",
            "/healthz at rest, same sidecar",
            lambda f: added(f, "p50"),
        ),
        Spec("unknown-line GETs: sidecar RSS growth", "before the bound: about 33 KB/request", get_growth),
        Spec(
            "1-token deltas into wide windows: sidecar RSS growth",
            "646 kB requests; their windows' counts: 8 MiB",
            ingest_growth,
        ),
        Spec("/metrics of one source reporting many routers", "absolute (--series-routers x --series-lines)", series),
    ]


# -- engine_routing ------------------------------------------------------------------------------------------------


def engine_routing_specs(args: list[str]) -> list[Spec]:
    specs = []
    for engine in arg_values(args, "--format") or ["vllm", "sglang"]:
        n = f"{engine}_2000"

        def cpu(f: Figures, n: str = n) -> str:
            return (
                f"{f[f'routing_cpu_ms_{n}']:.2f} ms (worker {f[f'decode_cpu_ms_{n}']:.2f}: counting "
                f"{f[f'counts_cpu_ms_{n}']:.2f} + parse/strip {f[f'parse_strip_cpu_ms_{n}']:.2f}; on the loop "
                f"{f[f'window_cpu_ms_{n}']:.2f}; a reader's collect {f[f'collect_cpu_ms_{n}']:.2f})"
            )

        def added(f: Figures, n: str = n, engine: str = engine) -> str:
            return (
                f"{f[f'proxy_added_ms_{n}']:+.1f} ms ({f[f'proxy_on_p50_ms_{n}']:.1f} vs "
                f"{f[f'proxy_off_p50_ms_{n}']:.1f} ms, {x(f[f'proxy_ratio_{n}'], 2)}); 100 tokens "
                f"{f[f'proxy_added_ms_{engine}_100']:+.1f} ms"
            )

        def stall(f: Figures, n: str = n, rest: str = engine) -> str:
            return (
                f"{f[f'healthz_added_p99_ms_{n}']:+.1f} ms (p99 {f[f'healthz_p99_ms_{n}']:.1f} vs "
                f"{f[f'healthz_rest_p99_ms_{rest}']:.1f} ms at rest, {f[f'healthz_samples_{n}']} polls)"
            )

        specs += [
            Spec(
                f"decode+count 2,000 tokens DeepSeek-V3 (CPU ms), {engine}",
                f"absolute: thread CPU, median; {engine}'s field, 928k expert ids",
                cpu,
                "<= 5 ms",
                lambda f, n=n: f[f"routing_cpu_ms_{n}"] <= 5.0,
            ),
            Spec(
                f"proxy added p50, {engine}, 2,000 tokens, routing on / off",
                "the same body without routing (--engine none)",
                added,
            ),
            Spec(
                f"/healthz p99 added during routing-on requests, {engine}, 2,000 tokens",
                "/healthz at rest, same proxy",
                stall,
            ),
        ]
        if "--no-thread" not in args:
            specs.append(
                Spec(
                    f"/healthz p99 added, {engine}, 2,000 tokens, --decode-workers 0 (thread)",
                    "/healthz at rest, same proxy",
                    lambda f, n=n, engine=engine: stall(f, n + "_thread", engine + "_thread"),
                )
            )
    return specs


def history_size_specs(args: list[str]) -> list[Spec]:
    def size(f: Figures) -> str:
        return (
            f"{f['file_bytes'] / 2**20:.1f} MiB, {x(f['size_ratio'])} of the bound "
            f"({f['bytes_per_series_day'] / 1024:.1f} KiB per series-day)"
        )

    def write(f: Figures) -> str:
        return f"{f['write_ms_per_sample']:.2f} ms per sample; points() over a day {f['points_us_day']:.0f} us"

    return [
        Spec(
            "durable history: 30 days, 58 routers x 6 lines",
            "the size bound of mla_watch/history/store.py",
            size,
            goal="within the bound",
            met=lambda f: f["size_ratio"] <= 1.0,
        ),
        Spec("durable history: write per 10 s sample / read per rule", "348 series", write),
    ]


FLEET_LAYOUTS = ("10x1", "10x4", "100x4/10")  # bench/fleet_rules.py's default layouts


def fleet_rules_specs(args: list[str]) -> list[Spec]:
    layouts = args[args.index("--layouts") + 1 :] if "--layouts" in args else list(FLEET_LAYOUTS)
    layouts = [name for name in layouts if not name.startswith("--")]
    specs = []
    for name in layouts:

        def groups(f: Figures, name: str = name) -> dict[str, Any]:
            return f["layouts"][name]["groups"]

        def evaluation(f: Figures, name: str = name) -> str:
            return "; ".join(
                f"{group} {x(g['ratio_exported'])} of its exported {g['exported_interval_s']:g} s "
                f"({g['evaluation_s']:.2f} s, median of {len(g['evaluation_s_rounds'])} rounds; {g['missed']:.0f} "
                f"missed)"
                for group, g in groups(f, name).items()
            )

        def cost(f: Figures, name: str = name) -> str:
            layout = f["layouts"][name]
            per = {
                group: samples / (layout["replicas"] * layout["lines"])
                for group, samples in layout["samples_per_evaluation"].items()
            }
            return (
                f"{layout['per_expert_series']:,} per-expert series, {layout['series_per_replica']:,.0f} "
                f"scraped per replica; samples read per evaluation per replica and line: "
                + ", ".join(f"{group} {value:,.0f}" for group, value in per.items())
                + f"; RSS {layout['prometheus_rss_bytes_max'] / 2**20:,.0f} MiB; exact within "
                f"{layout['exactness']['max_difference']:.0e}"
            )

        def within_half(f: Figures, name: str = name) -> bool:
            return all(g["ratio_exported"] <= 0.5 for g in groups(f, name).values())

        specs += [
            Spec(
                f"fleet rules {name}: each group's evaluation / its exported interval",
                "real Prometheus, 2 cores",
                evaluation,
                "<= x0.5 (half the interval)",
                within_half,
            ),
            Spec(f"fleet rules {name}: series, samples read, memory", "58 routers x 256 experts per line", cost),
        ]
    return specs


BENCHES = [
    Bench("rule_eval", [], [], rule_specs),
    Bench(
        "probe_overhead",
        ["--only", "bundled", "--alternations", "20"],
        ["--alternations", "40", "--instructions"],
        probe_specs,
    ),
    Bench("server_overhead", ["--requests", "50", "--load-requests", "16"], ["--requests", "150"], server_specs),
    Bench("proxy_hop", ["--rounds", "40", "--load-requests", "100"], ["--rounds", "240"], proxy_hop_specs),
    Bench("detection", ["--healthy-tokens", "20000"], ["--healthy-tokens", "20000"], detection_specs),
    Bench("retune", [], [], retune_specs),  # no smaller arguments: three scenarios, each a few hundred requests
    Bench("status_page", ["--rounds", "3", "--requests", "20"], ["--rounds", "6"], status_page_specs),
    Bench("history_size", [], [], history_size_specs),
    Bench("fleet_rules", ["--rounds", "2", "--layouts", "10x1"], [], fleet_rules_specs),
    Bench("attacks", ["--requests", "1000", "--rounds", "3", "--bucket-requests", "10"], [], attack_specs),
    Bench(
        "engine_routing",
        ["--repeats", "5", "--requests", "20"],
        ["--repeats", "20", "--requests", "100", "--rest", "5"],
        engine_routing_specs,
    ),
]


def command_line(name: str, args: list[str]) -> str:
    return " ".join(["python", "-m", f"bench.{name}", *args])


def run_bench(bench: Bench, args: list[str], logs: Path, verbose: bool, timeout: float | None) -> Result:
    result = Result(bench.name, command_line(bench.name, args))
    out = logs / f"{bench.name}.json"
    log = logs / f"{bench.name}.log"
    result.log = str(log)
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", f"bench.{bench.name}", *args, "--json", str(out)]
    start = time.monotonic()
    with log.open("w") as handle:
        # Its own session, so that a timeout or Ctrl-C stops the sidecars it started as well.
        output = {} if verbose else {"stdout": handle, "stderr": subprocess.STDOUT}
        process = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, **output)
        try:
            result.rc = process.wait(timeout)
        except subprocess.TimeoutExpired:
            result.error = f"timed out after {timeout:.0f} s"
            stop(process)
        except KeyboardInterrupt:
            stop(process)
            raise
    result.wall_s = time.monotonic() - start
    if result.error is None and result.rc != 0:
        tail = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        result.error = f"exit status {result.rc}" + (f": {tail[0][:160]}" if tail else "")
    elif result.error is None:
        try:
            result.figures = json.loads(out.read_text())
        except (OSError, ValueError) as error:
            result.error = f"no JSON figures: {error}"
    return result


def stop(process: subprocess.Popen) -> None:
    """Stop the bench's process group (the bench and the sidecars it started): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def rows_for(bench: Bench, args: list[str], result: Result) -> list[Row]:
    rows = []
    for spec in bench.specs(args):
        goal, ok = spec.goal, True
        if result.figures is None:
            value, ok = f"FAILED ({result.error})", False
        else:
            try:
                value = spec.value(result.figures)
                if spec.met is not None:
                    goal = f"{spec.goal}: {'met' if spec.met(result.figures) else 'NOT met'}"
            except StopIteration:
                value, ok = "FAILED (not in the bench's figures)", False
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
                value, ok = f"FAILED (figure missing: {type(error).__name__} {error})", False
        rows.append(Row(bench.name, spec.figure, value, spec.anchor, goal, result.command, ok))
    return rows


def table(rows: list[Row]) -> str:
    header = Row("benchmark", "figure", "value", "anchor", "goal", "command")
    columns = ("benchmark", "figure", "value", "anchor", "goal", "command")
    cells = [[getattr(row, column) for column in columns] for row in (header, *rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = []
    for index, line in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main() -> int:
    names = [bench.name for bench in BENCHES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the README's arguments instead of the quick ones")
    parser.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only this bench (repeatable): {', '.join(names)}",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the whole table and every bench's figures as JSON")
    parser.add_argument("--logs", metavar="DIR", help="keep each bench's output and JSON in DIR (default: discarded)")
    parser.add_argument("--timeout", type=float, metavar="S", help="stop a bench that runs longer than S seconds")
    parser.add_argument("--verbose", action="store_true", help="show each bench's output as it runs")
    args = parser.parse_args()

    selected = [bench for bench in BENCHES if not args.only or bench.name in args.only]
    mode = "full" if args.full else "quick"
    started = time.monotonic()
    rows: list[Row] = []
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        if args.logs:
            logs = Path(args.logs)
            logs.mkdir(parents=True, exist_ok=True)
        else:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mla-watch-bench-")))
        for index, bench in enumerate(selected, 1):
            bench_args = bench.full if args.full else bench.quick
            print(f"[{index}/{len(selected)}] {command_line(bench.name, bench_args)}", file=sys.stderr, flush=True)
            result = run_bench(bench, bench_args, logs, args.verbose, args.timeout)
            status = "ok" if result.error is None else f"FAILED: {result.error}"
            print(f"      {status} ({result.wall_s:.0f} s)", file=sys.stderr, flush=True)
            if result.error is not None and not args.verbose:
                tail = Path(result.log).read_text(errors="replace").splitlines()[-15:]
                print("\n".join(f"      | {line}" for line in tail), file=sys.stderr, flush=True)
            results.append(result)
            rows += rows_for(bench, bench_args, result)
    wall = time.monotonic() - started

    print(
        f"mla_watch benchmarks, {mode} arguments{' (--full for the README figures)' if not args.full else ''}; "
        f"one run each, wall time {wall:.0f} s"
    )
    print(table(rows))
    failed = [result.name for result in results if result.error is not None]
    bad_rows = [row for row in rows if not row.ok]
    if failed or bad_rows:
        print(f"FAILED: {', '.join(failed or sorted({row.benchmark for row in bad_rows}))}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "mode": mode,
                    "wall_s": wall,
                    "rows": [asdict(row) for row in rows],
                    "benches": {
                        r.name: {
                            "command": r.command,
                            "rc": r.rc,
                            "wall_s": r.wall_s,
                            "error": r.error,
                            "log": r.log if args.logs else None,
                            "figures": r.figures,
                        }
                        for r in results
                    },
                },
                indent=2,
            )
            + "\n"
        )
    return 1 if failed or bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
