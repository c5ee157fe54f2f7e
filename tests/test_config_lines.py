"""Errors in rules, policies and reference prompt files name the entry and the line of the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mla_watch.alerting.rules import RuleError, load_rules_dir
from mla_watch.common.yamlcheck import key_lines
from mla_watch.policy import PolicyError
from mla_watch.policy.files import load_policy_dir
from mla_watch.references.prompts import ReferenceSetError, load_reference_dir

RULES = """\
receivers: [{name: oncall, type: alertmanager_webhook, url: 'http://127.0.0.1:9/hook'}]
rules:
  - alert: Fine
    metric: entropy_bits
    below: 5
  - alert: RoutingEntropyLow
    metric: entropy_bits
    select:
      kind: expert
      layers: [9, 2]
    below: 5
    for: 2x
  - metric: bogus
    below: 5
"""


def test_a_broken_rule_is_named_by_its_alert_and_each_key_by_its_line(tmp_path: Path) -> None:
    (tmp_path / "routing.yaml").write_text(RULES)
    with pytest.raises(RuleError) as caught:
        load_rules_dir(tmp_path, environ={})
    label = tmp_path / "routing.yaml"
    errors = caught.value.errors
    assert len(errors) == 4, errors
    assert errors[0].startswith(f"{label}: rules[RoutingEntropyLow].select.layers = [9, 2]: expected ")
    assert errors[0].endswith("(line 10)")
    assert errors[1].startswith(f"{label}: rules[RoutingEntropyLow].for = '2x': expected a duration")
    assert errors[1].endswith("(line 12)")
    # without an alert name the rule keeps its index; a missing key names the line the rule starts on
    assert errors[2] == f"{label}: rules[2].alert: missing: expected the alert name, e.g. RoutingEntropyLow (line 13)"
    assert errors[3].startswith(f"{label}: rules[2].metric = 'bogus'") and errors[3].endswith("(line 13)")


def test_a_policy_error_names_the_line_of_its_key(tmp_path: Path) -> None:
    (tmp_path / "default.yaml").write_text(
        "business_line: default\ndefault_task: chat\ntasks:\n  chat:\n    params:\n"
        "      temperature: {min: 0.0, max: 9.0}\n      top_pp: {max: 1.0}\n"
    )
    with pytest.raises(PolicyError) as caught:
        load_policy_dir(tmp_path)
    errors = caught.value.errors
    assert any("tasks.chat.params.temperature.max = 9.0" in e and e.endswith("(line 6)") for e in errors), errors
    assert any("tasks.chat.params.top_pp: unknown key 'top_pp'" in e and e.endswith("(line 7)") for e in errors)


def test_a_reference_set_error_names_the_line_of_its_key(tmp_path: Path) -> None:
    (tmp_path / "default.yaml").write_text(
        "business_line: default\nversion: 1\nprompts:\n  - one\n  - ''\n  - three\n  - four\n"
    )
    with pytest.raises(ReferenceSetError) as caught:
        load_reference_dir(tmp_path)
    assert caught.value.errors == [
        f"{tmp_path / 'default.yaml'}: prompts[1] = '<text of 0 characters>': expected a non-empty text (line 5)"
    ]


def test_key_lines_walk_an_anchor_once() -> None:
    text = "a: &x [1, 2]\nb: *x\nc:\n  d: 3\n"
    assert key_lines(yaml.compose(text)) == {"a": 1, "a[0]": 1, "a[1]": 1, "b": 2, "c": 3, "c.d": 4}


def test_a_start_refused_for_a_broken_rule_names_it_and_writes_no_state(tmp_path: Path) -> None:
    from mla_watch.cli.setting_flags import flag_of
    from mla_watch.server.app import build_sidecar
    from mla_watch.server.config import ServerConfig

    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "routing.yaml").write_text(RULES)
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as caught:
        build_sidecar(ServerConfig(rules=rules, state_dir=state), name_field=flag_of)
    message = str(caught.value.code)
    assert message.startswith("mla-watch: the alert rules cannot be used:")
    assert "rules[RoutingEntropyLow].for = '2x'" in message and "(line 12)" in message
    assert not (state / "history.sqlite").exists() and list(state.iterdir()) == []
