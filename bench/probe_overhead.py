"""What the probe costs: decode throughput with the probe, without it, and with a naive hook.

    python bench/probe_overhead.py                       # bundled model and a ~100M config
    python bench/probe_overhead.py --only bundled --alternations 120 --tokens 16
    python bench/probe_overhead.py --device cuda --dtype bfloat16   # where there is a GPU
    python bench/probe_overhead.py --json figures.json   # also write the figures as JSON

The estimator. Each alternation times four short greedy generations of the same prompt, in a
shuffled order, in one process: no hooks (the anchor), no hooks again (the A/A control),
mla_watch's probe, and the naive hook the DESIGN measured (``torch.bincount(...).tolist()`` on
every router call). Attaching and detaching happen outside the timed blocks, and each block
starts after a ``gc.collect()``. Every arm is divided by the anchor of its own alternation, and
the printed figure is the median of those per-alternation ratios, with a bootstrap 95%
confidence interval of that median, its quartiles and its spread (min-max); a 10% trimmed mean
is printed beside it as a cross-check. Why this is the right estimator on a shared machine:

* Ratios of blocks a fraction of a second apart cancel the slow drift (thermal, frequency, the
  other processes' load) that moves whole runs by far more than 1%.
* Other processes only ever add time, in bursts: a burst in the anchor block makes that ratio
  low, one in the probe block makes it high. The shuffled order gives both the same chance, so
  the median of the ratios is not pulled by the bursts whatever their size, where a mean is.
* Many short blocks beat a few long ones: the median's uncertainty falls with the square root
  of the number of alternations, and the confidence interval says what this run could resolve.
* The A/A control is the same estimator applied to two identical arms: its median should be
  x1.00 and its interval shows the noise floor. A probe interval that is no wider, and wholly
  at or below x1.01, demonstrates the goal; one that straddles it does not, either way.

Wall time and process CPU time (``time.process_time``: what this process burned, less sensitive
to other processes) are both reported. Then two lower-noise figures: the probe's own work
replayed on recorded decode steps with the model's compute taken out, and adjacent pairs of
8-token forward passes on two copies of the model, one watched. Absolute times are printed for
context only: they drift from run to run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV32ForCausalLM

import mla_watch
from mla_watch.models.architecture import bundled_config
from mla_watch.probe import discover_routers

LARGE = {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 128, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128,
         "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64, "index_head_dim": 64,
         "index_n_heads": 4, "max_position_embeddings": 1024}


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


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> tuple[float, float]:
    """Wall and process CPU seconds of one greedy generation."""
    cpu = time.process_time()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def paired_forward_cost(model: torch.nn.Module, prompt: torch.Tensor, pairs: int) -> tuple[float, float, float]:
    """Median time of one short forward pass without hooks, and the median paired difference with
    the probe attached (spread: quartiles). Two copies of the model, one watched, run in adjacent
    pairs, so the machine's drift cancels far better than between whole generations."""
    ids = prompt[:, :8]
    watched = copy.deepcopy(model)
    probe = mla_watch.attach(watched)
    bare, added = [], []
    with torch.no_grad():
        for index in range(pairs + 10):
            order = (model, watched) if index % 2 else (watched, model)
            timed = {}
            for candidate in order:
                start = time.perf_counter()
                candidate(input_ids=ids)
                timed[candidate is watched] = time.perf_counter() - start
            if index >= 10:  # the first pairs warm both copies up
                bare.append(timed[False])
                added.append(timed[True] - timed[False])
    probe.detach()
    quartiles = statistics.quantiles(added, n=4)
    return statistics.median(bare), statistics.median(added), quartiles[0], quartiles[2]


