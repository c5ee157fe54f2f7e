"""What faces the engine behind the sidecar (``serve --upstream``), built from the configuration.

The proxy's client (:class:`~mla_watch.server.proxy.Upstream`) and the routing decoder it hands
answers to, SGLang's expert distribution recorder poller (``--sglang-recorder-dir``), and the
upstream's health check behind ``/readyz``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mla_watch.common.stop_budget import StopBudget
from mla_watch.engines.count_queue import Capture
from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.reading import reads_routing
from mla_watch.engines.recorder import RecorderPoller
from mla_watch.engines.watch import EngineRouting
from mla_watch.server.config import ServerConfig
from mla_watch.server.proxy import Upstream
from mla_watch.server.upstream_health import UpstreamHealth

__all__ = ["UpstreamSide", "build_upstream_side"]


@dataclass
class UpstreamSide:
    decoder: RoutingDecoder
    upstream: Upstream
    health: UpstreamHealth
    recorder: RecorderPoller | None

    def start(self) -> None:
        """Poll SGLang's recorder, and check the upstream's health on the running event loop."""
        if self.recorder is not None:
            self.recorder.start()
        self.health.start()  # /readyz: ready while the upstream answers

    async def close(self, budget: StopBudget | None = None) -> None:
        budget = budget or StopBudget()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.stop, budget.left())
        await self.health.close()
        # Before the decoder: what it still has to count needs it. Counts queued get their drain (2 s at most), then
        # are dropped and counted so.
        await self.upstream.close()
        self.decoder.close()


def build_upstream_side(config: ServerConfig, routing: EngineRouting | None, capture: Capture | None) -> UpstreamSide:
    """The parts for ``config.upstream``, none started; ``routing``: the engine's routers' windows (beside vLLM or
    SGLang), ``capture``: where the token ids of its answers go (``serve --capture``)."""
    assert config.upstream is not None  # the upstream side exists only with --upstream
    # Its processes start when an answer needs one: routing to count, or an answer too long for the event loop.
    decoder = RoutingDecoder(config.decode_workers)
    upstream = Upstream(
        config.upstream,
        config.request_timeout,
        decoder=decoder,
        routing=routing if reads_routing(config.engine) else None,
        max_bytes=config.upstream_max_bytes,
        max_line_bytes=config.upstream_max_line_bytes,
        credentials=config.upstream_credentials,
        replay=config.replay if config.replay.rate > 0 else None,
        count_queue_bytes=config.count_queue_bytes,
        capture=capture,
    )
    recorder = None
    if config.sglang_recorder_dir is not None:
        assert routing is not None  # a recorder's dumps are an engine's routing read (checked with the flags)
        recorder = RecorderPoller(
            config.sglang_recorder_dir,
            config.upstream,
            routing,
            interval=config.sglang_recorder_interval,
            buffer_size=config.sglang_recorder_buffer,
            settle_seconds=config.sglang_recorder_settle,
            credentials=config.upstream_credentials,
        )
    health = UpstreamHealth(
        config.upstream, credentials=config.upstream_credentials, interval=config.upstream_check_seconds
    )
    return UpstreamSide(decoder=decoder, upstream=upstream, health=health, recorder=recorder)
