"""The sidecar beside an engine, as light as a sidecar: --help, start-up, resident memory, install size.

    python -m bench.engine_side                                        # this interpreter
    python -m bench.engine_side --python /work/venvs/engine-side/bin/python --venv /work/venvs/engine-side
    python -m bench.engine_side --answers 1000 --tokens 2000           # the issue's load (minutes on 2 cores)

Measured in one run, with ``--python`` (an interpreter where mla_watch is installed; by default this one,
whose torch is installed but must not be imported):

* ``mla-watch --help``: median wall time of ``--repeats`` runs against ``python -c pass`` in the same run;
* ``serve --upstream URL --engine vllm --model-config config.json`` beside a fake vLLM (its own process,
  canned DeepSeek-V3 answers of ``--tokens`` tokens with their routing, bench/engine_routing.py): the
  time from the process start to ``/readyz`` 200, and the resident memory (VmRSS) of the sidecar and its
  decoding processes: idle once ready, then after ``--answers`` answers, each counted;
* with ``--venv``: that virtual environment's size on disk (an engine-side install: ``pip install .``),
  against what the ``[model]`` extra's packages (torch, transformers, tokenizers, matplotlib) occupy in
  this interpreter's environment.

Nothing is asserted: on a shared machine only figures measured in one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import httpx

from bench.engine_routing import DEEPSEEK_V3, engine_bodies, fake_engine, key
from harness.support import end_process, free_port, metric_value, process_tree_rss
from mla_watch.engines.geometry import parse_geometry

MODEL_EXTRA = ("torch", "transformers", "tokenizers", "matplotlib")


def wall(command: list[str], repeats: int) -> float:
    """Median wall seconds of ``command`` (its output discarded)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=tempfile.gettempdir()
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def tree_rss_mib(pid: int) -> tuple[float, int, float]:
    """VmRSS of ``pid`` and every process below it, in MiB, how many processes that is, and ``pid``'s own."""
    rss = process_tree_rss(pid)
    return sum(rss.values()) / 1024, len(rss), rss.get(pid, 0) / 1024


def tree_size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / (1 << 20)


def distribution_mib(name: str) -> float | None:
    """What an installed distribution's files occupy, in MiB; ``None`` where it is not installed here."""
    try:
        files = metadata.distribution(name).files or []
    except metadata.PackageNotFoundError:
        return None
    return sum(f.locate().stat().st_size for f in files if f.locate().is_file()) / (1 << 20)


def serve_figures(python: str, answers: int, tokens: int, root: Path) -> dict[str, float]:
    geometry = parse_geometry(DEEPSEEK_V3)
    engine_dir = root / "engine"
    engine_dir.mkdir()
    for name, body in engine_bodies(geometry, [tokens]).items():
        if name.startswith("vllm_"):
            (engine_dir / f"{name}.json").write_bytes(body)
    (engine_dir / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    figures: dict[str, float] = {}
    with fake_engine(engine_dir) as upstream:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_WATCH_")}
        started = time.perf_counter()
        process = subprocess.Popen(
            [
                python,
                "-m",
                "mla_watch.cli",
                "serve",
                "--port",
                str(port),
                "--state-dir",
                str(root / "state"),
                "--upstream",
                upstream,
                "--engine",
                "vllm",
                "--model-config",
                str(engine_dir / "config.json"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=root,
        )
        try:
            with httpx.Client(timeout=60) as client:
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"the sidecar exited with {process.returncode}")
                    try:
                        if client.get(url + "/readyz").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.02)
                figures["ready_s"] = time.perf_counter() - started
                time.sleep(2.0)
                idle = tree_rss_mib(process.pid)
                figures["idle_rss_mib"], figures["idle_processes"], figures["idle_main_mib"] = idle
                body = {"prompt": key("vllm", tokens, True), "max_tokens": 16}  # the canned answer has its tokens
                line_header = {"X-Business-Line": "code_assistant"}
                for _ in range(answers):
                    answer = client.post(url + "/v1/completions", json=body, headers=line_header)
                    answer.raise_for_status()
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:  # every answer counted, or dropped at a full count queue
                    text = client.get(url + "/metrics").text
                    figures["counted"] = metric_value(
                        text, "mla_watch_engine_responses_total", engine="vllm", outcome="counted"
                    )
                    figures["dropped"] = metric_value(text, "mla_watch_engine_count_dropped_total", reason="queue_full")
                    if figures["counted"] + figures["dropped"] >= answers:
                        break
                    time.sleep(0.2)
                time.sleep(2.0)
                figures["loaded_rss_mib"], figures["loaded_processes"], figures["loaded_main_mib"] = tree_rss_mib(
                    process.pid
                )
        finally:
            end_process(process)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="an interpreter with mla_watch installed")
    parser.add_argument("--venv", type=Path, help="an engine-side virtual environment to size")
    parser.add_argument("--repeats", type=int, default=5, help="runs of --help and of python -c pass")
    parser.add_argument("--answers", type=int, default=200, help="answers sent through the sidecar")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of routing in each answer")
    args = parser.parse_args()

    help_s = wall([args.python, "-m", "mla_watch.cli", "--help"], args.repeats)
    pass_s = wall([args.python, "-c", "pass"], args.repeats)
    torch_s = wall([sys.executable, "-c", "import torch"], args.repeats)
    print(
        f"mla-watch --help: {help_s:.2f} s; python -c pass: {pass_s:.2f} s (x{help_s / pass_s:.1f}); "
        f"import torch alone, for scale: {torch_s:.2f} s"
    )
    with tempfile.TemporaryDirectory(prefix="mla-watch-engine-side-") as directory:
        figures = serve_figures(args.python, args.answers, args.tokens, Path(directory))
    print(
        f"serve beside a fake vLLM (DeepSeek-V3 geometry): /readyz 200 after {figures['ready_s']:.2f} s; "
        f"resident {figures['idle_rss_mib']:.0f} MiB idle ({figures['idle_processes']:.0f} process(es)), "
        f"{figures['loaded_rss_mib']:.0f} MiB after {args.answers} answers of {args.tokens} tokens, "
        f"{figures['counted']:.0f} counted and {figures['dropped']:.0f} dropped at the full count queue "
        f"({figures['loaded_processes']:.0f} process(es); the server's own {figures['idle_main_mib']:.0f} MiB "
        f"idle, {figures['loaded_main_mib']:.0f} MiB once the queue drained)"
    )
    if args.venv is not None:
        venv = tree_size_mib(args.venv)
        extra = {name: distribution_mib(name) for name in MODEL_EXTRA}
        added = sum(size for size in extra.values() if size is not None)
        shown = ", ".join(f"{name} {size:.0f}" for name, size in extra.items() if size is not None)
        print(
            f"engine-side venv {args.venv}: {venv:.0f} MiB on disk; the [model] extra's packages here add "
            f"{added:.0f} MiB more ({shown}; their own dependencies not included), x{(venv + added) / venv:.1f}"
        )


if __name__ == "__main__":
    main()
