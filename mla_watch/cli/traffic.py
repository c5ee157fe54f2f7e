"""``mla-watch routing`` and ``mla-watch baseline``: traffic run through the model here, its routing read.

The traffic is a ``--prompts`` file, one ``--domain`` of the generated corpus, or a mix of every
domain; ``routing`` prints each router's statistics, ``baseline`` saves the healthy routing counts
that drift checks compare against.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mla_watch.cli.flags import DEFAULT_STATE_DIR, DOCS
from mla_watch.cli.startup import FlagError
from mla_watch.cli.tables import format_table
from mla_watch.common.output_file import check_output_file, write_error, write_stdout
from mla_watch.routing.footprint import FootprintSampler

__all__ = ["add_parsers", "read_traffic", "traffic_options"]


def _read_prompts(path: Path) -> list[str]:
    """One prompt per line, or JSONL objects with a ``prompt`` (or ``text``) field."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise FlagError(f"--prompts {path}: cannot read it ({error.strerror})") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise FlagError(f"--prompts {path}:{number}: invalid JSON ({error.msg})") from error
            text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise FlagError(f"--prompts {path}:{number}: expected a 'prompt' or 'text' string field")
            prompts.append(text)
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise FlagError(f"--prompts {path}: no prompts in the file")
    return prompts


