"""First run of the command line, as a user meets it: the real CLI in a subprocess.

A bad flag value stops start-up before anything binds or prints a URL, in one line on stderr that
names the flag, the value and what was expected (exit 2, no traceback); a port in use is one such
line too; a mistyped flag shows its subcommand's usage on one line; ``--help`` shows the defaults;
loading the model prints no progress bar.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from harness import processes
from harness.support import REPO
from mla_watch.cli import build_parser
from mla_watch.cli.startup import HelpFormatter, device_problem
from mla_watch.common.progress import quiet_progress_bars

CLI = [sys.executable, "-m", "mla_watch.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MLA_WATCH_ONCALL_URL"}
    return processes.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environ)


def assert_one_line(done: subprocess.CompletedProcess, expected: str) -> None:
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr[-3000:]
    assert expected in lines[0], lines[0]
    assert "Uvicorn running" not in done.stderr + done.stdout and "status page" not in done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model", "bundeld"],
            'mla-watch serve: --model bundeld: no such directory and not a bundled model name: expected "bundled" or a '
            'save_pretrained directory (did you mean "bundled"?)',
        ),
        (["--device", "gpu"], "mla-watch serve: --device gpu: expected auto, cpu, cuda or cuda:N"),
        (
            ["--policies", "no-such-policies"],
            "mla-watch serve: --policies no-such-policies: no such directory: "
            "expected a directory of policy YAML files",
        ),
        (
            ["--baseline-max-client-share", "0"],
            "mla-watch serve: --baseline-max-client-share 0.0: expected a share in (0, 1]",
        ),
    ],
)
def test_serve_refuses_a_bad_flag_in_one_line_before_it_listens(tmp_path, args, expected) -> None:
    done = cli("serve", "--port", "0", "--state-dir", str(tmp_path / "state"), *args)
    assert_one_line(done, expected)
    assert args[-1] in done.stderr and args[0] in done.stderr  # the flag and its value


def test_cuda_is_refused_where_torch_sees_no_gpu_and_a_device_past_the_last_one_everywhere(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_problem("cuda").startswith("CUDA is not available on this machine (torch ")
    assert device_problem("cuda:1").endswith(": expected auto or cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda") is None and device_problem("cuda:1") is None
    assert device_problem("cuda:2") == (
        "this machine has 2 CUDA device(s): expected cuda:0 to cuda:1, cuda, auto or cpu"
    )
    assert device_problem("cpu") is None
    assert device_problem("gpu") == "expected auto, cpu, cuda or cuda:N (did you mean cuda?)"


def test_routing_and_check_refuse_a_mistyped_model_in_one_line() -> None:
    assert_one_line(cli("routing", "--model", "bundeld", "--samples", "4"), "mla-watch routing: --model bundeld: ")
    assert_one_line(cli("check", "--model", "./bundeld"), "mla-watch check: --model ./bundeld: no such directory")


def test_a_port_in_use_is_one_line_before_the_app_starts(tmp_path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("serve", "--port", str(port), "--state-dir", str(tmp_path / "state"))
    assert_one_line(
        done, f"mla-watch serve: --port {port}: 127.0.0.1:{port} is in use: expected a free port (or --port 0 for any)"
    )
    assert "Application startup complete" not in done.stderr and f"http://127.0.0.1:{port}" not in done.stderr


def test_serve_says_its_status_page_with_the_port_it_bound(tmp_path) -> None:
    # Beside an upstream (nothing there): no model to load, the sidecar starts at once. --decode-workers 0:
    # no worker process, which a stop this soon after the start could leave half-started.
    with processes.running(
        [
            *CLI,
            "serve",
            "--port",
            "0",
            "--state-dir",
            str(tmp_path / "state"),
            "--upstream",
            "http://127.0.0.1:9",
            "--decode-workers",
            "0",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        grace=60,
    ) as process:
        seen: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "Uvicorn running on" in line:
                break
        text = "".join(seen)
        assert "Uvicorn running on http://127.0.0.1:" in text, text[-3000:]
        port = int(text.rsplit("Uvicorn running on http://127.0.0.1:", 1)[1].split()[0])
        assert port != 0 and f"status page: http://127.0.0.1:{port}/" in text
        assert text.index("status page:") < text.index("Application startup complete")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
    process.stderr.close()


def test_a_mistyped_flag_shows_the_subcommands_usage_on_one_line() -> None:
    done = cli("serve", "--prot", "8000")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "usage: mla-watch serve [FLAGS]  (mla-watch serve --help lists its flags)",
        "mla-watch serve: error: unrecognized arguments: --prot 8000 (did you mean --port?)",
    ]
    nested = cli("retune", "run", "--forse")
    assert nested.returncode == 2 and nested.stderr.startswith("usage: mla-watch retune run [FLAGS]  ")
    assert "mla-watch retune run: error: unrecognized arguments: --forse (did you mean --force?)" in nested.stderr


def test_serve_refuses_a_fleet_url_that_is_not_postgresql_without_showing_it() -> None:
    done = cli("serve", "--fleet", "https://user:hunter2@db/fleet")
    assert done.returncode == 2 and "hunter2" not in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "mla-watch serve: error: argument --fleet: expected a postgresql:// URL"
    ), done.stderr
    done = cli("serve", "--fleet", "postgresql://db/fleet", "--fleet-lease", "10", "--fleet-poll", "6")
    assert_one_line(done, "--fleet-poll 6.0: expected seconds > 0, at most half of the lease")


def test_serve_help_shows_the_defaults() -> None:
    done = cli("serve", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())  # argparse wraps the lines
    for shown in (
        "(default bundled)",
        "(default auto)",
        "(default 127.0.0.1)",
        "(default 8000)",
        "(default 32)",
        "(default 60.0)",
        "(default sdpa)",
    ):
        assert shown in text, shown


def subparsers(parser):
    yield parser
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for sub in action.choices.values():
                yield from subparsers(sub)


def test_every_subcommand_help_shows_each_flags_default() -> None:
    parsers = list(subparsers(build_parser()))
    assert {p.prog for p in parsers} >= {
        "mla-watch serve",
        "mla-watch check",
        "mla-watch demo",
        "mla-watch routing",
        "mla-watch baseline",
        "mla-watch retune run",
        "mla-watch rules export",
    }
    for parser in parsers:
        assert parser.formatter_class is HelpFormatter, parser.prog
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and action.default not in (None, []):
                shown = formatter._expand_help(action)  # what --help prints for the flag, before wrapping
                assert "default" in shown, (parser.prog, action.option_strings, shown)
        assert parser.format_help()


def test_check_prints_no_progress_bar() -> None:
    done = cli("check")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ok: router model.layers.1.mlp.gate" in done.stdout
    assert "Loading weights" not in done.stdout + done.stderr and "it/s]" not in done.stdout + done.stderr


def test_quieting_the_progress_bars_is_undone_for_library_users() -> None:
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    with quiet_progress_bars():
        assert not hf_logging.is_progress_bar_enabled() and hub.are_progress_bars_disabled()
    assert (hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()) == before


def _engine_health_app():
    """An engine that answers its health check: the sidecar's checker calls it through its HTTP client library."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    return Starlette(routes=[Route("/health", lambda request: PlainTextResponse(""))])


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_libraries_log_lines_show_at_debug_only(tmp_path, level: str) -> None:
    from harness.support import free_port, serve_app, sidecar_process

    log = tmp_path / "serve.log"
    port = free_port()
    with (
        serve_app(_engine_health_app()) as engine,
        sidecar_process(
            port, tmp_path / "state", "--upstream", engine, "--decode-workers", "0", "--log-level", level, log=log
        ),
    ):
        for _ in range(3):  # requests answered; the engine's health asked once at least (readiness asks it)
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
    text = log.read_text()
    assert "mla_watch.server: status page:" in text, text[-3000:]  # the sidecar's own lines at both levels
    library = ("HTTP Request: GET " + engine + "/health", '"GET /readyz HTTP/1.1" 200')
    if level == "debug":
        assert all(line in text for line in library), text[-3000:]
    else:
        assert not any(line in text for line in library), text[-3000:]
        assert "httpx" not in text and "httpcore" not in text, text[-3000:]
