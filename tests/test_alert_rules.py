"""Alert rule files: loading, validation messages, secrets, durations, templates and the linter.

No torch, no model: routers are hand-built RouterInfo records.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.support import REPO
from mla_watch.alerting.lint import LintFinding, lint
from mla_watch.alerting.rules import (
    RuleError,
    load_rules_dir,
    load_rules_file,
    parse_duration,
    render_annotations,
)
from mla_watch.alerting.vocabulary import Rule, Selector, Trend
from mla_watch.routing.routers import RouterInfo

SHIPPED_RULES = REPO / "rules"
SHIPPED_NAMES = {
    "RoutingEntropyLow",
    "RoutingEntropyHigh",
    "RoutingCollapse",
    "RoutingEntropyNearCeiling",
    "RoutingEntropyFalling",
    "RoutingCollapseForecast",
    "ExpertHotspot",
    "DeadExperts",
    "RoutingDrift",
    "LongContextDrift",
    "IndexerDegenerate",
}
ONCALL = {
    "MLA_WATCH_ONCALL_URL": "https://alerts.example.com/hook",
    "MLA_WATCH_LINE_OWNERS_URL": "https://owners.example.com/hook",
}

V2_LITE = [RouterInfo(f"model.layers.{i}.mlp.gate", i, "expert", 64, 6) for i in (1, 2, 3)]
V3 = [RouterInfo("model.layers.3.mlp.gate", 3, "expert", 256, 8)]
INDEXER = [RouterInfo("model.layers.1.self_attn.indexer", 1, "indexer", 4096, 256)]


def write(tmp_path: Path, text: str, name: str = "routing.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(path: Path, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(RuleError) as info:
        load_rules_file(path, environ=environ if environ is not None else ONCALL)
    return info.value.errors


def one_rule(body: str, extra: str = "") -> str:
    """A file with one receiver and one rule whose keys are ``body`` (indented by the caller's dedent)."""
    return (
        "receivers:\n  - {name: oncall, type: alertmanager_webhook, url: 'https://h.example/x'}\n"
        + extra
        + "rules:\n  - "
        + textwrap.dedent(body).strip().replace("\n", "\n    ")
        + "\n"
    )


# --------------------------------------------------------------------------- shipped rules


def test_shipped_rules_load_with_the_oncall_url():
    rules = load_rules_dir(SHIPPED_RULES, environ=ONCALL)
    assert {r.name for r in rules.rules} == SHIPPED_NAMES
    assert rules.receivers["oncall"].url == "https://alerts.example.com/hook"
    assert rules.receivers["oncall"].type == "alertmanager_webhook"
    assert rules.warnings == ()
    low = next(r for r in rules.rules if r.name == "RoutingEntropyLow")
    assert (low.below, low.resolve_above, low.for_seconds, low.severity) == (5.0, 5.2, 120.0, "critical")
    assert low.actions == ("notify", "retune") and low.retune_strategies == ("bias", "restore")
    assert low.selector.kind == "expert" and low.receivers == ("oncall",)
    assert (low.traffic_severity, low.receivers_for("traffic"), low.receivers_for("model")) == (
        "warning",
        ("line_owners",),
        ("oncall",),
    )
    assert all(rule.traffic_receivers == ("line_owners",) for rule in rules.rules)
    assert low.annotations["runbook_url"].endswith("docs/runbooks.md#routingentropylow")
    high = next(r for r in rules.rules if r.name == "RoutingEntropyHigh")
    assert (high.above, high.resolve_below) == (6.5, 6.3)
    dead = next(r for r in rules.rules if r.name == "DeadExperts")
    assert dead.min_tokens == 1024 and dead.above == 4
    # the early warnings: RoutingEntropyLow's and RoutingCollapse's thresholds, predicted 3 days ahead
    falling = next(r for r in rules.rules if r.name == "RoutingEntropyFalling")
    assert falling.trend == Trend("predict", 12 * 3600.0, ahead_seconds=3 * 86400.0)
    assert (falling.below, falling.resolve_above, falling.severity, falling.actions) == (
        low.below,
        5.2,
        "warning",
        ("notify",),
    )
    assert falling.selector == low.selector
    forecast = next(r for r in rules.rules if r.name == "RoutingCollapseForecast")
    collapse = next(r for r in rules.rules if r.name == "RoutingCollapse")
    assert forecast.trend == falling.trend and forecast.selector == collapse.selector
    assert (forecast.below, forecast.severity, forecast.actions) == (collapse.below, "warning", ("notify",))


def test_shipped_rules_without_the_oncall_url_warn_and_disable_the_receiver():
    rules = load_rules_dir(SHIPPED_RULES, environ={})
    assert rules.receivers["oncall"].url is None and rules.receivers["line_owners"].url is None
    assert len(rules.warnings) == 2
    assert (
        "receiver 'oncall': MLA_WATCH_ONCALL_URL is unset; alerts are evaluated, exported and logged but not sent"
        in rules.warnings[0]
    )
    assert "receiver 'line_owners': MLA_WATCH_LINE_OWNERS_URL is unset" in rules.warnings[1]


def test_every_shipped_rule_has_summary_description_and_runbook():
    for rule in load_rules_dir(SHIPPED_RULES, environ=ONCALL).rules:
        assert {"summary", "description", "runbook_url"} <= set(rule.annotations), rule.name
        assert rule.annotations["runbook_url"].endswith("#" + rule.name.lower())


# --------------------------------------------------------------------------- validation messages


def test_broken_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "rules:\n  - alert: A\n    metric: [entropy_bits\n")
    (message,) = errors_of(path)
    assert str(path) in message and "line " in message and "YAML" in message


