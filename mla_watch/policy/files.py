"""Policy files: ``policies/*.yaml`` read and validated into a :class:`~mla_watch.policy.PolicySet`, and the
policies in force (:class:`PolicyStore`), reloaded when their files change.

Every problem of every file is reported at once (:class:`~mla_watch.policy.PolicyError`), each naming
the file, the key path, the offending value and what was expected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mla_watch.common.directory_store import DirectoryStore, ReloadResult
from mla_watch.common.values import is_integer, is_number
from mla_watch.common.yaml_directory import read_yaml_directory
from mla_watch.common.yamlcheck import Checker as _Checker
from mla_watch.common.yamlcheck import YamlDocument, read_yaml_document
from mla_watch.common.yamlcheck import fmt as _fmt
from mla_watch.policy.model import (
    DEFAULT_BUSINESS_LINE,
    GOVERNED_PARAMS,
    ON_VIOLATION_CHOICES,
    PARAM_DOMAINS,
    ParamRule,
    Policy,
    PolicyError,
    PolicySet,
    TaskPolicy,
    format_range,
)
from mla_watch.policy.params import SAMPLING_PARAMS
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE

__all__ = ["PolicyStore", "load_policy_dir", "load_policy_file"]

_TOP_KEYS: tuple[str, ...] = ("business_line", "description", "default_task", "defaults", "tasks")
_SECTION_KEYS: tuple[str, ...] = ("on_violation", "max_prompt_tokens", "params")
_RULE_KEYS: tuple[str, ...] = ("min", "max", "default", "fixed")


# --------------------------------------------------------------------------- formatting helpers


# --------------------------------------------------------------------------- validation


def _number_hint(value: object) -> str:
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (YAML reads this as text; write it as a plain number such as 1.0e-3, unquoted)"
    return ""


def _check_value(chk: _Checker, path: str, param: str, value: object) -> float | None:
    """A rule value checked against the parameter's domain and what a client may send over HTTP (both
    from :data:`~mla_watch.sampling_params.SAMPLING_PARAMS`); ``None`` (after reporting) when invalid."""
    domain = PARAM_DOMAINS[param]
    if not is_number(value):
        chk.bad(path, value, f"{domain.describe()} for {param}{_number_hint(value)}")
        return None
    assert isinstance(value, int | float)
    if not math.isfinite(value):
        chk.bad(path, value, f"a finite {domain.describe()[2:]} for {param} (leave the key out for no bound)")
        return None
    if domain.integer and not isinstance(value, int):
        chk.bad(path, value, f"{domain.describe()} for {param}")
        return None
    if not domain.contains(value):
        chk.bad(path, value, f"{domain.describe()} for {param}")
        return None
    spec = SAMPLING_PARAMS[param]
    if not spec.policy_domain.contains(value):  # the sampler could, but no client may ask for it over HTTP
        assert spec.http is not None
        chk.bad(
            path,
            value,
            f"{spec.policy_domain.describe()} for {param} (requests over HTTP may not send "
            f"{param} outside {spec.http.interval()}, "
            "so a policy cannot allow or default to it)",
        )
        return None
    return int(value) if domain.integer else float(value)


def _parse_rule(chk: _Checker, path: str, param: str, raw: object) -> ParamRule | None:
    data = chk.mapping(path, raw, _RULE_KEYS, "{min, max, default} or {fixed}")
    if data is None:
        return None
    n_before = len(chk.errors)
    if "fixed" in data:
        others = [k for k in ("min", "max", "default") if k in data]
        if others:
            chk.bad(f"{path}.fixed", data["fixed"], f"'fixed' alone; it cannot be combined with {', '.join(others)}")
            return None
        value = _check_value(chk, f"{path}.fixed", param, data["fixed"])
        return None if value is None else ParamRule(value, value, value)
    values: dict[str, float | None] = {}
    for key in ("min", "max", "default"):
        if key in data and data[key] is not None:
            values[key] = _check_value(chk, f"{path}.{key}", param, data[key])
        else:
            values[key] = None
    if len(chk.errors) != n_before:
        return None
    lo, hi, default = values["min"], values["max"], values["default"]
    if lo is not None and hi is not None and lo > hi:
        chk.bad(f"{path}.min", data["min"], f"a value <= max ({_fmt(data['max'])})")
        return None
    if default is not None and ((lo is not None and default < lo) or (hi is not None and default > hi)):
        chk.bad(f"{path}.default", data["default"], f"a value inside [min, max] = {format_range(lo, hi)}")
        return None
    return ParamRule(lo, hi, default)


_UNSET: Any = object()


@dataclass
class _Section:
    on_violation: Any = _UNSET
    max_prompt_tokens: Any = _UNSET
    params: dict[str, ParamRule] = field(default_factory=dict)


def _parse_section(chk: _Checker, path: str, raw: object) -> _Section:
    section = _Section()
    if raw is None:
        return section
    data = chk.mapping(path, raw, _SECTION_KEYS, "with keys " + ", ".join(_SECTION_KEYS))
    if data is None:
        return section
    if "on_violation" in data:
        value = data["on_violation"]
        if value in ON_VIOLATION_CHOICES and isinstance(value, str):
            section.on_violation = value
        else:
            chk.bad(f"{path}.on_violation", value, "one of: clamp, reject")
    if "max_prompt_tokens" in data:
        value = data["max_prompt_tokens"]
        if value is None or (is_integer(value) and value >= 1):
            section.max_prompt_tokens = value
        else:
            chk.bad(f"{path}.max_prompt_tokens", value, "an integer >= 1 (or null for no limit)")
    if "params" in data and data["params"] is not None:
        params = chk.mapping(f"{path}.params", data["params"], GOVERNED_PARAMS, "parameter name -> rule")
        for name, raw_rule in (params or {}).items():
            if name in GOVERNED_PARAMS:
                rule = _parse_rule(chk, f"{path}.params.{name}", name, raw_rule)
                if rule is not None:
                    section.params[name] = rule
    return section


def _build_policy(document: YamlDocument, path: Path, label: str) -> Policy:
    chk = _Checker(label, lines=document.lines)
    data = document.data
    if not isinstance(data, dict):
        what = "an empty file" if data is None else type(data).__name__
        raise PolicyError(
            [
                f"{label}: (top level) = {_fmt(data) if data is not None else '(' + what + ')'}: "
                f"expected a mapping with keys {', '.join(_TOP_KEYS)}"
            ]
        )
    for key in data:
        if key not in _TOP_KEYS:
            chk.unknown_key("(top level)", key, _TOP_KEYS)

    business_line = data.get("business_line", _UNSET)
    if business_line is _UNSET:
        chk.missing("business_line", f"a string equal to the file name stem {path.stem!r}")
        business_line = path.stem
    elif not isinstance(business_line, str) or business_line != path.stem:
        chk.bad("business_line", business_line, f"the file name stem {path.stem!r} (one file per business line)")
    if not NAME_RE.fullmatch(path.stem):
        chk.bad("business_line", business_line, f"a name of {NAME_RULE}, taken from the file name")
    elif path.stem == ALL_LINES:
        chk.bad("business_line", business_line, f"another name: {ALL_LINES!r} is reserved for every line summed")

    description = data.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        chk.bad("description", description, "a string")
        description = ""

    defaults = _parse_section(chk, "defaults", data.get("defaults"))

    tasks: dict[str, TaskPolicy] = {}
    raw_tasks = data.get("tasks", _UNSET)
    if raw_tasks is _UNSET:
        chk.missing("tasks", "a mapping of task name -> {on_violation, max_prompt_tokens, params}")
    else:
        task_map = chk.mapping("tasks", raw_tasks, None, "task name -> {on_violation, max_prompt_tokens, params}")
        if task_map is not None and not task_map:
            chk.bad("tasks", raw_tasks, "at least one task")
        for name, raw_task in (task_map or {}).items():
            if not isinstance(name, str) or not NAME_RE.fullmatch(name):
                chk.bad(f"tasks.{name}", name, f"a task name of {NAME_RULE}")
                continue
            section = _parse_section(chk, f"tasks.{name}", raw_task)
            on_violation = section.on_violation if section.on_violation is not _UNSET else defaults.on_violation
            max_prompt = (
                section.max_prompt_tokens if section.max_prompt_tokens is not _UNSET else defaults.max_prompt_tokens
            )
            merged = {**defaults.params, **section.params}
            tasks[name] = TaskPolicy(
                name=name,
                on_violation="clamp" if on_violation is _UNSET else on_violation,
                params=MappingProxyType({p: merged[p] for p in GOVERNED_PARAMS if p in merged}),
                max_prompt_tokens=None if max_prompt is _UNSET else max_prompt,
            )

    default_task = data.get("default_task", _UNSET)
    if default_task is _UNSET:
        chk.missing("default_task", f"the name of one of the tasks ({', '.join(tasks) or 'none defined'})")
        default_task = ""
    elif not isinstance(default_task, str) or (isinstance(raw_tasks, dict) and default_task not in raw_tasks):
        chk.bad("default_task", default_task, f"the name of one of the tasks: {', '.join(tasks) or '(none defined)'}")

    if chk.errors:
        raise PolicyError(chk.errors)
    return Policy(
        business_line=business_line,
        description=description.strip(),
        default_task=default_task,
        tasks=MappingProxyType(tasks),
        source=path,
    )


def load_policy_file(path: Path) -> Policy:
    """Load and validate one policy file.

    Raises :class:`PolicyError` listing every problem in the file: unreadable file, YAML
    syntax error (with line and column), and all schema errors.
    """
    path = Path(path)
    label = str(path)
    return _build_policy(read_yaml_document(path, label, PolicyError), path, label)


def load_policy_dir(directory: Path) -> PolicySet:
    """Load every policy file of ``directory`` into a :class:`PolicySet`.

    Raises :class:`PolicyError` collecting the errors of all files, and for a missing
    directory, a directory without policy files, or two files for one business line.
    """
    directory = Path(directory)
    read = read_yaml_directory(
        directory, load_policy_file, PolicyError, kind="policy", at_least=f"one, e.g. {DEFAULT_BUSINESS_LINE}.yaml"
    )
    errors = read.errors
    by_line: dict[str, list[Policy]] = {}
    for _, policy in read.loaded:
        by_line.setdefault(policy.business_line, []).append(policy)
    for line, policies in by_line.items():
        if len(policies) > 1:
            names = ", ".join(str(p.source) for p in policies)
            errors.append(
                f"{directory}: business_line = {line!r} is defined by {len(policies)} files ({names}): "
                "expected exactly one file per business line"
            )
    if errors:
        raise PolicyError(errors)
    return PolicySet({line: ps[0] for line, ps in sorted(by_line.items())}, directory=directory)


# --------------------------------------------------------------------------- the policies in force


class PolicyStore(DirectoryStore[PolicySet]):
    """The policies in force (``serve --policies``): reloaded when their files change, and a reload
    that fails keeps the last good set (:class:`~mla_watch.config.DirectoryStore`)."""

    def __init__(
        self,
        directory: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_reload: Callable[[ReloadResult], None] | None = None,
    ) -> None:
        super().__init__(directory, load_policy_dir, what="policies", clock=clock, on_reload=on_reload)

    def as_dict(self) -> dict[str, Any]:
        """The policies in force plus ``version`` and ``last_error`` (for ``GET /v1/policies``)."""
        last_error = self.last_error
        return {
            "version": self.version,
            "last_error": None if last_error is None else list(last_error.errors),
            **self.current.as_dict(),
        }
