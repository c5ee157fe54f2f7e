"""The first hour with mla_watch, as a new user meets it: what the server says while it starts and what each
answer says, on real servers on loopback ports, and the command line in a subprocess.

The start: ``/readyz`` and completions say "loading" until the model generates, and one log line says when it
does. Answers: a policy never clamps a request into one the model refuses, and a refused request names the
policy that refused it. Beside an engine: ``/readyz`` follows whether the engine answers. The command line: a
mistyped flag is two lines, no flag is taken by a prefix, ``--version``, help that names the manual's pages,
``rules export`` counts what it wrote, ``check`` on a model without indexers, ``retune run --wait`` returns
when the job waits for data, long commands show progress on stderr and libraries show none.
"""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harness import processes
from harness.support import REPO, running_sidecar, serve_app, wait_until

CLI = [sys.executable, "-m", "mla_watch.cli"]
GATE = "model.layers.1.mlp.gate"


def cli(*args: str, timeout: float = 300, **environment: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if not key.startswith("MLA_WATCH_")}
    return processes.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**environ, **environment}
    )


# ---------------------------------------------------------------------------------------------- starting


def test_until_the_model_generates_readyz_and_completions_say_it_is_loading(tmp_path, caplog) -> None:
    import mla_watch
    from mla_watch.server.app import ServerConfig, Sidecar

    loaded = mla_watch.load_model
    release = threading.Event()

    def held_load(*args, **kwargs):  # the model loads once the test has seen the sidecar loading
        assert release.wait(120)
        return loaded(*args, **kwargs)

    caplog.set_level(logging.INFO, logger="mla_watch.server")
    sidecar = Sidecar(
        ServerConfig(
            device="cpu", rules=None, state_dir=tmp_path / "state", policy_poll_seconds=None, admin_token=None
        ),
        model_loader=held_load,
    )
    with serve_app(sidecar.app) as url:
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["ready"] is False and ready.json()["status"] == "loading"
        assert ready.json()["problems"] == ["the model is loading"]
        early = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        assert early.status_code == 503 and early.headers["Retry-After"] == "5"
        assert early.json()["error"]["message"] == "the model is still loading"
        said = [record.getMessage() for record in caplog.records]
        assert any(
            m.startswith("loading the model bundled (device cpu): until it is ready, completions answer 503")
            for m in said
        ), said
        assert not any(m.startswith("ready:") for m in said)
        release.set()
        assert sidecar.wait_ready(120), sidecar.load_error
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "ready" and ready.json()["problems"] == []
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60).status_code == 200
    said = [record.getMessage() for record in caplog.records]
    assert sum(m.startswith("ready: the model generates (loaded and checked in ") for m in said) == 1, said


@pytest.mark.slow
def test_serve_logs_one_line_when_it_can_generate_and_no_library_noise(tmp_path) -> None:
    seen: list[str] = []
    with processes.running(
        [*CLI, "serve", "--port", "0", "--state-dir", str(tmp_path / "state")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        grace=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLA_WATCH_")},
    ) as process:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "ready: the model generates" in line:
                break
        text = "".join(seen)
        assert "ready: the model generates" in text, text[-3000:]
        port = int(text.split("Uvicorn running on http://127.0.0.1:", 1)[1].split()[0])
        # Said once it can generate: the first completion after that line is answered.
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "def f(", "max_tokens": 2}, timeout=120
        )
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).json()["status"] == "ready"
    process.stderr.close()
    loading = next(i for i, line in enumerate(seen) if "loading the model bundled" in line)
    ready = next(i for i, line in enumerate(seen) if "ready: the model generates" in line)
    assert loading < ready
    assert "Loading weights" not in text and "it/s]" not in text  # transformers' bar
    assert "apscheduler" not in text  # "Scheduler started": the library's
    assert "Traceback" not in text


def test_the_python_api_loads_the_model_without_a_progress_bar() -> None:
    code = (
        "import mla_watch\nmodel, tokenizer = mla_watch.load_model('bundled', device='cpu')\n"
        "probe = mla_watch.attach(model)\nprint(len(probe.routers))\n"
        "from transformers.utils import logging\nprint(logging.is_progress_bar_enabled())\n"
    )
    done = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["7", "True"]  # the program's own bars are left as they were
    assert done.stderr == "", done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- answers


