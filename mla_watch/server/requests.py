"""Parse and validate OpenAI-style generation requests, with errors that say what was wrong.

Every error is an :class:`ApiError` carrying the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; the message names the parameter, the
value received and what was expected. Sampling fields follow vLLM's names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_integer, is_number
from mla_watch.policy.params import SAMPLING_PARAMS, SamplingParam

__all__ = ["ApiError", "GenerationRequest", "describe_value", "parse_body", "parse_generation_request"]

_STOP = SAMPLING_PARAMS["stop"]
MAX_STOP_SEQUENCES: int = _STOP.max_items  # type: ignore[assignment]  # from the table of sampling parameters
MAX_MESSAGES = 1024
MAX_STOP_LENGTH: int = _STOP.max_length  # type: ignore[assignment]
ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """An error answered to the client, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        policy: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.headers = headers or {}
        self.policy = policy  # the policy that refused the request ("line/task"), for X-MLA-Policy

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    kind: Literal["completion", "chat"]
    model: str | None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # governed params as requested (absent = not given)
    # seed and stop are not governed by policies: they go to the sampler as sent
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    business_line: str | None = None
    task: str | None = None
    return_routed_experts: bool = False  # SGLang's request field: the client wants the routing itself

    def upstream_body(self, original: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
        """``original`` with the policy's applied values, for forwarding to another engine."""
        body = dict(original)
        for name, value in applied.items():
            if name == "max_tokens" and self.kind == "chat" and "max_completion_tokens" in body:
                body["max_completion_tokens"] = value
            else:
                body[name] = value
        return body


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON ({error})", code="invalid_json") from error
    except RecursionError as error:  # the decoder recurses once per level of nesting
        raise ApiError(
            400, "the request body nests arrays or objects too deeply; expected a flat JSON object", code="invalid_json"
        ) from error
    if not isinstance(body, dict):
        raise ApiError(
            400, f"the request body is a JSON {type(body).__name__}; expected an object", code="invalid_json"
        )
    return body


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and they would poison stored jobs.
    raise ValueError(f"{name} is not a JSON number")


def _bad(param: str, value: Any, expected: str) -> ApiError:
    return ApiError(
        400, f"{param}={describe_value(value)} is invalid: expected {expected}", param=param, code="invalid_value"
    )


def _expected(param: SamplingParam) -> str:
    limit = param.http
    assert limit is not None and limit.high is not None
    kind = "an integer" if limit.integer else "a number"
    return (
        f"{kind} in {'[' if limit.low_inclusive else '('}{limit.low}, "
        f"{limit.high}{']' if limit.high_inclusive else ')'}"
    )


def _number(body: dict[str, Any], param: SamplingParam) -> float | None:
    """``body[param.name]`` within the parameter's HTTP limit (:data:`SAMPLING_PARAMS`), as a float."""
    value = body.get(param.name)
    if value is None:
        return None
    assert param.http is not None
    if not is_number(value, finite=True):
        raise _bad(param.name, value, _expected(param))
    if not param.http.contains(value):
        raise _bad(param.name, value, _expected(param))
    return float(value)


def _integer(body: dict[str, Any], param: SamplingParam) -> int | None:
    """``body[param.name]`` within the parameter's HTTP limit (an integral float is read as an int), with
    the parameter's HTTP spellings read as what they mean (top_k -1 is 0)."""
    value = body.get(param.name)
    if value is None:
        return None
    assert param.http is not None
    if not is_integer(value):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(param.name, value, _expected(param))
    if not param.http.contains(value):
        raise _bad(param.name, value, _expected(param))
    return dict(param.http_aliases).get(value, value)


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(name, value, "a string")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", value, f"a string or a list of up to {MAX_STOP_SEQUENCES} strings")
    if len(items) > MAX_STOP_SEQUENCES or any(not s or len(s) > MAX_STOP_LENGTH for s in items):
        raise _bad("stop", value, f"up to {MAX_STOP_SEQUENCES} non-empty strings of at most {MAX_STOP_LENGTH} chars")
    return tuple(items)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise _bad("messages", value, f"a list of 1 to {MAX_MESSAGES} {{role, content}} objects")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(where, message, "an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", role, f"one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI's content parts: only text is meaningful here
            parts = []
            for part_index, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{part_index}]", part, 'a {"type": "text", "text": ...} part')
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", content, "a string or a list of text parts")
        messages.append({"role": role, "content": content})
    return messages


def _prompt(body: dict[str, Any]) -> str:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, list) and len(value) > 1:
        raise _bad("prompt", value, "one prompt per request (send several requests for several prompts)")
    if not isinstance(value, str):
        raise _bad("prompt", value, "a string")
    return value


def _routing_labels(body: dict[str, Any], headers: dict[str, str]) -> tuple[str | None, str | None]:
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata", metadata, "an object")
    metadata = metadata or {}
    labels = []
    for key, header in (("business_line", "x-business-line"), ("task", "x-task")):
        from_body = metadata.get(key)
        if from_body is not None and not isinstance(from_body, str):
            raise _bad(f"metadata.{key}", from_body, "a string")
        from_header = headers.get(header)
        if from_body is not None and from_header is not None and from_body != from_header:
            raise ApiError(
                400,
                f"metadata.{key}={from_body!r} contradicts header {header}={from_header!r}; "
                "send one, or the same value in both",
                param=f"metadata.{key}",
                code="conflict",
            )
        labels.append(from_header if from_header is not None else from_body)
    return labels[0], labels[1]


UNSUPPORTED = {
    "logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "echo": "echo",
    "best_of": "best_of",
    "suffix": "suffix",
    "tools": "tools",
    "functions": "functions",
    "logit_bias": "logit_bias",
}


def parse_generation_request(
    kind: Literal["completion", "chat"], body: dict[str, Any], headers: dict[str, str]
) -> GenerationRequest:
    """Validate one request; ``headers`` lower-cased."""
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, False, 0, [], {}) and not (name == "best_of" and value == 1):
            raise ApiError(
                400,
                f"{name}={describe_value(value)} is not supported by mla_watch",
                param=name,
                code="unsupported_parameter",
            )
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise ApiError(
                400,
                f"{name}={describe_value(value)} is not supported; use repetition_penalty",
                param=name,
                code="unsupported_parameter",
            )
    request = GenerationRequest(kind=kind, model=_string(body, "model"))
    if kind == "chat":
        request.messages = _messages(body)
    else:
        request.prompt = _prompt(body)
    params = SAMPLING_PARAMS
    sampling: dict[str, Any] = {  # in the order errors have always been reported
        name: (_integer if params[name].integer else _number)(body, params[name])
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "n")
    }
    max_tokens = _integer(body, params["max_tokens"])
    if kind == "chat":
        completion_tokens = _integer(body, params["max_completion_tokens"])
        if max_tokens is not None and completion_tokens is not None and max_tokens != completion_tokens:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} and max_completion_tokens={completion_tokens} disagree; send one",
                param="max_completion_tokens",
                code="conflict",
            )
        max_tokens = completion_tokens if completion_tokens is not None else max_tokens
    sampling["max_tokens"] = max_tokens
    request.sampling = {name: value for name, value in sampling.items() if value is not None}
    seed = body.get("seed")
    if seed is not None:
        request.seed = _integer(body, params["seed"])
    request.stop = _stop(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", stream, "true or false")
    request.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise _bad("stream_options", options, 'an object like {"include_usage": true}')
        request.include_usage = bool(options.get("include_usage", False))
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise _bad("return_routed_experts", routed, "true or false")
    request.return_routed_experts = routed
    request.business_line, request.task = _routing_labels(body, headers)
    return request
