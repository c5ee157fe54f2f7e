"""The one error for settings that cannot be used: what is wrong, where, with which value, and what was expected.

Core objects name a setting by its field path (``reference.long_share``, ``ingest.max_tokens``) or, for a
configuration file, by the file and key (``rules/routing.yaml: rules[RoutingEntropyLow].for``). Only the
command line knows flags: it words a problem with a flag's name through :meth:`SettingsError.messages`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["FieldNamer", "SettingProblem", "SettingsError"]

FieldNamer = Callable[[str], "str | None"]
"""A field path -> the name a user knows it by (a flag), or ``None`` to keep the path."""


_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


@dataclass(frozen=True)
class SettingProblem:
    """One setting that cannot be used: its field path, its value as shown (shortened by the caller, never a
    secret), an optional word on what is wrong with it, and what was expected.

    ``problem`` and ``expected`` name another setting as ``{field.path}``; a problem of several settings
    together is a ``template`` instead: ``"{engine} reads an engine's routing: it needs {upstream} URL"``.
    """

    field: str
    shown: str = ""
    expected: str = ""
    problem: str = ""
    template: str = ""

    def message(self, name: FieldNamer | None = None) -> str:
        """``field = value: expected ...``, or with ``name`` giving a flag, ``--flag value: expected ...``."""

        def fields(text: str) -> str:  # the value shown is the user's: its braces are left alone
            return _FIELD.sub(lambda m: _named(m.group(1), name), text)

        if self.template:
            return fields(self.template)
        flag = None if name is None else name(self.field)
        head = f"{self.field} = {self.shown}" if flag is None else f"{flag} {self.shown}"
        problem = f"{fields(self.problem)}: " if self.problem else ""
        return f"{head}: {problem}expected {fields(self.expected)}"


def _named(field: str, name: FieldNamer | None) -> str:
    flag = None if name is None else name(field)
    return field if flag is None else flag


class SettingsError(ValueError):
    """Settings that cannot be used; ``errors`` holds one complete message per problem.

    A problem is a :class:`SettingProblem` (a field of a settings object) or an already complete message
    (a configuration file's, which names the file, the key, its line and the value).
    """

    what = "settings"

    def __init__(self, errors: Iterable[str | SettingProblem], *, what: str | None = None) -> None:
        if what is not None:
            self.what = what
        self.problems: list[str | SettingProblem] = list(errors)
        self.errors: list[str] = self.messages() or [f"invalid {self.what}"]
        if len(self.errors) == 1:
            text = self.errors[0]
        else:
            text = f"{len(self.errors)} problems in the {self.what}:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(text)

    def messages(self, name: FieldNamer | None = None) -> list[str]:
        """Each problem's message, a field worded by ``name`` (the command line's flags) where it has one."""
        return [p if isinstance(p, str) else p.message(name) for p in self.problems]

    def first(self, name: FieldNamer | None = None) -> str:
        """The first problem's message (a command line stops at the first bad flag)."""
        messages = self.messages(name)
        return messages[0] if messages else str(self)