def prompt_of(tokenizer, tokens: int) -> str:
    """A prompt of at least ``tokens`` tokens, and at most a few more, as the sidecar counts them (BOS included)."""
    words: list[str] = []
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) + 1 < tokens:
        words.append(f"w{len(words) % 50}")
    return " ".join(words)


def test_a_policy_never_clamps_max_tokens_past_the_context(sidecar) -> None:
    url, running = sidecar
    tokenizer = running.model_worker.tokenizer
    context = running.model_worker.model.config.max_position_embeddings
    prompt = prompt_of(tokenizer, context - 12)
    code = {"X-Business-Line": "code_assistant", "X-Task": "code"}
    # Asked 100000; the policy clamps to its 512, and to the room the context leaves after this prompt.
    answer = httpx.post(
        url + "/v1/completions", headers=code, timeout=120, json={"prompt": prompt, "max_tokens": 100000}
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-MLA-Policy"] == "code_assistant/code"
    room = context - answer.json()["usage"]["prompt_tokens"]
    assert 1 <= room <= 12
    changes = {a["param"]: a for a in answer.json()["mla_watch"]["adjustments"]}
    assert changes["max_tokens"] == {"param": "max_tokens", "requested": 100000, "applied": room}
    assert answer.json()["usage"]["completion_tokens"] <= room
    # Not asked: the policy's default (256) is lowered to fit, and said to be the policy's (requested: null).
    default = httpx.post(url + "/v1/completions", headers=code, timeout=120, json={"prompt": prompt})
    assert default.status_code == 200, default.text
    changes = {a["param"]: a for a in default.json()["mla_watch"]["adjustments"]}
    assert changes["max_tokens"] == {"param": "max_tokens", "requested": None, "applied": room}
    # Asked 600 of a policy that allows it (default: up to 2048): the request's own value, quoted as sent.
    own = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": "def f(", "max_tokens": 600})
    assert own.status_code == 400 and own.json()["error"]["code"] == "context_length_exceeded"
    assert "max_tokens is 600: " in own.json()["error"]["message"]
    assert f"exceeds the model's context of {context} tokens" in own.json()["error"]["message"]
    # A prompt that fills the context leaves no room, whatever the policy would clamp to.
    full = httpx.post(
        url + "/v1/completions",
        headers=code,
        timeout=60,
        json={"prompt": prompt_of(tokenizer, context), "max_tokens": 5},
    )
    assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"
    assert "max_tokens" not in full.json()["error"]["message"]
    assert "leaves no room for a completion" in full.json()["error"]["message"]


@pytest.mark.slow
def test_the_apis_default_max_tokens_is_fitted_too_where_no_policy_says(tmp_path) -> None:
    """Neither the request nor a policy says max_tokens: the API's default of 16 is the sidecar's choice, lowered
    to fit like a policy's, never quoted back as if the client had sent it."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "default.yaml").write_text(
        "business_line: default\ndefault_task: general\n"
        "tasks:\n  general:\n    params:\n      temperature: {min: 0.0, max: 2.0}\n"
    )
    with running_sidecar(policies=policies, rules=None) as (url, running):
        tokenizer = running.model_worker.tokenizer
        context = running.model_worker.model.config.max_position_embeddings
        prompt = prompt_of(tokenizer, context - 8)
        answer = httpx.post(url + "/v1/completions", json={"prompt": prompt}, timeout=120)
        assert answer.status_code == 200, answer.text
        room = context - answer.json()["usage"]["prompt_tokens"]
        assert 1 <= room < 16
        assert {"param": "max_tokens", "requested": None, "applied": room} in answer.json()["mla_watch"]["adjustments"]
        asked = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16}, timeout=60)
        assert asked.status_code == 400 and asked.json()["error"]["code"] == "context_length_exceeded"
        assert "max_tokens is 16: " in asked.json()["error"]["message"]  # this time the client's own


def test_a_refused_request_names_the_policy_that_refused_it(sidecar) -> None:
    url, _ = sidecar
    refused = httpx.post(
        url + "/v1/completions",
        headers={"X-Business-Line": "code_assistant", "X-Task": "sql"},
        json={"prompt": "SELECT", "max_tokens": 4, "temperature": 0.9},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "policy_violation"
    assert refused.headers["X-MLA-Policy"] == "code_assistant/sql"
    unknown = httpx.post(
        url + "/v1/completions",
        headers={"X-Business-Line": "nobody"},
        json={"prompt": "x", "max_tokens": 1},
        timeout=60,
    )
    assert unknown.status_code == 400 and unknown.headers["X-MLA-Policy"] == "none"  # no policy applied


# ---------------------------------------------------------------------------------------------- beside an engine


class Engine:
    """An OpenAI-compatible upstream whose /health answers 200, or 503 while ``sick``."""

    def __init__(self) -> None:
        self.sick = False
        self.health_calls = 0

        async def health(request: Request) -> Response:
            self.health_calls += 1
            return Response(status_code=503 if self.sick else 200)

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]})

        self.app = Starlette(routes=[Route("/health", health), Route("/v1/models", models)])


def test_readyz_follows_whether_the_upstream_answers(tmp_path) -> None:
    engine = Engine()
    with (
        serve_app(engine.app) as upstream,
        running_sidecar(upstream=upstream, rules=None, decode_workers=0, upstream_check_seconds=0.2) as (url, _),
    ):
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
        engine.sick = True
        assert wait_until(lambda: httpx.get(url + "/readyz", timeout=10).status_code == 503, 30)
        sick = httpx.get(url + "/readyz", timeout=10).json()
        assert sick["status"] == "upstream_unavailable"
        assert sick["problems"] == [f"the upstream at {upstream} answered 503 to GET /health"]
        status = httpx.get(url + "/v1/status", timeout=10).json()
        assert status["ready"] is False and status["upstream_problem"] == sick["problems"][0]
        engine.sick = False
        assert wait_until(lambda: httpx.get(url + "/readyz", timeout=10).status_code == 200, 30)
    # Stopped: nothing listens there any more. Beside vLLM, the status page's engine problems say it first.
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 4,
                "first_k_dense_replace": 1,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
            }
        )
    )
    with running_sidecar(
        upstream=upstream,
        rules=None,
        decode_workers=0,
        upstream_check_seconds=0.2,
        engine="vllm",
        model_config=config,
        engine_retune="off",
    ) as (url, _):
        dead = httpx.get(url + "/readyz", timeout=10)
        assert dead.status_code == 503 and dead.json()["status"] == "upstream_unavailable"
        assert dead.json()["problems"][0].startswith(f"the upstream at {upstream} cannot be reached (ConnectError")
        engine = httpx.get(url + "/v1/status", timeout=10).json()["engine"]
        assert engine["problems"][0] == dead.json()["problems"][0]


# ---------------------------------------------------------------------------------------------- the command line


def test_a_mistyped_flag_is_two_lines_and_no_flag_is_taken_by_a_prefix() -> None:
    done = cli("serve", "--prot", "18002")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "usage: mla-watch serve [FLAGS]  (mla-watch serve --help lists its flags)",
        "mla-watch serve: error: unrecognized arguments: --prot 18002 (did you mean --port?)",
    ]
    prefix = cli("demo", "--no-liv", "--timeout", "1")
    assert prefix.returncode == 2 and prefix.stderr.splitlines()[-1] == (
        "mla-watch demo: error: unrecognized arguments: --no-liv (did you mean --no-live?)"
    )
    nested = cli("retune", "promote")
    assert nested.returncode == 2 and nested.stderr.splitlines() == [
        "usage: mla-watch retune promote [FLAGS] version  (mla-watch retune promote --help lists its flags)",
        "mla-watch retune promote: error: the following arguments are required: version",
    ]
    bare = cli()
    assert bare.returncode == 2 and bare.stderr.splitlines()[0] == (
        "usage: mla-watch [FLAGS] COMMAND ...  (mla-watch --help lists its commands and flags)"
    )


@pytest.mark.parametrize("flag", ["--port", "--receiver-port"])
def test_demo_on_a_port_in_use_is_one_line_before_anything_runs(tmp_path: Path, flag: str) -> None:
    """The sidecar's port, and the port of the webhook receiver standing in for on-call, are the ones asked for."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("demo", flag, str(port), "--out", str(tmp_path / "demo"))
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"mla-watch demo: {flag} {port}: 127.0.0.1:{port} is in use: expected a free port (or {flag} 0 for any)"
    ]
    assert done.stdout == ""


def test_version_and_help_that_names_the_manuals_pages() -> None:
    from mla_watch import __version__
    from mla_watch.cli import build_parser
    from mla_watch.cli.flags import DOCS

    version = cli("--version")
    assert version.returncode == 0 and version.stdout == f"mla-watch {__version__}\n"
    serve = " ".join(cli("serve", "--help").stdout.split())
    assert " ".join(cli("rules", "--help").stdout.split()).endswith("The manual: docs/alerting.md")
    assert "README" not in serve
    assert 'external command template (docs/retuning.md, "Beyond one machine")' in serve
    pages = {page.name for page in (REPO / "docs").glob("*.md")}
    texts = []  # every epilog and flag help, and the note rules export --fleet prints
    parsers = [build_parser()]
    while parsers:  # every command's help ends with the manual's page that covers it, a page that exists
        parser = parsers.pop()
        named = [
            text.split(DOCS, 1)[1].split()[0].rstrip(";,.)")
            for text in (parser.epilog or "").split(" ")
            if DOCS in text
        ]
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                parsers.extend(action.choices.values())
        assert named, parser.prog
        # named by their path, which reads the same offline: no command's help points at a web page of the manual
        assert "://" not in (parser.epilog or "") or parser.prog == "mla-watch", (parser.prog, parser.epilog)
        for page in named:
            assert page.split("#")[0] in pages, (parser.prog, page)
        texts.append(parser.epilog or "")
        for action in parser._actions:  # and a flag's help names pages that exist
            texts.append(action.help or "")
            for page in [word.strip(',;)"') for word in (action.help or "").split() if word.startswith("docs/")]:
                assert page.removeprefix("docs/").split("#")[0] in pages, (parser.prog, action.dest, page)
    from mla_watch.alerting.fleet import FLEET_SCALE_NOTE

    texts.append(FLEET_SCALE_NOTE)
    # A section named beside its page ('docs/retuning.md, "Beyond one machine"') is a heading of that page.
    sections = re.findall(r'([\w-]+\.md)(?:,\s*|\s*\()"([^"]+)"', " ".join(" ".join(texts).split()))
    assert ("retuning.md", "Beyond one machine") in sections, sections
    for page, section in sections:
        headings = [
            line.lstrip("#").strip() for line in (REPO / "docs" / page).read_text().splitlines() if line.startswith("#")
        ]
        assert section in headings, (page, section)


def test_rules_export_counts_the_alerts_and_recording_rules_it_wrote(tmp_path) -> None:
    for flags, file_format in ((["--fleet"], "operator"), ([], "prometheus"), (["--fleet"], "mimir")):
        out = tmp_path / f"{file_format}.yaml"
        done = cli("rules", "export", "--format", file_format, *flags, "--out", str(out))
        assert done.returncode == 0, done.stderr
        document = yaml.safe_load(out.read_text())
        groups = document["spec"]["groups"] if file_format == "operator" else document["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        alerts, recordings = sum("alert" in r for r in rules), sum("record" in r for r in rules)
        assert alerts + recordings == len(rules) and alerts > 0 and (recordings > 0) == bool(flags)
        assert (
            f"wrote {alerts} alerts and {recordings} recording rule{'s' * (recordings != 1)} to {out}" in done.stderr
        ), done.stderr
        # What one Prometheus takes, in the file's header and on stderr (docs/fleet.md, "A hundred replicas").
        bound = "split the fleet by layer (--fleet-shards N)"
        assert (bound in " ".join(out.read_text().replace("#", " ").split())) == bool(flags)
        noted = "note: mla_watch_fleet reads every replica's per-expert series" in done.stderr and bound in done.stderr
        assert noted == bool(flags)


def test_check_on_a_model_without_indexers_says_the_indexer_rule_does_not_apply(tmp_path) -> None:
    from transformers import MixtralConfig

    config = tmp_path / "config.json"
    MixtralConfig(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=1000,
    ).to_json_file(config)
    done = cli("check", "--model-config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    indexer = [line for line in lines if "rule IndexerDegenerate" in line]
    assert (
        len(indexer) == 1
        and indexer[0].startswith("info: ")
        and indexer[0].endswith("for indexer routers; this model has none (kinds: expert), so it does not apply here")
    ), indexer
    assert not [line for line in lines if line.startswith("warning:") and "will never be evaluated" in line]


def test_retune_run_wait_returns_when_the_job_waits_for_data(tmp_path) -> None:
    # Capture on and no traffic yet: the job has nothing to train on and waits, retrying by itself every 300 s.
    # Were it to sit out --wait (an hour), the subprocess' own timeout would fail the test.
    token = "first-hour-admin-token-0123"
    with running_sidecar(capture=True, rules=None, admin_token=token) as (url, _):
        done = cli(
            "retune",
            "run",
            "--url",
            url,
            "--router",
            GATE,
            "--strategy",
            "bias",
            "--wait",
            "3600",
            MLA_WATCH_ADMIN_TOKEN=token,
        )
    assert done.returncode == 3, done.stdout + done.stderr
    out = done.stdout
    assert "scheduled re-tune job " in out and re.search(r"^job \S+: waiting \(\d+ s\)$", out, re.MULTILINE), out
    assert re.search(
        r" waits for more data and tries again by itself at \d\d:\d\d:\d\d UTC \(in (299|300) s\): "
        r"\S",
        out,
    ), out


def test_long_commands_show_progress_on_stderr_when_piped() -> None:
    done = cli("routing", "--samples", "8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout)) == 7  # stdout is the JSON, whole
    lines = done.stderr.splitlines()
    assert lines[0] == "mla-watch routing: loading the model bundled"
    assert lines[-1].startswith("mla-watch routing: 8 samples in ")
    assert all(line.startswith("mla-watch routing: ") for line in lines), lines  # no library's line
    assert "\x1b[" not in done.stderr  # no bar, no colour on a pipe


def test_a_long_command_draws_a_bar_on_a_terminal() -> None:
    main, child = pty.openpty()  # stderr is a terminal; stdout stays a pipe
    seen = b""
    try:
        with processes.running(
            [*CLI, "baseline", "--samples", "8", "--out", os.devnull],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=child,
            env={**os.environ, "COLUMNS": "100"},
        ) as process:
            os.close(child)
            child = -1
            while select.select([main], [], [], 300)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            out, _ = process.communicate(timeout=300)
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    text = seen.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    assert "mla-watch baseline: loading the model bundled" in text
    assert "mla-watch baseline: samples" in text and "━" in text  # rich's bar, drawn in place
    assert "8 samples in " in text and "Loading weights" not in text
    assert out.decode().startswith("wrote the healthy baselines of ")


def test_progress_lines_on_a_pipe_come_at_tenths_at_most_every_two_seconds() -> None:
    import io

    from mla_watch.common.progress import Progress

    now = [0.0]
    stream = io.StringIO()
    progress = Progress("mla-watch x", stream=stream, live=False, clock=lambda: now[0])
    for _ in progress.track(range(40), "samples"):
        now[0] += 1.0  # one second a sample: a line at each tenth (4 samples, 4 s)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "mla-watch x: 4/40 samples (10%), 4 s, about 36 s left"
    assert lines[-1] == "mla-watch x: 40 samples in 40 s"
    assert len(lines) == 10
    stream.seek(0)
    stream.truncate()
    for _ in progress.track(range(40), "samples"):
        now[0] += 0.01  # fast: only the last line
    assert stream.getvalue().splitlines() == ["mla-watch x: 40 samples in 0 s"]
