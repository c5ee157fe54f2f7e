"""The C heap's free pages go back to the system once a burst of large answers is counted."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from harness import processes
from mla_watch.engines.count_queue import CountQueue
from mla_watch.engines.formats import RoutingPlan, encode_vllm
from mla_watch.engines.watch import EngineMetrics, EngineRouting
from tests.test_engine_streams import GEOMETRY, SlowDecoder
from tests.vllm_twin import VllmTwin

GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc") if hasattr(os, "confstr") else False

# A burst as the proxy leaves it: answers of 1.3 MB freed, small blocks allocated between them still held.
BURST = r"""
import json
from mla_watch.common.heap import release_free_memory

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) >> 10

first = bytearray(2 << 20)
del first  # glibc now serves blocks of this size from the heap
before = rss()
answers, held = [], []
for index in range(200):
    answers.append(bytearray(1_300_000))
    held.append(bytearray(1000))
answers.clear()
freed = rss()
returned = release_free_memory()
print(json.dumps({"before": before, "freed": freed, "released": rss(), "returned": returned}))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim")
def test_the_heaps_free_pages_go_back_to_the_system() -> None:
    run = processes.run([sys.executable, "-c", BURST], capture_output=True, text=True, timeout=60, check=True)
    figures = json.loads(run.stdout)
    assert figures["freed"] - figures["before"] > 150  # MiB: 260 MB of answers freed, kept by glibc
    assert figures["returned"] is True
    assert figures["released"] - figures["before"] < 20


def test_the_count_queue_returns_free_pages_when_it_drains_after_enough_answers() -> None:
    from prometheus_client import CollectorRegistry

    releases: list[int] = []
    routed = encode_vllm(VllmTwin(GEOMETRY).routing([1, 2, 3]), GEOMETRY.num_experts)
    body = json.dumps({"choices": [{"index": 0, "text": "x", "routed_experts": routed}]}).encode()
    plan = RoutingPlan("vllm", GEOMETRY, keep=False)

    async def drained(queue: CountQueue, answers: int) -> None:
        for _ in range(answers):
            assert queue.submit("a", plan, body, streamed=False)
        while queue.queued:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the release runs in a thread after the last answer

    async def run() -> list[int]:
        routing = EngineRouting("vllm", GEOMETRY, EngineMetrics(CollectorRegistry()), window_tokens=None)
        decoder = SlowDecoder()
        decoder.release.set()
        queue = CountQueue(
            routing, decoder, release_after_bytes=3 * len(body), release=lambda: releases.append(1) or True
        )
        seen = []
        await drained(queue, 2)  # less than release_after_bytes has passed
        seen.append(len(releases))
        await drained(queue, 1)  # now enough: once, when the queue is empty
        seen.append(len(releases))
        await drained(queue, 2)  # counted afresh from the release
        seen.append(len(releases))
        await queue.close()
        assert routing.answers == 5
        return seen

    assert asyncio.run(run()) == [0, 1, 1]
