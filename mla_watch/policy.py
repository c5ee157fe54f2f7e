"""Per-business-line, per-task sampling policies ("guard sampling").

Policies live in ``policies/*.yaml``, one file per business line; the file stem must equal
the file's ``business_line``::

    business_line: code_assistant
    description: Code completion and SQL generation.
    default_task: code              # used when a request names no task
    defaults:                       # apply to every task unless the task sets the same key
      on_violation: clamp           # clamp (adjust and report) | reject (4xx)
      max_prompt_tokens: 384        # optional
      params:
        max_tokens: {min: 1, max: 256, default: 128}
    tasks:
      code:
        params:
          temperature: {min: 0.1, max: 0.3, default: 0.2}
          repetition_penalty: {fixed: 1.2}
      sql:
        on_violation: reject

Files are validated when loaded; a :class:`PolicyError` lists *every* problem found, each
message naming the file, the key path, the offending value and what was expected.
:func:`enforce` applies a task policy to one request (pure function), and
:class:`PolicyStore` holds the policies in force, reloading them on demand or when the
directory changes while never giving up the last good set.

This module does not import torch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from mla_watch.config import ConfigError, DirectoryStore, ReloadResult, config_files
from mla_watch.windows import ALL_LINES, NAME_RE, NAME_RULE
from mla_watch.yamlcheck import Checker as _Checker
from mla_watch.yamlcheck import fmt as _fmt
from mla_watch.yamlcheck import is_number as _is_number
from mla_watch.yamlcheck import read_yaml

__all__ = [
    "DEFAULT_BUSINESS_LINE",
    "GOVERNED_PARAMS",
    "Adjustment",
    "Decision",
    "ParamRule",
    "Policy",
    "PolicyError",
    "PolicyRejection",
    "PolicySet",
    "PolicyStore",
    "ReloadResult",
    "TaskPolicy",
    "UnknownBusinessLine",
    "UnknownTask",
    "enforce",
    "load_policy_dir",
    "load_policy_file",
]

log = logging.getLogger(__name__)

GOVERNED_PARAMS: tuple[str, ...] = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "n")
"""Sampling parameters a policy may govern, in the order :func:`enforce` checks them."""

DEFAULT_BUSINESS_LINE = "default"
"""The business line used when a request names none."""

OnViolation = Literal["clamp", "reject"]
_ON_VIOLATION: tuple[str, ...] = ("clamp", "reject")

_TOP_KEYS: tuple[str, ...] = ("business_line", "description", "default_task", "defaults", "tasks")
_SECTION_KEYS: tuple[str, ...] = ("on_violation", "max_prompt_tokens", "params")
_RULE_KEYS: tuple[str, ...] = ("min", "max", "default", "fixed")


# --------------------------------------------------------------------------- errors


class PolicyError(ConfigError):
    """The policy configuration is invalid; ``errors`` holds one complete message per problem."""

    what = "policy configuration"


class UnknownBusinessLine(LookupError):
    """A request named a business line that has no policy."""

    def __init__(self, value: object, known: Iterable[str]) -> None:
        self.value = value
        self.known: tuple[str, ...] = tuple(sorted(known))
        super().__init__(f"unknown business line {value!r}; known business lines: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # LookupError would otherwise repr() a single argument like KeyError does not
        return str(self.args[0])


class UnknownTask(LookupError):
    """A request named a task that its business line's policy does not define."""

    def __init__(self, value: object, business_line: str, known: Iterable[str]) -> None:
        self.value = value
        self.business_line = business_line
        self.known: tuple[str, ...] = tuple(known)
        super().__init__(
            f"unknown task {value!r} for business line {business_line!r}; "
            f"its tasks: {', '.join(self.known) or '(none)'}"
        )

    def __str__(self) -> str:
        return str(self.args[0])