def test_duplicate_yaml_keys_are_errors(tmp_path):
    path = write(tmp_path, one_rule("alert: A\nmetric: entropy_bits\nbelow: 5\nbelow: 4"))
    (message,) = errors_of(path)
    assert "duplicate key 'below'" in message and str(path) in message


def test_wrong_threshold_type_names_file_key_value_and_expectation(tmp_path):
    path = write(tmp_path, one_rule("alert: A\nmetric: entropy_bits\nbelow: low"))
    assert errors_of(path) == [f"{path}: rules[A].below = 'low': expected a number (line 6)"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("alert: A\nmetric: entropy\nbelow: 5", ["rules[A].metric = 'entropy'", "entropy_bits", "js_divergence"]),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nthreshold: 4",
            ["rules[A].threshold: unknown key 'threshold'", "below", "resolve_above"],
        ),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nselect: {layers: [5, 2]}",
            ["rules[A].select.layers = [5, 2]", "matches no layer"],
        ),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nselect: {kind: attention}",
            ["rules[A].select.kind = 'attention'", "expert, indexer"],
        ),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nfor: -2m", ["rules[A].for = '-2m'", "non-negative"]),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nfor: soon", ["rules[A].for = 'soon'", "30s"]),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nresolve_above: 4.8", ["rules[A].resolve_above = 4.8", ">= below"]),
        ("alert: A\nmetric: entropy_bits\nabove: 6\nresolve_below: 6.2", ["rules[A].resolve_below = 6.2", "<= above"]),
        ("alert: A\nmetric: entropy_bits", ["rules[A].below: missing", "below and/or above"]),
        ("alert: 9lives\nmetric: entropy_bits\nbelow: 5", ["rules[0].alert = '9lives'", "[A-Za-z_]"]),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nseverity: page", ["rules[A].severity = 'page'", "critical"]),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nactions: [notify, reboot]",
            ["rules[A].actions[1] = 'reboot'", "notify, retune"],
        ),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nactions: []", ["rules[A].actions = []", "non-empty"]),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nretune_strategy: bias",
            ["rules[A].retune_strategy = 'bias'", "unless actions include retune"],
        ),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nactions: [retune]\nretune_strategy: [bias, reboot]",
            ["rules[A].retune_strategy[1] = 'reboot'", "router_finetune"],
        ),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nlabels: {severity: low}",
            ["rules[A].labels.severity = 'low'", "no override"],
        ),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nlabels: {router: x}", ["rules[A].labels.router = 'x'"]),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nlabels: {team: 7}", ["rules[A].labels.team = 7", "a string"]),
        ("alert: A\nmetric: entropy_bits\nbelow: 5\nmin_tokens: 0", ["rules[A].min_tokens = 0", "integer >= 1"]),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nannotations: {summary: '{valeu:.2f} on {router}'}",
            [
                "rules[A].annotations.summary = '{valeu:.2f} on {router}'",
                "{valeu} is unknown",
                "did you mean {value}",
                "floor_bits",
                "status_url",
            ],
        ),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nannotations: {summary: 'entropy {value:.2f'}",
            ["rules[A].annotations.summary = 'entropy {value:.2f'", "str.format template"],
        ),
        (
            "alert: A\nmetric: entropy_bits\nbelow: 5\nannotations: {summary: 'on {router:.2f}'}",
            ["rules[A].annotations.summary", "format spec"],
        ),
        ("alert: A\nmetric: entropy_bits\nbelow: 6\nabove: 5", ["rules[A].below = 6.0", "< above"]),
    ],
)
def test_rule_errors_name_file_key_value_and_expectation(tmp_path, body, expected):
    path = write(tmp_path, one_rule(body))
    errors = errors_of(path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}: ")
    for fragment in expected:
        assert fragment in errors[0], (fragment, errors[0])


