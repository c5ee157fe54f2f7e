"""The sampling parameters of the HTTP contract, each written once, and the values applied to a request.

:data:`SAMPLING_PARAMS` is the one table of sampling parameters. Every consumer reads its limits and
defaults from here instead of writing its own:

* :mod:`mla_watch.server.requests` validates a request against :attr:`SamplingParam.http` (what a
  client may send) and the stop-string limits;
* :mod:`mla_watch.policy.model` / :mod:`mla_watch.policy.files` take the governed parameters, their
  :attr:`SamplingParam.domain` and integer-ness from it, and refuse a policy value that the HTTP
  layer would refuse from a client (:attr:`SamplingParam.policy_domain`);
* :class:`SamplingValues` (the sampler's ``SamplingParams``) takes its fields' defaults and its
  validation from it.

:class:`SamplingValues` is the typed form of the values applied to one request: built once from the
policy decision (:meth:`SamplingValues.from_applied`), frozen, and handed to the sampler.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Literal

from mla_watch.common.values import is_integer, is_number
from mla_watch.common.yamlcheck import fmt as _fmt

__all__ = [
    "GREEDY_BELOW",
    "SAMPLING_PARAMS",
    "Domain",
    "SamplingParam",
    "SamplingValues",
]

GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (as vLLM does): dividing the logits by them would overflow."""


# --------------------------------------------------------------------------- ranges


def _brief_number(value: float) -> str:
    if isinstance(value, int):
        if value >= 2**32 and value & (value - 1) == 0:  # a power of two: 2**64 reads better than its digits
            return f"2**{value.bit_length() - 1}"
        return str(value)
    return f"{value:g}"


@dataclass(frozen=True)
class Domain:
    """A range of numbers: ``[low, high]``, each end inclusive or not; ``high=None`` is unbounded."""

    integer: bool
    low: float
    low_inclusive: bool
    high: float | None = None
    high_inclusive: bool = True

    def contains(self, value: float) -> bool:
        if value < self.low or (value == self.low and not self.low_inclusive):
            return False
        if self.high is None:
            return True
        return value < self.high or (value == self.high and self.high_inclusive)

    def interval(self) -> str:
        """YAML-flavoured interval: ``[0.0, inf)``."""
        low = f"{'[' if self.low_inclusive else '('}{_fmt(self.low)}"
        high = f"{_fmt(self.high)}{']' if self.high_inclusive else ')'}" if self.high is not None else "inf)"
        return f"{low}, {high}"

    def describe(self) -> str:
        """YAML-flavoured wording (policy files): ``a number in [0.0, inf)``."""
        return f"{'an integer' if self.integer else 'a number'} in {self.interval()}"

    def brief(self) -> str:
        """The sampler's wording: ``a finite number >= 0``, ``a number in (0, 1]``, ``an integer >= 1``."""
        low = _brief_number(self.low)
        if self.high is None:
            kind = "an integer" if self.integer else "a finite number"
            return f"{kind} {'>=' if self.low_inclusive else '>'} {low}"
        kind = "an integer" if self.integer else "a number"
        return (
            f"{kind} in {'[' if self.low_inclusive else '('}{low}, "
            f"{_brief_number(self.high)}{']' if self.high_inclusive else ')'}"
        )

    def within(self, other: Domain) -> Domain:
        """The part of this range that ``other`` also allows."""
        low, low_inclusive = self.low, self.low_inclusive
        if other.low > low or (other.low == low and not other.low_inclusive):
            low, low_inclusive = other.low, other.low_inclusive
        high, high_inclusive = self.high, self.high_inclusive
        if other.high is not None and (
            high is None or other.high < high or (other.high == high and not other.high_inclusive)
        ):
            high, high_inclusive = other.high, other.high_inclusive
        return Domain(self.integer, low, low_inclusive, high, high_inclusive)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class SamplingParam:
    """One sampling parameter of the HTTP contract.

    ``domain`` is what the sampler can do (and what a policy value must be, see :attr:`policy_domain`);
    ``http`` is what a client may send; ``default`` is what the sampler uses when the request and the
    policy leave the parameter out.
    """

    name: str
    kind: Literal["number", "integer", "strings"]
    default: Any
    domain: Domain | None  # None: not a number (stop)
    http: Domain | None  # None: no numeric range (stop: see max_items, max_length)
    governed: bool = False  # a policy may set {min, max, default} / {fixed}
    field: str | None = None  # the SamplingValues field it fills; None for none
    note: str = ""  # what special values mean, for the sampler's messages
    optional: bool = False  # None is a value (seed: draw a fresh one per request)
    http_aliases: tuple[tuple[Any, Any], ...] = ()  # (as sent, as read): vLLM's top_k -1 is 0, "off"
    chat_only: bool = False  # only /v1/chat/completions accepts it
    max_items: int | None = None  # stop: at most this many strings over HTTP
    max_length: int | None = None  # stop: each of at most this many characters over HTTP

    @property
    def integer(self) -> bool:
        return self.kind == "integer"

    @property
    def python_type(self) -> type:
        return {"number": float, "integer": int, "strings": tuple}[self.kind]

    @property
    def policy_domain(self) -> Domain:
        """What a policy may allow or default to: the sampler's domain, no wider than HTTP accepts."""
        assert self.domain is not None
        return self.domain if self.http is None else self.domain.within(self.http)

    @property
    def sampler_expectation(self) -> str:
        """What the sampler expects, as its error messages say it."""
        if self.kind == "strings":
            return "a tuple of non-empty strings"
        assert self.domain is not None
        text = ("None or " if self.optional else "") + self.domain.brief()
        return f"{text} ({self.note})" if self.note else text


