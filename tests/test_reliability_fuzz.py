"""Generated bad input: policy files, rule files and admin re-tune requests.

Loading a policy or rule directory either succeeds or raises the documented error
(``PolicyError`` / ``RuleError``) whose every message names the file it is about; never any
other exception, and never a secret in a message. ``POST /admin/retune`` answers 202, 400 or
409 to any JSON body, never 500, and a 400 says which field is wrong. (Generation request
bodies are fuzzed in test_server_fuzz.py.)
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.support import REPO, running_sidecar
from mla_watch.alerting.notifiers import NOTIFIER_TYPES
from mla_watch.alerting.rules import SEVERITIES, RuleError, load_rules_dir
from mla_watch.alerting.vocabulary import METRICS
from mla_watch.policy.files import load_policy_dir
from mla_watch.policy.model import GOVERNED_PARAMS, PolicyError

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Generating overly large repr")]

TRIED: Counter = Counter()  # inputs tried, per kind (printed at the end of the module)
SECRET = "SeCrEt-"  # every secret value the strategies write starts with this
MARKED = re.compile(SECRET + "[A-Za-z0-9]+")


@pytest.fixture(scope="module", autouse=True)
def tally():
    yield
    print("\ninputs tried: " + ", ".join(f"{count} {kind}" for kind, count in sorted(TRIED.items())))


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.integers(), st.floats(), st.text(max_size=12)
)
KEYS = st.one_of(st.text(max_size=8), st.integers(-3, 3), st.booleans(), st.none())
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3), max_leaves=6
)
NUMBERS = st.one_of(
    st.integers(-5, 5000),
    st.floats(-10, 10),
    st.floats(),
    st.sampled_from([0, 1, 0.5, "0.5", "1e-3", "lots", True, None, [1], {"a": 1}]),
)


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly ``strategy``, sometimes any value at all."""
    return st.one_of(strategy, strategy, VALUES)


# --------------------------------------------------------------------------- files from documents

# How a generated document becomes a file: dumped as it is, cut short, replaced by text that is
# YAML-ish or not, by bytes that are not UTF-8, or with its first line repeated (a duplicate key).
MANGLING = st.one_of(
    st.none(),
    st.none(),
    st.tuples(st.just("cut"), st.integers(0, 600)),
    st.tuples(st.just("text"), st.text(alphabet=st.sampled_from(list(":-[]{}&*!|>'\"%@`#,? \n\tab01")), max_size=60)),
    st.tuples(st.just("bytes"), st.binary(max_size=40)),
    st.tuples(st.just("repeat_first_line"), st.just(0)),
)


def render(document: object, mangling: tuple | None) -> bytes:
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    if mangling is None:
        return text.encode()
    how, arg = mangling
    if how == "cut":
        return text[:arg].encode()
    if how == "text":
        return arg.encode()
    if how == "bytes":
        return arg
    return (text + text.splitlines()[0] + "\n").encode() if text.strip() else b""


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a document, the document itself (``()``) first."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


def mutate(document: object, edits: list[tuple[int, str, object, object]]) -> object:
    """``document`` with each edit applied: at the (index mod count)-th key path, set the value, delete
    the key, or add a key to the mapping found there."""
    document = copy.deepcopy(document)
    for index, how, key, value in edits:
        paths = _paths(document)
        path = paths[index % len(paths)]
        if not path:
            if how == "add" and isinstance(document, dict):
                document[key] = value
            continue
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        if how == "set":
            parent[path[-1]] = value
        elif how == "delete":
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][key] = value
    return document


def edits(keys: list[str], values: st.SearchStrategy) -> st.SearchStrategy:
    """Up to three edits of a shipped document, with the real keys and plausible or arbitrary values."""
    return st.lists(
        st.tuples(
            st.integers(0, 400),
            st.sampled_from(["set", "delete", "add"]),
            st.sampled_from(keys) | KEYS,
            values | VALUES,
        ),
        max_size=3,
    )