def test_all_errors_of_a_file_are_reported_together(tmp_path):
    path = write(tmp_path, one_rule("alert: A\nmetric: nope\nbelow: x\nfor: -1"))
    errors = errors_of(path)
    assert len(errors) == 3
    assert any("metric = 'nope'" in e for e in errors)
    assert any("below = 'x'" in e for e in errors)
    assert any("for = -1" in e for e in errors)


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "rule:\n  - alert: A\n")
    (message,) = errors_of(path)
    assert "rule: unknown key 'rule'" in message and "did you mean 'rules'" in message and str(path) in message


@pytest.mark.parametrize(
    ("receiver", "expected"),
    [
        (
            "{name: oncall, type: alertmanager_webhook, url: 'ftp://h.example/x'}",
            ["receivers[0].url = 'ftp://h.example/…'", "http:// or https://", "scheme is 'ftp'"],
        ),
        ("{name: oncall, type: alertmanager_webhook, url: 'https:///x'}", ["receivers[0].url", "no host"]),
        (
            "{name: oncall, type: webhook, url: 'https://h.example'}",
            ["receivers[0].type = 'webhook'", "alertmanager_webhook, alertmanager_api, slack, pagerduty"],
        ),
        (
            "{name: oncall, type: alertmanager_webhook, url: 'https://h.example', timeout: -5s}",
            ["receivers[0].timeout = '-5s'", "non-negative"],
        ),
        (
            "{name: oncall, type: alertmanager_webhook, url: 'https://h.example', retries: 3}",
            ["receivers[0].retries: unknown key", "max_attempts"],
        ),
        ("{name: oncall, type: alertmanager_webhook}", ["receivers[0].url: missing"]),
        ("{name: oncall, type: pagerduty}", ["receivers[0].routing_key: missing"]),
        (
            "{name: oncall, type: slack, url: 'https://h.example', resend_interval: 1m}",
            ["receivers[0].resend_interval = '1m'", "only used by type alertmanager_api"],
        ),
        (
            "{name: oncall, type: alertmanager_webhook, url: 'https://h.example', max_attempts: 0}",
            ["receivers[0].max_attempts = 0", "integer >= 1"],
        ),
    ],
)
def test_receiver_errors(tmp_path, receiver, expected):
    path = write(tmp_path, f"receivers:\n  - {receiver}\n")
    errors = errors_of(path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}: ")
    for fragment in expected:
        assert fragment in errors[0], (fragment, errors[0])


