"""The ``mla-watch`` command line: its parser, assembled from the subcommands' modules, and ``main``.

Each subcommand's flags and handler live together: ``routing`` and ``baseline`` in
:mod:`mla_watch.cli.traffic`, ``serve`` in :mod:`mla_watch.cli.serve`, ``check`` and ``rules export``
in :mod:`mla_watch.cli.check`, ``retune`` in :mod:`mla_watch.cli.retune`; ``demo`` here. Flag value
types are in :mod:`mla_watch.cli.flags`, start-up checks and plumbing in :mod:`mla_watch.cli.startup`.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mla_watch.cli import check, context, fleet, retune, serve, traffic
from mla_watch.cli.flags import DEFAULT_STATE_DIR as DEFAULT_STATE_DIR
from mla_watch.cli.flags import DOCS, REPOSITORY, positive_float, tcp_port
from mla_watch.cli.startup import FlagError, Parser
from mla_watch.common.output_file import OutputError

__all__ = ["DEMO_DURATION", "main"]

DEMO_DURATION = "about a minute"  # on 2 CPU cores, two to three when others share them (docs/first-hour.md)


def _cmd_demo(args: argparse.Namespace) -> int:
    import logging

    from mla_watch.cli.startup import require_model_extra

    require_model_extra("mla-watch demo (the bundled model, here)")
    from mla_watch.cli.demo import main as demo

    logging.basicConfig(level=logging.ERROR)
    return demo(
        args.out,
        live=not args.no_live and sys.stdout.isatty(),
        timeout=args.timeout,
        inject_fault=not args.no_fault,
        port=args.port,
        receiver_port=args.receiver_port,
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``mla-watch`` parser; its subcommands in the order ``--help`` lists them."""
    from mla_watch import __version__

    parser = Parser(
        prog="mla-watch",
        description="Watch the routers of an MLA/MoE model.",
        epilog=f"The manual: {DOCS}index.md, and each command's --help names its page (the docs "
        f"folder of {REPOSITORY})",
    )
    parser.add_argument("--version", action="version", version=f"mla-watch {__version__}")
    # [Any]: the subcommand modules are typed for ArgumentParser's subparsers; these make Parser ones (its subclass)
    commands: argparse._SubParsersAction[Any] = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    traffic.add_parsers(commands)  # routing, baseline
    serve.add_parser(commands)
    check.add_parsers(commands)  # check, rules export
    context.add_parser(commands)
    demo = commands.add_parser(
        "demo",
        help=f"the whole loop in {DEMO_DURATION} on 2 CPU cores, offline, on the bundled model",
        epilog=f"The manual: {DOCS}first-hour.md",
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("mla-watch-demo"),
        help="where timeline.png and summary.json go (default ./mla-watch-demo)",
    )
    demo.add_argument(
        "--port",
        type=tcp_port,
        default=0,
        help="the port of the demo's sidecar on 127.0.0.1, whose status page it prints to open; "
        "0: any free one (default 0)",
    )
    demo.add_argument(
        "--receiver-port",
        type=tcp_port,
        default=0,
        help="the port on 127.0.0.1 of the webhook receiver standing in for on-call, which the demo's "
        "pages go to; 0: any free one (default 0)",
    )
    demo.add_argument("--no-live", action="store_true", help="print progress lines instead of the live view")
    demo.add_argument("--timeout", type=positive_float, default=600.0, help="give up after this many seconds")
    demo.add_argument("--no-fault", action="store_true", help=argparse.SUPPRESS)  # the failure path, for tests
    demo.set_defaults(handler=_cmd_demo)
    retune.add_parser(commands)
    fleet.add_parser(commands)

    from mla_watch.cli.startup import finish_parser

    return finish_parser(parser)


def main(argv: Sequence[str] | None = None, *, model_loader: Callable[..., tuple[Any, Any]] | None = None) -> int:
    """The ``mla-watch`` command; ``model_loader``: what loads ``--model`` for ``check`` (``mla_watch.load_model``'s
    signature; ``None``: load_model itself)."""
    from mla_watch.cli.startup import parse_args, prog

    args = parse_args(build_parser(), argv)
    args.model_loader = model_loader
    try:
        if getattr(args, "samples", 1) < 1:
            raise FlagError(f"--samples {args.samples}: expected a positive number")
        if getattr(args, "generate", 0) < 0:
            raise FlagError(f"--generate {args.generate}: expected 0 or more")
        return int(args.handler(args))
    except FlagError as error:  # one line naming the flag, its value and what was expected: no traceback
        print(f"{prog(args)}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except OutputError as error:  # a file it could not write: the path, what went wrong, what to do
        if not (error.label == "standard output" and error.errno == errno.EPIPE):  # `| head`: the reader is done
            print(f"{prog(args)}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