def write_files(directory: Path, files: list[tuple[str, str, object, tuple | None]]) -> list[Path]:
    paths = []
    for stem, suffix, document, mangling in files:
        path = directory / f"{stem}{suffix}"
        path.write_bytes(render(document, mangling))
        paths.append(path)
    return paths


def assert_names_a_file(messages: list[str], paths: list[Path], secrets: frozenset[str] = frozenset()) -> None:
    assert messages
    for message in messages:
        assert isinstance(message, str) and any(str(path) in message for path in paths), message
        assert not [secret for secret in secrets if secret in message], message


def secrets_of(documents: list[object], environ: dict[str, str]) -> frozenset[str]:
    """The secret values written where the rules documentation promises they never show: receiver
    header values, ``hmac_secret``, ``routing_key``, the path of a ``url`` string, and every value
    expanded from the environment (less any that the strategies also wrote somewhere else)."""
    hidden: set[str] = set()
    shown: set[str] = set()

    def walk(node: object, secret: bool) -> None:
        if isinstance(node, str):
            (hidden if secret else shown).update(MARKED.findall(node))
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(key, False)
                walk(value, secret)
        elif isinstance(node, list):
            for value in node:
                walk(value, secret)

    for document in documents:
        receivers = document.get("receivers") if isinstance(document, dict) else None
        for receiver in receivers if isinstance(receivers, list) else []:
            for key, value in receiver.items() if isinstance(receiver, dict) else []:
                walk(key, False)
                if key == "headers" and isinstance(value, dict):
                    for name, header in value.items():
                        walk(name, False)
                        walk(header, True)
                else:
                    walk(
                        value,
                        key in ("headers", "hmac_secret", "routing_key") or (key == "url" and isinstance(value, str)),
                    )
        if isinstance(receivers, list):
            walk({k: v for k, v in document.items() if k != "receivers"}, False)
        else:
            walk(document, False)
    for value in environ.values():
        hidden.update(MARKED.findall(value))
    return frozenset(hidden - shown)


# --------------------------------------------------------------------------- policies

STEMS = ["default", "code_assistant", "doc_summary", "x", "bad name", "-dash", "ünï"]
TASK_NAMES = st.sampled_from(["code", "sql", "chat", "general", "bad name", "", "x.y-z"]) | st.text(max_size=6)
PARAM_RULE = maybe(
    st.fixed_dictionaries(
        {}, optional={"min": NUMBERS, "max": NUMBERS, "default": NUMBERS, "fixed": NUMBERS, "step": NUMBERS}
    )
)
SECTION = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "on_violation": maybe(st.sampled_from(["clamp", "reject", "warn", ""])),
            "max_prompt_tokens": maybe(st.integers(-2, 5000)),
            "params": maybe(
                st.dictionaries(st.sampled_from([*GOVERNED_PARAMS, "stop", "seed"]), PARAM_RULE, max_size=4)
            ),
        },
    )
)
POLICY = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "business_line": maybe(st.sampled_from(STEMS)),
            "description": maybe(st.text(max_size=20)),
            "default_task": maybe(TASK_NAMES),
            "defaults": SECTION,
            "tasks": maybe(st.dictionaries(TASK_NAMES | KEYS, SECTION, max_size=3)),
            "task": VALUES,  # a typo of a real key
        },
    )
)
SHIPPED_POLICIES = {path.stem: yaml.safe_load(path.read_text()) for path in (REPO / "policies").glob("*.yaml")}
POLICY_KEYS = [
    "business_line",
    "description",
    "default_task",
    "defaults",
    "tasks",
    "on_violation",
    "max_prompt_tokens",
    "params",
    *GOVERNED_PARAMS,
    "min",
    "max",
    "default",
    "fixed",
    "code",
    "sql",
]
POLICY_VALUES = st.one_of(NUMBERS, st.sampled_from(["clamp", "reject", "code", "sql", "chat", *STEMS]), SECTION)
EDITED_POLICY_FILE = st.builds(
    lambda stem, suffix, changes, mangling, rename: (
        rename or stem,
        suffix,
        mutate(SHIPPED_POLICIES[stem], changes),
        mangling,
    ),
    st.sampled_from(sorted(SHIPPED_POLICIES)),
    st.sampled_from([".yaml", ".yml"]),
    edits(POLICY_KEYS, POLICY_VALUES),
    st.one_of(st.none(), st.none(), st.none(), MANGLING),
    st.none() | st.none() | st.sampled_from(STEMS),
)
POLICY_FILES = st.lists(
    st.tuples(st.sampled_from(STEMS), st.sampled_from([".yaml", ".yml"]), POLICY, MANGLING)
    | EDITED_POLICY_FILE
    | EDITED_POLICY_FILE,
    min_size=1,
    max_size=3,
    unique_by=lambda f: f[0] + f[1],
)