def test_receiver_url_from_the_environment_that_does_not_parse_shows_the_variable_not_the_value(tmp_path):
    path = write(tmp_path, "receivers:\n  - {name: oncall, type: slack, url: '${SLACK_URL}'}\n")
    (message,) = errors_of(path, {"SLACK_URL": "ftp://hooks.example/T000/B000/XXXXSECRETXXXX"})
    assert "receivers[0].url = ${SLACK_URL}" in message and "scheme is 'ftp'" in message
    assert "XXXXSECRETXXXX" not in message and "hooks.example" not in message


def test_secrets_never_appear_in_messages(tmp_path):
    secret = "s3cr3t-T0KEN-value"
    path = write(
        tmp_path,
        f"""\
        receivers:
          - name: a
            type: alertmanager_webhook
            url: ${{HOOK_URL}}
            headers: {{Authorization: "Bearer ${{ONCALL_TOKEN}}", X-Unset: "${{NOT_SET_VAR}}", X-Bad: 12}}
            hmac_secret: ${{ONCALL_HMAC}}
            routing_key: {secret}
          - name: b
            type: pagerduty
            routing_key: ["{secret}"]
          - name: c
            type: alertmanager_webhook
            url: 'https://user:{secret}@[bad/x'
        rules:
          - {{alert: A, metric: entropy_bits, below: 5, receivers: [a]}}
        """,
    )
    environ = {"HOOK_URL": f"https://h.example/{secret}", "ONCALL_TOKEN": secret, "ONCALL_HMAC": secret}
    errors = errors_of(path, environ)
    text = "\n".join(errors)
    assert secret not in text
    assert any("receivers[0].headers.X-Unset" in e and "NOT_SET_VAR is unset" in e for e in errors)
    assert any("receivers[0].headers.X-Bad" in e and "value hidden" in e for e in errors)
    assert any("receivers[0].routing_key" in e and "only used by type pagerduty" in e for e in errors)
    assert any("receivers[1].routing_key" in e and "value hidden" in e for e in errors)
    assert any("receivers[2].url" in e for e in errors)


def test_secrets_are_expanded_into_the_receiver(tmp_path):
    path = write(
        tmp_path,
        """\
        receivers:
          - name: pd
            type: pagerduty
            routing_key: ${PD_KEY}
            headers: {Authorization: "Bearer ${TOKEN}"}
            hmac_secret: ${HMAC}
            timeout: 2s
            repeat_interval: 1h30m
            group_by: [alertname]
            send_resolved: false
          - {name: am, type: alertmanager_api, url: 'http://am.example:9093', resend_interval: 2m}
        """,
    )
    _, receivers, warnings = load_rules_file(path, environ={"PD_KEY": "k1", "TOKEN": "t2", "HMAC": "h3"})
    pd = receivers["pd"]
    assert pd.url == "https://events.pagerduty.com/v2/enqueue" and pd.routing_key == "k1"
    assert pd.headers == {"Authorization": "Bearer t2"} and pd.hmac_secret == "h3"
    assert (pd.timeout_seconds, pd.repeat_interval_seconds, pd.group_by, pd.send_resolved) == (
        2.0,
        5400.0,
        ("alertname",),
        False,
    )
    assert receivers["am"].resend_interval_seconds == 120.0 and warnings == []