class PolicyRejection(Exception):
    """A request violates a policy whose ``on_violation`` is ``reject``."""

    def __init__(
        self,
        param: str,
        value: object,
        minimum: float | None,
        maximum: float | None,
        business_line: str,
        task: str,
    ) -> None:
        self.param = param
        self.value = value
        self.minimum = minimum
        self.maximum = maximum
        self.business_line = business_line
        self.task = task
        super().__init__(
            f"{param}={_fmt(value)} is outside the allowed range {_fmt_range(minimum, maximum)} "
            f"for {business_line}/{task}"
        )

    def openai_error(self) -> dict[str, Any]:
        """The body of an OpenAI-style 4xx answer: ``{"error": {message, type, param, code}}``."""
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": "policy_violation",
            }
        }


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ParamRule:
    """Allowed range and default for one sampling parameter; ``None`` means unbounded / no default."""

    minimum: float | None = None
    maximum: float | None = None
    default: float | None = None

    @property
    def fixed(self) -> bool:
        """True when the rule pins the parameter to one value."""
        return self.minimum is not None and self.minimum == self.maximum

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside ``[minimum, maximum]`` (NaN never does once a bound exists)."""
        if self.minimum is not None and not value >= self.minimum:
            return False
        return not (self.maximum is not None and not value <= self.maximum)

    def clamp(self, value: float) -> float:
        """``value`` moved to the nearest bound when it lies outside the range."""
        if self.minimum is not None and value < self.minimum:
            return self.minimum
        if self.maximum is not None and value > self.maximum:
            return self.maximum
        return value

    def as_dict(self) -> dict[str, float | None]:
        return {"min": self.minimum, "max": self.maximum, "default": self.default}


@dataclass(frozen=True)
class TaskPolicy:
    """The effective policy of one task (``defaults`` already merged in)."""

    name: str
    on_violation: OnViolation
    params: Mapping[str, ParamRule]
    max_prompt_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "on_violation": self.on_violation,
            "max_prompt_tokens": self.max_prompt_tokens,
            "params": {name: rule.as_dict() for name, rule in self.params.items()},
        }


@dataclass(frozen=True)
class Policy:
    """The policy of one business line, as loaded from ``source``."""

    business_line: str
    description: str
    default_task: str
    tasks: Mapping[str, TaskPolicy]
    source: Path

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``GET /v1/policies``)."""
        return {
            "business_line": self.business_line,
            "description": self.description,
            "default_task": self.default_task,
            "source": str(self.source),
            "tasks": {name: task.as_dict() for name, task in self.tasks.items()},
        }


@dataclass(frozen=True)
class Adjustment:
    """One change :func:`enforce` made: ``requested`` is ``None`` when a default was filled in."""

    param: str
    requested: object
    applied: object

    @property
    def defaulted(self) -> bool:
        """The request left the parameter out and the policy filled in its default (nothing was changed)."""
        return self.requested is None

    def as_dict(self) -> dict[str, object]:
        return {"param": self.param, "requested": self.requested, "applied": self.applied}


@dataclass(frozen=True)
class Decision:
    """What :func:`enforce` decided for one request."""

    business_line: str
    task: str
    applied: dict[str, object]
    adjustments: tuple[Adjustment, ...]
    on_violation: str

    @property
    def policy_label(self) -> str:
        """``"<business_line>/<task>"``, the value of the ``X-MLA-Policy`` header."""
        return f"{self.business_line}/{self.task}"

    def as_dict(self) -> dict[str, Any]:
        """The ``"mla_watch"`` object of a response: ``{"policy", "adjustments"}``."""
        return {"policy": self.policy_label, "adjustments": [a.as_dict() for a in self.adjustments]}


# --------------------------------------------------------------------------- parameter domains


@dataclass(frozen=True)
class _Domain:
    integer: bool
    low: float
    low_inclusive: bool
    high: float | None = None

    def contains(self, value: float) -> bool:
        if value < self.low or (value == self.low and not self.low_inclusive):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low = f"{'[' if self.low_inclusive else '('}{_fmt(self.low)}"
        high = f"{_fmt(self.high)}]" if self.high is not None else "inf)"
        return f"{kind} in {low}, {high}"


