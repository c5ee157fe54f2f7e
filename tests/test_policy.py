"""Tests for mla_watch.policy.model: loading, validation errors, enforce, PolicyStore reload/watch."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_watch.policy.files import PolicyStore, load_policy_dir, load_policy_file
from mla_watch.policy.model import (
    GOVERNED_PARAMS,
    Adjustment,
    ParamRule,
    Policy,
    PolicyError,
    PolicyRejection,
    PolicySet,
    TaskPolicy,
    UnknownBusinessLine,
    UnknownTask,
    enforce,
)

SHIPPED = Path(__file__).resolve().parent.parent / "policies"

GOOD = """\
business_line: {line}
description: test line
default_task: code
defaults:
  on_violation: clamp
  params:
    max_tokens: {{min: 1, max: 256, default: 128}}
    n: {{min: 1, max: 4, default: 1}}
tasks:
  code:
    params:
      temperature: {{min: 0.1, max: 0.3, default: 0.2}}
      repetition_penalty: {{fixed: 1.2}}
  sql:
    on_violation: reject
    params:
      temperature: {{min: 0.1, max: 0.3, default: 0.1}}
      repetition_penalty: {{fixed: 1.2}}
  chat:
    params:
      temperature: {{min: 0.0, max: 1.2, default: 0.7}}