@settings(max_examples=300, deadline=None)
@given(files=POLICY_FILES)
def test_generated_policy_files_load_or_are_refused_naming_the_file(files) -> None:
    TRIED["policy directories"] += 1
    with tempfile.TemporaryDirectory() as name:
        paths = write_files(Path(name), files)
        try:
            policies = load_policy_dir(Path(name))
        except PolicyError as error:
            TRIED["policy directories refused"] += 1
            assert_names_a_file(error.errors, paths)
            return
        TRIED["policy directories loaded"] += 1
        for line, policy in policies.lines.items():
            assert policy.source in paths and policy.default_task in policy.tasks
            policies.resolve(line, None)


# --------------------------------------------------------------------------- rules

SECRETS = st.builds(lambda s: SECRET + s, st.text(alphabet="abcdefXYZ0123456789", min_size=4, max_size=8))
DURATIONS = maybe(
    st.one_of(
        st.sampled_from(["0s", "30s", "2m", "1h30m", "500ms", "-1s", "5x", "1m1h", "", "nan", "inf", "1e3", "2 m"]),
        st.integers(-5, 10**6),
        st.floats(),
    )
)
URLS = maybe(
    st.one_of(
        st.sampled_from(
            [
                "${MLA_WATCH_ONCALL_URL}",
                "${UNSET_VAR}",
                "http://127.0.0.1:9/hook",
                "ftp://x",
                "http://",
                "not a url",
                "",
                "http://h:x/",
            ]
        ),
        st.builds(
            lambda secret, host: f"https://{host}/services/{secret}",
            SECRETS,
            st.sampled_from(["hooks.example", "h:99999", "[::1", " bad host"]),
        ),
    )
)
RECEIVER = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "name": maybe(st.sampled_from(["oncall", "other", "bad name", ""])),
            "type": maybe(st.sampled_from([*NOTIFIER_TYPES, "email"])),
            "url": URLS,
            "headers": st.one_of(
                st.dictionaries(
                    st.sampled_from(["Authorization", "X-Api", "bad header", ""]),
                    st.one_of(
                        SECRETS,
                        st.sampled_from(["${TOKEN_VAR}", "${UNSET_VAR}", "", "Bearer ${TOKEN_VAR}"]),
                        st.lists(SECRETS, max_size=2),
                        st.none(),
                        st.integers(),
                    ),
                    max_size=2,
                ),
                st.lists(SECRETS, max_size=2),
                SECRETS,
            ),
            "hmac_secret": st.one_of(
                SECRETS,
                st.sampled_from(["${TOKEN_VAR}", "${UNSET_VAR}", ""]),
                st.none(),
                st.integers(),
                st.lists(SECRETS, max_size=1),
            ),
            "routing_key": st.one_of(SECRETS, st.sampled_from(["${TOKEN_VAR}", "${UNSET_VAR}", "", "two\nlines"])),
            "timeout": DURATIONS,
            "repeat_interval": DURATIONS,
            "resend_interval": DURATIONS,
            "max_attempts": maybe(st.integers(-1, 20)),
            "group_by": maybe(st.lists(st.sampled_from(["alertname", "router", "layer", "bad-label", ""]), max_size=3)),
            "send_resolved": maybe(st.booleans()),
        },
    )
)
TEMPLATES = maybe(
    st.one_of(
        st.sampled_from(
            [
                "{value:.2f} bits on {router}",
                "{nope}",
                "{}",
                "{0}",
                "{router.name}",
                "{value:{x}}",
                "{value:.2f",
                "}",
                "{{literal}}",
                "{tokens:d}",
                "{value:%}",
                "{router!r}",
                "{layer:>{w}}",
                "{value:.2f} > {threshold}",
                "{status_url}#{router}",
                "{routr}",
            ]
        ),
        st.text(alphabet=st.sampled_from(list("{}:.!0123456789abrdfvalue ")), max_size=20),
    )
)
SELECT = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "kind": maybe(st.sampled_from(["expert", "indexer", "gate"])),
            "layers": maybe(st.one_of(st.lists(st.integers(-3, 70), max_size=3), st.integers(-3, 5))),
            "router": maybe(st.sampled_from(["*", "*.mlp.gate", "model.layers.[12", "", "model.layers.1.mlp.gate"])),
            "business_line": maybe(st.sampled_from(["*", "all", "code_assistant", "bad line", ""])),
        },
    )
)
RULE = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "alert": maybe(st.sampled_from(["RoutingEntropyLow", "Storm", "bad name", "1x", ""])),
            "metric": maybe(st.sampled_from([*METRICS, "entropy"])),
            "select": SELECT,
            "below": NUMBERS,
            "above": NUMBERS,
            "resolve_above": NUMBERS,
            "resolve_below": NUMBERS,
            "for": DURATIONS,
            "keep_firing_for": DURATIONS,
            "min_tokens": maybe(st.integers(-2, 5000)),
            "severity": maybe(st.sampled_from([*SEVERITIES, "page"])),
            "actions": maybe(st.lists(st.sampled_from(["notify", "retune", "page"]), max_size=3)),
            "retune_strategy": maybe(
                st.lists(st.sampled_from(["bias", "restore", "router_finetune", "magic"]), max_size=3)
            ),
            "labels": maybe(
                st.dictionaries(
                    st.sampled_from(["team", "severity", "__x", "bad-name"]) | st.text(max_size=5),
                    maybe(st.text(max_size=8)),
                    max_size=3,
                )
            ),
            "annotations": maybe(
                st.dictionaries(st.sampled_from(["summary", "runbook_url", "bad-key"]), TEMPLATES, max_size=3)
            ),
            "receivers": maybe(st.lists(st.sampled_from(["oncall", "other", "nope"]), max_size=3)),
        },
    )
)
RULES_DOCUMENT = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "receivers": maybe(st.lists(RECEIVER, max_size=2)),
            "rules": maybe(st.lists(RULE, max_size=3)),
            "route": VALUES,  # not a key of rule files
        },
    )
)
SHIPPED_RULES = yaml.safe_load((REPO / "rules" / "routing.yaml").read_text())
RULE_KEYS = [
    "receivers",
    "rules",
    "name",
    "type",
    "url",
    "headers",
    "hmac_secret",
    "routing_key",
    "timeout",
    "max_attempts",
    "group_by",
    "repeat_interval",
    "send_resolved",
    "resend_interval",
    "alert",
    "metric",
    "select",
    "kind",
    "layers",
    "router",
    "business_line",
    "below",
    "above",
    "resolve_above",
    "resolve_below",
    "for",
    "keep_firing_for",
    "min_tokens",
    "severity",
    "actions",
    "retune_strategy",
    "labels",
    "annotations",
]
RULE_VALUES = st.one_of(
    NUMBERS,
    DURATIONS,
    URLS,
    TEMPLATES,
    SECRETS,
    SELECT,
    RULE,
    RECEIVER,
    st.sampled_from([*METRICS, *SEVERITIES, "notify", "retune", "*", "all", "oncall"]),
)
EDITED_RULES = st.builds(mutate, st.just(SHIPPED_RULES), edits(RULE_KEYS, RULE_VALUES))
RULE_FILES = st.lists(
    st.tuples(
        st.sampled_from(["routing", "extra", "a b"]),
        st.sampled_from([".yaml", ".yml"]),
        RULES_DOCUMENT | EDITED_RULES | EDITED_RULES,
        st.one_of(st.none(), st.none(), MANGLING),
    ),
    min_size=1,
    max_size=2,
    unique_by=lambda f: f[0] + f[1],
)
ENVIRON = st.fixed_dictionaries(
    {},
    optional={
        "MLA_WATCH_ONCALL_URL": st.sampled_from(["http://127.0.0.1:9/hook", "not a url", "", "ftp://x/y"])
        | st.builds(lambda s: f"https://hooks.example/{s}", SECRETS),
        "TOKEN_VAR": SECRETS | st.just("") | st.builds(lambda s: f"{s}\nX-Injected: 1", SECRETS),
    },
)


