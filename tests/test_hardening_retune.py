"""Issue 11, the re-tuning parts: datasets only from the dataset directory and no error quoting a file,
a private state directory whose job files live only as long as the job, and bounded admin inputs."""

from __future__ import annotations

import json
import os
import stat
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from harness.support import wait_until
from mla_watch.common.describe import describe_value
from mla_watch.common.output_file import write_file
from mla_watch.common.state_dir import ensure_private_dir, ensure_private_file
from mla_watch.retune.data import resolve_dataset
from mla_watch.retune.jobs import JobSpec, RetuneSettings
from mla_watch.retune.runner import Retuner
from mla_watch.retune.versions import RouterVersions
from tests.retune_harness import GATE, Harness, spec

TOKEN = "hardening-retune-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROUTER = "model.layers.1.mlp.gate"
SECRET = "SECRET-7f3a"
EXPECTED = "is invalid: expected a .jsonl file name inside the dataset directory"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def sidecar(make_sidecar, tmp_path_factory):
    """The module's sidecar, with its state directory: ``(url, sidecar, state)``."""
    state = tmp_path_factory.mktemp("state")
    os.chmod(state, 0o755)  # as an operator's mkdir would leave it
    return (*make_sidecar(admin_token=TOKEN, state_dir=state), state)


