"""The expert footprint of a batch on the bundled model: distinct experts per MoE layer of one decode step.

    python -m bench.batch_footprint --requests 48 --decode 16

Each business line's requests (the generated corpus, one domain per line) are decoded greedily, ``--decode``
tokens each, with the probe recording every decode step's expert ids; decode steps of B concurrent requests are
then drawn from those real decode tokens (``mla_watch.routing.footprint``): B requests of one line (lines batched apart)
or of all lines (mixed), one decode token of each. Printed: the mean distinct experts per MoE layer for B = 1, 8,
32, 64, per line and mixed, and the ratio of expert weight bytes a step reads with lines batched apart versus
mixed, with the expert size of the bundled model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import mla_watch
from mla_watch.models import corpus
from mla_watch.routing.footprint import BATCH_SIZES, FootprintSampler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="requests per business line (default 48)")
    parser.add_argument("--decode", type=int, default=16, help="decode steps per request (default 16)")
    parser.add_argument("--draws", type=int, default=256, help="decode steps drawn per batch size (default 256)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    probe = mla_watch.attach(model, window_tokens=None)
    config = model.config
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * next(model.parameters()).element_size()
    sampler = FootprintSampler(config.n_routed_experts, max_requests=args.requests, tokens_per_request=args.decode)
    started = time.perf_counter()
    with torch.no_grad():
        for line in corpus.DOMAINS:
            for text in corpus.generate(line, args.requests, args.seed):
                ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
                ids = ids[: config.max_position_embeddings - args.decode]
                prompt = torch.tensor([ids])
                with probe.record_routing() as recording:
                    model.generate(
                        input_ids=prompt,
                        attention_mask=torch.ones_like(prompt),
                        do_sample=False,
                        max_new_tokens=args.decode,
                        min_new_tokens=args.decode,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                sampler.add(line, recording.rows(0)[len(ids) :])  # the decode steps' tokens only
    table = sampler.table(BATCH_SIZES, draws=args.draws, seed=args.seed)
    print(
        f"bundled model: {config.n_routed_experts} experts top-{config.num_experts_per_tok}, "
        f"{expert_bytes} bytes per expert; {args.requests} requests per line x {args.decode} decode steps "
        f"({time.perf_counter() - started:.0f} s); {args.draws} drawn steps per B"
    )
    print(table.format(expert_bytes))
    index = BATCH_SIZES.index(32)
    print(
        f"B = 32: lines batched apart read {table.apart[index]:.1f} experts per layer, mixed "
        f"{table.mixed[index]:.1f}: x{table.ratio[index]:.3f} the expert weight bytes per decode step"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({**table.as_dict(), "expert_bytes": expert_bytes}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
