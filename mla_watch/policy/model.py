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

This module is the policies' vocabulary and :func:`enforce`, which applies a task policy to
one request (a pure function). :mod:`mla_watch.policy.files` reads and validates the files (a
:class:`PolicyError` lists *every* problem, each naming the file, the key path, the offending
value and what was expected) and holds the policies in force (``PolicyStore``).

This module does not import torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from mla_watch.common.describe import describe_value
from mla_watch.common.setting_errors import SettingsError
from mla_watch.common.values import is_number
from mla_watch.common.yamlcheck import fmt as _fmt
from mla_watch.policy.params import SAMPLING_PARAMS, Domain

__all__ = [
    "DEFAULT_BUSINESS_LINE",
    "GOVERNED_PARAMS",
    "ON_VIOLATION_CHOICES",
    "PARAM_DOMAINS",
    "Adjustment",
    "Decision",
    "ParamDomain",
    "ParamRule",
    "Policy",
    "PolicyError",
    "PolicyRejection",
    "PolicySet",
    "TaskPolicy",
    "UnknownBusinessLine",
    "UnknownTask",
    "enforce",
    "format_range",
]

log = logging.getLogger(__name__)

GOVERNED_PARAMS: tuple[str, ...] = tuple(param.name for param in SAMPLING_PARAMS.values() if param.governed)
"""Sampling parameters a policy may govern, in the order :func:`enforce` checks them (those of
:data:`~mla_watch.sampling_params.SAMPLING_PARAMS` marked ``governed``)."""

DEFAULT_BUSINESS_LINE = "default"
"""The business line used when a request names none."""

OnViolation = Literal["clamp", "reject"]
ON_VIOLATION_CHOICES: tuple[str, ...] = ("clamp", "reject")


# --------------------------------------------------------------------------- errors


class PolicyError(SettingsError):
    """The policy configuration is invalid; ``errors`` holds one complete message per problem."""

    what = "policy configuration"


class UnknownBusinessLine(LookupError):
    """A request named a business line that has no policy."""

    def __init__(self, value: object, known: Iterable[str]) -> None:
        self.value = value
        self.known: tuple[str, ...] = tuple(sorted(known))
        # describe_value: a header is an outsider's value, cut short before it is echoed
        super().__init__(
            f"unknown business line {describe_value(value)}; known business lines: {', '.join(self.known) or '(none)'}"
        )

    def __str__(self) -> str:  # LookupError would otherwise repr() a single argument like KeyError does not
        return str(self.args[0])


class UnknownTask(LookupError):
    """A request named a task that its business line's policy does not define."""

    def __init__(self, value: object, business_line: str, known: Iterable[str]) -> None:
        self.value = value
        self.business_line = business_line
        self.known: tuple[str, ...] = tuple(known)
        super().__init__(
            f"unknown task {describe_value(value)} for business line {business_line!r}; "
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
            f"{param}={_fmt(value)} is outside the allowed range {format_range(minimum, maximum)} "
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


ParamDomain = Domain
"""The range of values a parameter takes (:class:`mla_watch.sampling_params.Domain`)."""

PARAM_DOMAINS: dict[str, ParamDomain] = {
    param.name: param.domain for param in SAMPLING_PARAMS.values() if param.governed and param.domain is not None
}
"""What the sampler can do with each governed parameter, from the table of sampling parameters; a
policy value must also lie within what a client may send over HTTP
(:attr:`~mla_watch.sampling_params.SamplingParam.policy_domain`)."""
assert tuple(PARAM_DOMAINS) == GOVERNED_PARAMS


# --------------------------------------------------------------------------- formatting


def format_range(minimum: float | None, maximum: float | None) -> str:
    low = f"[{_fmt(minimum)}" if minimum is not None else "(-inf"
    high = f"{_fmt(maximum)}]" if maximum is not None else "inf)"
    return f"{low}, {high}"


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
    if not is_number(value):
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
            if name in GOVERNED_PARAMS and value is None:
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
        integer = SAMPLING_PARAMS[param].integer
        number = _as_number(param, value, integer)
        if rule.contains(number):
            applied[param] = number if integer else value
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
