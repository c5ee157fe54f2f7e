"""What counting routing by position adds to the probe, on the bundled model.

    python -m bench.position_overhead --alternations 30

Two copies of the bundled model in one process, both watched by the probe, one with ``count_positions=True``
(what ``serve`` runs by default). An alternation is 8 greedy 16-token generations of one prompt by each copy
through serve's decode loop, in a shuffled order, each copy's pending passes counted at its end. Printed: the
median of the per-alternation ratios (positions on / off) with its quartiles, and the device memory the
per-position counters hold.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

import mla_watch
from mla_watch.policy.sampling import SamplingParams, generate_stream

PROMPT = "Hello, I would like to return my order number 12345 because it arrived damaged"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alternations", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    twin = copy.deepcopy(model)
    arms = {"off": (model, mla_watch.attach(model)), "on": (twin, mla_watch.attach(twin, count_positions=True))}
    ids = [tokenizer.bos_token_id, *tokenizer(PROMPT, add_special_tokens=False)["input_ids"]]

    def run(name: str) -> float:
        chosen, probe = arms[name]
        started = time.perf_counter()
        for _ in range(8):
            for _event in generate_stream(chosen, tokenizer, ids, SamplingParams(max_tokens=16, seed=1)):
                pass
        probe.count_pending()
        return time.perf_counter() - started

    for name in arms:  # warm-up
        run(name)
    ratios = []
    for _ in range(args.alternations):
        order = list(arms)
        random.shuffle(order)
        seconds = {name: run(name) for name in order}
        ratios.append(seconds["on"] / seconds["off"])
    median, low, high = np.median(ratios), *np.percentile(ratios, [25, 75])
    device_bytes = arms["on"][1].position_bytes
    print(
        f"routing by position on / off: median x{median:.4f} (quartiles {low:.4f}-{high:.4f}) over "
        f"{args.alternations} alternations; per-position counters: {device_bytes} bytes"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"median": median, "quartiles": [low, high], "ratios": ratios, "position_bytes": device_bytes})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