def replayed_step_cost(model: torch.nn.Module, prompt: torch.Tensor, tokens: int,
                       repeats: int = 40) -> tuple[float, float, float]:
    """The probe's own cost per decode step (best: the fastest watched replay less the fastest bare one, what
    the work costs when the shared machine leaves it alone; and the median of ``repeats`` paired differences),
    and the decode step it is added to (seconds).

    The router outputs of ``tokens`` real decode steps are recorded once, then the probe is fed
    exactly those passes (its wrappers, its batching, its flushes) with the model's compute taken
    out, so the whole-generation noise (far larger than 1% here) does not hide the figure.
    """
    modules = dict(model.named_modules())
    routers = [info for _, info, _ in discover_routers(model)]
    steps: list[tuple[dict, list[tuple[tuple, dict, object]]]] = []
    handles = [model.register_forward_pre_hook(lambda module, args, kwargs: steps.append((dict(kwargs), [])),
                                               with_kwargs=True)]
    for info in routers:
        handles.append(modules[info.name].register_forward_hook(
            lambda module, args, kwargs, output: steps[-1][1].append((args, kwargs, output)), with_kwargs=True))
    with torch.no_grad():
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens + 1,
                       min_new_tokens=tokens + 1, do_sample=False, pad_token_id=0)
    for handle in handles:
        handle.remove()
    decode = steps[1:]  # the prefill is one pass per request; decode steps are what a token costs
    probe = mla_watch.attach(model)
    calls = [router.watch.call for router in probe._routers]

    def replay(watched: bool) -> float:
        start = time.perf_counter()
        for kwargs, outputs in decode:
            def forward(*args, outputs=outputs, **kwargs):
                for call, (router_args, router_kwargs, output) in zip(calls, outputs, strict=True):
                    if watched:
                        call(lambda *a, output=output, **k: output, router_args, router_kwargs)
            if watched:
                probe._model_call(forward, (), kwargs)
            else:
                forward(**kwargs)
        if watched:
            probe._flush_pending()  # what a reader would pay for the steps still waiting
        return (time.perf_counter() - start) / len(decode)

    watched, bare = zip(*((replay(True), replay(False)) for _ in range(repeats)), strict=True)
    probe.detach()
    step = min(decode_seconds(model, prompt, tokens)[0] / tokens for _ in range(max(3, repeats // 8)))
    # Best: each side's own minimum (the minimum of differences picks the round whose bare replay was
    # interrupted, and went negative on a loaded machine); median: of the paired differences.
    return min(watched) - min(bare), statistics.median(w - b for w, b in zip(watched, bare, strict=True)), step


ARMS = ("none", "control", "probe", "naive")  # "control": no hooks, a second time (the A/A check)


def ratio_summary(values: list[float], seed: int, resamples: int = 2000) -> dict:
    """Median of per-alternation ratios with a bootstrap 95% interval, quartiles, spread and a 10% trimmed mean."""
    ordered = sorted(values)
    trim = len(ordered) // 10
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "ci95": [medians[int(0.025 * resamples)],
                                                           medians[int(0.975 * resamples) - 1]],
            "quartiles": [quartiles[0], quartiles[2]], "min": ordered[0], "max": ordered[-1],
            "trimmed_mean": statistics.fmean(ordered[trim:len(ordered) - trim]), "values": values}


def describe(summary: dict) -> str:
    low, high = summary["ci95"]
    q1, q3 = summary["quartiles"]
    return (f"median x{summary['median']:.4f} (95% CI {low:.4f}-{high:.4f}; quartiles {q1:.3f}-{q3:.3f}; "
            f"spread {summary['min']:.2f}-{summary['max']:.2f}; trimmed mean x{summary['trimmed_mean']:.4f})")


def measure(name: str, model: torch.nn.Module, alternations: int, tokens: int, seed: int,
            replay_tokens: int = 48) -> dict:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (1, 24), generator=generator).to(device)
    routers = [info for _, info, _ in discover_routers(model)]
    for _ in range(2):  # warm-up: allocator, caches, and the attach path
        decode_seconds(model, prompt, tokens)
        mla_watch.attach(model).detach()
    order = random.Random(seed)
    ratios: dict[str, list[float]] = {mode: [] for mode in ARMS[1:]}
    cpu_ratios: dict[str, list[float]] = {mode: [] for mode in ARMS[1:]}
    seconds: dict[str, list[float]] = {mode: [] for mode in ARMS}
    probe_memory = 0
    for _ in range(alternations):
        modes = list(ARMS)
        order.shuffle(modes)
        timed: dict[str, tuple[float, float]] = {}
        for mode in modes:
            # Set-up and tear-down stay outside the timed block; every block starts from a collected heap.
            probe = mla_watch.attach(model, window_tokens=4096) if mode == "probe" else None
            remove = naive_hooks(model, routers) if mode == "naive" else None
            gc.collect()
            timed[mode] = decode_seconds(model, prompt, tokens)
            if probe is not None:
                probe.collect()
                probe_memory = probe.counter_bytes + probe.window_bytes()
                probe.detach()
            if remove is not None:
                remove()
        for mode, value in timed.items():
            seconds[mode].append(value[0])
        for mode in ARMS[1:]:
            ratios[mode].append(timed[mode][0] / timed["none"][0])
            cpu_ratios[mode].append(timed[mode][1] / timed["none"][1])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    throughput = tokens / statistics.median(seconds["none"])
    print(f"\n{name}: {params:.1f}M parameters, {len(routers)} routers, {tokens} decode tokens x "
          f"{alternations} alternations, {throughput:.1f} tokens/s without hooks")
    summaries = {mode: ratio_summary(ratios[mode], seed) for mode in ARMS[1:]}
    cpu_summaries = {mode: ratio_summary(cpu_ratios[mode], seed) for mode in ARMS[1:]}
    labels = {"probe": "probe / none", "naive": "naive / none", "control": "none / none (A/A control)"}
    for mode in ("probe", "naive", "control"):
        print(f"  {labels[mode]}: wall {describe(summaries[mode])}")
        print(f"  {' ' * len(labels[mode])}  CPU  {describe(cpu_summaries[mode])}")
    print(f"  probe memory: {probe_memory / 1024:.1f} KiB (device counters + host window)")
    replayed, replayed_median, step = replayed_step_cost(model, prompt, replay_tokens)
    print(f"  replayed: the probe's own work is {replayed * 1e6:.1f} us per decode step (best of 40 replays of "
          f"{replay_tokens} recorded steps; median {replayed_median * 1e6:.1f} us) on a {step * 1e3:.2f} ms step "
          f"(best of 5) = x{1 + replayed / step:.4f}")
    forward, added, low, high = paired_forward_cost(model, prompt, pairs=300)
    print(f"  one 8-token forward pass: {forward * 1e3:.2f} ms without hooks; the probe adds "
          f"{added * 1e6:.0f} us (quartiles {low * 1e6:.0f} to {high * 1e6:.0f} us) = x{1 + added / forward:.4f}")
    figures = {"name": name, "params_millions": params, "routers": len(routers), "tokens": tokens,
               "alternations": alternations, "tokens_per_s_none": throughput,
               "seconds_median": {mode: statistics.median(values) for mode, values in seconds.items()},
               "probe_memory_bytes": probe_memory, "replayed_probe_us_per_step": replayed * 1e6,
               "replayed_probe_us_per_step_median": replayed_median * 1e6,
               "replayed_step_ms": step * 1e3, "replayed_ratio": 1 + replayed / step,
               "forward_ms": forward * 1e3, "forward_probe_added_us": added * 1e6,
               "forward_probe_added_quartiles_us": [low * 1e6, high * 1e6], "forward_ratio": 1 + added / forward}
    for mode in ARMS[1:]:
        figures[f"{mode}_ratio"] = summaries[mode]
        figures[f"{mode}_cpu_ratio"] = cpu_summaries[mode]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alternations", type=int, default=80,
                        help="shuffled rounds of the four arms (the ratios' sample size)")
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens per timed generation")
    parser.add_argument("--replay-tokens", type=int, default=48,
                        help="recorded decode steps the probe's own work is replayed on (counted in one flush)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--only", choices=["bundled", "large"])
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    models: dict[str, dict] = {}
    if args.only in (None, "bundled"):
        model, _ = mla_watch.load_model("bundled", device=args.device)
        models["bundled"] = measure("bundled model", model.to(dtype), args.alternations, args.tokens, seed=1,
                                    replay_tokens=args.replay_tokens)
    if args.only in (None, "large"):
        torch.manual_seed(0)
        config = bundled_config(2048, pad_token_id=0, bos_token_id=1, eos_token_id=2, **LARGE)
        model = DeepseekV32ForCausalLM(config).to(args.device, dtype).eval()
        models["large"] = measure("random-init DeepSeek-V3.2 config", model, args.alternations, args.tokens, seed=2,
                                 replay_tokens=args.replay_tokens)
    if args.json:
        figures = {"bench": "probe_overhead", "args": vars(args), "models": models}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
