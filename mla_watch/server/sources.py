"""The hub of routing sources: the routers this sidecar serves (the local model's probe) or stands beside
(an engine's routing, read from its answers), and the workers that report theirs.

Everything that reads routing asks here: the metrics, alert evaluation, the history and the APIs share one
:class:`~mla_watch.windows.RoutingSnapshot`, computed once per change of the counts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.engines.geometry import load_geometry
from mla_watch.engines.reading import reads_routing
from mla_watch.engines.recorder import RECORDER_ENGINE
from mla_watch.engines.watch import UNATTRIBUTED_LINE, EngineMetrics, EngineRouting
from mla_watch.retune.jobs import ENGINE_RETUNE_MODES
from mla_watch.routing.baselines import Baselines
from mla_watch.routing.client_mix import ClientMix
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.ingest import RemoteRouting
from mla_watch.routing.windows import RouterStats, RouterWindows, RoutingSnapshot, take_snapshot
from mla_watch.server.config import ENGINE_CHOICES, SERVER_SETTINGS, ServerConfig
from mla_watch.server.requests import describe_value

if TYPE_CHECKING:
    from mla_watch.probe.probe import Probe
    from mla_watch.retune.service import RetuneService

__all__ = ["RoutingSources"]

log = logging.getLogger("mla_watch.server")


class RoutingSources:
    """The local model's windows (once it is loaded), the engine's (beside vLLM / SGLang) and the workers'.

    Holds the healthy baselines every window is judged against (STATE_DIR/baseline.json), and learns them from
    each new snapshot - with or without alert rules: Prometheus' copies of the rules relative to a baseline read
    the learned values from /metrics. ``learn_excluded`` gives the (router, line) series an alert is pending or
    firing on, never learned from; ``clients`` who sent each line's tokens through this sidecar: a window of its own
    routers is learned only where it is its line's traffic, not one client's (``Baselines.gate``).
    """

    def __init__(
        self,
        config: ServerConfig,
        registry: CollectorRegistry,
        baselines: Baselines,
        *,
        clock: Callable[[], float],
        learn_excluded: Callable[[], set[tuple[str, str]]] | None = None,
        clients: ClientShares | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.baselines = baselines
        self._learn_excluded = learn_excluded
        self.clients = clients
        self.probe: Probe | None = None  # once the local model is loaded
        self._snapshot: tuple[tuple, RoutingSnapshot] | None = None
        self._snapshot_lock = threading.Lock()
        self.remote = RemoteRouting(
            config.ingest_limits,
            window_tokens=config.window_tokens,
            window_seconds=config.window_seconds,
            clock=clock,
            baselines=baselines,
        )
        self.engine_routing = self._engine_routing(registry)  # beside vLLM / SGLang: their routers' windows

    def _engine_routing(self, registry: CollectorRegistry) -> EngineRouting | None:
        config = self.config
        if config.engine not in ENGINE_CHOICES:
            raise SettingsError(
                [SettingProblem("engine", repr(config.engine), f"one of {', '.join(ENGINE_CHOICES)}")],
                what=SERVER_SETTINGS,
            )
        if problems := config.replay.problems():  # the command line checks them; the Python API comes here
            raise SettingsError(problems, what=SERVER_SETTINGS)
        if config.engine_retune not in ENGINE_RETUNE_MODES:
            raise SettingsError(
                [
                    SettingProblem(
                        "engine_retune",
                        describe_value(config.engine_retune, 40),
                        f"one of {', '.join(ENGINE_RETUNE_MODES)}",
                    )
                ],
                what=SERVER_SETTINGS,
            )
        reading = reads_routing(config.engine) or config.sglang_recorder_dir is not None
        if not reading:
            return None
        field = "engine" if reads_routing(config.engine) else "sglang_recorder_dir"
        if not config.upstream:
            raise SettingsError(
                [
                    SettingProblem(
                        "upstream",
                        template=f"{{{field}}} reads an engine's routing: it needs {{upstream}} URL (the engine)",
                    )
                ],
                what=SERVER_SETTINGS,
            )
        if config.model_config is None:
            raise SettingsError(
                [
                    SettingProblem(
                        "model_config",
                        template=f"{{{field}}} needs {{model_config}}: the "
                        "config.json the engine loaded (or its directory), which says where "
                        "its MoE layers are",
                    )
                ],
                what=SERVER_SETTINGS,
            )
        geometry = load_geometry(config.model_config)  # GeometryError names the file and the key
        log.info("engine routers from %s: %s", config.model_config, geometry.describe())
        engine = config.engine if reads_routing(config.engine) else RECORDER_ENGINE
        return EngineRouting(
            engine,
            geometry,
            EngineMetrics(registry),
            window_tokens=config.window_tokens,
            window_seconds=config.window_seconds,
            clock=self.clock,
        )

    # ------------------------------------------------------------------ windows
    def own_windows(self) -> RouterWindows | None:
        """The windows of the routers this sidecar serves or stands beside (not the workers' that report)."""
        if self.probe is not None:
            self.probe.collect()
            return self.probe.windows
        if self.engine_routing is None:
            return None
        self.engine_routing.collect()
        return self.engine_routing.windows

    def windows(self) -> list[RouterWindows]:
        """Every source's windows, the local probe's counts collected first."""
        sources = []
        if self.probe is not None:
            self.probe.collect()  # safe beside a running forward: counts are read as deltas
            sources.append(self.probe.windows)
        if self.engine_routing is not None:
            self.engine_routing.collect()
            sources.append(self.engine_routing.windows)
        sources.extend(self.remote.windows())
        return sources

    def routing_snapshot(self) -> RoutingSnapshot:
        """Every router's statistics, per business line and summed: computed once per change of the
        counts, and shared by the metrics, alert evaluation, the history and the APIs."""
        sources = self.windows()  # collects the local probe's counts first
        self.baselines.save_again()  # a save the disk refused: made again once it has room, traffic or not
        key = tuple((windows.serial, windows.version) for windows in sources)
        with self._snapshot_lock:
            cached = self._snapshot
            # Windows bounded by age change with time alone: their snapshot lives one second.
            if (
                cached is not None
                and cached[0] == key
                and (self.config.window_seconds is None or self.clock() - cached[1].taken_at < 1.0)
            ):
                return cached[1]
            snapshot = take_snapshot(sources, self.clock())
            self._snapshot = (key, snapshot)
        # Learned now, carried by the next snapshot (the baselines' version is part of its key).
        self.baselines.learn(snapshot.records, excluded=self._learn_excluded, clients=self.window_clients())
        return snapshot

    def window_clients(self) -> Callable[[RouterStats], ClientMix | None]:
        """Whose tokens a record's window holds, where this sidecar sees them: its own routers' (the model's, the
        engine's), not the workers' that report their counts. For an indexer, the tokens that carry its signal:
        those of queries that saw at least 2 x index_topk keys (``RoutingStats.no_signal``)."""
        own = {
            info.name
            for windows in (
                self.probe.windows if self.probe is not None else None,
                self.engine_routing.windows if self.engine_routing is not None else None,
            )
            if windows is not None
            for info in windows.routers
        }
        mixes: dict[tuple[str | None, int], ClientMix | None] = {}

        def mix(record: RouterStats) -> ClientMix | None:
            if self.clients is None or record.router.name not in own:
                return None
            key = (record.business_line, 2 * record.router.top_k if record.router.kind == "indexer" else 0)
            if key not in mixes:
                mixes[key] = self.clients.mix(key[0], keys_seen=key[1])
            return mixes[key]

        return mix

    # ------------------------------------------------------------------ beside an engine
    def engine_routers(self) -> set[str]:
        return set(self.engine_routing.geometry.router_names) if self.engine_routing is not None else set()

    def engine_status(self, *, retune_note: str, counting: dict[str, Any] | None) -> dict[str, Any] | None:
        """The engine read beside (``engine`` of ``GET /v1/status``); ``None`` beside none."""
        routing = self.engine_routing
        if routing is None:
            return None
        return {
            "engine": routing.engine,
            "url": self.config.upstream,
            "routers": routing.geometry.describe(),
            "recorder_dir": str(self.config.sglang_recorder_dir) if self.config.sglang_recorder_dir else None,
            "unattributed_line": UNATTRIBUTED_LINE,
            "retune": retune_note,
            "problems": routing.problems(),
            "counting": counting,
        }

    # ------------------------------------------------------------------ healthy baselines
    def trust_baselines(self, retune: RetuneService | None) -> None:
        """Learn baselines only from routers known to be good: beside the model, the version served passed its
        start-up health check or a quality gate. Beside an engine (or workers) no health check runs before
        traffic: what is learned there is the first traffic no alert is pending or firing on."""
        if self.probe is None or retune is None:
            self.baselines.trust(None)
            return
        versions = retune.versions
        live = versions.live_version()
        if live is None:
            self.baselines.trust("no router version is recorded yet")
        elif versions.is_good(live):
            self.baselines.trust(None)
        else:
            health = versions.manifest(live).get("health") or {}
            self.baselines.trust(
                f"router version {live}, served now, is not known to be good "
                f"({health.get('reason') or 'no start-up health check passed'}); "
                "POST /admin/baseline sets the baselines by hand"
            )

    def save_baseline(self, business_line: str | None) -> dict[str, Any] | None:
        """The windows now become the healthy baselines of their series (``business_line``'s, or every
        line's and all lines summed), replacing what was learned; kept in STATE_DIR/baseline.json."""
        windows = self.own_windows()
        if windows is None:
            return None
        # windows.baselines is self.baselines, kept in STATE_DIR; each records whose traffic it was, as a learned one
        taken = windows.set_baselines(business_line, clients=self.window_clients())
        return {
            "path": str(self.baselines.path),
            "business_line": business_line,
            "routers": list(dict.fromkeys(baseline.router for baseline in taken)),
            "series": len(taken),
        }