@settings(max_examples=300, deadline=None)
@given(files=RULE_FILES, environ=ENVIRON)
def test_generated_rule_files_load_or_are_refused_naming_the_file(files, environ) -> None:
    TRIED["rule directories"] += 1
    with tempfile.TemporaryDirectory() as name:
        paths = write_files(Path(name), files)
        try:
            rules = load_rules_dir(Path(name), environ=environ)
        except RuleError as error:
            TRIED["rule directories refused"] += 1
            assert_names_a_file(error.errors, paths, secrets_of([f[2] for f in files], environ))
            return
        TRIED["rule directories loaded"] += 1
        if rules.warnings:
            assert_names_a_file(list(rules.warnings), paths, secrets_of([f[2] for f in files], environ))
        for rule in rules.rules:
            assert all(receiver in rules.receivers for receiver in rule.receivers)


@pytest.mark.parametrize(
    "line",
    [
        "    headers:\n      X-Api: Basic SeCrEt-abcd: x",  # a header value with ': ' in it, unquoted
        "    url: https://hooks.slack.com/services/T0/B0/SeCrEt-abcd: x",  # a webhook URL (its path is the secret)
    ],
    ids=["header_value", "webhook_url"],
)
def test_a_yaml_syntax_error_in_a_receiver_never_echoes_its_secret(tmp_path, line) -> None:
    """Syntax errors quote the offending line; rules.py promises header values (and, where URLs are
    redacted, webhook paths) never appear in errors, whatever the header is called."""
    rules = tmp_path / "routing.yaml"
    rules.write_text("receivers:\n  - name: oncall\n    type: slack\n" + line + "\n")
    if "url:" not in line:
        rules.write_text(rules.read_text() + "    url: https://hooks.example/hook\n")
    with pytest.raises(RuleError) as refused:
        load_rules_dir(tmp_path, environ={})
    assert_names_a_file(refused.value.errors, [rules], frozenset({"SeCrEt-abcd"}))


