"""The plain proxy hop (``serve --upstream URL`` without ``--engine``) and the decoding processes beside it.

An answer that carries no routing is checked and marked in the event loop's process: no decoding
process starts for it, which a process boundary would show. Decoding processes start when an answer
needs one (routing to count, an answer too long for the event loop), grow to ``--decode-workers``
under load and stop when idle. bench/proxy_hop.py measures what the hop costs.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from harness.canned_engine import GENERATED, engine_app
from harness.support import running_sidecar, serve_app
from mla_watch.engines.decoder import RoutingDecoder

HEADERS = {"X-Business-Line": "code_assistant", "X-Task": "code"}
LONG_TEXT = "w" * 100_000  # longer than the event loop reads (STRIP_ON_LOOP_BYTES)


def children() -> set[int]:
    """This process's child processes (a decoding process of a sidecar running here would be one)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == os.getpid():
                found.add(int(entry.name))
    return found


def stream(client: httpx.Client) -> list[bytes]:
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
    ) as answer:
        assert answer.status_code == 200
        raw = b"".join(answer.iter_bytes())
    return [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]


def test_plain_answers_without_routing_never_leave_the_event_loops_process(tmp_path) -> None:
    before = children()
    with (
        serve_app(engine_app("plain")) as engine,
        running_sidecar(upstream=engine, rules=None, window_tokens=None, state_dir=tmp_path) as (url, sidecar),
        httpx.Client(base_url=url, headers=HEADERS, timeout=30) as client,
    ):
        for _ in range(3):
            completion = client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": GENERATED})
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            events = stream(client)
            for answer in (completion, chat):
                assert answer.status_code == 200, answer.text
                assert answer.json()["mla_watch"]["policy"] == "code_assistant/code"
            assert completion.json()["choices"][0]["text"] == " tok" * GENERATED
            assert chat.json()["choices"][0]["message"]["content"] == " tok" * GENERATED
            assert events[-1] == b"[DONE]" and len(events) == GENERATED + 2
            assert b'"mla_watch"' in events[0] and all(b'"mla_watch"' not in event for event in events[1:])
        decoder = sidecar._upstream_side.decoder
        assert decoder.submitted == 0 and not decoder.running  # nothing was handed to a decoding process
        assert children() <= before  # and none was started
    assert not decoder.running


def long_engine() -> Starlette:
    """An engine whose answers are too long for the event loop: JSON, or (``prompt: html``) an HTML page."""

    async def complete(request: Request) -> Response:
        if (await request.json()).get("prompt") == "html":
            return Response(b"<html>" + b"x" * 100_000 + b"</html>", media_type="text/html")
        return Response(
            b'{"choices": [{"index": 0, "text": "' + LONG_TEXT.encode() + b'"}]}', media_type="application/json"
        )

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])


def test_a_long_plain_answer_is_read_in_a_decoding_process_started_for_it(tmp_path) -> None:
    before = children()
    with (
        serve_app(long_engine()) as engine,
        running_sidecar(upstream=engine, rules=None, window_tokens=None, state_dir=tmp_path) as (url, sidecar),
        httpx.Client(base_url=url, headers=HEADERS, timeout=60) as client,
    ):
        assert not sidecar._upstream_side.decoder.running  # nothing starts before an answer needs it
        answer = client.post("/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == LONG_TEXT and answer.json()["mla_watch"]["policy"]
        assert sidecar._upstream_side.decoder.submitted == 1 and children() - before
        refused = client.post("/v1/completions", json={"prompt": "html"})  # a long 200 that is no JSON: still a 502
        assert refused.status_code == 502 and "not a JSON object" in refused.json()["error"]["message"]
        assert sidecar._upstream_side.decoder.submitted == 2


# ---------------------------------------------------------------------- the decoding processes follow the load
def sleep_then_pid(seconds: bytes) -> int:
    """Run in a decoding process (by name: module level): hold it for a while, say which process it was."""
    time.sleep(float(seconds))
    return os.getpid()


def gone(pids: set[int], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_decoding_processes_start_with_work_grow_to_the_maximum_and_stop_when_idle() -> None:
    now = [0.0]
    decoder = RoutingDecoder(workers=2, idle_seconds=60, clock=lambda: now[0])

    async def scenario() -> None:
        assert not decoder.running and children() == before
        await decoder.offload(sleep_then_pid, b"0")
        assert len(await decoder.worker_pids()) == 1  # one answer at a time: one process
        # Three at once: a second process starts while the first is busy; never more than the maximum.
        await asyncio.gather(*(decoder.offload(sleep_then_pid, b"0.5") for _ in range(3)))
        pids = set(await decoder.worker_pids())
        assert len(pids) == 2 and pids <= children()
        now[0] += 59
        assert not decoder.retire_idle() and decoder.running  # not idle long enough
        now[0] += 2
        assert decoder.retire_idle() and not decoder.running
        assert gone(pids)
        again = await decoder.offload(sleep_then_pid, b"0")  # the next answer starts one again
        assert again not in pids and decoder.running

    before = children()
    try:
        asyncio.run(scenario())
    finally:
        decoder.close()


def test_an_idle_pool_stops_its_processes_on_its_own() -> None:
    decoder = RoutingDecoder(workers=1, idle_seconds=0.3)

    async def scenario() -> int:
        pid = await decoder.offload(sleep_then_pid, b"0")
        assert decoder.running
        deadline = time.monotonic() + 30  # the check due 0.3 s after the last answer runs on this loop
        while decoder.running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not decoder.running
        return pid

    try:
        pid = asyncio.run(scenario())
    finally:
        decoder.close()
    assert gone({pid})


@pytest.mark.parametrize("workers", [0, 1])
def test_a_decoder_never_used_starts_nothing(workers) -> None:
    before = children()
    decoder = RoutingDecoder(workers=workers)
    decoder.close()
    assert not decoder.running and decoder.submitted == 0 and children() <= before
