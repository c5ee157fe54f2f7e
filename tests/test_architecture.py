"""The package's layers as docs/architecture.md draws them: imports point down, never in a circle."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mla_watch"

# Bottom to top: a module may import its own package and the ones listed before it, never one after.
# "public" is the package root: mla_watch/__init__.py and the Python API's aliases beside it.
LAYERS = (
    "shipped",
    "dashboards",
    "common",
    "routing",
    "probe",
    "engines",
    "policy",
    "models",
    "quality",
    "alerting",
    "history",
    "references",
    "cause",
    "retune",
    "fleet",
    "server",
    "public",
    "cli",
)
MAX_ROOT_MODULES = 8


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or not (PACKAGE / parts[1]).is_dir():
        return "public"
    return parts[1]


def _imports(tree: ast.Module, modules: set[str] | dict[str, ast.Module]) -> Iterator[tuple[str, int]]:
    """The mla_watch modules a module imports, at any depth (an import inside a function is one too):
    ``from M import name`` is M.name where that is a module, else M."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names if alias.name.startswith("mla_watch"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mla_watch"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield (submodule if submodule in modules else node.module), node.lineno


@functools.cache  # parsed once for every test here (read, never changed): ~4 s a parse of the tree
def _sources() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_package_sits_in_a_layer() -> None:
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert packages <= set(LAYERS), f"packages in no layer: {sorted(packages - set(LAYERS))}"


def test_imports_point_down_the_layers() -> None:
    sources = _sources()
    upward = []
    for module, tree in sources.items():
        rank = LAYERS.index(_layer(module))
        for target, line in _imports(tree, sources):
            if target in sources and LAYERS.index(_layer(target)) > rank:
                upward.append(f"{module}:{line} imports {target} ({_layer(module)} -> {_layer(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_circle() -> None:
    sources = _sources()
    graph = {
        module: sorted({target for target, _ in _imports(tree, sources) if target in sources and target != module})
        for module, tree in sources.items()
    }
    state: dict[str, str] = {}
    circles: list[list[str]] = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target, [*path, target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            walk(module, [module])
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_the_package_root_keeps_the_public_face_only() -> None:
    root_modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules


# Rule-group names share the prefix but name no series.
GROUP_NAMES = {
    "mla_watch.alerting.promexport": {"mla_watch_routing"},
    "mla_watch.alerting.fleet": {"mla_watch_fleet"},
    "mla_watch.alerting.fleet_versions": {"mla_watch_fleet_versions"},
}


def test_series_names_are_written_in_their_home_only() -> None:
    """A metric name spelled out anywhere but where it is defined drifts from it the day one is renamed."""
    spelled = []
    for module, tree in _sources().items():
        if module == "mla_watch.routing.series":
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("mla_watch_")
                and node.value.isidentifier()
                and node.value not in GROUP_NAMES.get(module, set())
            ):
                spelled.append(f"{module}:{node.lineno} {node.value!r}")
    assert not spelled, spelled


def test_alert_and_series_labels_are_read_by_their_constant() -> None:
    """``labels.get("router")`` and ``labels["layer"]`` read a series label: by mla_watch.routing.series's name."""
    from mla_watch.routing.series import EXPERT_LABELS

    def is_labels(node: ast.expr) -> bool:
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        return name.endswith("labels")

    spelled = []
    for module, tree in _sources().items():
        for node in ast.walk(tree):
            key: ast.expr | None = None
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and is_labels(node.func.value)
                and node.args
            ):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and is_labels(node.value):
                key = node.slice
            if isinstance(key, ast.Constant) and key.value in EXPERT_LABELS:
                spelled.append(f"{module}:{node.lineno} {key.value!r}")
    assert not spelled, spelled


# ---------------------------------------------------------------------------------------------- the HTTP layer
def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions (prose, not values)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _server_sources() -> dict[str, ast.Module]:
    return {module: tree for module, tree in _sources().items() if _layer(module) == "server"}


def test_the_http_layer_names_no_engine() -> None:
    """The server relays, bounds and times an engine's bytes: what each engine's format means is for its reader in
    engines/ (engines/reading.py chooses it by name). An engine's name as a value in server/ is a branch on it."""
    from mla_watch.engines.backends import SWAPPING_ENGINES
    from mla_watch.engines.reading import ANSWER_FORMATS

    names = sorted({*ANSWER_FORMATS, *SWAPPING_ENGINES})
    assert names, "no engine format is registered"
    named = re.compile(rf"(?<![\w-])({'|'.join(map(re.escape, names))})(?![\w-])")
    spelled = []
    for module, tree in _server_sources().items():
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in prose
                and named.search(node.value)
            ):
                spelled.append(f"{module}:{node.lineno} {node.value[:60]!r}")
    assert not spelled, "\n".join(spelled)


