"""What the probe costs: decode throughput with the probe, without it, and with a naive hook.

    python -m bench.probe_overhead                       # bundled model and a ~100M config
    python -m bench.probe_overhead --only bundled --alternations 40 --generations 1
    python -m bench.probe_overhead --only bundled --instructions   # also count instructions (valgrind)
    python -m bench.probe_overhead --device cuda --dtype bfloat16   # where there is a GPU
    python -m bench.probe_overhead --json figures.json   # also write the figures as JSON

The estimator. Four copies of the model run in one process: no hooks (the anchor), no hooks
again (the A/A control), one watched by mla_watch's probe for the whole run, and one with the
naive hook the DESIGN measured (``torch.bincount(...).tolist()`` on every router call). An
alternation is ``--generations`` rounds (default 8) in which each copy makes one greedy
generation of ``--tokens`` tokens (default 16, serve's default length) of the same prompt, in a
shuffled order, so the arms take turns a fraction of a second apart; each arm's time is summed
over the alternation. 8 x 16 is 128 decode passes, the probe's default ``flush_every``: the
probe counts its passes together at its own cadence, as in a serving process, and its last
generation of every alternation ends by counting everything it still holds, so each
alternation pays for all of its counting. Every arm is divided by the anchor of its own
alternation, and the printed figure is the median of those per-alternation ratios, with
a bootstrap 95% confidence interval of that median, its quartiles and its spread (min-max); a
10% trimmed mean is printed beside it as a cross-check. Why this is the right estimator on a
shared machine:

* Ratios of arms that take turns a fraction of a second apart cancel the slow drift (thermal, frequency, the
  other processes' load) that moves whole runs by far more than 1%.
* Other processes only ever add time, in bursts: a burst in the anchor's turns makes that ratio
  low, one in the probe's turns makes it high. The shuffled order gives both the same chance, so
  the median of the ratios is not pulled by the bursts whatever their size, where a mean is.
* The A/A control is the same estimator applied to two identical arms: its median should be
  x1.00 and its interval shows the noise floor.
* Beside it, the ratio of each arm's fastest tenth of alternations (their mean): the ones other
  processes disturbed least. The A/A control says how far it moves.

Wall time and process CPU time are both reported. On a CPU the model runs on ``--threads``
intra-op threads (default 1): a decode step of these models is too small to gain from more, and
on a shared two-core machine a second thread waits on the other processes (the bundled model
decoded faster with one thread than with two here, and its A/A quartiles were half as wide).

``--instructions`` adds the one figure that noise cannot move: the instructions the probe adds
per generation against the model's own, counted by valgrind's cachegrind in separate processes
that differ only in the probe (same imports, same warm-up). Instructions are not time: the
probe's Python runs between the model's ops with cold caches, so its share of the time is
larger than its share of the instructions; the whole-generation ratio is the goal's figure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV32ForCausalLM

import mla_watch
from mla_watch.models.architecture import bundled_config
from mla_watch.probe import discover_routers

LARGE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 64,
    "index_head_dim": 64,
    "index_n_heads": 4,
    "max_position_embeddings": 1024,
}


def naive_hooks(model: torch.nn.Module, probe_routers: list[mla_watch.RouterInfo]) -> Callable[[], None]:
    """The anchor from DESIGN.md: a bincount copied to the host on every router call."""
    modules = dict(model.named_modules())
    totals: dict[str, list[int]] = {}
    handles = []
    for info in probe_routers:

        def hook(module, args, output, info=info):
            indices = output[-1] if info.kind == "expert" else output
            flat = indices.reshape(-1)
            counts = torch.bincount(flat[flat >= 0].long(), minlength=info.num_slots).tolist()
            kept = totals.setdefault(info.name, [0] * len(counts))
            if len(kept) < len(counts):
                kept.extend([0] * (len(counts) - len(kept)))
            for slot, count in enumerate(counts):
                kept[slot] += count

        handles.append(modules[info.name].register_forward_hook(hook))
    return lambda: [handle.remove() for handle in handles]


def decode_seconds(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    tokens: int,
    probe: mla_watch.Probe | None = None,
    generations: int = 1,
) -> tuple[float, float]:
    """Wall and process CPU seconds of ``generations`` greedy generations; with ``probe``, counting every pass it
    holds at the end."""
    cpu = time.process_time()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(generations):
            model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
    if probe is not None:
        probe.count_pending()
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


ARMS = ("none", "control", "probe", "naive")  # "control": no hooks, a second time (the A/A check)


def ratio_summary(values: list[float], seed: int, resamples: int = 2000) -> dict:
    """Median of per-alternation ratios with a bootstrap 95% interval, quartiles, spread and a 10% trimmed mean."""
    ordered = sorted(values)
    trim = len(ordered) // 10
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "ci95": [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]],
        "quartiles": [quartiles[0], quartiles[2]],
        "min": ordered[0],
        "max": ordered[-1],
        "trimmed_mean": statistics.fmean(ordered[trim : len(ordered) - trim]),
        "values": values,
    }


def describe(summary: dict) -> str:
    low, high = summary["ci95"]
    q1, q3 = summary["quartiles"]
    return (
        f"median x{summary['median']:.4f} (95% CI {low:.4f}-{high:.4f}; quartiles {q1:.3f}-{q3:.3f}; "
        f"spread {summary['min']:.2f}-{summary['max']:.2f}; trimmed mean x{summary['trimmed_mean']:.4f})"
    )


def warm_prompt(model: torch.nn.Module, seed: int) -> torch.Tensor:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, 24), generator=generator).to(device)


def measure(name: str, model: torch.nn.Module, alternations: int, tokens: int, seed: int, generations: int) -> dict:
    prompt = warm_prompt(model, seed)
    routers = [info for _, info, _ in discover_routers(model)]
    # One copy of the model per arm, watched (or hooked) for the whole run, so that the arms can take turns
    # generation by generation and the probe flushes at its own cadence.
    copies = {mode: copy.deepcopy(model) for mode in ARMS}
    probe = mla_watch.attach(copies["probe"], window_tokens=4096)
    naive_hooks(copies["naive"], routers)
    for mode in ARMS:  # warm-up: allocator, caches, first calls
        decode_seconds(copies[mode], prompt, tokens, probe if mode == "probe" else None)
    order = random.Random(seed)
    ratios: dict[str, list[float]] = {mode: [] for mode in ARMS[1:]}
    cpu_ratios: dict[str, list[float]] = {mode: [] for mode in ARMS[1:]}
    seconds: dict[str, list[float]] = {mode: [] for mode in ARMS}
    for _ in range(alternations):
        gc.collect()
        timed = {mode: [0.0, 0.0] for mode in ARMS}
        for generation in range(generations):
            modes = list(ARMS)
            order.shuffle(modes)
            for mode in modes:
                # The probe's last turn of the alternation counts everything it still holds.
                last = mode == "probe" and generation == generations - 1
                wall, cpu = decode_seconds(copies[mode], prompt, tokens, probe if last else None)
                timed[mode][0] += wall
                timed[mode][1] += cpu
        for mode, value in timed.items():
            seconds[mode].append(value[0])
        for mode in ARMS[1:]:
            ratios[mode].append(timed[mode][0] / timed["none"][0])
            cpu_ratios[mode].append(timed[mode][1] / timed["none"][1])
    probe.collect()
    probe_memory = probe.counter_bytes + probe.window_bytes()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    throughput = tokens * generations / statistics.median(seconds["none"])
    print(
        f"\n{name}: {params:.1f}M parameters, {len(routers)} routers, {generations} rounds of "
        f"{tokens} tokens x {alternations} alternations, {throughput:.1f} tokens/s without hooks, "
        f"{torch.get_num_threads()} intra-op thread(s)"
    )
    summaries = {mode: ratio_summary(ratios[mode], seed) for mode in ARMS[1:]}
    cpu_summaries = {mode: ratio_summary(cpu_ratios[mode], seed) for mode in ARMS[1:]}
    labels = {"probe": "probe / none", "naive": "naive / none", "control": "none / none (A/A control)"}
    for mode in ("probe", "naive", "control"):
        print(f"  {labels[mode]}: wall {describe(summaries[mode])}")
        print(f"  {' ' * len(labels[mode])}  CPU  {describe(cpu_summaries[mode])}")
    fastest = {mode: statistics.fmean(sorted(values)[: max(1, len(values) // 10)]) for mode, values in seconds.items()}
    fastest_ratios = {mode: fastest[mode] / fastest["none"] for mode in ARMS[1:]}
    print(
        f"  fastest tenth of each arm's alternations (mean), against no hooks: probe x{fastest_ratios['probe']:.4f}, "
        f"naive x{fastest_ratios['naive']:.4f}, A/A control x{fastest_ratios['control']:.4f}"
    )
    print(f"  probe memory: {probe_memory / 1024:.1f} KiB (device counters + host window)")
    figures = {
        "name": name,
        "params_millions": params,
        "routers": len(routers),
        "tokens": tokens,
        "generations_per_alternation": generations,
        "alternations": alternations,
        "threads": torch.get_num_threads(),
        "tokens_per_s_none": throughput,
        "seconds_median": {mode: statistics.median(values) for mode, values in seconds.items()},
        "probe_memory_bytes": probe_memory,
        "seconds": seconds,
        **{f"{mode}_fastest_ratio": fastest_ratios[mode] for mode in ARMS[1:]},
    }
    for mode in ARMS[1:]:
        figures[f"{mode}_ratio"] = summaries[mode]
        figures[f"{mode}_cpu_ratio"] = cpu_summaries[mode]
    return figures


def load(key: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    if key == "bundled":
        model, _ = mla_watch.load_model("bundled", device=device)
        return model.to(dtype)
    torch.manual_seed(0)
    config = bundled_config(2048, pad_token_id=0, bos_token_id=1, eos_token_id=2, **LARGE)
    return DeepseekV32ForCausalLM(config).to(device, dtype).eval()


def instruction_worker(key: str, arm: str, generations: int, tokens: int, seed: int, per_block: int) -> None:
    """Run under cachegrind: a warm-up generation watched (every import and first call, in every arm), then
    ``generations`` timed-arm generations, watched only in the ``probe`` arm."""
    model = load(key, "cpu", torch.float32)
    prompt = warm_prompt(model, seed)
    probe = mla_watch.attach(model)
    decode_seconds(model, prompt, tokens, probe)
    probe.collect()
    if arm == "none":
        probe.detach()
        probe = None
    # The import-time heap is frozen in both arms, so a full collection that happens to fall in one arm's
    # generations (tens of millions of instructions) does not count as either arm's work.
    gc.collect()
    gc.freeze()
    for _ in range(generations // per_block):
        decode_seconds(model, prompt, tokens, probe, per_block)


def instruction_counts(key: str, tokens: int, seed: int, per_block: int, generations: int = 32) -> dict:
    """Instructions per generation: the model's own, and what the probe adds (cachegrind, three processes)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    runs = {"base": ("none", 0), "none": ("none", generations), "probe": ("probe", generations)}
    # One thread and a fixed hash seed: what varies between the processes is the probe, not the scheduling.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as scratch:
        processes = {}
        for label, (arm, count) in runs.items():
            command = [
                valgrind,
                "--tool=cachegrind",
                "--cache-sim=no",
                f"--cachegrind-out-file={Path(scratch) / label}",
                sys.executable,
                __file__,
                "--instruction-worker",
                key,
                arm,
                str(count),
                "--tokens",
                str(tokens),
                "--seed",
                str(seed),
                "--generations",
                str(per_block),
            ]
            processes[label] = subprocess.Popen(
                command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        refs = {}
        for label, process in processes.items():
            _, err = process.communicate()
            found = re.search(r"I\s+refs:\s+([\d,]+)", err)
            if process.returncode != 0 or found is None:
                raise SystemExit(f"cachegrind run {label!r} failed (exit {process.returncode}): {err[-2000:]}")
            refs[label] = int(found.group(1).replace(",", ""))
    model_per = (refs["none"] - refs["base"]) / generations
    probe_per = (refs["probe"] - refs["none"]) / generations
    print(
        f"  instructions per {tokens}-token generation (cachegrind): model {model_per / 1e6:.1f}M, the probe adds "
        f"{probe_per / 1e6:.2f}M = x{1 + probe_per / model_per:.4f}"
    )
    return {"model_instructions": model_per, "probe_instructions": probe_per, "ratio": 1 + probe_per / model_per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--alternations", type=int, default=30, help="shuffled rounds of the four arms (the ratios' sample size)"
    )
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens per generation (serve's default)")
    parser.add_argument(
        "--generations",
        type=int,
        default=8,
        help="rounds per alternation (8 x 16 tokens: 128 passes, the probe's flush_every)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads on a CPU (see the docstring)")
    parser.add_argument("--only", choices=["bundled", "large"])
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count the instructions the probe adds, with valgrind's cachegrind (~4 min a model)",
    )
    parser.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--instruction-worker", nargs=3, metavar=("MODEL", "ARM", "GENERATIONS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.instruction_worker:
        key, arm, generations = args.instruction_worker
        instruction_worker(key, arm, int(generations), args.tokens, args.seed, args.generations)
        return
    dtype = getattr(torch, args.dtype)
    models: dict[str, dict] = {}
    seeds = {"bundled": 1, "large": 2}
    labels = {"bundled": "bundled model", "large": "random-init DeepSeek-V3.2 config"}
    for key in [args.only] if args.only else list(seeds):
        models[key] = measure(
            labels[key], load(key, args.device, dtype), args.alternations, args.tokens, seeds[key], args.generations
        )
        if args.instructions:
            models[key]["instructions"] = instruction_counts(key, args.tokens, seeds[key], args.generations)
    if args.json:
        figures = {"bench": "probe_overhead", "args": vars(args), "models": models}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
