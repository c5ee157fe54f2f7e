"""``mla-watch context``: how long a line's prompts may be before its routing leaves in-range routing.

From a dataset (``--prompts``, ``--domain``: run through the model here, every prompt up to the model's context
length) or from a running sidecar's traffic (``--url``: its ``/v1/routing`` positions for ``--business-line``), it
prints each expert router's routing by position bucket and recommends the line's ``max_prompt_tokens``: the first
position of the earliest bucket where any router leaves in-range routing. From a sidecar's traffic a departure
counts only where it holds across clients (each judged against its own shorter prompts,
:mod:`mla_watch.routing.positions`), and the recommendation names them and the share of the line's prompts the
cap would refuse; a dataset is the operator's own prompts, one source.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from mla_watch.cli.flags import DOCS, positive_float
from mla_watch.cli.startup import FlagError
from mla_watch.cli.tables import format_table
from mla_watch.common.describe import describe_value
from mla_watch.common.output_file import write_stdout
from mla_watch.routing.positions import PositionProfile, Recommendation, recommend

__all__ = ["add_parser"]

_MAX_ANSWER_BYTES = 32 << 20  # a sidecar's /v1/routing answer read here, at most


def _from_dataset(args: argparse.Namespace) -> tuple[str, dict[str, PositionProfile], list[int] | None]:
    from mla_watch.cli.startup import require_model_extra

    require_model_extra(f"--model {args.model} (run here over the prompts; --url reads a sidecar's traffic without it)")
    import torch

    import mla_watch
    from mla_watch.cli.startup import check_model_flags, one_thread_for_the_bundled_model
    from mla_watch.cli.traffic import read_traffic
    from mla_watch.common.progress import Progress

    check_model_flags(args)
    traffic = read_traffic(args)
    progress = Progress("mla-watch context")
    one_thread_for_the_bundled_model(args.model, args.device)
    progress.say(f"loading the model {args.model}")
    model, tokenizer = mla_watch.load_model(args.model, device=args.device)
    probe = mla_watch.attach(model, window_tokens=None, count_positions=True)
    assert probe.positions is not None
    probe.positions.min_clients = 1  # the operator's own prompts: one source, no client's texts to mistake
    device = next(model.parameters()).device
    limit = int(model.config.max_position_embeddings)
    line = args.business_line or traffic[0][0]
    for _, text in progress.track(traffic, "samples"):
        ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]][:limit]
        with torch.no_grad(), probe.attribute(line, clients="dataset", prompt_tokens=len(ids)):
            model(input_ids=torch.tensor([ids], device=device))
    probe.collect()
    return line, probe.positions.profiles(line), probe.positions.prompts(line).tolist()


def _from_sidecar(args: argparse.Namespace) -> tuple[str, dict[str, PositionProfile], list[int] | None]:
    if not args.business_line:
        raise FlagError("--url needs --business-line: the line whose traffic to read")
    if urllib.parse.urlsplit(args.url).scheme not in ("http", "https"):
        raise FlagError(f"--url {describe_value(args.url)}: expected the sidecar's http:// or https:// base URL")
    url = args.url.rstrip("/") + "/v1/routing?" + urllib.parse.urlencode({"business_line": args.business_line})
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as answer:
            body = answer.read(_MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise FlagError(f"--url {args.url}: GET /v1/routing answered {error.code}") from None
    except (urllib.error.URLError, OSError) as error:
        raise FlagError(f"--url {args.url}: cannot read /v1/routing ({getattr(error, 'reason', error)})") from None
    if len(body) > _MAX_ANSWER_BYTES:
        raise FlagError(f"--url {args.url}: /v1/routing answered more than {_MAX_ANSWER_BYTES} bytes")
    try:
        positions = json.loads(body)["positions"]
        profiles = {router["name"]: PositionProfile.from_dict(router) for router in positions["routers"]}
        prompts = positions.get("prompts")
        if prompts is not None and (
            not isinstance(prompts, list)
            or not all(isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in prompts)
        ):
            raise ValueError("prompts")
    except (ValueError, KeyError, TypeError):
        raise FlagError(
            f"--url {args.url}: /v1/routing has no routing by position (serve "
            "--no-routing-by-position, or beside an engine whose --model-config gives no "
            "max_position_embeddings)"
        ) from None
    return args.business_line, profiles, prompts


def _table(profiles: dict[str, PositionProfile]) -> str:
    names = list(profiles)
    labels = [bucket.bucket for bucket in next(iter(profiles.values())).buckets] if profiles else []
    rows = [["bucket", "tokens", *names]]
    for index, label in enumerate(labels):
        cells = []
        for name in names:
            bucket = profiles[name].buckets[index]
            mark = "" if not bucket.judged else (" ok" if bucket.in_range else " LEFT")
            if bucket.js_divergence is None:
                cells.append("ref" if bucket.in_range else "-")
            else:
                cells.append(f"{bucket.js_divergence:.4f}{mark}")
        tokens = profiles[names[0]].buckets[index].tokens
        rows.append([label, str(tokens), *cells])
    return format_table(rows, numbers=True)


def _advice(line: str, found: Recommendation, profiles: dict[str, PositionProfile], *, dataset: bool) -> str:
    if found.max_prompt_tokens is None:
        alone = sorted(
            {client.client for profile in profiles.values() for client in profile.clients if client.edge is not None}
        )
        return (
            f"{line}: no router left in-range routing up to position {found.judged_up_to} (the last bucket with "
            "enough tokens from enough clients to judge); nothing to recommend from this traffic"
            + (
                f". Alone, without a second client's routing leaving there too: {', '.join(alone[:5])} (one "
                "client's texts, not the position: no cap is drawn from them)"
                if alone
                else ""
            )
        )
    seen = f"the dataset's {found.prompts} prompts" if dataset else f"the line's last {found.prompts} prompts"
    refused = (
        ""
        if found.refused_share is None
        else f"; it would refuse {found.refused_share:.1%} of {seen} (those longer than {found.max_prompt_tokens} "
        "tokens)"
    )
    who = f", across the clients {', '.join(found.clients)}" if found.clients and not dataset else ""
    return (
        f"{line}: routing leaves in-range routing from bucket {found.edge} ({', '.join(found.routers)}){who}.\n"
        f"recommended max_prompt_tokens: {found.max_prompt_tokens}{refused}\n"
        f"  in policies/{line}.yaml:  defaults: {{max_prompt_tokens: {found.max_prompt_tokens}}}\n"
        f"  then a request whose prompt has more tokens is refused with 400 prompt_too_long, naming the limit "
        "(whatever the policy's on_violation): the client must shorten it"
    )


def _cmd_context(args: argparse.Namespace) -> int:
    line, profiles, prompts = _from_sidecar(args) if args.url else _from_dataset(args)
    found = recommend(profiles, prompts)
    if args.json:  # a full disk or a closed pipe on stdout: one line, no traceback
        write_stdout(
            json.dumps(
                {
                    "business_line": line,
                    "recommendation": found.as_dict(),
                    "routers": {name: profile.as_dict() for name, profile in profiles.items()},
                },
                indent=1,
            )
            + "\n"
        )
        return 0
    held = ", held across clients" if args.url else ""
    write_stdout(
        f"JS divergence (bits) of each position bucket's prompt tokens from in-range routing{held} (ref: the "
        "first judged bucket; ok: in range; LEFT: left it; '-': not judged)\n"
        f"{_table(profiles)}\n{_advice(line, found, profiles, dataset=not args.url)}\n"
    )
    return 0


def add_parser(commands: argparse._SubParsersAction[Any]) -> None:
    """Add the ``context`` subcommand."""
    from mla_watch.cli.traffic import traffic_options

    context = commands.add_parser(
        "context",
        help="recommend a line's max_prompt_tokens from its routing by position",
        epilog=f'The manual: {DOCS}operations.md ("Where the router stops generalizing")',
    )
    traffic_options(context)
    context.add_argument("--url", help="a running sidecar: read its traffic's routing by position instead")
    context.add_argument("--business-line", help="the line to read (--url), or to attribute the dataset to")
    context.add_argument("--timeout", type=positive_float, default=10.0, help="seconds to wait for --url (default 10)")
    context.add_argument("--json", action="store_true", help="print JSON instead of a table")
    context.set_defaults(handler=_cmd_context)
