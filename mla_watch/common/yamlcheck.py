"""Reading configuration YAML with errors that name the file, the key, the value and the expectation.

Shared by the sampling policies (``mla_watch.policy.model``) and the alert rules
(``mla_watch.alerting.rules``): a strict YAML loader that refuses duplicate keys, and a
checker that collects every problem of a file instead of stopping at the first.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from mla_watch.common.describe import describe_value

__all__ = ["Checker", "StrictLoader", "check_positive", "fmt", "read_yaml"]


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


def read_yaml(path: Path, label: str, error: Callable[[list[str]], Exception], *,
              may_hold_secrets: bool = False) -> Any:
    """The parsed document; a problem raises ``error([message])``. A syntax error quotes the line
    it is on, unless the file ``may_hold_secrets``: no pattern can tell every secret-bearing line
    (an unquoted header value, a URL with a token) from the others, so those files quote none."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error([f"{label}: byte {exc.start}: expected UTF-8 text"]) from None
    except OSError as exc:
        raise error([f"{label}: cannot read the file ({exc.strerror or exc}): expected a readable YAML file"]) from None
    try:
        return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: no arbitrary objects
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


@dataclass
class Checker:
    """Collects the problems of one file, each naming the file, the key path, the value and the expectation."""

    label: str
    errors: list[str] = field(default_factory=list)

    def bad(self, path: str, value: object, expected: str) -> None:
        self.errors.append(f"{self.label}: {path} = {fmt(value)}: expected {expected}")

    def secret(self, path: str, expected: str) -> None:
        """Like :meth:`bad` for a secret: the value is never shown."""
        self.errors.append(f"{self.label}: {path} = (value hidden): expected {expected}")

    def missing(self, path: str, expected: str) -> None:
        self.errors.append(f"{self.label}: {path}: missing: expected {expected}")

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
        self.errors.append(
            f"{self.label}: {where}: unknown key {fmt(key)}{hint}: expected one of: {', '.join(allowed)}"
        )