def test_unset_secret_of_a_disabled_receiver_is_not_an_error(tmp_path):
    path = write(
        tmp_path,
        """\
        receivers:
          - {name: oncall, type: alertmanager_webhook, url: '${HOOK}', headers: {Authorization: 'Bearer ${TOKEN}'}}
        """,
    )
    _, receivers, warnings = load_rules_file(path, environ={})
    assert receivers["oncall"].url is None and receivers["oncall"].headers == {}
    assert len(warnings) == 1 and "HOOK is unset" in warnings[0]
    (message,) = errors_of(path, {"HOOK": "https://h.example"})
    assert "receivers[0].headers.Authorization: environment variable TOKEN is unset" in message


def test_duplicate_names_within_a_file(tmp_path):
    path = write(
        tmp_path,
        one_rule("alert: A\nmetric: entropy_bits\nbelow: 5") + "  - {alert: A, metric: entropy_bits, above: 6}\n",
    )
    (message,) = errors_of(path)
    assert "rules[A].alert = 'A'" in message and "used by one rule only" in message and message.endswith("(line 7)")


def test_directory_errors_collect_every_file(tmp_path):
    write(
        tmp_path,
        "receivers:\n  - {name: oncall, type: alertmanager_webhook, url: 'https://h.example'}\n",
        "receivers.yaml",
    )
    write(tmp_path, "rules:\n  - {alert: A, metric: entropy_bits, below: 5}\n", "a.yaml")
    write(
        tmp_path,
        "rules:\n  - {alert: A, metric: entropy_bits, above: 6}\n"
        "  - {alert: B, metric: entropy_bits, above: 6, receivers: [pager]}\n",
        "b.yml",
    )
    write(tmp_path, "rules:\n  - {alert: C, metric: bogus, above: 6}\n", "c.yaml")
    write(tmp_path, "this is: [not, valid\n", ".editor-backup.yaml")  # dotfiles are skipped
    with pytest.raises(RuleError) as info:
        load_rules_dir(tmp_path, environ={})
    errors = info.value.errors
    assert any("c.yaml: rules[C].metric = 'bogus'" in e for e in errors)
    assert any("b.yml: rules[0].alert = 'A'" in e and "a.yaml: rules[0]" in e for e in errors)
    assert not any(".editor-backup" in e for e in errors)
    (tmp_path / "c.yaml").unlink()
    with pytest.raises(RuleError) as info:
        load_rules_dir(tmp_path, environ={})
    assert any("b.yml: rules[0].alert = 'A'" in e for e in info.value.errors)
    (tmp_path / "a.yaml").unlink()
    with pytest.raises(RuleError) as info:
        load_rules_dir(tmp_path, environ={})
    assert info.value.errors == [
        f"{tmp_path / 'b.yml'}: rules[1].receivers[0] = 'pager': expected a defined receiver: oncall"
    ]


def test_duplicate_receiver_across_files(tmp_path):
    for name in ("a.yaml", "b.yaml"):
        write(tmp_path, "receivers:\n  - {name: oncall, type: alertmanager_webhook, url: 'https://h.example'}\n", name)
    with pytest.raises(RuleError) as info:
        load_rules_dir(tmp_path, environ={})
    (message,) = info.value.errors
    assert "b.yaml: receivers[0].name = 'oncall'" in message and "a.yaml: receivers[0]" in message


@pytest.mark.parametrize("make", ["missing", "empty", "only-dotfiles"])
def test_missing_or_empty_directory(tmp_path, make):
    directory = tmp_path / "rules"
    if make != "missing":
        directory.mkdir()
    if make == "only-dotfiles":
        (directory / ".hidden.yaml").write_text("rules: []\n")
    with pytest.raises(RuleError) as info:
        load_rules_dir(directory, environ={})
    assert str(directory) in str(info.value)


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        ("1d", 86400.0),
        (45, 45.0),
        (2.5, 2.5),
        ("90", 90.0),
        ("0s", 0.0),
        ("1m30s", 90.0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text, "rules[0].for") == seconds