# --------------------------------------------------------------------------- POST /admin/retune

TOKEN = "fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
FIELDS = ("routers", "business_line", "strategy", "rule", "dataset", "options", "force")
ROUTERS = [
    "model.layers.1.mlp.gate",
    "model.layers.2.mlp.gate",
    "model.layers.3.mlp.gate",
    "model.layers.0.self_attn.indexer",
    "model.layers.9.mlp.gate",
    "",
]
STRATEGY_NAMES = st.sampled_from(["bias", "restore", "router_finetune", "magic", ""])
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**15), 10**15),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
RETUNE_FIELDS = {
    "routers": st.one_of(st.lists(st.sampled_from(ROUTERS), max_size=3), JSON_VALUES),
    "business_line": st.one_of(st.sampled_from(["code_assistant", "doc_summary", "nope", ""]), JSON_VALUES),
    "strategy": st.one_of(STRATEGY_NAMES, st.lists(STRATEGY_NAMES, max_size=3), JSON_VALUES),
    "rule": st.one_of(
        st.sampled_from(
            ["RoutingEntropyLow", "ExpertHotspot", "IndexerDegenerate", "RoutingDrift", "DeadExperts", "Nope", ""]
        ),
        JSON_VALUES,
    ),
    "dataset": st.one_of(
        st.sampled_from(["/nonexistent.jsonl", "", "/", "relative.jsonl", "a\x00b", "/etc"]), JSON_VALUES
    ),
    "options": st.one_of(
        st.dictionaries(
            st.sampled_from(["bias", "router_finetune", "restore", "x"]),
            st.dictionaries(st.text(max_size=6), JSON_SCALARS, max_size=2) | JSON_VALUES,
            max_size=2,
        ),
        JSON_VALUES,
    ),
    "force": st.one_of(st.booleans(), JSON_VALUES),
}
# A request the sidecar accepts (202, or 409 within a router's cooldown) ...
VALID_RETUNE = st.fixed_dictionaries(
    {"routers": st.lists(st.sampled_from(ROUTERS[:3]), min_size=1, max_size=3)},
    optional={
        "strategy": st.sampled_from(["bias", "restore", "router_finetune"])
        | st.lists(st.sampled_from(["bias", "restore", "router_finetune"]), min_size=1, max_size=3),
        "business_line": st.sampled_from(["code_assistant", "doc_summary", "customer_service"]),
        "rule": st.sampled_from(["RoutingEntropyLow", "ExpertHotspot", "DeadExperts"]),
        "options": st.dictionaries(
            st.sampled_from(["bias", "router_finetune", "restore"]),
            st.dictionaries(st.sampled_from(["gamma", "steps", "lr", "epochs", "x"]), JSON_SCALARS, max_size=2),
            max_size=2,
        ),
        "force": st.booleans(),
    },
)
# ... with one field changed to anything, or bodies from scratch.
RETUNE_BODIES = st.one_of(
    VALID_RETUNE,
    st.builds(
        lambda body, field, value: {**body, field: value},
        VALID_RETUNE,
        st.sampled_from([*FIELDS, "route"]),
        st.one_of(*RETUNE_FIELDS.values()),
    ),
    st.fixed_dictionaries({}, optional=RETUNE_FIELDS),
    st.dictionaries(st.sampled_from([*FIELDS, "route", "priority", ""]), JSON_VALUES, max_size=4),
)