def retune(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/admin/retune", json=body, headers=AUTH, timeout=30)


def finished(url: str, job_id: str) -> dict:
    def done() -> bool:
        return httpx.get(f"{url}/v1/retune/jobs/{job_id}").json()["status"] in ("promoted", "rejected", "failed")

    assert wait_until(done, timeout=120)
    return httpx.get(f"{url}/v1/retune/jobs/{job_id}").json()


# --------------------------------------------------------------------------- item 5: datasets


def test_a_dataset_outside_the_directory_gets_one_answer_whether_it_exists_or_not(sidecar, tmp_path) -> None:
    url, _, state = sidecar
    datasets = state / "datasets"
    assert datasets.is_dir() and mode(datasets) == 0o700
    outside = tmp_path / "outside.jsonl"
    outside.write_text(f'{{"text": ["{SECRET}"]}}\n')
    (datasets / "link.jsonl").symlink_to(outside)  # a link out of the directory
    (datasets / "dangling.jsonl").symlink_to(tmp_path / "missing.jsonl")
    (datasets / "sub.jsonl").mkdir()
    values = [
        str(outside),
        str(tmp_path / "missing.jsonl"),
        "/etc/passwd",
        "../outside.jsonl",
        "link.jsonl",
        "dangling.jsonl",
        "sub.jsonl",
        "absent.jsonl",
        "data.jsonl\n",
        ".hidden.jsonl",
        "data.json",
        "a" * 300 + ".jsonl",
        "",
        7,
        ["x.jsonl"],
        {"path": "x.jsonl"},
    ]
    for value in values:
        response = retune(url, {"routers": [ROUTER], "dataset": value, "force": True})
        assert response.status_code == 400, (value, response.text)
        error = response.json()["error"]
        assert error["param"] == "dataset" and error["code"] == "invalid_value"
        assert error["message"] == f"dataset={describe_value(value)} {EXPECTED}"  # the same words for every one
        assert SECRET not in response.text and len(error["message"]) < 200
    assert httpx.get(url + "/v1/retune/jobs").json()["jobs"] == []
    assert httpx.get(url + "/healthz").status_code == 200


def test_a_dataset_job_never_publishes_or_logs_what_the_file_holds(sidecar, caplog) -> None:
    url, _, state = sidecar
    rows = [
        f'{{"text": ["{SECRET}-1"]}}',
        f'"{SECRET}-2"',
        f'{{"input_ids": "{SECRET}-3"}}',
        f"not json {SECRET}-4",
        f'{{"{SECRET}-5": 1}}',
        f'{{"input_ids": [1, {10**9}]}}',
    ]
    (state / "datasets" / "bad.jsonl").write_text("\n".join(rows) + "\n")
    with caplog.at_level("DEBUG"):
        response = retune(url, {"routers": [ROUTER], "dataset": "bad.jsonl", "strategy": "restore", "force": True})
        assert response.status_code == 202, response.text
        job = finished(url, response.json()["id"])
    assert job["status"] == "failed" and job["spec"]["dataset"] == "bad.jsonl"
    error = job["result"]["error"]
    assert error.startswith("6 problems:\nbad.jsonl:1: key 'text': expected a string, got a list of 1 item(s)")
    for line in (
        "bad.jsonl:2: not a JSON object (got a string of 13 character(s))",
        "bad.jsonl:3: key 'input_ids': expected a list of token ids (ints), got a string of 13 character(s)",
        "bad.jsonl:4: invalid JSON (Expecting value at column 1)",
        "bad.jsonl:5: none of the keys",
        "bad.jsonl:6: key 'input_ids[1]': expected an int token id in [0, ",
    ):
        assert line in error
    published = [
        httpx.get(url + "/v1/retune/jobs").text,
        httpx.get(url + "/v1/status").text,
        httpx.get(f"{url}/v1/retune/jobs/{job['id']}").text,
        caplog.text,
    ]
    assert "bad.jsonl:1: key 'text'" in caplog.text  # the failure is logged: by its description only
    for text in published:
        assert SECRET not in text and str(10**9) not in text and str(state) not in text


def test_the_runner_checks_the_dataset_again_when_the_job_runs(tmp_path) -> None:
    """Accepted by name, then swapped for a link out of the directory: the job fails with the same words."""
    from tests.tiny_models import build

    datasets = ensure_private_dir(tmp_path / "datasets")
    outside = tmp_path / "outside.jsonl"
    outside.write_text(f'{{"text": "{SECRET}"}}\n')
    (datasets / "swap.jsonl").write_text('{"input_ids": [1, 2]}\n')
    assert resolve_dataset("swap.jsonl", datasets) == (datasets / "swap.jsonl").resolve()
    (datasets / "swap.jsonl").unlink()
    (datasets / "swap.jsonl").symlink_to(outside)
    model = build("deepseek_v32")
    registry = RouterVersions(tmp_path / "routers")
    registry.record_initial(model)
    runner = Retuner(
        model=model,
        tokenizer=None,
        versions=registry,
        settings=RetuneSettings(),
        workdir=tmp_path / "w",
        promote=lambda version: None,
        model_lock=threading.Lock(),
        dataset_dir=datasets,
    )
    status, result = runner.run(JobSpec(routers=[GATE], strategies=["restore"], dataset="swap.jsonl"))
    assert status == "failed" and result["error"] == f'dataset="swap.jsonl" {EXPECTED}'


def test_the_cli_copies_a_local_dataset_into_the_dataset_directory(sidecar, tmp_path, monkeypatch, capsys) -> None:
    from mla_watch.cli import main

    url, _, state = sidecar
    monkeypatch.setenv("MLA_WATCH_ADMIN_TOKEN", TOKEN)
    local = tmp_path / "mine.jsonl"
    local.write_text('{"input_ids": [1, 2, 3]}\n')
    argv = [
        "retune",
        "run",
        "--url",
        url,
        "--router",
        ROUTER,
        "--strategy",
        "restore",
        "--force",
        "--dataset",
        str(local),
        "--dataset-dir",
        str(state / "datasets"),
    ]
    assert main(argv) == 0
    copy = state / "datasets" / "mine.jsonl"
    assert copy.read_text() == local.read_text() and mode(copy) == 0o600
    jobs = httpx.get(url + "/v1/retune/jobs").json()["jobs"]
    assert jobs[0]["spec"]["dataset"] == "mine.jsonl"
    assert main(argv) == 0  # the same file again: the copy there is used
    local.write_text('{"input_ids": [4, 5, 6]}\n')
    with pytest.raises(SystemExit, match=r"mine\.jsonl exists with other content"):
        main(argv)
    with pytest.raises(SystemExit, match=r"file name 'bad name\.jsonl' is invalid"):
        main([*argv[:-4], "--dataset", str(tmp_path / "bad name.jsonl")])
    capsys.readouterr()


# --------------------------------------------------------------------------- item 8: bounded inputs


def test_promote_names_the_versions_there_are(sidecar) -> None:
    url, _, _ = sidecar
    for version in (10**300, 5):
        response = httpx.post(url + "/admin/retune/promote", json={"version": version}, headers=AUTH)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "version" and error["message"].startswith("router version ")
        assert error["message"].endswith("does not exist: expected one of the versions 0 to 0")
        assert len(error["message"]) < 160
    assert httpx.get(url + "/v1/retune/versions").json()["live"] == 0


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("code_assistant\n", 'business_line="code_assistant\\n" is invalid: expected a business line name'),
        ("", 'business_line="" is invalid: expected a business line name'),
        ("../x", 'business_line="../x" is invalid: expected a business line name'),
        ("x" * 300, 'business_line="xxxx'),
        (3, "business_line=3 is invalid"),
        ("nope", "business_line=\"nope\" is not a business line of the policies: expected one of ['code_assistant', "),
    ],
)
def test_business_line_must_be_a_policy_line(sidecar, line, words) -> None:
    url, _, _ = sidecar
    response = retune(url, {"routers": [ROUTER], "business_line": line, "force": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "business_line" and error["message"].startswith(words)
    assert len(error["message"]) < 300


def test_a_known_business_line_is_accepted(sidecar) -> None:
    url, _, _ = sidecar
    response = retune(
        url, {"routers": [ROUTER], "business_line": "code_assistant", "strategy": "restore", "force": True}
    )
    assert response.status_code == 202, response.text
    assert response.json()["spec"]["business_line"] == "code_assistant"


@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        (
            {"magic": {}},
            "options.magic",
            'options.magic: no strategy is named "magic": expected options of the '
            "strategies ['bias', 'restore', 'router_finetune']",
        ),
        (
            {"bias": {"gama": 0.1}},
            "options.bias",
            "options.bias: unknown option(s) [\"gama\"] for strategy 'bias'; expected some of ['gamma', 'steps']",
        ),
        ({"restore": {"x": 1}}, "options.restore", "options.restore: unknown option(s) [\"x\"] for strategy 'restore'"),
        ({"bias": {"gamma": None}}, "options.bias", "options.bias.gamma=null is invalid: expected a number in (0, 1]"),
        ({"bias": {"steps": 1.5}}, "options.bias", "options.bias.steps=1.5 is invalid: expected an integer"),
        ({"router_finetune": {"lr": 10**300}}, "options.router_finetune", "options.router_finetune.lr=1000000"),
    ],
)
def test_options_must_name_a_strategy_and_its_options(sidecar, options, param, words) -> None:
    url, _, _ = sidecar
    response = retune(url, {"routers": [ROUTER], "options": options, "force": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(words)
    assert len(error["message"]) < 300


def test_valid_options_are_accepted(sidecar) -> None:
    url, _, _ = sidecar
    response = retune(
        url,
        {
            "routers": [ROUTER],
            "strategy": "restore",
            "force": True,
            "options": {"bias": {"gamma": 0.2}, "router_finetune": {"lora_rank": None}},
        },
    )
    assert response.status_code == 202, response.text


# --------------------------------------------------------------------------- item 6: private files


MODES_SCRIPT = """
import json, os, stat, sys
data, job, output, report = sys.argv[1:5]
directory = os.path.dirname(data)
paths = {"data": data, "job": job, "output": output, "dir": directory, "work": os.path.dirname(directory)}
with open(report, "w") as handle:
    json.dump({key: stat.S_IMODE(os.stat(path).st_mode) for key, path in paths.items()}, handle)
print("Traceback (most recent call last):\\n  File x, line 1\\n    " + open(data).readline(), file=sys.stderr)
print("RuntimeError: out of GPUs", file=sys.stderr)
sys.exit(3)
"""


def test_the_state_directory_is_private_and_a_jobs_files_live_only_while_it_runs(tmp_path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    stale = state / "work" / "20260101-000000-abcdef-bias"  # left by a crash mid-job
    stale.mkdir(parents=True)
    (stale / "data.jsonl").write_text('{"input_ids": [1, 2]}\n')
    script, report = tmp_path / "modes.py", tmp_path / "modes.json"
    script.write_text(textwrap.dedent(MODES_SCRIPT))
    harness = Harness(state, command=f"{{python}} {script} {{data}} {{job}} {{output}} {report}")
    os.chmod(state / "capture.sqlite", 0o644)  # as an older release left it
    harness.capture.close()
    harness.capture = type(harness.capture)(state / "capture.sqlite")
    service = harness.start()
    try:
        assert mode(state) == 0o700 and not stale.exists()
        record = service.submit(spec(strategies=["bias"]))
        assert service.wait_idle(120)
        record = service.store.get(record["id"])
    finally:
        service.stop()
        harness.capture.close()
    modes = json.loads(report.read_text())
    assert modes == {"data": 0o600, "job": 0o600, "output": 0o700, "dir": 0o700, "work": 0o700}
    assert list((state / "work").iterdir()) == []  # removed when the attempt ended
    assert record["status"] == "failed"
    (attempt,) = record["result"]["attempts"]
    assert attempt["reason"] == "RuntimeError: the external command exited with status 3: RuntimeError: out of GPUs"
    for name in ("capture.sqlite", "retune_jobs.sqlite", "retune_schedule.sqlite"):
        assert mode(state / name) == 0o600, name


def test_private_dir_and_file_helpers(tmp_path) -> None:
    nested = ensure_private_dir(tmp_path / "a" / "b")
    assert nested == tmp_path / "a" / "b" and mode(nested) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o775)
    assert mode(ensure_private_dir(loose)) == 0o700
    shared = tmp_path / "shared"  # a /tmp-like directory is never ours to change
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert mode(ensure_private_dir(shared)) == 0o1777
    file = tmp_path / "f.sqlite"
    file.write_text("")
    os.chmod(file, 0o644)
    assert mode(ensure_private_file(file)) == 0o600
    written = write_file(tmp_path / "w.json", "{}", private=True)
    assert written.read_text() == "{}" and mode(written) == 0o600
    os.chmod(written, 0o666)
    assert mode(write_file(written, b"[]", private=True)) == 0o600
    with pytest.raises(OSError):
        ensure_private_dir(file)