@pytest.mark.parametrize("text", ["-5s", -1, "5 minutes", "", "30m1h", "1x", True, None, float("nan"), "s"])
def test_parse_duration_errors_name_where(text):
    with pytest.raises(RuleError) as info:
        parse_duration(text, "rules.yaml: rules[3].for")
    assert str(info.value).startswith("rules.yaml: rules[3].for = ")


# --------------------------------------------------------------------------- render_annotations


def test_render_annotations_formats_fields_and_defaults_the_rule_constants():
    rule = Rule(
        name="Low",
        metric="entropy_bits",
        selector=Selector(),
        below=5.0,
        resolve_above=5.2,
        annotations={
            "summary": "{alertname}: {value:.2f} < {threshold} (resolve {resolve_threshold}) on {router} layer {layer}",
            "more": "floor {floor_bits:.3f}, {tokens} tokens, min {min_tokens}, {status_url}",
        },
    )
    out = render_annotations(
        rule,
        {
            "value": 4.4567,
            "router": "model.layers.1.mlp.gate",
            "layer": 1,
            "floor_bits": 2.58496,
            "tokens": 300,
            "status_url": None,
        },
    )
    assert out["summary"] == "Low: 4.46 < 5.0 (resolve 5.2) on model.layers.1.mlp.gate layer 1"
    assert out["more"] == "floor 2.585, 300 tokens, min n/a, n/a"


def test_render_annotations_never_raises_on_odd_values():
    rule = Rule(
        name="X",
        metric="max_violation",
        selector=Selector(),
        above=1.0,
        annotations={"summary": "{value:.2f} on {router}"},
    )
    assert render_annotations(rule, {"value": "oops"}) == {"summary": "oops on n/a"}


# --------------------------------------------------------------------------- lint


def findings_for(rules_text: str, routers, tmp_path: Path) -> list[LintFinding]:
    write(tmp_path, rules_text)
    return lint(load_rules_dir(tmp_path, environ=ONCALL), routers)


def test_lint_shipped_rules_flag_entropy_high_on_64_experts_only():
    rules = load_rules_dir(SHIPPED_RULES, environ=ONCALL)
    findings = lint(rules, V2_LITE)
    # one finding for every router it selects, an info: the rule says why it is expected
    (never,) = [f for f in findings if f.rule == "RoutingEntropyHigh"]
    assert never.severity == "info" and never.code == "never_fires" and never.router is None
    assert (
        "above 6.5 bits can never fire on any of the 3 routers it selects (model.layers.1.mlp.gate, "
        "model.layers.2.mlp.gate, model.layers.3.mlp.gate)"
    ) in never.message
    assert "its ceiling is log2 64 = 6.000 bits. Expected: the seed's threshold" in never.message
    assert not [f for f in findings if f.severity == "warning" and f.rule == "RoutingEntropyHigh"]
    assert not [f for f in findings if f.severity == "error"]  # the shipped rules are usable as they are
    # the indexer rule is for a kind of router this model has none of: it does not apply, as the 64-expert rules
    (indexer,) = [f for f in findings if f.rule == "IndexerDegenerate"]
    assert indexer.severity == "info" and indexer.router is None and "does not apply here" in indexer.message

    v3 = lint(rules, V3)
    assert not [f for f in v3 if f.severity == "error"], v3
    assert not any("can never fire" in f.message for f in v3)


def test_lint_shipped_rules_on_an_indexer():
    findings = lint(load_rules_dir(SHIPPED_RULES, environ=ONCALL), INDEXER)
    assert not [f for f in findings if f.severity == "error"], findings


def test_lint_below_above_the_ceiling_always_fires(tmp_path):
    findings = findings_for(one_rule("alert: Seven\nmetric: entropy_bits\nbelow: 7"), V2_LITE[:1], tmp_path)
    (finding,) = findings
    assert finding.severity == "error" and finding.router == "model.layers.1.mlp.gate"
    assert "below 7 bits always fires" in finding.message and "log2 64 = 6.000 bits" in finding.message