def _number(
    low: float, high: float | None = None, *, low_inclusive: bool = True, high_inclusive: bool = True
) -> Domain:
    return Domain(False, float(low), low_inclusive, None if high is None else float(high), high_inclusive)


def _integer(low: int, high: int | None = None, *, high_inclusive: bool = True) -> Domain:
    return Domain(True, low, True, high, high_inclusive)


_PARAMS: tuple[SamplingParam, ...] = (
    SamplingParam(
        "temperature",
        "number",
        1.0,
        _number(0),
        _number(0, 2),
        governed=True,
        field="temperature",
        note="0 means greedy",
    ),
    SamplingParam(
        "top_p",
        "number",
        1.0,
        _number(0, 1, low_inclusive=False),
        _number(0, 1, low_inclusive=False),
        governed=True,
        field="top_p",
        note="1 disables nucleus filtering",
    ),
    SamplingParam(
        "top_k",
        "integer",
        0,
        _integer(0),
        _integer(-1, 100_000),
        governed=True,
        field="top_k",
        note="0 disables top-k filtering",
        http_aliases=((-1, 0),),
    ),
    SamplingParam(
        "repetition_penalty",
        "number",
        1.0,
        _number(0, low_inclusive=False),
        _number(0, 10, low_inclusive=False),
        governed=True,
        field="repetition_penalty",
        note="1 means no penalty",
    ),
    SamplingParam("max_tokens", "integer", 16, _integer(1), _integer(1, 1_000_000), governed=True, field="max_tokens"),
    # OpenAI's newer name for max_tokens in chat: read into max_tokens (the two must agree when both are sent)
    SamplingParam(
        "max_completion_tokens", "integer", 16, _integer(1), _integer(1, 1_000_000), field="max_tokens", chat_only=True
    ),
    SamplingParam(
        "seed",
        "integer",
        None,
        _integer(0, 2**64, high_inclusive=False),
        _integer(0, 2**63 - 1),
        field="seed",
        optional=True,
    ),
    SamplingParam("stop", "strings", (), None, None, field="stop", max_items=4, max_length=256),
    SamplingParam("n", "integer", 1, _integer(1), _integer(1, 16), governed=True, field="n"),
)

SAMPLING_PARAMS: Mapping[str, SamplingParam] = MappingProxyType({param.name: param for param in _PARAMS})
"""Every sampling parameter of the HTTP contract, by name, in the order a policy's rules are checked."""


def _default(name: str) -> Any:
    return SAMPLING_PARAMS[name].default


# --------------------------------------------------------------------------- the applied values


def _checked(param: SamplingParam, value: Any) -> Any:
    """``value`` as the sampler takes it (stop normalised to a tuple); ``ValueError`` when it cannot."""
    if param.kind == "strings":
        items = (value,) if isinstance(value, str) else value
        if isinstance(items, tuple | list) and all(isinstance(item, str) and item for item in items):
            return tuple(items)
    elif value is None and param.optional:
        return value
    else:
        assert param.domain is not None
        if param.integer:
            if is_integer(value) and param.domain.contains(value):
                return value
        elif is_number(value, finite=True) and param.domain.contains(value):
            return value
    raise ValueError(f"SamplingParams.{param.name}={value!r} is invalid: expected {param.sampler_expectation}")


@dataclass(frozen=True)
class SamplingValues:
    """The validated sampling values of one request, as the sampler uses them.

    Defaults and limits come from :data:`SAMPLING_PARAMS`. ``temperature == 0`` means greedy decoding
    (argmax); an explicit zero is a value, not "unset". ``top_k == 0`` and ``top_p == 1.0`` switch those
    filters off; ``repetition_penalty == 1.0`` is no penalty. ``seed=None`` draws a fresh seed per
    request. ``stop`` holds the stop strings (a single string or a list is normalised to a tuple).
    """

    temperature: float = _default("temperature")
    top_p: float = _default("top_p")
    top_k: int = _default("top_k")
    repetition_penalty: float = _default("repetition_penalty")
    max_tokens: int = _default("max_tokens")
    n: int = _default("n")
    seed: int | None = _default("seed")
    stop: tuple[str, ...] = _default("stop")

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            checked = _checked(SAMPLING_PARAMS[name], value)
            if checked is not value:
                object.__setattr__(self, name, checked)

    @classmethod
    def from_applied(
        cls, applied: Mapping[str, object], *, seed: int | None = None, stop: tuple[str, ...] = ()
    ) -> SamplingValues:
        """The values of a policy decision's ``applied`` mapping (absent or ``None``: the table's default),
        numbers as floats and integers as ints, with the request's ``seed`` and ``stop``.

        Raises ``ValueError`` naming the parameter when a value is outside what the sampler can do."""
        values: dict[str, Any] = {"seed": seed, "stop": stop}
        for name in _FIELDS:
            if name in values:
                continue
            param = SAMPLING_PARAMS[name]
            value = applied.get(name)
            if value is None:
                values[name] = param.default
            elif param.integer and is_number(value) and float(value).is_integer():
                values[name] = int(value)
            elif not param.integer and is_number(value):
                values[name] = float(value)
            else:
                values[name] = value  # refused by __post_init__, naming it
        return cls(**values)

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax: ``temperature`` 0, or so close to it (below
        ``GREEDY_BELOW``, as vLLM does) that dividing the logits by it would overflow."""
        return self.temperature < GREEDY_BELOW


_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingValues))
assert sorted(_FIELDS) == sorted({p.field for p in _PARAMS if p.field is not None}), "a field without a parameter"
assert all(p.name not in _FIELDS or getattr(SamplingValues(), p.name) == p.default for p in _PARAMS)
