"""The engine-side install, for real: ``pip install mla-watch`` (this checkout's wheel, its dependencies from the
package index, no extra) in a fresh venv, in which torch and transformers cannot be imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness import processes
from harness.support import REPO

INSTALL_TIMEOUT_S = 900


def engine_side_install(directory: Path) -> Path:
    """A venv under ``directory`` holding mla_watch without the [model] extra; its ``mla-watch`` console script.

    Raises ``AssertionError`` naming the module when torch or transformers can be imported there.
    """
    dist, venv = directory / "dist", directory / "venv"
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
        cwd=directory,
    )
    (wheel,) = dist.glob("mla_watch-*.whl")
    processes.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    processes.run(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)],
        check=True,
        timeout=INSTALL_TIMEOUT_S,
        env=env,
        cwd=directory,
    )
    for heavy in ("torch", "transformers"):
        found = processes.run(
            [str(python), "-c", f"import importlib.util; print(importlib.util.find_spec({heavy!r}))"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env=env,
            cwd=directory,
        )
        assert found.stdout.strip() == "None", f"{heavy} is importable in the engine-side install"
    return venv / "bin" / "mla-watch"