def read_traffic(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(business_line, text)`` pairs for the routing and baseline commands."""
    from mla_watch.models import corpus

    if args.prompts is not None:
        return [("prompts", text) for text in _read_prompts(args.prompts)]
    if args.domain is not None:
        if args.domain not in corpus.DOMAINS:
            raise FlagError(f"--domain {args.domain!r}: expected one of {', '.join(corpus.DOMAINS)}")
        return [(args.domain, text) for text in corpus.generate(args.domain, args.samples, args.seed)]
    per_domain = max(1, args.samples // len(corpus.DOMAINS))
    return corpus.generate_mixed(per_domain * len(corpus.DOMAINS), args.seed)


def _run(args: argparse.Namespace) -> Any:
    from mla_watch.cli.startup import require_model_extra

    require_model_extra(f"--model {args.model} (run here)")
    import torch

    import mla_watch
    from mla_watch.cli.startup import check_model_flags, one_thread_for_the_bundled_model
    from mla_watch.common.progress import Progress

    check_model_flags(args)
    baseline = getattr(args, "baseline", None)
    if baseline is not None and not baseline.is_file():
        raise FlagError(f"--baseline {baseline}: no such file: expected a baseline file `mla-watch baseline` wrote")
    traffic = read_traffic(args)  # a --prompts file that cannot be read is refused before the model loads
    progress = Progress(f"mla-watch {args.command}")  # on stderr: stdout is the table or the JSON
    one_thread_for_the_bundled_model(args.model, args.device)
    progress.say(f"loading the model {args.model}")
    model, tokenizer = mla_watch.load_model(args.model, device=args.device)
    probe = mla_watch.attach(model, window_tokens=None)
    if baseline is not None:
        probe.load_baseline(baseline)
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    experts = [info for info in probe.routers if info.kind == "expert"]
    footprint = FootprintSampler(max(info.num_slots for info in experts)) if experts else None
    with torch.no_grad():
        for line, text in progress.track(traffic, "samples"):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = [tokenizer.bos_token_id, *ids][: limit - args.generate]
            input_ids = torch.tensor([ids], device=device)
            with probe.attribute(line), probe.record_routing() as recording:
                if args.generate > 0:
                    model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        max_new_tokens=args.generate,
                        do_sample=False,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                else:
                    model(input_ids=input_ids)
            if footprint is not None:
                # Every token of the request (prompt and generated) stands in for one of its decode steps: a
                # request that stops early would otherwise leave nothing to draw from.
                footprint.add(line, recording.rows(0))
    probe.footprint = footprint  # type: ignore[attr-defined]
    return probe


def _format_table(records: list[dict[str, Any]]) -> str:
    columns = [
        ("layer", "layer", "{}"),
        ("router", "name", "{}"),
        ("kind", "kind", "{}"),
        ("tokens", "tokens", "{}"),
        ("entropy", "entropy_bits", "{:.3f}"),
        ("floor", "floor_bits", "{:.3f}"),
        ("ceiling", "ceiling_bits", "{:.3f}"),
        ("normalized", "normalized_entropy", "{:.3f}"),
        ("maxvio", "max_violation", "{:.3f}"),
        ("dead", "dead_slots", "{}"),
        ("js", "js_divergence", "{:.4f}"),
        ("locality", "locality", "{:.3f}"),
    ]
    rows = [[title for title, _, _ in columns]]
    for record in records:
        row = []
        for _, key, form in columns:
            value = record.get(key)
            row.append("-" if value is None else form.format(value))
        if record.get("too_small"):
            row[3] += "*"
        rows.append(row)
    text = format_table(rows, numbers=True)
    if any(record.get("too_small") for record in records):
        text += "\n* fewer tokens than the router's minimum window: the entropy reads low by chance"
    return text


def _cmd_routing(args: argparse.Namespace) -> int:
    probe = _run(args)
    records = probe.stats()
    if args.json:
        write_stdout(json.dumps(records, indent=1) + "\n")
        return 0
    text = _format_table(records) + "\n"
    footprint = probe.footprint
    if footprint is not None and footprint.business_lines:
        text += (
            "\nExpert footprint of a batch: mean distinct experts per MoE layer that one decode step of B "
            "concurrent requests reads (each request's tokens stand in for its decode steps; "
            f"{footprint.num_experts} experts per layer)\n" + footprint.table().format() + "\n"
        )
    write_stdout(text)
    return 0


def _cmd_baseline(args: argparse.Namespace) -> int:
    out = args.out or (args.state_dir / "baseline.json")
    label = f"--out {out}" if args.out is not None else f"{out} (--state-dir)"
    check_output_file(out, label=label, parents=True)  # a directory, say, is refused before the model loads
    probe = _run(args)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        document = probe.save_baseline(out)
    except OSError as error:  # a full disk, say: one line (a device is written through, never replaced)
        raise write_error(label, error) from None
    routers = {entry["router"] for entry in document["series"]}
    lines = {entry["business_line"] for entry in document["series"]}
    print(
        f"wrote the healthy baselines of {len(routers)} routers x {len(lines)} business lines "
        f"({', '.join(sorted(lines))}) to {out}"
    )
    return 0


def traffic_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled", help="'bundled' or a save_pretrained directory")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--domain", help="traffic of one domain: customer_service, code, sql, doc_summary")
    source.add_argument("--prompts", type=Path, help="a file of prompts: one per line, or JSONL with 'prompt'")
    parser.add_argument("--samples", type=int, default=64, help="generated samples (default 64)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the generated traffic")
    parser.add_argument(
        "--generate",
        type=int,
        default=0,
        help="tokens to generate after each prompt (default 0: one forward pass over it)",
    )


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``routing`` and ``baseline`` subcommands."""
    manual = (
        f'The manual: {DOCS}serving.md ("The command line beside the server"); how long it takes: {DOCS}first-hour.md'
    )
    routing = commands.add_parser(
        "routing", help="run traffic through the model and print per-router statistics", epilog=manual
    )
    traffic_options(routing)
    routing.add_argument("--baseline", type=Path, help="a baseline file, to report drift (js)")
    routing.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    routing.set_defaults(handler=_cmd_routing)

    baseline = commands.add_parser(
        "baseline", help="save the routing counts that drift checks compare against", epilog=manual
    )
    traffic_options(baseline)
    baseline.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="where baseline.json is written unless --out says"
    )
    baseline.add_argument("--out", type=Path, help="file to write (default STATE_DIR/baseline.json)")
    baseline.set_defaults(handler=_cmd_baseline)
