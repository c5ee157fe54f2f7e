"""Generated hostile input against a live sidecar (issue 11): ingestion bodies and read-endpoint query strings.

One sidecar in proxy mode (``upstream`` is a port nobody listens on, so no model loads) with
small :class:`IngestLimits`, so that generated requests reach every cap. Ingestion bodies are
near-valid snapshots with fields changed to huge, negative, float, boolean, string or nested
values, lists made longer or shorter or given a duplicate, unknown fields added, JSON nested
thousands deep, many business lines or sources at once, and arbitrary JSON or bytes. Query
strings of ``/v1/routing``, ``/v1/status`` and ``/v1/retune/jobs`` are arbitrary text, unicode,
raw percent sequences and long values.

After each example: every answer is 2xx or 4xx (``/v1/retune/jobs`` of a proxy: its documented
503), every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a message and,
for an ingestion 400, the field it is about; ``/metrics`` and ``/v1/routing`` still answer 200;
the remote windows stay within the caps; a read stores nothing; and, periodically and at the
end, the process's resident memory stays within a bound derived from the limits. A sidecar with
the bundled model then gets the same query strings, where ``/v1/retune/jobs`` reads ``limit``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.support import running_sidecar
from mla_watch.routing.ingest import IngestLimits

# Over 20 s: a request to an in-process sidecar takes ~45 ms here (harness.support.serve_app's socket is made
# with proto 0, so asyncio leaves Nagle's algorithm on and each answer waits for a delayed ACK).
pytestmark = pytest.mark.slow

TOKEN = "hardening-fuzz-token-0123456789"
LIMITS = IngestLimits(
    max_slots=4096,
    max_top_k=64,
    max_routers=8,
    max_sources=3,
    max_lines=4,
    max_window_slots=20_000,
    max_tokens=1 << 20,
    source_idle_seconds=2.0,
)
WINDOW_TOKENS = 64  # the sidecar's window_tokens: each window keeps at most this many + 1 buckets
EXAMPLES = 170
READ_EXAMPLES = 50  # the second test's, on a sidecar with the bundled model
WARM_UP_EXAMPLES = 30  # the RSS baseline is taken after these
RSS_CHECK_EVERY = 25

# The bound on what the generated requests may add to the resident set. The sidecar runs in this
# process (the test asserts on its RemoteRouting, which a subprocess would hide), so RSS is this
# process's VmRSS, read after gc and malloc_trim (freed memory the allocator keeps is not growth);
# the baseline is taken after a warm-up, once httpx, hypothesis and the allocator have grown to
# their working size, and the bound is what the limits let ingestion hold:
#   dense counts:   max_window_slots x 8 bytes (int64 per slot);
#   buckets:        each window keeps up to window_tokens + 1 deltas (each at least one token), a
#                   delta holding up to num_slots (slot, count) pairs of 16 bytes, so at most
#                   max_window_slots x (window_tokens + 1) x 16 bytes, plus ~512 bytes of objects
#                   per bucket; the caps do not count these (bench/attacks.py measures them with
#                   the default window of 4,096 tokens);
#   window objects: ~8 KiB each, at most sources x routers x lines of them;
#   a fixed margin: allocator slack after 1 MB bodies, and hypothesis' own bookkeeping (about
#                   20 KB per example; the same requests replayed 8 times grew the RSS 0.5 MiB).
# Per-request leaks too small for this bound (issue 11's 33 KB per GET) are measured per request
# by tests/test_reliability.py's attack replay; here a read must also leave no window behind.
MAX_WINDOWS = LIMITS.max_sources * LIMITS.max_routers * LIMITS.max_lines
RSS_BOUND_BYTES = (
    LIMITS.max_window_slots * 8
    + LIMITS.max_window_slots * (WINDOW_TOKENS + 1) * 16
    + MAX_WINDOWS * (WINDOW_TOKENS + 1) * 512
    + MAX_WINDOWS * 8192
    + 48 * 2**20
)

TRIED: Counter = Counter()
LIBC = ctypes.CDLL("libc.so.6")

# --------------------------------------------------------------------------- ingestion bodies

SOURCES = [f"worker-{i}" for i in range(5)]
MANY_SOURCES = [f"src-{i}" for i in range(30)]
LINES = ["code_assistant", "doc_summary", "customer_service", "sql", "line-e", "line-f"]
# Every source reports the same routers (a source's router set is fixed once it has reported).
ROUTERS = [
    {"name": "model.layers.1.mlp.gate", "layer": 1, "kind": "expert", "num_slots": 64, "top_k": 6},
    {"name": "model.layers.1.self_attn.indexer", "layer": 1, "kind": "indexer", "num_slots": 512, "top_k": 32},
    {"name": "wide.gate", "layer": 2, "kind": "expert", "num_slots": 4096, "top_k": 64},
]
INGEST_FIELDS = ("source", "routers", "deltas")
DEEP_MARK = "\u0000deep:"  # a string value replaced by JSON nested that deep when the body is encoded

WEIRD_NUMBERS = st.sampled_from(
    [
        0,
        1,
        -1,
        2**31,
        2**53 + 1,
        2**62,
        2**63 - 1,
        2**63,
        2**64,
        -(2**63),
        10**12,
        10**300,
        1.5,
        2.0,
        -0.0,
        1e308,
        1e-300,
        True,
        False,
        "3",
        "",
        "1e3",
        None,
    ]
)
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
DEEP = st.sampled_from([10, 500, 5_000, 50_000]).map(lambda depth: f"{DEEP_MARK}{depth}")
WEIRD_TEXT = st.one_of(
    st.sampled_from(["", " ", "a\n", "../etc", "w/gate", "x" * 300, "\u00e9", "\u4e00" * 70, "line\u0000", "<script>"]),
    st.text(max_size=30),
)
WEIRD_VALUES = st.one_of(
    WEIRD_NUMBERS,
    WEIRD_TEXT,
    JSON_VALUES,
    DEEP,
    st.lists(st.integers(-5, 70), max_size=12),
    st.lists(WEIRD_NUMBERS, max_size=4),
)
KEYS = st.sampled_from(
    [
        "source",
        "routers",
        "deltas",
        "router",
        "business_line",
        "slots",
        "counts",
        "tokens",
        "local_selections",
        "choice_selections",
        "name",
        "layer",
        "kind",
        "num_slots",
        "top_k",
        "priority",
        "extra",
    ]
) | st.text(max_size=8)


@st.composite
def valid_snapshots(draw: st.DrawFn, sources: list[str] = SOURCES) -> dict[str, Any]:
    """A body the sidecar accepts unless a cap is reached: counts within tokens x top_k."""
    deltas = []
    for _ in range(draw(st.integers(0, 4))):
        router = draw(st.sampled_from(ROUTERS))
        tokens = draw(st.integers(1, 40) | st.integers(1, LIMITS.max_tokens))
        slots = draw(st.lists(st.integers(0, router["num_slots"] - 1), unique=True, max_size=8))
        most = tokens * router["top_k"]
        counts = [draw(st.integers(0, most // max(1, len(slots)))) for _ in slots]
        choice = draw(st.integers(0, most))
        deltas.append(
            {
                "router": router["name"],
                "business_line": draw(st.sampled_from(LINES)),
                "slots": slots,
                "counts": counts,
                "tokens": tokens,
                "local_selections": draw(st.integers(0, choice)),
                "choice_selections": choice,
            }
        )
    return {"source": draw(st.sampled_from(sources)), "routers": ROUTERS, "deltas": deltas}


def key_paths(node: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a document, the document itself (``()``) first."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += key_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += key_paths(value, (*prefix, index))
    return found


def edited(document: dict[str, Any], edits: list[tuple[int, str, str, object]]) -> dict[str, Any]:
    """``document`` with each edit applied at the (index mod count)-th key path: set the value, delete the
    key, add a key to the object there, append to the list there, or repeat its first item."""
    document = json.loads(json.dumps(document))
    for index, how, key, value in edits:
        paths = key_paths(document)
        path = paths[index % len(paths)]
        parent: Any = None
        node: Any = document
        for step in path:
            parent, node = node, node[step]
        if how == "add" and isinstance(node, dict):
            node[key] = value
        elif how == "append" and isinstance(node, list):
            node.append(value)
        elif how == "repeat" and isinstance(node, list) and node:
            node.append(node[0])
        elif how == "set" and parent is not None:
            parent[path[-1]] = value
        elif how == "delete" and parent is not None:
            del parent[path[-1]]
    return document


EDITS = st.lists(
    st.tuples(
        st.integers(0, 500), st.sampled_from(["set", "set", "delete", "add", "append", "repeat"]), KEYS, WEIRD_VALUES
    ),
    min_size=1,
    max_size=3,
)
NEAR_VALID = st.builds(edited, valid_snapshots(), EDITS)
MANY_LINES = st.builds(
    lambda body, count: {
        **body,
        "deltas": [
            {"router": ROUTERS[0]["name"], "business_line": f"bulk-{i}", "slots": [0], "counts": [1], "tokens": 1}
            for i in range(count)
        ],
    },
    valid_snapshots(),
    st.integers(2, 400),
)
INGEST_BODIES = st.one_of(
    valid_snapshots(),
    NEAR_VALID,
    NEAR_VALID,
    NEAR_VALID,
    valid_snapshots(MANY_SOURCES),
    MANY_LINES,
    st.dictionaries(st.sampled_from([*INGEST_FIELDS, "priority"]), WEIRD_VALUES, max_size=4),
    JSON_VALUES,
    st.binary(max_size=64),
    st.builds(lambda body, size: {**body, "source": "x" * size}, valid_snapshots(), st.just(1_100_000)),
)
AUTHORISATION = st.sampled_from(["good"] * 12 + ["missing", "wrong", "no scheme"])


def encode(body: object) -> bytes:
    """The request body: raw bytes as they are, JSON otherwise (with :data:`DEEP_MARK` strings nested)."""
    if isinstance(body, bytes):
        return body
    text = json.dumps(body)
    mark = '"' + json.dumps(DEEP_MARK)[1:-1]  # how the mark starts a string in the JSON text
    while mark in text:
        start = text.index(mark)
        end = text.index('"', start + 1)
        depth = int(text[start + len(mark) : end])
        text = text[:start] + "[" * depth + "]" * depth + text[end + 1 :]
    return text.encode()


def headers_for(authorisation: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if authorisation == "good":
        headers["Authorization"] = f"Bearer {TOKEN}"
    elif authorisation == "wrong":
        headers["Authorization"] = f"Bearer {TOKEN[:-1]}x"
    elif authorisation == "no scheme":
        headers["Authorization"] = TOKEN
    return headers


def parsed_object(content: bytes) -> dict[str, Any] | None:
    """The body as the sidecar should read it: a JSON object, or None."""
    try:
        value = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --------------------------------------------------------------------------- query strings

READ_PATHS = {"/v1/routing": "business_line", "/v1/status": "since", "/v1/retune/jobs": "limit"}
QUERY_VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            "code_assistant",
            "all",
            "1",
            "0",
            "-1",
            "1000",
            "1001",
            "nan",
            "inf",
            "-1e309",
            "1e999",
            "0x10",
            "\u0661\u0662\u0663",
            "\u00b2",
            "9" * 5000,
            "1" * 400,
            "%",
            "%zz",
            "%ff%fe",
            "a\nb",
            "line-e",
            "\u202e",
            "\ufeff1",
        ]
    ),
    st.text(max_size=80),
    st.builds(
        lambda char, count: char * count,
        st.sampled_from(["a", "9", "\u00e9", "\u4e00", "%", "&", "="]),
        st.integers(60, 3000),
    ),
)
RAW_QUERIES = st.text(alphabet=st.sampled_from(list("%&=+;?/ azAZ09\u00e9\u4e00\n")), max_size=60)
MAX_URL_QUERY = 7000  # the server's request line stays under h11's 16 KB limit (a refusal by uvicorn, not the app)


@st.composite
def read_requests(draw: st.DrawFn) -> tuple[str, str]:
    """A read endpoint and its encoded query string: its own parameter (maybe twice), or a raw one."""
    path = draw(st.sampled_from(sorted(READ_PATHS)))
    if draw(st.integers(0, 4)) == 0:
        query = quote(draw(RAW_QUERIES), safe="%&=+;/?")
    else:
        values = draw(st.lists(QUERY_VALUES, min_size=1, max_size=2))
        # as it is (raw percent sequences kept) or encoded
        query = "&".join(
            f"{READ_PATHS[path]}=" + quote(value, safe="%" if draw(st.booleans()) else "") for value in values
        )
    return path, query[:MAX_URL_QUERY]


# --------------------------------------------------------------------------- checks


def rss_bytes() -> int:
    gc.collect()
    LIBC.malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a refusal, checked for shape."""
    document = response.json()
    assert set(document) == {"error"}, response.text[:300]
    error = document["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def check_ingestion(response: httpx.Response, content: bytes, authorisation: str) -> None:
    status = response.status_code
    TRIED[f"ingestion {status}"] += 1
    assert 200 <= status < 500, (status, response.text[:300], content[:300])
    assert (status == 401) == (authorisation != "good"), (status, authorisation, response.text[:300])
    if status < 300:
        assert response.json() == {"ok": True}
        return
    error = error_of(response)
    body = parsed_object(content)
    if status == 400:
        if body is None:  # not a JSON object: there is no field to name
            assert error["code"] == "invalid_json" and error["param"] is None, error
            return
        param = error["param"]  # a field of the snapshot, or an unknown key of the request as sent ("" included)
        assert isinstance(param, str), (error, content[:300])
        assert param.split(".")[0].split("[")[0] in INGEST_FIELDS or param in body, (error, sorted(body))
    elif status == 409:
        assert error["param"] == "routers" and error["code"] == "conflict", error
    elif status == 413:
        assert error["code"] == "body_too_large" and len(content) > 1_000_000, error
    elif status == 429:
        assert error["param"] in ("source", "deltas", "deltas.business_line"), error
    else:
        assert status == 401, (status, error)


def check_read(response: httpx.Response, path: str, local_model: bool) -> None:
    status = response.status_code
    TRIED[f"{path} {status}"] += 1
    if path == "/v1/retune/jobs" and not local_model:  # re-tuning needs a local model: documented 503
        assert status == 503 and error_of(response)["code"] == "retune_unavailable", response.text[:300]
        return
    assert 200 <= status < 500, (path, status, response.text[:300])
    if status >= 400:
        error = error_of(response)
        assert error["param"] == READ_PATHS[path], error
        assert status in ((400, 404) if path == "/v1/routing" else (400,)), (path, status, error)


def remote_state(sidecar: Any) -> set[tuple[int, str]]:
    """Which (source windows, business line) the remote routing holds."""
    return {(index, line) for index, windows in enumerate(sidecar.remote.windows()) for line in windows.business_lines}


def check_monitoring(client: httpx.Client, sidecar: Any) -> None:
    assert client.get("/metrics").status_code == 200
    routing = client.get("/v1/routing")
    assert routing.status_code == 200, routing.text[:300]
    remote = sidecar.remote
    assert remote.window_slots <= LIMITS.max_window_slots
    assert len(remote.business_lines) <= LIMITS.max_lines
    assert len(remote.windows()) <= LIMITS.max_sources


def server_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Errors the sidecar logged (an unhandled exception in a request shows as uvicorn.error)."""
    return [
        record.getMessage()[:300]
        for record in caplog.records
        if record.levelno >= logging.ERROR and record.name.startswith(("mla_watch", "uvicorn"))
    ]


# --------------------------------------------------------------------------- the tests


def test_generated_ingestion_and_query_strings_get_documented_answers_within_bounded_memory(caplog) -> None:
    caplog.set_level(logging.ERROR)
    with (
        running_sidecar(
            upstream="http://127.0.0.1:9",
            admin_token=TOKEN,
            ingest_limits=LIMITS,
            window_tokens=WINDOW_TOKENS,
            history_interval_seconds=0.5,
            history_span_seconds=10.0,
            alert_interval=0.5,
            body_timeout_seconds=5.0,
        ) as (url, sidecar),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        rss: dict[str, int] = {}
        examples = [0]
        failed: list[int] = []

        def check_rss() -> None:
            now = rss_bytes()
            rss["peak"] = max(rss.get("peak", 0), now)
            assert now - rss["baseline"] <= RSS_BOUND_BYTES, (
                f"RSS grew {(now - rss['baseline']) / 2**20:.1f} MiB after {examples[0]} examples; bound "
                f"{RSS_BOUND_BYTES / 2**20:.1f} MiB"
            )

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        )
        @given(ingestion=st.tuples(INGEST_BODIES, AUTHORISATION), reads=st.lists(read_requests(), max_size=3))
        def ingest_and_read(ingestion: tuple[object, str], reads: list[tuple[str, str]]) -> None:
            examples[0] += 1
            try:
                send(ingestion, reads)
            except BaseException:
                failed.append(examples[0])  # while hypothesis shrinks a failure, RSS says nothing about the sidecar
                raise
            if examples[0] == WARM_UP_EXAMPLES:
                rss["baseline"] = rss_bytes()
            elif examples[0] > WARM_UP_EXAMPLES and examples[0] % RSS_CHECK_EVERY == 0 and not failed:
                check_rss()

        def send(ingestion: tuple[object, str], reads: list[tuple[str, str]]) -> None:
            body, authorisation = ingestion
            content = encode(body)
            response = client.post("/v1/routing/ingest", content=content, headers=headers_for(authorisation))
            check_ingestion(response, content, authorisation)
            held = remote_state(sidecar)
            for path, query in reads:
                check_read(client.get(f"{path}?{query}"), path, local_model=False)
            assert remote_state(sidecar) == held, "a read created a window"
            check_monitoring(client, sidecar)

        ingest_and_read()
        check_rss()
        print(
            f"\n{examples[0]} examples; RSS {rss['baseline'] / 2**20:.0f} MiB after the warm-up, peak "
            f"{rss['peak'] / 2**20:.0f} MiB (bound +{RSS_BOUND_BYTES / 2**20:.0f} MiB); remote windows hold "
            f"{sidecar.remote.window_slots} of {LIMITS.max_window_slots} slots, lines "
            f"{sorted(sidecar.remote.business_lines)}; answers: "
            + ", ".join(f"{count} x {kind}" for kind, count in sorted(TRIED.items()))
        )
    assert server_errors(caplog) == []


def test_generated_query_strings_on_a_sidecar_with_a_local_model_get_documented_answers(caplog, tmp_path) -> None:
    """``/v1/retune/jobs`` reads ``limit`` only where there is a local model to re-tune: the same query
    strings against the bundled model."""
    caplog.set_level(logging.ERROR)
    with (
        running_sidecar(admin_token=TOKEN, attn_implementation="eager", state_dir=tmp_path / "state") as (url, sidecar),
        httpx.Client(base_url=url, timeout=60) as client,
    ):

        @settings(
            max_examples=READ_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(reads=st.lists(read_requests(), min_size=1, max_size=4))
        @example(reads=[("/v1/retune/jobs", "limit=" + quote("\u00b2"))])  # str.isdigit() but not int()
        @example(reads=[("/v1/retune/jobs", "limit=" + "9" * 5000)])  # past int()'s 4,300 digits
        @example(reads=[("/v1/retune/jobs", "limit=" + quote("\u0661\u0662"))])  # Arabic-Indic digits
        @example(reads=[("/v1/status", "since=1e999"), ("/v1/routing", "business_line=" + "x" * 100)])
        def example_reads(reads: list[tuple[str, str]]) -> None:
            held = remote_state(sidecar), set(sidecar.probe.windows.business_lines)
            for path, query in reads:
                check_read(client.get(f"{path}?{query}"), path, local_model=True)
            assert (remote_state(sidecar), set(sidecar.probe.windows.business_lines)) == held, "a read created a window"
            check_monitoring(client, sidecar)

        example_reads()
    assert server_errors(caplog) == []