def test_lint_below_the_floor_never_fires(tmp_path):
    findings = findings_for(one_rule("alert: Floor\nmetric: entropy_bits\nbelow: 2.5"), V2_LITE[:1], tmp_path)
    (finding,) = findings
    assert finding.severity == "warning" and "can never fire" in finding.message
    assert "log2 6 = 2.585" in finding.message


@pytest.mark.parametrize(
    ("body", "fragment", "severity"),
    [
        ("metric: normalized_entropy\nabove: 1.0", "can never fire", "warning"),
        ("metric: normalized_entropy\nbelow: 0", "can never fire", "warning"),
        ("metric: max_violation\nabove: 9.7", "N/k - 1 = 64/6 - 1 = 9.667", "warning"),
        ("metric: max_violation\nbelow: 0", "can never fire", "warning"),
        ("metric: dead_slots\nabove: 58", "N - k = 64 - 6 = 58", "warning"),
        ("metric: dead_slots\nbelow: 59", "always fires", "error"),
        ("metric: js_divergence\nabove: 1", "at most 1 bit", "warning"),
        ("metric: locality\nabove: 0.5", "only reported for indexers", "warning"),
        ("metric: entropy_bits\nbelow: 5\nresolve_above: 6.1", "never resolves", "error"),
    ],
)
def test_lint_metric_ranges(tmp_path, body, fragment, severity):
    findings = findings_for(one_rule("alert: R\n" + body), V2_LITE[:1], tmp_path)
    assert [f.severity for f in findings] == [severity], findings
    assert fragment in findings[0].message


def test_lint_thresholds_inside_the_range_are_clean(tmp_path):
    text = one_rule("alert: R\nmetric: max_violation\nabove: 9.6")
    assert findings_for(text, V2_LITE[:1], tmp_path) == []


def test_lint_small_minimum_window(tmp_path):
    findings = findings_for(
        one_rule("alert: Small\nmetric: entropy_bits\nbelow: 5\nmin_tokens: 16"), V2_LITE[:1], tmp_path
    )
    (finding,) = findings
    assert finding.severity == "warning" and "minimum window too small" in finding.message
    assert "152" in finding.message  # the recommended minimum for 64 experts, top-6, 0.05 bits
    assert "0.473 bits low" in finding.message  # 63 / (2 * 16 * 6 * ln 2)
    assert (
        findings_for(one_rule("alert: Small\nmetric: entropy_bits\nbelow: 5\nmin_tokens: 152"), V2_LITE[:1], tmp_path)
        == []
    )


def test_lint_selector_matching_nothing(tmp_path):
    text = one_rule("alert: Nowhere\nmetric: entropy_bits\nbelow: 5\nselect: {router: '*.moe.router', layers: [0, 9]}")
    (finding,) = findings_for(text, V2_LITE, tmp_path)
    assert finding.severity == "warning" and finding.router is None and finding.rule == "Nowhere"
    assert "matches none of the model's 3 routers" in finding.message and "'*.moe.router'" in finding.message


def test_lint_applies_layer_and_router_selectors(tmp_path):
    text = one_rule("alert: Seven\nmetric: entropy_bits\nbelow: 7\nselect: {layers: [2, 3], router: '*.mlp.gate'}")
    findings = findings_for(text, [*V2_LITE, *V3], tmp_path)
    assert [f.router for f in findings] == ["model.layers.2.mlp.gate", "model.layers.3.mlp.gate"]


RECEIVER = "receivers:\n  - name: oncall\n    type: alertmanager_webhook\n    url: http://127.0.0.1:9/hook\n"


