"""The sidecar's image (Dockerfile): what can be checked without Docker, which is not run here.

Parsed as Docker reads it (instructions, line continuations, JSON-form ENTRYPOINT): it installs the
engine-side package (no extra: no torch, no transformers) from the files it copies, runs as a user of
its own, keeps its state in a volume, and its entrypoint plus each pod example's args is a ``serve``
command line the parser accepts, with the state directory in that volume.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from harness.support import REPO
from mla_watch.cli import build_parser


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuations joined, comments left out."""
    joined = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    found = []
    for line in joined.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def only(keyword: str) -> str:
    (value,) = [rest for name, rest in instructions() if name == keyword]
    return value


def test_the_image_installs_the_engine_side_package_from_what_it_copies() -> None:
    assert {name for name, _ in instructions()} <= {
        "FROM",
        "RUN",
        "WORKDIR",
        "COPY",
        "USER",
        "VOLUME",
        "EXPOSE",
        "ENTRYPOINT",
        "ARG",
    }
    assert only("FROM").startswith("python:3.")
    copied = {Path(source) for name, rest in instructions() if name == "COPY" for source in rest.split()[:-1]}
    assert copied == {Path("pyproject.toml"), Path("README.md"), Path("mla_watch")}
    installs = [rest for name, rest in instructions() if name == "RUN" and "pip install" in rest]
    (install,) = installs
    assert shlex.split(install)[:5] == ["pip", "install", "--no-cache-dir", ".${EXTRAS}", "&&"]
    assert re.fullmatch(r'EXTRAS=""', only("ARG"))  # by default no extra: the install the engine-side tests mean
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert ignored[0] == "*" and {"!pyproject.toml", "!README.md", "!mla_watch/"} <= set(ignored)


def test_the_project_installs_without_torch_or_transformers_and_the_model_extra_adds_them() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in project["dependencies"]}
    assert not names & {"torch", "transformers", "tokenizers", "matplotlib"}
    model = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in project["optional-dependencies"]["model"]}
    assert {"torch", "transformers", "tokenizers", "matplotlib"} <= model
    assert "mla-watch[model]" in project["optional-dependencies"]["dev"]  # .ci/run's install has what tests need


def test_the_image_runs_as_its_own_user_with_the_state_directory_a_volume() -> None:
    user = only("USER").split(":")[0]
    assert user not in ("0", "root") and user.isdigit()
    assert json.loads(only("VOLUME")) == ["/state"]
    created = " ".join(rest for name, rest in instructions() if name == "RUN")
    assert f"--uid {user}" in created and "chown mla-watch:mla-watch /state" in created
    assert "chmod 0700 /state" in created


@pytest.mark.parametrize("pod", ["vllm-pod.yaml", "sglang-pod.yaml"])
def test_each_pod_example_runs_the_image_as_its_user_and_its_args_complete_serve(pod: str) -> None:
    entrypoint = json.loads(only("ENTRYPOINT"))
    assert entrypoint[:2] == ["mla-watch", "serve"]
    document = yaml.safe_load((REPO / "deploy" / pod).read_text())
    (sidecar,) = [c for c in document["spec"]["containers"] if c["name"] == "mla-watch"]
    assert "command" not in sidecar  # the image's entrypoint, args added to it
    args = build_parser().parse_args([*entrypoint[1:], *sidecar["args"]])
    mounts = {mount["mountPath"] for mount in sidecar["volumeMounts"]}
    assert str(args.state_dir) in mounts and str(args.state_dir) in json.loads(only("VOLUME"))
    assert args.host == "0.0.0.0" and {"containerPort": args.port, "name": "http"} in sidecar["ports"]
    user = int(only("USER").split(":")[0])
    assert sidecar["securityContext"]["runAsUser"] == user and sidecar["securityContext"]["runAsNonRoot"]
    assert document["spec"]["securityContext"]["fsGroup"] == user  # the state volume writable by that user
    needs_model = args.sglang_recorder_dir is not None
    assert sidecar["image"].endswith("-model") == needs_model  # the [model] extra only where a flag needs it