def test_the_http_layer_does_not_branch_on_the_engine_format() -> None:
    """No ``plan.engine == "..."`` (nor ``!=``, ``in``) in server/: an engine's format is an object that is asked,
    not a name that is compared."""

    def engine(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "engine") or (
            isinstance(node, ast.Name) and node.id == "engine"
        )

    def literal(node: ast.expr) -> bool:
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(literal(element) for element in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    branches = []
    for module, tree in _server_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(engine(operand) for operand in operands) and any(literal(operand) for operand in operands):
                    branches.append(f"{module}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not branches, "\n".join(branches)


def test_engines_never_import_the_http_layer() -> None:
    """An answer's path runs from server/ down into engines/ and never back: no module of engines/ imports one of
    server/ (the per-chunk path is also watched running: tests/test_engine_streams.py)."""
    sources = _sources()
    climbing = [
        f"{module}:{line} imports {target}"
        for module, tree in sources.items()
        if _layer(module) == "engines"
        for target, line in _imports(tree, sources)
        if target.startswith("mla_watch.server")
    ]
    assert not climbing, "\n".join(climbing)


def _cli_flags() -> set[str]:
    """Every flag the command line defines (the option strings given to ``add_argument``)."""
    flags = set()
    for module, tree in _sources().items():
        if _layer(module) != "cli":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flags.update(
                    arg.value
                    for arg in node.args
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:2] == "--"
                )
    return flags


def _raised_name(node: ast.Raise) -> str:
    call = node.exc
    func = call.func if isinstance(call, ast.Call) else call
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def test_only_the_command_line_names_its_flags_in_a_settings_error() -> None:
    """The core names a setting by its field path; cli/setting_flags.py turns it into a flag. A message about
    a setting starts with it or says what was expected of it; advice may still name a flag ("serve with
    --reference-model DIR")."""
    flags = _cli_flags()
    assert "--reference-long-share" in flags and "--engine" in flags  # the walk above finds them
    found = []
    for module, tree in _sources().items():
        if _layer(module) == "cli":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or _raised_name(node) not in ("ValueError", "SettingsError"):
                continue
            for text in ast.walk(node):
                if (
                    isinstance(text, ast.Constant)
                    and isinstance(text.value, str)
                    and (text.value.lstrip().startswith("--") or "expected" in text.value)
                ):
                    named = set(re.findall(r"--[a-z][a-z0-9-]*", text.value)) & flags
                    found += [f"{module}:{node.lineno}: {flag}" for flag in sorted(named)]
    assert not found, found


def test_one_settings_error_class() -> None:
    from mla_watch.common.directory_store import ConfigError
    from mla_watch.common.setting_errors import SettingsError
    from mla_watch.server.config import ServerConfigError

    assert ConfigError is SettingsError and ServerConfigError is SettingsError  # the former names, kept one release
    classes = [
        f"{module}.{node.name}"
        for module, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name.endswith(("ConfigError", "SettingsError"))
    ]
    assert classes == ["mla_watch.common.setting_errors.SettingsError"]


# ---------------------------------------------------------------------------------------------- names
def test_no_module_imports_another_modules_private_name() -> None:
    """An underscore name is its module's own: one that another module needs is public (in ``__all__``) or moves to
    where it is used. Dunder names (``__version__``, ``__all__``) are public."""
    borrowed = []
    for module, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mla_watch"):
                borrowed.extend(
                    f"{module}:{node.lineno} imports {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                )
    assert not borrowed, "\n".join(borrowed)


# Python API paths renamed in this release: the old path -> the new one. Each old path keeps working for one release.
RENAMED = {"mla_watch.references.prompts.ReferenceError": "mla_watch.references.prompts.ReferenceSetError"}


def test_the_old_name_of_the_references_package_gives_the_same_modules_for_one_release() -> None:
    import sys

    from harness import processes

    same = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from mla_watch.cause.prober import ReferenceSettings\n"
        "    from mla_watch.cause import prompts\n"
        "from mla_watch.references.prober import ReferenceSettings as New\n"
        "import mla_watch.references.prompts as new_prompts\n"
        "assert ReferenceSettings is New and prompts is new_prompts\n"
        "assert [str(w.message) for w in caught] == "
        "['mla_watch.cause is now mla_watch.references: import it from there'], caught\n"
    )
    done = processes.run([sys.executable, "-c", same], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_renamed_python_api_paths_keep_working_one_release() -> None:
    import importlib
    import warnings

    def resolve(path: str) -> object:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    for old, new in RENAMED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve(old) is resolve(new), old
        assert any(issubclass(warning.category, DeprecationWarning) for warning in caught), f"{old} does not warn"


# Base names two modules may share, and why. A cli/ module is named after its command (``mla-watch check``,
# ``mla-watch fleet``); a root module is the documented Python API name of its home below (docs/python-api.md).
SHARED_BASE_NAMES = {
    "check": {"mla_watch.cli.check", "mla_watch.fleet.check"},
    "fleet": {"mla_watch.cli.fleet", "mla_watch.alerting.fleet"},
    "footprint": {"mla_watch.footprint", "mla_watch.routing.footprint"},
    "positions": {"mla_watch.positions", "mla_watch.routing.positions"},
    "windows": {"mla_watch.windows", "mla_watch.routing.windows"},
}


def test_no_two_modules_share_a_base_name() -> None:
    """``engine.py`` in two packages makes every traceback, grep and import ambiguous: a module's base name is
    its own (``__init__.py`` apart, and the justified pairs above)."""
    by_name: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, set()).add(_module_name(path))
    shared = {name: modules for name, modules in by_name.items() if len(modules) > 1}
    unjustified = {name: sorted(modules) for name, modules in shared.items() if modules != SHARED_BASE_NAMES.get(name)}
    assert not unjustified, unjustified


def test_no_class_name_is_defined_in_two_modules() -> None:
    """One class name, one idea: two unrelated classes of one name are told apart only by their import."""
    defined: dict[str, list[str]] = {}
    for module, tree in _sources().items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(module)
    twice = {name: modules for name, modules in defined.items() if len(modules) > 1}
    assert not twice, twice


MAX_MODULE_LINES = 600
# Modules allowed past it, and why: the corpus is data.
LONG_MODULES = {"mla_watch.models.corpus"}


def test_no_module_is_over_600_lines() -> None:
    """A module holds one idea: past 600 lines it holds two, and the second goes to a sibling module."""
    long = {
        module: lines
        for module, lines in (
            (_module_name(path), len(path.read_text().splitlines())) for path in PACKAGE.rglob("*.py")
        )
        if lines > MAX_MODULE_LINES and module not in LONG_MODULES
    }
    assert not long, long


# ---------------------------------------------------------------------------------------- the tests and the benches
REPO = PACKAGE.parent
SUITES = ("tests", "bench", "harness")  # the tests, the benchmarks, and what both share (neither imports the other)
SLEEPING = {"time.sleep", "asyncio.sleep", "sleep"}
# A sleep of a value that is not a constant under a second, kept because it paces a loop or plays a part, never to
# wait for something: (file, function) -> why.
PACED_SLEEPS = {
    ("harness/support.py", "wait_until"): "the pause between two looks at what is awaited (interval, 0.05 s)",
    ("harness/processes.py", "_wait_gone"): "the pause between two looks at whether a process has gone",
    ("harness/receivers.py", "do_POST"): "the answer delay a test asks of the receiver (Reply.delay)",
    ("harness/attacks.py", "replay"): "/healthz is sampled at rest this long: a measurement, not a wait",
    ("tests/vllm_twin.py", "_stream"): "the twin's decode step, a fraction of a second each test sets",
    ("tests/test_proxy_hop.py", "sleep_then_pid"): "keeps a decoding process busy as its caller asks (0 or 0.5 s)",
    ("tests/slow_engine.py", "_answer"): "the slow engine's answer time, the part it plays (a client's, a score's)",
}
# Fixed waits that no event yet replaces: (file, function) -> why. Each is a test that is slower than it needs to be.
WAITED_OUT: dict[tuple[str, str], str] = {}


def _suite_sources(*suites: str) -> dict[str, ast.Module]:
    return {
        str(path.relative_to(REPO)): ast.parse(path.read_text(), str(path))
        for suite in suites
        for path in sorted((REPO / suite).rglob("*.py"))
    }


def _calls_by_function(tree: ast.Module) -> Iterator[tuple[str, ast.Call]]:
    """Each call with the name of the function it is in (the innermost; ``""`` at module level)."""

    def walk(node: ast.AST, function: str) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                yield function, child
            yield from walk(child, inner)

    yield from walk(tree, "")


def _fixed_sleeps(sources: dict[str, ast.Module]) -> Iterator[tuple[str, str, int, str]]:
    """Each sleep of a second or more, or of a value that is not a constant: (file, function, line, argument)."""
    for path, tree in sources.items():
        for function, call in _calls_by_function(tree):
            if ast.unparse(call.func) not in SLEEPING or not call.args:
                continue
            argument = call.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, int | float) and argument.value < 1:
                continue
            yield path, function, call.lineno, ast.unparse(argument)


