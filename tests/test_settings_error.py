"""One settings error: the core names the field, the command line words it with the flag."""

from __future__ import annotations

import argparse

import pytest

from mla_watch.cli.main import build_parser
from mla_watch.cli.setting_flags import FIELD_FLAGS, flag_messages, flag_text
from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.references.prober import ReferenceSettings
from mla_watch.routing.ingest import IngestLimits
from mla_watch.server.config import ServerConfig


def test_a_core_object_names_the_field_and_the_command_line_the_flag() -> None:
    with pytest.raises(SettingsError) as caught:
        ServerConfig(reference=ReferenceSettings(long_share=2.0, rate=0.0), capture_max_client_share=0)
    error = caught.value
    assert error.errors == [
        "reference.rate = 0.0: expected prompts a second > 0",
        "reference.long_share = 2.0: expected a share of the reader's time in (0, 1]",
        "capture_max_client_share = 0: expected a share in (0, 1]",
    ]
    assert flag_messages(error) == [
        "--reference-rate 0.0: expected prompts a second > 0",
        "--reference-long-share 2.0: expected a share of the reader's time in (0, 1]",
        "--capture-max-client-share 0: expected a share in (0, 1]",
    ]
    assert str(error).startswith("3 problems in the server configuration:\n  - reference.rate = 0.0")


def test_a_problem_of_two_settings_names_both() -> None:
    problem = SettingProblem("upstream", template="{engine} reads an engine's routing: it needs {upstream} URL")
    error = SettingsError([problem])
    assert str(error) == "engine reads an engine's routing: it needs upstream URL"
    assert flag_text(error) == "--engine reads an engine's routing: it needs --upstream URL"
    with pytest.raises(SettingsError) as caught:
        IngestLimits(max_top_k=0)
    assert (str(caught.value), flag_text(caught.value)) == (
        "ingest_limits.max_top_k = 0: expected an integer >= 1",
        "--ingest-max-top-k 0: expected an integer >= 1",
    )


def test_every_field_flag_is_a_flag_of_the_command_line() -> None:
    flags: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:  # argparse keeps no public list of a parser's options
            flags.update(option for option in action.option_strings if option.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    assert set(FIELD_FLAGS.values()) <= flags, sorted(set(FIELD_FLAGS.values()) - flags)