@pytest.fixture(scope="module")
def retune_sidecar(tmp_path_factory):
    # No capture and no dataset: an accepted job fails at once ("no data") instead of running a fit.
    with running_sidecar(
        admin_token=TOKEN, attn_implementation="eager", state_dir=tmp_path_factory.mktemp("state")
    ) as running:
        yield running


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=RETUNE_BODIES)
def test_generated_retune_requests_get_202_400_or_409_never_500(retune_sidecar, body) -> None:
    url, _ = retune_sidecar
    TRIED["re-tune requests"] += 1
    response = httpx.post(url + "/admin/retune", content=json.dumps(body), headers=AUTH, timeout=60)
    TRIED[f"re-tune requests answered {response.status_code}"] += 1
    assert response.status_code in (202, 400, 409), (body, response.status_code, response.text)
    document = response.json()
    if response.status_code == 202:
        assert document["id"] and document["status"] in ("pending", "running", "failed", "rejected", "promoted")
        return
    error = document["error"]
    assert error["message"] and error["type"], document
    if response.status_code == 400:  # it names the field: as its param, or in the message
        named = (*FIELDS, "strategies", *body)
        assert error["param"] in named or any(str(field) in error["message"] for field in named if field), document
    else:
        assert error["code"] == "cooldown" and error["param"] == "force"


def test_a_retune_option_that_is_not_a_finite_number_does_not_break_the_jobs_api(tmp_path) -> None:
    """JSON bodies may carry NaN and Infinity (Python's json reads them); a job must not store one and
    then fail every listing of the jobs."""
    body = '{"routers": ["model.layers.1.mlp.gate"], "strategy": "bias", "options": {"bias": {"gamma": NaN}}}'
    with running_sidecar(admin_token=TOKEN, attn_implementation="eager", state_dir=tmp_path) as (url, _):
        response = httpx.post(url + "/admin/retune", content=body, headers=AUTH, timeout=60)
        listing = httpx.get(url + "/v1/retune/jobs", timeout=60)
        assert (response.status_code, listing.status_code) in ((202, 200), (400, 200)), (response.text, listing.text)