def test_tests_wait_on_what_they_can_observe_not_on_a_fixed_sleep() -> None:
    """A wait for something to happen polls for it (harness.support.wait_until) or moves the injected clock; a
    sleep of a second or more makes the suite slower, and flaky where the machine is slower still."""
    sleeps = list(_fixed_sleeps(_suite_sources("tests", "harness")))
    kept = {**PACED_SLEEPS, **WAITED_OUT}
    fixed = [
        f"{path}:{line} {function}: sleep({argument})"
        for path, function, line, argument in sleeps
        if (path, function) not in kept
    ]
    assert not fixed, "wait on an event instead:\n" + "\n".join(fixed)
    stale = sorted(set(kept) - {(path, function) for path, function, _, _ in sleeps})
    assert not stale, f"no such sleep any more: drop {stale}"


def test_the_sleep_check_finds_a_fixed_wait() -> None:
    source = ast.parse(
        "import asyncio, time\ndef waits():\n    time.sleep(0.05)\n    time.sleep(2)\n"
        "    time.sleep(3 * POLL)\nasync def also():\n    await asyncio.sleep(1.0)\n"
    )
    assert [(function, argument) for _, function, _, argument in _fixed_sleeps({"tests/x.py": source})] == [
        ("waits", "2"),
        ("waits", "3 * POLL"),
        ("also", "1.0"),
    ]