"""


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def good(line: str = "code_assistant") -> str:
    return GOOD.format(line=line)


def load_errors(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy_file(path)
    return info.value.errors


def assert_one_error(path: Path, *fragments: str) -> str:
    """Exactly one error, naming the file and every fragment (key path, value, expectation)."""
    errors = load_errors(path)
    assert len(errors) == 1, errors
    message = errors[0]
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --------------------------------------------------------------------------- shipped policies


@pytest.fixture(scope="module")
def shipped() -> PolicySet:
    return load_policy_dir(SHIPPED)


def test_shipped_policies_load(shipped: PolicySet) -> None:
    assert set(shipped.lines) == {"customer_service", "code_assistant", "doc_summary", "default"}
    for line, policy in shipped.lines.items():
        assert policy.source.stem == line
        assert policy.description
        assert policy.default_task in policy.tasks


def test_shipped_code_and_sql(shipped: PolicySet) -> None:
    code_assistant = shipped.lines["code_assistant"]
    assert set(code_assistant.tasks) == {"code", "sql", "chat"}
    for name in ("code", "sql"):
        task = code_assistant.tasks[name]
        temperature = task.params["temperature"]
        assert (temperature.minimum, temperature.maximum) == (0.1, 0.3)
        assert temperature.default is not None and 0.1 <= temperature.default <= 0.3
        assert task.params["repetition_penalty"] == ParamRule(1.2, 1.2, 1.2)
    assert code_assistant.tasks["sql"].on_violation == "reject"
    assert code_assistant.tasks["code"].on_violation == "clamp"
    chat = code_assistant.tasks["chat"].params["temperature"]
    assert chat.maximum is not None and chat.maximum > 0.3


def test_shipped_other_lines(shipped: PolicySet) -> None:
    cs = shipped.lines["customer_service"]
    assert cs.default_task == "chat"
    assert cs.tasks["chat"].on_violation == "clamp"
    t = cs.tasks["chat"].params["temperature"]
    assert (t.minimum, t.maximum) == (0.3, 1.0)
    ds = shipped.lines["doc_summary"]
    assert ds.default_task == "summarize"
    assert ds.tasks["summarize"].on_violation == "clamp"
    assert ds.tasks["summarize"].params["temperature"].maximum <= 0.5
    for policy in shipped.lines.values():
        for task in policy.tasks.values():
            if policy.business_line != "code_assistant" or task.name == "code":
                assert task.on_violation == "clamp"


def test_shipped_resolve(shipped: PolicySet) -> None:
    policy, task = shipped.resolve(None, None)
    assert (policy.business_line, task.name) == ("default", "general")
    policy, task = shipped.resolve("code_assistant", None)
    assert (policy.business_line, task.name) == ("code_assistant", "code")
    _, task = shipped.resolve("code_assistant", "sql")
    assert task.name == "sql"
    assert shipped.as_dict()["business_lines"]["code_assistant"]["tasks"]["sql"]["on_violation"] == "reject"


def test_shipped_sql_rejects_hot_request(shipped: PolicySet) -> None:
    policy, task = shipped.resolve("code_assistant", "sql")
    with pytest.raises(PolicyRejection) as info:
        enforce(policy, task, {"temperature": 0.9})
    assert str(info.value) == "temperature=0.9 is outside the allowed range [0.1, 0.3] for code_assistant/sql"


def test_resolve_unknown_names(shipped: PolicySet) -> None:
    with pytest.raises(UnknownBusinessLine) as info:
        shipped.resolve("marketing", None)
    assert "marketing" in str(info.value) and "code_assistant" in str(info.value) and "default" in str(info.value)
    with pytest.raises(UnknownBusinessLine):
        shipped.resolve("", None)  # explicit empty string is a bad value, not "unset"
    with pytest.raises(UnknownTask) as info2:
        shipped.resolve("code_assistant", "poetry")
    message = str(info2.value)
    assert "poetry" in message and "code_assistant" in message
    assert all(t in message for t in ("code", "sql", "chat"))
    with pytest.raises(UnknownTask):
        shipped.resolve("code_assistant", "")


def test_resolve_without_default_line(tmp_path: Path) -> None:
    write(tmp_path, "code_assistant.yaml", good())
    policies = load_policy_dir(tmp_path)
    with pytest.raises(UnknownBusinessLine) as info:
        policies.resolve(None, "code")
    assert "default" in str(info.value) and "code_assistant" in str(info.value)


# --------------------------------------------------------------------------- enforce


@pytest.fixture
def code_policy(tmp_path: Path) -> Policy:
    return load_policy_file(write(tmp_path, "code_assistant.yaml", good()))


def test_enforce_clamps_above_and_below(code_policy: Policy) -> None:
    task = code_policy.tasks["code"]
    high = enforce(code_policy, task, {"temperature": 0.9, "max_tokens": 1000})
    assert high.applied["temperature"] == 0.3 and high.applied["max_tokens"] == 256
    assert Adjustment("temperature", 0.9, 0.3) in high.adjustments
    assert Adjustment("max_tokens", 1000, 256) in high.adjustments
    low = enforce(code_policy, task, {"temperature": 0.05, "repetition_penalty": 1.0})
    assert low.applied["temperature"] == 0.1 and low.applied["repetition_penalty"] == 1.2
    assert Adjustment("temperature", 0.05, 0.1) in low.adjustments
    assert Adjustment("repetition_penalty", 1.0, 1.2) in low.adjustments
    assert low.policy_label == "code_assistant/code"
    assert low.on_violation == "clamp"
    assert {"param": "temperature", "requested": 0.05, "applied": 0.1} in low.as_dict()["adjustments"]


def test_enforce_zero_is_a_value(code_policy: Policy) -> None:
    decision = enforce(code_policy, code_policy.tasks["code"], {"temperature": 0})
    assert decision.applied["temperature"] == 0.1
    assert Adjustment("temperature", 0, 0.1) in decision.adjustments
    assert Adjustment("temperature", None, 0.2) not in decision.adjustments


def test_enforce_defaults_for_absent_params(code_policy: Policy) -> None:
    decision = enforce(code_policy, code_policy.tasks["code"], {"top_p": None})
    assert decision.applied == {"temperature": 0.2, "repetition_penalty": 1.2, "max_tokens": 128, "n": 1}
    assert set(decision.adjustments) == {
        Adjustment("temperature", None, 0.2),
        Adjustment("repetition_penalty", None, 1.2),
        Adjustment("max_tokens", None, 128),
        Adjustment("n", None, 1),
    }


def test_enforce_rule_without_default_leaves_param_absent() -> None:
    task = TaskPolicy("t", "clamp", {"temperature": ParamRule(0.0, 1.0, None)}, None)
    policy = Policy("line", "", "t", {"t": task}, Path("line.yaml"))
    decision = enforce(policy, task, {})
    assert decision.applied == {} and decision.adjustments == ()


def test_enforce_inside_range_untouched(code_policy: Policy) -> None:
    requested = {"temperature": 0.25, "repetition_penalty": 1.2, "max_tokens": 64, "n": 2}
    decision = enforce(code_policy, code_policy.tasks["code"], requested)
    assert decision.applied == requested
    assert decision.adjustments == ()
    assert requested == {"temperature": 0.25, "repetition_penalty": 1.2, "max_tokens": 64, "n": 2}  # not mutated


def test_enforce_reject(code_policy: Policy) -> None:
    task = code_policy.tasks["sql"]
    with pytest.raises(PolicyRejection) as info:
        enforce(code_policy, task, {"temperature": 0.9, "max_tokens": 5000})
    exc = info.value
    assert (exc.param, exc.value, exc.minimum, exc.maximum) == ("temperature", 0.9, 0.1, 0.3)
    assert (exc.business_line, exc.task) == ("code_assistant", "sql")
    message = str(exc)
    assert "temperature" in message and "0.9" in message and "[0.1, 0.3]" in message
    body = exc.openai_error()["error"]
    assert body["param"] == "temperature" and body["message"] == message


def test_enforce_reject_first_in_governed_order(code_policy: Policy) -> None:
    task = code_policy.tasks["sql"]
    with pytest.raises(PolicyRejection) as info:
        enforce(code_policy, task, {"max_tokens": 5000, "repetition_penalty": 1.0})
    assert info.value.param == "repetition_penalty"  # comes before max_tokens in GOVERNED_PARAMS
    assert "[1.2, 1.2]" in str(info.value)
    # inside-range and defaulted params do not reject
    decision = enforce(code_policy, task, {"temperature": 0.2})
    assert decision.applied["repetition_penalty"] == 1.2 and decision.on_violation == "reject"


def test_enforce_ints_stay_ints(code_policy: Policy) -> None:
    decision = enforce(code_policy, code_policy.tasks["code"], {"max_tokens": 10_000, "n": 0})
    assert decision.applied["max_tokens"] == 256 and type(decision.applied["max_tokens"]) is int
    assert decision.applied["n"] == 1 and type(decision.applied["n"]) is int
    decision = enforce(code_policy, code_policy.tasks["code"], {"max_tokens": 64.0})
    assert type(decision.applied["max_tokens"]) is int


def test_enforce_passes_through_ungoverned(code_policy: Policy) -> None:
    requested = {"seed": 7, "stop": ["\n\n"], "top_k": 40, "temperature": 0.2, "max_completion_tokens": 9}
    decision = enforce(code_policy, code_policy.tasks["code"], requested)
    assert decision.applied["seed"] == 7 and decision.applied["stop"] == ["\n\n"]
    assert decision.applied["top_k"] == 40  # governed name, but this task has no top_k rule
    assert decision.applied["max_completion_tokens"] == 9
    assert all(a.param in GOVERNED_PARAMS for a in decision.adjustments)


@pytest.mark.parametrize("bad", ["0.2", True, float("nan"), [0.2]])
def test_enforce_non_numbers_raise_type_error(code_policy: Policy, bad: object) -> None:
    with pytest.raises(TypeError, match="temperature"):
        enforce(code_policy, code_policy.tasks["code"], {"temperature": bad})


def test_enforce_non_integer_for_integer_param(code_policy: Policy) -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        enforce(code_policy, code_policy.tasks["code"], {"max_tokens": 12.5})


# --------------------------------------------------------------------------- bad files


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", "business_line: code_assistant\ntasks:\n  code: {params: [\n")
    message = assert_one_error(path, "line ", "YAML", "expected")
    assert "line 3" in message or "line 4" in message, message


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", good() + "default_task: chat\n")
    assert_one_error(path, "duplicate key 'default_task'", "line ")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", ""])
def test_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "(top level)", "expected a mapping")


def test_unknown_keys_list_allowed(tmp_path: Path) -> None:
    text = good().replace(
        "      temperature: {min: 0.1, max: 0.3, default: 0.2}", "      temprature: {min: 0.1, max: 0.3, default: 0.2}"
    )
    path = write(tmp_path, "code_assistant.yaml", text)
    message = assert_one_error(path, "tasks.code.params.temprature", "'temprature'", "did you mean 'temperature'")
    for name in GOVERNED_PARAMS:
        assert name in message
    path = write(tmp_path, "code_assistant.yaml", good() + "owner: me\n")
    assert_one_error(path, "owner", "unknown key", "business_line, description, default_task, defaults, tasks")
    text = good().replace("{fixed: 1.2}\n  sql", "{fixed: 1.2, step: 0.1}\n  sql")
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "tasks.code.params.repetition_penalty.step", "min, max, default, fixed")


def test_min_greater_than_max(tmp_path: Path) -> None:
    text = good().replace("{min: 0.1, max: 0.3, default: 0.2}", "{min: 0.5, max: 0.3, default: 0.2}")
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "tasks.code.params.temperature.min", "0.5", "<= max (0.3)")


def test_default_outside_range(tmp_path: Path) -> None:
    text = good().replace("{min: 0.1, max: 0.3, default: 0.2}", "{min: 0.1, max: 0.3, default: 0.7}")
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "tasks.code.params.temperature.default", "0.7", "[0.1, 0.3]")


def test_negative_temperature(tmp_path: Path) -> None:
    text = good().replace("{min: 0.1, max: 0.3, default: 0.2}", "{min: -1, max: 0.3, default: 0.2}")
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "tasks.code.params.temperature.min", "= -1", "[0.0, inf)")


def test_top_p_above_one(tmp_path: Path) -> None:
    text = good().replace(
        "repetition_penalty: {fixed: 1.2}\n  sql", "repetition_penalty: {fixed: 1.2}\n      top_p: {max: 2}\n  sql"
    )
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "tasks.code.params.top_p.max", "= 2", "(0.0, 1.0]")


def test_non_integer_top_k(tmp_path: Path) -> None:
    text = good().replace(
        "    n: {min: 1, max: 4, default: 1}", "    n: {min: 1, max: 4, default: 1}\n    top_k: {max: 2.5}"
    )
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "defaults.params.top_k.max", "2.5", "an integer")


@pytest.mark.parametrize(
    ("rule", "key", "value", "expected"),
    [
        ("temperature: {min: 0.1, max: 5, default: 0.2}", "temperature.max", "= 5", "a number in [0.0, 2.0]"),
        ("temperature: {fixed: 2.5}", "temperature.fixed", "= 2.5", "outside [0.0, 2.0]"),
        ("n: {min: 1, max: 17}", "n.max", "= 17", "an integer in [1, 16]"),
        ("top_k: {default: 100001}", "top_k.default", "= 100001", "an integer in [0, 100000]"),
        ("repetition_penalty: {max: 11}", "repetition_penalty.max", "= 11", "a number in (0.0, 10.0]"),
    ],
)
def test_a_policy_cannot_allow_what_http_refuses(
    tmp_path: Path, rule: str, key: str, value: str, expected: str
) -> None:
    text = good().replace("      temperature: {min: 0.0, max: 1.2, default: 0.7}", "      " + rule)
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, f"tasks.chat.params.{key}", value, expected, "HTTP")


def test_policy_domains_and_http_limits_come_from_one_table() -> None:
    from mla_watch.policy.model import PARAM_DOMAINS
    from mla_watch.policy.params import SAMPLING_PARAMS

    assert tuple(p.name for p in SAMPLING_PARAMS.values() if p.governed) == GOVERNED_PARAMS
    for name in GOVERNED_PARAMS:
        param = SAMPLING_PARAMS[name]
        assert PARAM_DOMAINS[name] is param.domain
        assert param.http is not None and param.http.high is not None
        assert param.policy_domain.high == param.http.high  # a policy can allow no more than a client may send


def test_non_number_rule_value_hint(tmp_path: Path) -> None:
    text = good().replace("{min: 0.1, max: 0.3, default: 0.2}", "{min: 1e-3, max: 0.3, default: 0.2}")
    path = write(tmp_path, "code_assistant.yaml", text)
    assert_one_error(path, "tasks.code.params.temperature.min", "'1e-3'", "a number", "as text")


def test_on_violation_warn(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", good().replace("on_violation: reject", "on_violation: warn"))
    assert_one_error(path, "tasks.sql.on_violation", "'warn'", "clamp, reject")


def test_default_task_missing(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", good().replace("default_task: code", "default_task: review"))
    assert_one_error(path, "default_task", "'review'", "code, sql, chat")


def test_business_line_must_match_stem(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", good("code-assistant"))
    assert_one_error(path, "business_line", "'code-assistant'", "'code_assistant'")


def test_fixed_combined_with_range(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", good().replace("{fixed: 1.2}\n  sql", "{fixed: 1.2, max: 2}\n  sql"))
    assert_one_error(path, "tasks.code.params.repetition_penalty.fixed", "1.2", "cannot be combined with max")


def test_several_problems_all_reported(tmp_path: Path) -> None:
    text = (
        good()
        .replace("on_violation: reject", "on_violation: warn")
        .replace("{min: 0.0, max: 1.2, default: 0.7}", "{min: -1, max: 1.2, default: 0.7}")
        .replace("default_task: code", "default_task: review")
        + "owner: me\n"
    )
    path = write(tmp_path, "code_assistant.yaml", text)
    errors = load_errors(path)
    assert len(errors) == 4, errors
    assert all(str(path) in e for e in errors)
    joined = "\n".join(errors)
    for fragment in ("tasks.sql.on_violation", "tasks.chat.params.temperature.min", "default_task", "owner"):
        assert fragment in joined


def test_missing_required_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", "business_line: code_assistant\n")
    errors = load_errors(path)
    joined = "\n".join(errors)
    assert len(errors) == 2 and "tasks: missing" in joined and "default_task: missing" in joined


def test_unreadable_file_is_policy_error(tmp_path: Path) -> None:
    message = load_errors(tmp_path / "nope.yaml")[0]
    assert "nope.yaml" in message and "expected" in message


def test_two_files_for_one_line(tmp_path: Path) -> None:
    write(tmp_path, "code_assistant.yaml", good())
    write(tmp_path, "code_assistant.yml", good())
    with pytest.raises(PolicyError) as info:
        load_policy_dir(tmp_path)
    (message,) = info.value.errors
    assert "code_assistant.yaml" in message and "code_assistant.yml" in message and "'code_assistant'" in message


@pytest.mark.parametrize("kind", ["empty", "missing", "only-other-files"])
def test_empty_or_missing_dir(tmp_path: Path, kind: str) -> None:
    directory = tmp_path / "policies"
    if kind != "missing":
        directory.mkdir()
    if kind == "only-other-files":
        write(directory, "README.md", "not a policy\n")
        write(directory, ".hidden.yaml", good("hidden"))
    with pytest.raises(PolicyError) as info:
        load_policy_dir(directory)
    assert str(directory) in str(info.value)


def test_dir_collects_errors_of_all_files(tmp_path: Path) -> None:
    write(tmp_path, "code_assistant.yaml", good().replace("on_violation: reject", "on_violation: warn"))
    write(tmp_path, "doc_summary.yaml", good("docs"))
    write(tmp_path, "default.yaml", good("default"))
    with pytest.raises(PolicyError) as info:
        load_policy_dir(tmp_path)
    errors = info.value.errors
    assert len(errors) == 2
    assert any("code_assistant.yaml" in e for e in errors) and any("doc_summary.yaml" in e for e in errors)
    assert "2 problems" in str(info.value)


def test_task_merge_over_defaults(tmp_path: Path) -> None:
    text = good().replace(
        "  chat:\n    params:", "  chat:\n    max_prompt_tokens: 100\n    params:\n      n: {fixed: 1}"
    )
    text = text.replace("  on_violation: clamp\n", "  on_violation: clamp\n  max_prompt_tokens: 384\n", 1)
    policy = load_policy_file(write(tmp_path, "code_assistant.yaml", text))
    chat, code = policy.tasks["chat"], policy.tasks["code"]
    assert chat.params["n"] == ParamRule(1, 1, 1)  # replaced
    assert chat.params["max_tokens"] == ParamRule(1, 256, 128)  # inherited
    assert chat.max_prompt_tokens == 100 and code.max_prompt_tokens == 384
    assert policy.tasks["sql"].on_violation == "reject" and code.on_violation == "clamp"
    assert list(code.params) == [p for p in GOVERNED_PARAMS if p in code.params]


# --------------------------------------------------------------------------- PolicyStore


def _touch_later(path: Path, text: str) -> None:
    """Rewrite ``path`` and move its mtime forward, so that coarse timestamps cannot hide the edit."""
    before = path.stat().st_mtime_ns
    path.write_text(text, encoding="utf-8")
    later = max(path.stat().st_mtime_ns, before + 1_000_000)
    os.utime(path, ns=(later, later))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    write(tmp_path, "code_assistant.yaml", good())
    write(tmp_path, "default.yaml", good("default"))
    return tmp_path


def test_store_reload_picks_up_edit(store_dir: Path) -> None:
    results = []
    store = PolicyStore(store_dir, on_reload=results.append)
    assert store.version == 1 and store.last_error is None
    assert store.reload().changed is False and store.version == 1
    _touch_later(store_dir / "code_assistant.yaml", good().replace("max: 0.3, default: 0.2", "max: 0.4, default: 0.2"))
    result = store.reload()
    assert result.ok and result.changed and result.version == 2 == store.version
    _, task = store.current.resolve("code_assistant", "code")
    assert task.params["temperature"].maximum == 0.4
    assert [r.version for r in results] == [1, 2]


def test_store_refuses_broken_edit_and_recovers(store_dir: Path) -> None:
    store = PolicyStore(store_dir)
    before = store.current
    path = store_dir / "code_assistant.yaml"
    _touch_later(path, good().replace("on_violation: reject", "on_violation: warn"))
    result = store.reload()
    assert not result.ok and not result.changed
    assert result.errors and all("code_assistant.yaml" in e for e in result.errors)
    assert store.current is before and store.version == 1 == result.version
    assert isinstance(store.last_error, PolicyError)
    assert store.as_dict()["last_error"] == result.errors
    _, sql = store.current.resolve("code_assistant", "sql")
    assert sql.on_violation == "reject"  # the last good set stays in force
    _touch_later(path, good().replace("on_violation: reject", "on_violation: clamp"))
    fixed = store.reload()
    assert fixed.ok and fixed.changed and store.version == 2 and store.last_error is None
    assert store.current.resolve("code_assistant", "sql")[1].on_violation == "clamp"


def test_store_start_up_error(tmp_path: Path) -> None:
    write(tmp_path, "code_assistant.yaml", good("wrong"))
    with pytest.raises(PolicyError, match=r"code_assistant\.yaml"):
        PolicyStore(tmp_path)


def test_check_for_changes(store_dir: Path) -> None:
    store = PolicyStore(store_dir)
    assert store.check_for_changes() is None
    assert store.check_for_changes() is None
    write(store_dir, "doc_summary.yaml", good("doc_summary"))
    result = store.check_for_changes()
    assert result is not None and result.ok and result.changed and store.version == 2
    assert "doc_summary" in store.current.lines
    assert store.check_for_changes() is None
    # a broken edit is tried once, then not again until the next edit
    _touch_later(store_dir / "doc_summary.yaml", "business_line: [\n")
    broken = store.check_for_changes()
    assert broken is not None and not broken.ok
    assert store.check_for_changes() is None
    assert "doc_summary" in store.current.lines and store.version == 2
    (store_dir / "doc_summary.yaml").unlink()
    removed = store.check_for_changes()
    assert removed is not None and removed.ok and "doc_summary" not in store.current.lines


def test_watch_picks_up_change(store_dir: Path) -> None:
    store = PolicyStore(store_dir)
    stop = store.watch(interval=0.05)
    try:
        _touch_later(
            store_dir / "code_assistant.yaml", good().replace("max: 0.3, default: 0.2", "max: 0.4, default: 0.2")
        )
        deadline = time.monotonic() + 5.0
        while store.version == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.version == 2
        assert store.current.resolve("code_assistant", "code")[1].params["temperature"].maximum == 0.4
    finally:
        stop()


def test_watch_stop_joins_thread(store_dir: Path) -> None:
    import threading

    store = PolicyStore(store_dir)
    before = set(threading.enumerate())
    stop = store.watch(interval=0.05)
    started = set(threading.enumerate()) - before
    assert len(started) == 1
    stop()
    assert not any(t.is_alive() for t in started)


# --------------------------------------------------------------------------- properties

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def rules(draw: st.DrawFn) -> ParamRule:
    lo, hi = sorted((draw(finite), draw(finite)))
    use_lo, use_hi = draw(st.booleans()), draw(st.booleans())
    return ParamRule(lo if use_lo else None, hi if use_hi else None, None)


def _single(rule: ParamRule, mode: str) -> tuple[Policy, TaskPolicy]:
    task = TaskPolicy("t", mode, {"temperature": rule}, None)  # type: ignore[arg-type]
    return Policy("line", "", "t", {"t": task}, Path("line.yaml")), task


def _inside(rule: ParamRule, value: float) -> bool:
    return (rule.minimum is None or value >= rule.minimum) and (rule.maximum is None or value <= rule.maximum)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rule=rules(), value=st.one_of(finite, st.integers(-(10**6), 10**6), st.sampled_from([float("inf"), -float("inf")]))
)
def test_property_clamp(rule: ParamRule, value: float) -> None:
    policy, task = _single(rule, "clamp")
    decision = enforce(policy, task, {"temperature": value})
    applied = decision.applied["temperature"]
    assert _inside(rule, applied)
    if _inside(rule, value):
        assert applied == value and decision.adjustments == ()
    else:
        assert decision.adjustments == (Adjustment("temperature", value, applied),)
        assert applied in (rule.minimum, rule.maximum)


@settings(max_examples=150, deadline=None)
@given(rule=rules(), value=st.one_of(finite, st.integers(-(10**6), 10**6)))
def test_property_reject(rule: ParamRule, value: float) -> None:
    policy, task = _single(rule, "reject")
    if _inside(rule, value):
        assert enforce(policy, task, {"temperature": value}).applied["temperature"] == value
    else:
        with pytest.raises(PolicyRejection) as info:
            enforce(policy, task, {"temperature": value})
        assert info.value.value == value and info.value.param == "temperature"


@settings(max_examples=100, deadline=None)
@given(lo=st.integers(1, 1000), span=st.integers(0, 1000), value=st.integers(-5000, 5000))
def test_property_integer_params_stay_int(lo: int, span: int, value: int) -> None:
    rule = ParamRule(lo, lo + span, None)
    task = TaskPolicy("t", "clamp", {"max_tokens": rule}, None)
    policy = Policy("line", "", "t", {"t": task}, Path("line.yaml"))
    applied = enforce(policy, task, {"max_tokens": value}).applied["max_tokens"]
    assert type(applied) is int and lo <= applied <= lo + span


def test_the_all_lines_name_is_reserved(tmp_path: Path) -> None:
    path = write(tmp_path, "all.yaml", good("all"))
    assert_one_error(path, "business_line", "'all'", "reserved for every line summed")


def test_names_are_matched_whole(tmp_path: Path) -> None:
    path = write(tmp_path, "code_assistant.yaml", good().replace("  code:", '  "code\\n":', 1))
    errors = load_errors(path)
    assert any("tasks.code" in error and "a task name of 1-64 letters" in error for error in errors), errors
