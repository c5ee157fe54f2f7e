"""The ``mla-watch`` command line: its parser, assembled from the subcommands' modules, and ``main``.

Each subcommand's flags and handler live together: ``routing`` and ``baseline`` in
:mod:`mla_watch.cli_traffic`, ``serve`` in :mod:`mla_watch.cli_serve`, ``check`` and ``rules export``
in :mod:`mla_watch.cli_check`, ``retune`` in :mod:`mla_watch.cli_retune`; ``demo`` here. Flag value
types are in :mod:`mla_watch.cli_flags`, start-up checks and plumbing in :mod:`mla_watch.cli_startup`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

from mla_watch import cli_check, cli_retune, cli_serve, cli_traffic
from mla_watch.cli_flags import DEFAULT_STATE_DIR as DEFAULT_STATE_DIR
from mla_watch.cli_flags import positive_float
from mla_watch.cli_startup import FlagError

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    import logging

    from mla_watch.demo import main as demo

    logging.basicConfig(level=logging.ERROR)
    return demo(args.out, live=not args.no_live and sys.stdout.isatty(), timeout=args.timeout,
                inject_fault=not args.no_fault)


def build_parser() -> argparse.ArgumentParser:
    """The ``mla-watch`` parser; its subcommands in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(prog="mla-watch", description="Watch the routers of an MLA/MoE model.")
    commands = parser.add_subparsers(dest="command", required=True)
    cli_traffic.add_parsers(commands)  # routing, baseline
    cli_serve.add_parser(commands)
    cli_check.add_parsers(commands)  # check, rules export
    demo = commands.add_parser("demo", help="the whole loop in about half a minute (2 CPU cores), offline, on "
                                            "the bundled model")
    demo.add_argument("--out", type=Path, default=Path("mla-watch-demo"),
                      help="where timeline.png and summary.json go (default ./mla-watch-demo)")
    demo.add_argument("--no-live", action="store_true", help="print progress lines instead of the live view")
    demo.add_argument("--timeout", type=positive_float, default=600.0, help="give up after this many seconds")
    demo.add_argument("--no-fault", action="store_true", help=argparse.SUPPRESS)  # the failure path, for tests
    demo.set_defaults(handler=_cmd_demo)
    cli_retune.add_parser(commands)

    from mla_watch.cli_startup import finish_parser

    return finish_parser(parser)


def _loads_model(args: argparse.Namespace) -> bool:
    """Whether the command loads a model here (its weight-loading progress bars are kept out of the output)."""
    if args.command == "serve":
        return not args.upstream
    if args.command == "check":
        return args.model_config is None and args.model is not None
    return args.command in ("routing", "baseline", "demo")


def main(argv: Sequence[str] | None = None) -> int:
    from mla_watch.cli_startup import parse_args, prog, quiet_progress_bars

    args = parse_args(build_parser(), argv)
    try:
        if getattr(args, "samples", 1) < 1:
            raise FlagError(f"--samples {args.samples}: expected a positive number")
        if getattr(args, "generate", 0) < 0:
            raise FlagError(f"--generate {args.generate}: expected 0 or more")
        with quiet_progress_bars() if _loads_model(args) else contextlib.nullcontext():
            return int(args.handler(args))
    except FlagError as error:  # one line naming the flag, its value and what was expected: no traceback
        print(f"{prog(args)}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