def _product_patches(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Each ``monkeypatch.setattr``/``delattr`` on something of mla_watch: a ``"mla_watch...."`` path, or a target
    that is not reached from a module imported from outside mla_watch (an mla_watch module, class or object)."""
    outside: set[str] = set()  # names bound to modules or objects imported from elsewhere (torch, ...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            outside.update(
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if not alias.name.startswith("mla_watch")
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.module.startswith("mla_watch")
            and not node.level
        ):
            outside.update(alias.asname or alias.name for alias in node.names)
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and ast.unparse(node.func.value) == "monkeypatch"
            and node.args
        ):
            continue
        target = node.args[0]
        if isinstance(target, ast.Constant):
            if isinstance(target.value, str) and target.value.startswith("mla_watch"):
                yield node.lineno, target.value
            continue
        root = target
        while isinstance(root, ast.Attribute):
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in outside):
            yield node.lineno, ast.unparse(target)


# Patches of the product that no parameter replaces yet: (file, target) -> what it swaps. None: keep it so.
PATCHED_STILL: dict[tuple[str, str], str] = {}


def test_tests_inject_through_parameters_instead_of_patching_the_product() -> None:
    """A test that swaps one of the product's functions or constants tests a program nobody runs; it passes what it
    needs through a constructor parameter (settings from the environment are fine)."""
    found = [
        (path, line, target)
        for path, tree in _suite_sources("tests", "harness").items()
        for line, target in _product_patches(tree)
    ]
    patched = [
        f"{path}:{line} monkeypatch.setattr({target}, ...)"
        for path, line, target in found
        if (path, target) not in PATCHED_STILL
    ]
    assert not patched, "inject through a parameter instead:\n" + "\n".join(patched)
    stale = sorted(set(PATCHED_STILL) - {(path, target) for path, _, target in found})
    assert not stale, f"no such patch any more: drop {stale}"


def test_the_patch_check_finds_the_product_patched() -> None:
    source = ast.parse(
        "import torch\nfrom mla_watch.engines import recorder\nimport mla_watch\n"
        "def test(monkeypatch, sidecar):\n    monkeypatch.setattr(torch.cuda, 'is_available', f)\n"
        "    monkeypatch.setattr(recorder, 'MAX', 1)\n    monkeypatch.setattr(mla_watch, 'load', f)\n"
        "    monkeypatch.setattr(sidecar.store, 'query', f)\n"
        "    monkeypatch.setattr('mla_watch.cli.main', f)\n    monkeypatch.setenv('A', 'b')\n"
    )
    assert [target for _, target in _product_patches(source)] == [
        "recorder",
        "mla_watch",
        "sidecar.store",
        "mla_watch.cli.main",
    ]


def test_tests_and_benches_share_through_harness_only() -> None:
    """tests/ imports no bench and bench/ no test: what both use is in harness/, which imports neither."""
    forbidden = {"tests": {"bench"}, "bench": {"tests"}, "harness": {"tests", "bench"}}
    crossing = []
    for path, tree in _suite_sources(*SUITES).items():
        suite = path.split("/")[0]
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else []
            )
            crossing += [
                f"{path}:{node.lineno} imports {name}" for name in names if name.split(".")[0] in forbidden[suite]
            ]
    assert not crossing, "\n".join(crossing)