_DOMAINS: dict[str, _Domain] = {
    "temperature": _Domain(integer=False, low=0.0, low_inclusive=True),
    "top_p": _Domain(integer=False, low=0.0, low_inclusive=False, high=1.0),
    "top_k": _Domain(integer=True, low=0, low_inclusive=True),  # 0 = off
    "repetition_penalty": _Domain(integer=False, low=0.0, low_inclusive=False),
    "max_tokens": _Domain(integer=True, low=1, low_inclusive=True),
    "n": _Domain(integer=True, low=1, low_inclusive=True),
}
assert tuple(_DOMAINS) == GOVERNED_PARAMS


# --------------------------------------------------------------------------- formatting helpers


def _fmt_range(minimum: float | None, maximum: float | None) -> str:
    low = f"[{_fmt(minimum)}" if minimum is not None else "(-inf"
    high = f"{_fmt(maximum)}]" if maximum is not None else "inf)"
    return f"{low}, {high}"


# --------------------------------------------------------------------------- validation


def _read_yaml(path: Path, label: str) -> Any:
    return read_yaml(path, label, PolicyError)



def _number_hint(value: object) -> str:
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (YAML reads this as text; write it as a plain number such as 1.0e-3, unquoted)"
    return ""


def _check_value(chk: _Checker, path: str, param: str, value: object) -> float | None:
    """A rule value checked against the parameter's domain; ``None`` (after reporting) when invalid."""
    domain = _DOMAINS[param]
    if not _is_number(value):
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
        chk.bad(f"{path}.default", data["default"], f"a value inside [min, max] = {_fmt_range(lo, hi)}")
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
        if value in _ON_VIOLATION and isinstance(value, str):
            section.on_violation = value
        else:
            chk.bad(f"{path}.on_violation", value, "one of: clamp, reject")
    if "max_prompt_tokens" in data:
        value = data["max_prompt_tokens"]
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
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


def _build_policy(data: object, path: Path, label: str) -> Policy:
    chk = _Checker(label)
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
    return _build_policy(_read_yaml(path, label), path, label)


def load_policy_dir(directory: Path) -> PolicySet:
    """Load every policy file of ``directory`` into a :class:`PolicySet`.

    Raises :class:`PolicyError` collecting the errors of all files, and for a missing
    directory, a directory without policy files, or two files for one business line.
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise PolicyError([f"{directory}: the policy directory {what}: expected a directory of *.yaml policy files"])
    try:
        files = config_files(directory)
    except OSError as exc:
        raise PolicyError(
            [
                f"{directory}: cannot list the directory ({exc.strerror or exc}): "
                "expected a readable directory of *.yaml policy files"
            ]
        ) from None
    if not files:
        raise PolicyError(
            [f"{directory}: no policy files (*.yaml, *.yml): expected at least one, e.g. {DEFAULT_BUSINESS_LINE}.yaml"]
        )
    errors: list[str] = []
    by_line: dict[str, list[Policy]] = {}
    for file in files:
        try:
            policy = load_policy_file(file)
        except PolicyError as exc:
            errors.extend(exc.errors)
            continue
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


# --------------------------------------------------------------------------- policy set


class PolicySet:
    """An immutable set of business-line policies."""

    def __init__(self, lines: Mapping[str, Policy], directory: Path | None = None) -> None:
        self.lines: Mapping[str, Policy] = MappingProxyType(dict(lines))
        self.directory = directory

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PolicySet):
            return NotImplemented
        return dict(self.lines) == dict(other.lines)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PolicySet(lines={sorted(self.lines)!r})"

    def resolve(self, business_line: str | None, task: str | None) -> tuple[Policy, TaskPolicy]:
        """The policy and task policy for a request.

        ``None`` means "not named": the line falls back to ``"default"`` and the task to the
        line's ``default_task``. Any other value, including ``""``, must name an existing
        line / task, or :class:`UnknownBusinessLine` / :class:`UnknownTask` is raised.
        """
        line = DEFAULT_BUSINESS_LINE if business_line is None else business_line
        policy = self.lines.get(line) if isinstance(line, str) else None
        if policy is None:
            raise UnknownBusinessLine(line, self.lines)
        name = policy.default_task if task is None else task
        task_policy = policy.tasks.get(name) if isinstance(name, str) else None
        if task_policy is None:
            raise UnknownTask(name, policy.business_line, policy.tasks)
        return policy, task_policy

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``GET /v1/policies``)."""
        return {
            "default_business_line": DEFAULT_BUSINESS_LINE if DEFAULT_BUSINESS_LINE in self.lines else None,
            "business_lines": {line: policy.as_dict() for line, policy in self.lines.items()},
        }


