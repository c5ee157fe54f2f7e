"""A wheel installed anywhere serves: built from this checkout, installed into a fresh venv outside
the repository, `mla-watch serve` answers a completion under the shipped policies and rules."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from harness import processes
from harness.support import REPO, free_port, wait_until

pytestmark = pytest.mark.slow


def running_site_packages() -> list[str]:
    """The site-packages directories this interpreter imports from: a venv's own (and its base's, with
    --system-site-packages), or a system Python's, and the user's where Python reads them."""
    directories = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(directories) if Path(d).is_dir()]


def inherit_site_packages(python: Path) -> None:
    """Make the running interpreter's packages importable in the venv of ``python``, after its own.

    Not ``venv --system-site-packages``: that inherits the base interpreter's site-packages, which,
    run from a venv, lack what was installed there (uvicorn, say). A .pth file lists the directories
    themselves: their own .pth files (an editable install of mla_watch, say) are not run.
    """
    own = processes.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    (Path(own) / "_inherited_site_packages.pth").write_text("".join(d + "\n" for d in running_site_packages()))


def test_a_wheel_installed_outside_the_repository_serves_with_the_shipped_policies_and_rules(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    processes.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(dist),
            str(REPO),
        ],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("mla_watch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mla_watch/shipped/policies/code_assistant.yaml" in names
    assert "mla_watch/shipped/rules/routing.yaml" in names
    assert "mla_watch/py.typed" in names  # type checkers read the Python API's hints

    # The venv reuses this interpreter's dependencies (torch, transformers: no network needed) but
    # gets mla_watch only from the wheel; its own site-packages come before the inherited ones.
    venv = tmp_path / "venv"
    processes.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python, command = venv / "bin" / "python", venv / "bin" / "mla-watch"
    inherit_site_packages(python)
    processes.run([str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    located = processes.run(
        [str(python), "-c", "import mla_watch; print(mla_watch.__file__)"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    assert located.startswith(str(venv)), located

    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLA_WATCH_")}
    url = f"http://127.0.0.1:{port}"
    with (
        (tmp_path / "serve.log").open("w") as log,
        processes.running(
            [str(command), "serve", "--device", "cpu", "--port", str(port), "--state-dir", str(tmp_path / "state")],
            cwd=elsewhere,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            grace=30,
        ) as process,
    ):

        def ready() -> bool:
            try:
                return httpx.get(url + "/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return process.poll() is not None

        assert wait_until(ready, timeout=240, interval=0.5) and process.poll() is None, (
            tmp_path / "serve.log"
        ).read_text()[-3000:]
        answer = httpx.post(
            url + "/v1/completions",
            timeout=120,
            headers={"X-Business-Line": "code_assistant", "X-Task": "code"},
            json={"prompt": "def parse_invoice(", "max_tokens": 8, "temperature": 0.9},
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-MLA-Policy"] == "code_assistant/code"
        applied = {a["param"]: a["applied"] for a in answer.json()["mla_watch"]["adjustments"]}
        assert applied["temperature"] == 0.3  # the shipped code policy, read from the wheel
        alerts = httpx.get(url + "/v1/alerts", timeout=30).json()
        assert alerts["rules"] >= 6  # the shipped rules, read from the wheel
