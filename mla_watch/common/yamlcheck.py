"""Reading configuration YAML with errors that name the file, the key, the value and the expectation.

Shared by the sampling policies (``mla_watch.policy.model``) and the alert rules
(``mla_watch.alerting.rules``): a strict YAML loader that refuses duplicate keys, and a
checker that collects every problem of a file instead of stopping at the first. Each problem
ends with the line of the key it names (``(line 12)``), read from the YAML nodes' marks.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from mla_watch.common.describe import describe_value

__all__ = [
    "Checker",
    "StrictLoader",
    "YamlDocument",
    "check_positive",
    "fmt",
    "key_lines",
    "read_yaml",
    "read_yaml_document",
]


def fmt(value: object) -> str:
    """A value as a message about a YAML file shows it (null, true, false), cut short."""
    return describe_value(value, form="yaml")


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def check_positive(name: str, value: object, kind: type | tuple[type, ...] = (int, float)) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not cast(float, value) > 0:
        expected = "a positive integer" if kind is int else "a positive number"
        raise ValueError(f"{name} = {fmt(value)}: expected {expected}")


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable: construct_mapping below reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class YamlDocument:
    """A parsed YAML file and, for each key path in it (``rules[0].for``), the line its key is on."""

    data: Any
    lines: Mapping[str, int]


def key_lines(node: yaml.Node | None) -> dict[str, int]:
    """The 1-based line of each key path under ``node``: ``a.b`` for a mapping key (the key's own line),
    ``a[2]`` for a list item (the item's first line). An alias is followed once, where it is defined."""
    lines: dict[str, int] = {}
    seen: set[int] = set()  # an anchor used many times is walked once: no blow-up from nested aliases

    def walk(node: yaml.Node, path: str) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                child = f"{path}.{key_node.value}" if path else str(key_node.value)
                lines.setdefault(child, key_node.start_mark.line + 1)
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = f"{path}[{index}]"
                lines.setdefault(child, item.start_mark.line + 1)
                walk(item, child)

    if node is not None:
        walk(node, "")
    return lines


def read_yaml(
    path: Path, label: str, error: Callable[[list[str]], Exception], *, may_hold_secrets: bool = False
) -> Any:
    """The parsed document of :func:`read_yaml_document`, without its lines."""
    return read_yaml_document(path, label, error, may_hold_secrets=may_hold_secrets).data


def read_yaml_document(
    path: Path, label: str, error: Callable[[list[str]], Exception], *, may_hold_secrets: bool = False
) -> YamlDocument:
    """The parsed document and its key lines; a problem raises ``error([message])``. A syntax error quotes
    the line it is on, unless the file ``may_hold_secrets``: no pattern can tell every secret-bearing line
    (an unquoted header value, a URL with a token) from the others, so those files quote none."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error([f"{label}: byte {exc.start}: expected UTF-8 text"]) from None
    except OSError as exc:
        raise error([f"{label}: cannot read the file ({exc.strerror or exc}): expected a readable YAML file"]) from None
    try:
        loader = StrictLoader(text)  # a SafeLoader subclass: no arbitrary objects; it refuses control characters
    except yaml.YAMLError as exc:
        where = f"character {exc.position + 1}: " if isinstance(exc, yaml.reader.ReaderError) else ""
        raise error(
            [f"{label}: {where}YAML error ({type(exc).__name__}): expected valid YAML text, no control characters"]
        ) from None
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(unknown position)"
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
        snippet = ""
        if mark is not None:
            lines = text.splitlines()
            if 0 <= mark.line < len(lines) and not may_hold_secrets:
                snippet = f" near {lines[mark.line].strip()!r}"
        raise error([f"{label}: {where}{snippet}: YAML syntax error ({problem}): expected valid YAML"]) from None
    except yaml.YAMLError as exc:
        raise error([f"{label}: YAML error ({type(exc).__name__}): expected valid YAML"]) from None
    finally:
        loader.dispose()
    return YamlDocument(data, key_lines(node))


_LAST_STEP = re.compile(r"(\.[^.\[]*|\[[^\]]*\])$")


@dataclass
class Checker:
    """Collects the problems of one file, each naming the file, the key path, the value and the expectation."""

    label: str
    errors: list[str] = field(default_factory=list)
    lines: Mapping[str, int] = field(default_factory=dict)
    """Key path -> line (:attr:`YamlDocument.lines`); a message names the line of the deepest key it has."""
    shown: dict[str, str] = field(default_factory=dict)
    """Path as messages show it (``rules[RoutingEntropyLow]``) -> as the document holds it (``rules[0]``)."""

    def show_as(self, path: str, shown: str) -> str:
        """Name ``path`` as ``shown`` in messages (an entry by its name rather than its index); returns ``shown``."""
        self.shown[shown] = path
        return shown

    def line_of(self, path: str) -> int | None:
        """The line of ``path``'s key, else of the nearest enclosing key; ``None`` when none is known."""
        for shown, held in self.shown.items():
            if path == shown or path.startswith((shown + ".", shown + "[")):
                path = held + path[len(shown) :]
                break
        while path:
            line = self.lines.get(path)
            if line is not None:
                return line
            path = _LAST_STEP.sub("", path) if _LAST_STEP.search(path) else ""
        return None

    def add(self, path: str, text: str) -> None:
        """Record the complete message ``text`` about ``path``, adding the line of its key."""
        line = self.line_of(path)
        self.errors.append(text if line is None else f"{text} (line {line})")

    def bad(self, path: str, value: object, expected: str) -> None:
        self.add(path, f"{self.label}: {path} = {fmt(value)}: expected {expected}")

    def secret(self, path: str, expected: str) -> None:
        """Like :meth:`bad` for a secret: the value is never shown."""
        self.add(path, f"{self.label}: {path} = (value hidden): expected {expected}")

    def missing(self, path: str, expected: str) -> None:
        self.add(path, f"{self.label}: {path}: missing: expected {expected}")

    def mapping(self, path: str, value: object, allowed: tuple[str, ...] | None, what: str) -> dict[Any, Any] | None:
        """``value`` as a dict, reporting a non-mapping and any key outside ``allowed``."""
        if not isinstance(value, dict):
            self.bad(path, value, f"a mapping ({what})")
            return None
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    self.unknown_key(path, key, allowed)
        return value

    def unknown_key(self, path: str, key: object, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        where = f"{path}.{key}" if path and path != "(top level)" else str(key)
        hint = ""
        if isinstance(key, str):
            close = difflib.get_close_matches(key, allowed, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
        self.add(where, f"{self.label}: {where}: unknown key {fmt(key)}{hint}: expected one of: {', '.join(allowed)}")
