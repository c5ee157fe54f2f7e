"""Generated request bodies against the live server: nothing crashes it, every refusal says why."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**15), 10**15), st.floats(allow_nan=False), st.text(max_size=20)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "prompt",
    "messages",
    "model",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "metadata",
    "logprobs",
    "presence_penalty",
]
PLAUSIBLE = {
    "prompt": st.text(max_size=40),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": st.text(max_size=30)}
        ),
        max_size=3,
    ),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 100),
    "max_tokens": st.integers(-5, 5),
    "n": st.integers(-1, 5),
    "seed": st.integers(-5, 2**64),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)),
    "metadata": st.fixed_dictionaries(
        {
            "business_line": st.sampled_from(["code_assistant", "doc_summary", "x", ""]),
            "task": st.sampled_from(["code", "sql", "chat", "summarize", "nope"]),
        }
    ),
}
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6) | st.fixed_dictionaries(
    {}, optional={name: strategy for name, strategy in PLAUSIBLE.items()}
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=BODIES, chat=st.booleans())
def test_generated_bodies_never_take_the_server_down(sidecar, body, chat) -> None:
    url, _ = sidecar
    if body.get("stream") is True:
        body["stream"] = False  # a stream answers 200 before it could fail; the stream tests cover it
    for limit in ("max_tokens", "max_completion_tokens"):  # keep each example quick: at most 4 tokens
        if isinstance(body.get(limit), int) and body[limit] > 4:
            body[limit] = 4
    body.setdefault("max_tokens", 2)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(
        url + path, content=json.dumps(body), timeout=60, headers={"Content-Type": "application/json"}
    )
    assert response.status_code < 500, (body, response.text)
    document = response.json()
    if response.status_code == 200:
        assert document["choices"] and "mla_watch" in document
    else:
        error = document["error"]
        assert error["message"] and error["type"] and error["code"], document
        if error["param"] is not None and error["code"] == "invalid_value":
            assert error["param"].split("[")[0].split(".")[0] in error["message"]
    assert response.headers["X-MLA-Policy"]
