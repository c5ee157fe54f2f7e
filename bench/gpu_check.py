"""Counts exact under torch.compile and CUDA graphs, and what the probe costs there (see bench/gpu_check.sh).

    python -m bench.gpu_check                      # CUDA when there is one (bf16), else the CPU part
    python -m bench.gpu_check --device cpu         # the CPU part: inductor, float32, no timing of graphs

1. ``generate`` with a static cache and compilation (on CUDA: ``mode="reduce-overhead"``, i.e. CUDA
   graphs; on a CPU: inductor) on the watched bundled model, attributed to one business line.
2. The same passes again in eager mode, teacher-forced on the tokens step 1 produced (prefill, then
   one token per step, as generate does), with a fresh probe: the reference.
3. Counts must be equal for every router, all of them in the line the compiled run was attributed
   to; the exit status is 1 when they differ.
4. With ``--time`` (default on CUDA): decode throughput of compiled generate on a watched copy and
   a bare copy of the model, alternated, median and spread of the ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import numpy as np
import torch
from transformers import CompileConfig, StaticCache

import mla_watch


def compiled_generate(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    device = prompt.device
    config = CompileConfig(fullgraph=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles on CUDA by itself; on a CPU it must be asked
    with torch.no_grad():
        output = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
            compile_config=config,
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return output


def eager_reference(model: torch.nn.Module, sequence: torch.Tensor, prompt: int) -> dict[str, np.ndarray]:
    """The passes generate made, in eager mode, counted by a fresh probe."""
    probe = mla_watch.attach(model, window_tokens=None)
    cache = StaticCache(config=model.config, max_cache_len=sequence.shape[1] + 8)
    device = sequence.device
    with torch.no_grad():
        model(
            input_ids=sequence[:, :prompt],
            position_ids=torch.arange(prompt, device=device)[None],
            cache=cache,
            use_cache=True,
        )
        for index in range(prompt, sequence.shape[1] - 1):  # the last generated token is never fed back
            model(
                input_ids=sequence[:, index : index + 1],
                position_ids=torch.tensor([[index]], device=device),
                cache=cache,
                use_cache=True,
            )
    counts = probe.counts()
    probe.detach()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=12)
    parser.add_argument("--alternations", type=int, default=15)
    parser.add_argument(
        "--time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time compiled generate watched vs bare (default: on CUDA only)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model, _ = mla_watch.load_model("bundled", device=str(device))
    model = model.to(dtype).eval()
    bare = copy.deepcopy(model)  # before attach: a copy that is never watched, with its own compiled call
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(5))
    prompt = prompt.to(device)
    print(
        f"gpu_check: {device} {str(dtype).removeprefix('torch.')}, bundled model, prompt {args.prompt}, "
        f"{args.tokens} new tokens, torch {torch.__version__}"
    )

    probe = mla_watch.attach(model, window_tokens=None)
    started = time.perf_counter()
    with probe.attribute("graph"):
        sequence = compiled_generate(model, prompt, args.tokens)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(
        f"  compiled generate (first call, compiling included): {time.perf_counter() - started:.1f} s, "
        f"{graphs} graph(s) compiled for {args.tokens - 1} decode steps"
    )
    got = probe.counts("graph")
    everything = probe.counts()
    probe.detach()
    reference = eager_reference(model, sequence, args.prompt)
    differ = [
        name
        for name, counts in reference.items()
        if not np.array_equal(got.get(name), counts) or not np.array_equal(everything.get(name), counts)
    ]
    for name, counts in reference.items():
        print(
            f"  {name}: compiled {int(got[name].sum())} picks, eager {int(counts.sum())}, "
            f"{'equal' if name not in differ else 'DIFFER'}"
        )
    if differ:
        print(f"gpu_check: counts DIFFER from the eager reference on {len(differ)} routers: {differ}")
        return 1
    print(f"gpu_check: counts exact on {len(reference)} routers (compiled vs eager reference)")

    if args.time if args.time is not None else device.type == "cuda":
        probe = mla_watch.attach(model, window_tokens=None)
        compiled_generate(model, prompt, args.tokens)  # a new probe is a new forward: compiled again
        compiled_generate(bare, prompt, args.tokens)
        ratios, seconds = [], {"bare": [], "watched": []}
        for alternation in range(args.alternations):
            timed = {}
            for name in ("bare", "watched") if alternation % 2 else ("watched", "bare"):
                start = time.perf_counter()
                compiled_generate(model if name == "watched" else bare, prompt, args.tokens)
                timed[name] = time.perf_counter() - start
                seconds[name].append(timed[name])
            ratios.append(timed["watched"] / timed["bare"])
        probe.collect()
        probe.detach()
        print(
            f"  compiled generate ({'CUDA graphs' if device.type == 'cuda' else 'inductor'}), "
            f"{args.tokens} tokens x {args.alternations} alternations: "
            f"{args.tokens / statistics.median(seconds['bare']):.1f} tokens/s bare; probe / none median "
            f"x{statistics.median(ratios):.4f} (spread {min(ratios):.4f}-{max(ratios):.4f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