def test_a_threshold_no_selected_router_can_reach_is_one_warning_unless_expected(tmp_path) -> None:
    text = RECEIVER + "rules:\n  - alert: High\n    metric: entropy_bits\n    select: {kind: expert}\n    above: 6.5\n"
    (warning,) = findings_for(text, V2_LITE, tmp_path)
    assert warning.severity == "warning" and "any of the 3 routers it selects" in warning.message
    (info,) = findings_for(text + "    lint_expect: {never_fires: kept for the record}\n", V2_LITE, tmp_path)
    assert info.severity == "info" and info.message.endswith("Expected: kept for the record")
    with pytest.raises(RuleError, match=r"rules\[High\]\.lint_expect = .*expected a mapping"):
        findings_for(text + "    lint_expect: [never_fires]\n", V2_LITE, tmp_path)
    with pytest.raises(RuleError, match=r"unknown key 'always_fires'|always_fires"):
        findings_for(text + "    lint_expect: {always_fires: nope}\n", V2_LITE, tmp_path)


def test_thresholds_relative_to_the_healthy_baseline(tmp_path) -> None:
    write(
        tmp_path,
        RECEIVER + "rules:\n  - alert: Hot\n    metric: max_violation\n"
        "    above: {baseline_times: 2.0, floor: 1.0}\n"
        "    resolve_below: {baseline_times: 1.5, floor: 0.7}\n",
    )
    (rule,) = load_rules_dir(tmp_path, environ=ONCALL).rules
    assert rule.above == 1.0 and rule.resolve_below == 0.7 and set(rule.baseline) == {"above", "resolve_below"}
    assert rule.levels(None) is None  # no baseline learned: not judged
    assert rule.levels(0.2) == (None, 1.0, None, 0.7)  # the floors hold a near-zero healthy value
    assert rule.levels(1.5) == (None, 3.0, None, 2.25)
    write(
        tmp_path,
        RECEIVER + "rules:\n  - alert: Dead\n    metric: dead_slots\n    above: {baseline_plus: 4, floor: 4}\n",
    )
    (dead,) = load_rules_dir(tmp_path, environ=ONCALL).rules
    assert dead.levels(0.0)[1] == 4 and dead.levels(10.0)[1] == 14
    write(
        tmp_path,
        RECEIVER + "rules:\n  - alert: Low\n    metric: entropy_bits\n    below: {baseline_plus: -0.5, ceiling: 5.0}\n",
    )
    (low,) = load_rules_dir(tmp_path, environ=ONCALL).rules
    assert low.levels(5.9)[0] == 5.0 and low.levels(5.2)[0] == pytest.approx(4.7)


@pytest.mark.parametrize(
    ("threshold", "words"),
    [
        ("above: {baseline_times: 2.0}", "rules[Hot].above.floor: missing: expected a floor"),
        ("above: {baseline_times: -1, floor: 1}", "rules[Hot].above.baseline_times = -1.0: expected a number > 0"),
        ("above: {baseline_times: 2, ceiling: 1}", "rules[Hot].above.ceiling: unknown key 'ceiling'"),
        ("above: {floor: 1}", "rules[Hot].above.baseline_times: missing"),
        (
            "above: 1.0\n    resolve_below: {baseline_times: 1.5, floor: 0.7}",
            "rules[Hot].resolve_below = {'baseline_times': 1.5, 'floor': 0.7}: expected a number, as above is one",
        ),
        (
            "above: {baseline_times: 2, floor: 1}\n    resolve_below: {baseline_times: 3, floor: 0.7}",
            "expected baseline_times and baseline_plus on the healthy side of above's",
        ),
        ("above: {baseline_times: 2, floor: 1}\n    trend: {over: 6h}", "a trend rule judges a slope"),
    ],
)
def test_a_bad_baseline_threshold_is_named(tmp_path, threshold: str, words: str) -> None:
    write(tmp_path, RECEIVER + f"rules:\n  - alert: Hot\n    metric: max_violation\n    {threshold}\n")
    with pytest.raises(RuleError) as caught:
        load_rules_dir(tmp_path, environ=ONCALL)
    assert words in str(caught.value), str(caught.value)
