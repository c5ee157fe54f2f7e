"""``GET /v1/history``'s query string, checked and bounded: everything in it comes from outside.

``since`` / ``until`` (seconds since the epoch; default the last hour), ``step`` (seconds per
column; default the finest of 10 s, 1 min, 15 min, 1 h, 6 h, 1 d giving at most
:data:`DEFAULT_COLUMNS`), ``metric`` (default ``entropy_bits``), ``business_line`` (a line or
``all``) and ``router`` (an fnmatch pattern). A bad parameter is a 400 naming it, the value sent
and what was expected; so is a parameter this endpoint does not know.

An answer is bounded twice: at most :data:`MAX_CELLS` columns x series (a larger query is a 400
naming ``step`` before anything is built), and at most :data:`MAX_ANSWER_BYTES` of JSON once
encoded (the same 400, for values whose text is unusually long). bench/history_size.py measures
the largest answer of a full store: 1,024 series over 30 days.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from starlette.responses import JSONResponse

from mla_watch.history.store import HISTORY_METRICS
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE
from mla_watch.server.requests import ApiError, describe_value

__all__ = [
    "DEFAULT_COLUMNS",
    "MAX_ANSWER_BYTES",
    "MAX_CELLS",
    "MAX_POINTS",
    "MAX_RANGE_SECONDS",
    "MAX_STEP_SECONDS",
    "HistoryQuery",
    "encode_history",
    "parse_history_query",
    "too_large",
]

PARAMS = ("since", "until", "step", "metric", "business_line", "router")
MAX_RANGE_SECONDS = 30 * 86400.0
MAX_STEP_SECONDS = 86400.0
MAX_POINTS = 2000  # columns one answer may hold
# columns x series. A cell is 13-16 bytes of JSON (a value rounded to 4 decimals and a too_small flag):
# 400,000 made 6.2 MB at most for 1,024 series over 30 days (bench/history_size.py), under MAX_ANSWER_BYTES.
MAX_CELLS = 400_000
MAX_ANSWER_BYTES = 8_000_000  # the largest /v1/history answer sent: a public read must stay cheap
DEFAULT_COLUMNS = 720
MAX_PATTERN = 200
MAX_NUMBER_TEXT = 32
_NICE_STEPS = (60.0, 900.0, 3600.0, 21600.0, 86400.0)


@dataclass(frozen=True)
class HistoryQuery:
    since: float
    until: float
    step: float
    metric: str
    business_line: str | None
    router: str | None


def _bad(param: str, value: object, expected: str) -> ApiError:
    return ApiError(
        400, f"{param}={describe_value(value)} is invalid: expected {expected}", param=param, code="invalid_value"
    )


def _seconds(params: Mapping[str, str], name: str, expected: str) -> float | None:
    text = params.get(name)
    if text is None:
        return None
    try:
        value = float(text) if len(text) <= MAX_NUMBER_TEXT else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise _bad(name, text, expected)
    return value


def parse_history_query(params: Mapping[str, str], *, now: float, min_step: float) -> HistoryQuery:
    """The checked query; ``min_step`` is the sampling interval (no finer step exists)."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ApiError(
            400,
            f"{describe_value(unknown[0])} is not a parameter of /v1/history: expected {', '.join(PARAMS)}",
            param=unknown[0],
            code="unknown_parameter",
        )
    until = _seconds(params, "until", "a time in seconds since the epoch")
    until = now if until is None else until
    since = _seconds(params, "since", "a time in seconds since the epoch")
    since = until - 3600.0 if since is None else since
    if not since < until:
        raise _bad("since", params.get("since"), f"a time before until ({until:.3f})")
    if until - since > MAX_RANGE_SECONDS:
        raise _bad(
            "since", params.get("since"), f"at most {MAX_RANGE_SECONDS / 86400:g} days before until ({until:.3f})"
        )
    span = until - since
    step = _seconds(params, "step", f"seconds per column in [{min_step:g}, {MAX_STEP_SECONDS:g}]")
    if step is None:
        step = next(
            (s for s in (min_step, *_NICE_STEPS) if s >= min_step and span / s <= DEFAULT_COLUMNS),
            max(MAX_STEP_SECONDS, min_step),
        )
    elif not min_step <= step <= MAX_STEP_SECONDS:
        raise _bad("step", params["step"], f"seconds per column in [{min_step:g}, {MAX_STEP_SECONDS:g}]")
    if span / step > MAX_POINTS:
        raise _bad(
            "step",
            params.get("step", step),
            f"at least {span / MAX_POINTS:g} s for this range ({span:g} s): at most {MAX_POINTS} columns",
        )
    metric = params.get("metric", "entropy_bits")
    if metric not in HISTORY_METRICS:
        raise _bad("metric", metric, f"one of {', '.join(HISTORY_METRICS)}")
    line = params.get("business_line")
    if line is not None and line != ALL_LINES and not NAME_RE.fullmatch(line):
        raise _bad("business_line", line, f"{ALL_LINES!r} or a line name ({NAME_RULE})")
    router = params.get("router")
    if router is not None and not 0 < len(router) <= MAX_PATTERN:
        raise _bad("router", router, f"a router name or fnmatch pattern of 1 to {MAX_PATTERN} characters")
    return HistoryQuery(since, until, step, metric, line, router)


def too_large(step: float, why: str) -> ApiError:
    """The 400 for an answer past :data:`MAX_CELLS` or :data:`MAX_ANSWER_BYTES`: the client asks for a larger step."""
    return ApiError(
        400,
        f"step={step:g} is invalid for this range and these series ({why}): expected a larger "
        "step, or a narrower router / business_line",
        param="step",
        code="invalid_value",
    )


def encode_history(body: Mapping[str, Any], *, max_bytes: int = MAX_ANSWER_BYTES) -> bytes:
    """``body`` as the JSON sent, refused (:func:`too_large`) past ``max_bytes``."""
    encoded = cast(bytes, JSONResponse(body).body)  # render() gives bytes; starlette's types allow a memoryview
    if len(encoded) > max_bytes:
        raise too_large(body["step_seconds"], f"{len(encoded)} bytes of JSON exceed {max_bytes}")
    return encoded
