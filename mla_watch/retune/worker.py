"""Run one re-tuning fit outside the server, as an external command template would.

    python -m mla_watch.retune.worker --job job.json --data data.jsonl --routers routers.safetensors \\
        --output OUT --model bundled

It loads the model, puts the live router tensors (``--routers``) into it, fits the job's
strategy on the samples and writes ``OUT/routers.safetensors`` (router tensors only, named as
in the registry) and ``OUT/result.json``. A cluster job for a model too large to tune in the
server (e.g. under ``torchrun``) keeps the same contract: read these files, write those two.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import load_file, save

from mla_watch.common.output_file import write_file
from mla_watch.retune.router_tensors import apply_router_tensors

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_watch.retune.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="the job as JSON (with strategy and options)")
    parser.add_argument(
        "--data", type=Path, required=True, help='training samples, JSONL of {"input_ids": [...], "scored_tokens": n}'
    )
    parser.add_argument("--routers", type=Path, required=True, help="the live router tensors (safetensors)")
    parser.add_argument("--output", type=Path, required=True, help="directory for routers.safetensors, result.json")
    parser.add_argument("--model", default="bundled", help="'bundled' or a save_pretrained directory")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from mla_watch.models.loading import load_model
    from mla_watch.quality.local_model import make_batches
    from mla_watch.retune.data import load_jsonl_dataset
    from mla_watch.retune.strategies import FitContext, get_strategy

    job = json.loads(args.job.read_text())
    strategy = get_strategy(job["strategy"])
    if strategy.name == "restore":
        print("worker: restore is a registry lookup and runs in the server, not here", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model, device=args.device)
    apply_router_tensors(model, load_file(str(args.routers)))
    reason = strategy.unsupported_reason(model)
    if reason is not None:
        print(f"worker: strategy {strategy.name} cannot re-tune this model: {reason}", file=sys.stderr)
        return 2
    samples = load_jsonl_dataset(args.data, tokenizer, add_bos=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = make_batches(
        samples,
        batch_size=int(job.get("batch_size", 8)),
        pad_id=pad,
        max_tokens=int(job.get("max_tokens_per_sample", 256)),
    )
    options = strategy.parse_options(job.get("options") or {}, f"{args.job}: options")
    candidate = strategy.fit(
        FitContext(model=model, batches=batches, routers=list(job["routers"]), versions=None, options=options)
    )
    args.output.mkdir(parents=True, exist_ok=True)
    write_file(
        args.output / "routers.safetensors",
        save({name: tensor.contiguous() for name, tensor in candidate.tensors.items()}),
        private=True,
    )
    write_file(
        args.output / "result.json",
        json.dumps({**candidate.details, "worker": "mla_watch.retune.worker"}),
        private=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
