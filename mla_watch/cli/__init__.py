"""The ``mla-watch`` command line: ``main`` and its parser; each subcommand's flags and handler in a module here."""

from mla_watch.cli.main import DEMO_DURATION, build_parser, main

__all__ = ["DEMO_DURATION", "build_parser", "main"]
