"""Every import in tests/, bench/ and harness/ resolves from the repository root, at any depth.

Collection runs only a module's top-level imports: one in a function body that names a missing module, a helper that
is not where it says, or a module of tests/, bench/ or harness/ by its bare name (``from conftest import ...``, which
works only while something puts tests/ itself on ``sys.path``) would fail only when that function runs. So every
``.py`` file is parsed and each of its imports checked: the module must exist, and a name imported from it must be one
the module defines (or a submodule of it). Third-party modules in :data:`OPTIONAL` are skipped where they are not
installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from harness.support import REPO

PACKAGES = ("tests", "bench", "harness")
# Installed only with an extra, a dev tool or an engine of its own; everything else must resolve.
OPTIONAL = frozenset(
    {
        "PIL",
        "cryptography",
        "huggingface_hub",
        "hypothesis",
        "matplotlib",
        "openai",
        "sglang",
        "tokenizers",
        "torch",
        "transformers",
        "triton",
        "vllm",
    }
)
ANY_NAME = None  # what :func:`local_names` returns for a module whose names cannot be listed (``__getattr__``, ``*``)


def sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


@cache
def bare_names() -> dict[str, str]:
    """The modules of tests/, bench/ and harness/ by the names they would have were one directory on ``sys.path``: the
    package each is in."""
    return {
        path.stem: package for package in PACKAGES for path in (REPO / package).glob("*.py") if path.stem != "__init__"
    }


def module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, path: Path) -> Iterator[tuple[int, str, str | None]]:
    """Each import at any depth: its line, the module, and the name taken from it (``None`` for ``import M``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
                module = importlib.util.resolve_name("." * node.level + module, package)
            for alias in node.names:
                yield node.lineno, module, None if alias.name == "*" else alias.name


@cache
def exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is missing, or is no package
        return False


@cache
def is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def bound(statements: list[ast.stmt]) -> Iterator[str | None]:
    """The names ``statements`` bind at module level (``None``: any name), looking into if/try/with/for blocks."""
    for node in statements:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
            if node.name == "__getattr__":
                yield ANY_NAME
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                yield ANY_NAME if alias.name == "*" else alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                yield from (name.id for name in ast.walk(target) if isinstance(name, ast.Name))
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and hasattr(node, block):
                yield from bound(getattr(node, block))


@cache
def local_names(module: str) -> frozenset[str] | None:
    """What a module of tests/, bench/ or harness/ binds at its top level, read from its source: importing each would
    run every test module and bench at import time."""
    origin = importlib.util.find_spec(module).origin
    names = set(bound(ast.parse(Path(origin).read_text()).body))
    return ANY_NAME if ANY_NAME in names else frozenset(names)


def defines(module: str, name: str) -> bool:
    if is_package(module) and exists(f"{module}.{name}"):
        return True
    if module.split(".")[0] in PACKAGES:
        names = local_names(module)
        return names is ANY_NAME or name in names
    return hasattr(importlib.import_module(module), name)


def problems(source: str, path: Path) -> list[str]:
    """What is wrong with the imports of ``source`` (the text of ``path``), one line each."""
    found = []
    where = path.relative_to(REPO)
    for line, module, name in sorted(imports(ast.parse(source), path), key=lambda found: found[0]):
        top = module.split(".")[0]
        if "conftest" in (top, module.removeprefix("tests.")):
            found.append(
                f"{where}:{line}: {module}: conftest.py holds fixtures and hooks only; the helpers are in "
                "harness.support"
            )
        elif top in bare_names():
            found.append(f"{where}:{line}: {module} by its bare name: import it as {bare_names()[top]}.{module}")
        elif not exists(module):
            if top not in OPTIONAL or exists(top):
                found.append(f"{where}:{line}: no module {module}")
        elif name is not None and not defines(module, name):
            found.append(f"{where}:{line}: {module} has no {name}")
    return found


def test_every_import_in_tests_and_bench_resolves_from_the_repository_root() -> None:
    found = [problem for path in sources() for problem in problems(path.read_text(), path)]
    assert found == [], "imports that do not resolve:\n" + "\n".join(found)


def test_the_check_finds_imports_in_function_bodies_that_would_fail_when_run() -> None:
    source = """
def helper():
    from conftest import free_port
    from tests.conftest import wait_until
    import processes
    from proxy_hop import process_tree_rss
    from harness.support import no_such_helper
    import no_such_module_anywhere
    from harness.support import free_port, wait_until
    from harness import processes
    from mla_watch.server.app import Sidecar
"""
    assert [problem.split(": ", 1)[1] for problem in problems(source, REPO / "tests" / "example.py")] == [
        "conftest: conftest.py holds fixtures and hooks only; the helpers are in harness.support",
        "tests.conftest: conftest.py holds fixtures and hooks only; the helpers are in harness.support",
        "processes by its bare name: import it as harness.processes",
        "proxy_hop by its bare name: import it as bench.proxy_hop",
        "harness.support has no no_such_helper",
        "no module no_such_module_anywhere",
    ]