# --------------------------------------------------------------------------- enforcement


def _as_number(param: str, value: object, integer: bool) -> float:
    if not _is_number(value):
        raise TypeError(f"{param}={value!r}: expected a number, got {type(value).__name__}")
    assert isinstance(value, int | float)
    if isinstance(value, float) and math.isnan(value):
        raise TypeError(f"{param}=nan: expected a number, got NaN")
    if integer and isinstance(value, float):
        if not value.is_integer():
            raise TypeError(f"{param}={value!r}: expected an integer")
        return int(value)
    return value


def enforce(policy: Policy, task: TaskPolicy, requested: Mapping[str, object]) -> Decision:
    """Apply ``task``'s rules to a request's sampling values. Pure: nothing is mutated.

    ``requested`` maps parameter names to the request's values; ``None`` or absence means
    "not given" (an explicit ``0`` is a value). For each governed parameter with a rule:

    * not given: the rule's default, if any, is applied (``Adjustment(param, None, default)``);
    * inside ``[min, max]``: kept as is, not reported;
    * outside: ``clamp`` moves it to the nearest bound (reported); ``reject`` raises
      :class:`PolicyRejection` for the first offending parameter in ``GOVERNED_PARAMS`` order.

    Integer parameters stay integers (an integral float is read as an int). A non-number
    (including ``bool`` and NaN) for a governed parameter raises :class:`TypeError` naming it.
    Every other entry of ``requested`` passes through unchanged.
    """
    applied: dict[str, object] = {}
    adjustments: list[Adjustment] = []
    for name, value in requested.items():
        if name not in task.params:
            if name in _DOMAINS and value is None:
                continue
            applied[name] = value
    for param in GOVERNED_PARAMS:
        rule = task.params.get(param)
        if rule is None:
            continue
        value = requested.get(param)
        if value is None:
            if rule.default is not None:
                applied[param] = rule.default
                adjustments.append(Adjustment(param, None, rule.default))
            continue
        number = _as_number(param, value, _DOMAINS[param].integer)
        if rule.contains(number):
            applied[param] = number if _DOMAINS[param].integer else value
            continue
        if task.on_violation == "reject":
            raise PolicyRejection(param, value, rule.minimum, rule.maximum, policy.business_line, task.name)
        clamped = rule.clamp(number)
        applied[param] = clamped
        adjustments.append(Adjustment(param, value, clamped))
    return Decision(
        business_line=policy.business_line,
        task=task.name,
        applied=applied,
        adjustments=tuple(adjustments),
        on_violation=task.on_violation,
    )


# --------------------------------------------------------------------------- the policies in force


class PolicyStore(DirectoryStore[PolicySet]):
    """The policies in force (``serve --policies``): reloaded when their files change, and a reload
    that fails keeps the last good set (:class:`~mla_watch.config.DirectoryStore`)."""

    def __init__(self, directory: Path, *, clock: Callable[[], float] = time.monotonic,
                 on_reload: Callable[[ReloadResult], None] | None = None) -> None:
        super().__init__(directory, load_policy_dir, what="policies", clock=clock, on_reload=on_reload)

    def as_dict(self) -> dict[str, Any]:
        """The policies in force plus ``version`` and ``last_error`` (for ``GET /v1/policies``)."""
        last_error = self.last_error
        return {"version": self.version, "last_error": None if last_error is None else list(last_error.errors),
                **self.current.as_dict()}
