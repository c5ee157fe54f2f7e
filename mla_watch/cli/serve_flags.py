"""Three of ``mla-watch serve``'s flag groups: beside an engine, the reference prompts and clients, the fleet.

Each function adds one group to the ``serve`` parser, at the place :func:`mla_watch.cli.serve.add_parser` calls it
(the order of ``--help``); the values become the sidecar's :class:`~mla_watch.server.config.ServerConfig` there.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mla_watch.cli.flags import (
    byte_size,
    client_id_sources,
    fleet_url,
    integer_in,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_share,
    share,
)
from mla_watch.engines.replay import ReplayBudget
from mla_watch.fleet.settings import FLEET_URL_ENV, FleetSettings
from mla_watch.references.prober import ReferenceSettings
from mla_watch.references.readers import MAX_ENGINE_PROMPT_TOKENS
from mla_watch.retune.jobs import ENGINE_RETUNE_MODES, RetentionPolicy
from mla_watch.routing.clients import DEFAULT_CLIENT_ID
from mla_watch.server.config import ENGINE_CHOICES, ServerConfig

__all__ = ["add_cause_flags", "add_engine_flags", "add_fleet_flags"]


def add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """The group of flags for a sidecar beside vLLM or SGLang: the engine, its answers' routing, its re-tuning."""
    beside = serve.add_argument_group("beside vLLM or SGLang (with --upstream; docs/engines.md)")
    beside.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default=ServerConfig.engine,
        help="read the routing the upstream returns in this engine's format; auto: ask its "
        "/v1/models (default %(default)s: read none)",
    )
    beside.add_argument(
        "--model-config",
        type=Path,
        help="the config.json the engine loaded, or its directory: where the MoE layers are",
    )
    beside.add_argument(
        "--decode-workers",
        type=non_negative_int,
        default=ServerConfig.decode_workers,
        help="processes decoding routing off the event loop, at most: started when an answer needs "
        "one, stopped after 60 s without work; 0: a thread (default %(default)s)",
    )
    beside.add_argument(
        "--count-queue-bytes",
        type=byte_size,
        default=ServerConfig.count_queue_bytes,
        help="engine answers waiting to have their routing counted, after the client has them; an "
        "answer that finds it full is not counted (default 256M)",
    )
    beside.add_argument(
        "--replay-rate",
        type=share,
        default=ReplayBudget.rate,
        help="the share of vLLM streams replayed to count their routing (vLLM puts none in a "
        "stream); 0: none (default %(default)s)",
    )
    beside.add_argument(
        "--replay-concurrency",
        type=positive_int,
        default=ReplayBudget.concurrency,
        help="stream replays sent to vLLM at once (default %(default)s)",
    )
    beside.add_argument(
        "--replay-tokens-per-second",
        type=non_negative_float,
        default=ReplayBudget.tokens_per_second,
        help="tokens replayed per second at most, all replays together; a stream past it is not "
        "counted; 0: no limit (default %(default)g)",
    )
    beside.add_argument(
        "--engine-retune",
        choices=ENGINE_RETUNE_MODES,
        default=ServerConfig.engine_retune,
        help="re-tune the engine's routers in place (vLLM: VLLM_SERVER_DEV_MODE=1, its port "
        "reachable by the sidecar only; --model-config in its checkpoint directory): propose "
        "pages on-call with the command that applies a candidate, apply swaps, gates and keeps or "
        'rolls back by itself; docs/retuning.md, "Inside a running engine" (default '
        f"{ServerConfig.engine_retune})",
    )
    beside.add_argument(
        "--engine-swap-dir",
        type=Path,
        help="where router checkpoints are written for the engine to load, at the same path in both "
        "containers (a shared volume; default STATE_DIR/engine-swaps)",
    )
    beside.add_argument(
        "--engine-gate-timeout",
        type=positive_float,
        default=ServerConfig.engine_gate_timeout,
        help="seconds a candidate may serve live traffic before its gate through the engine decides; "
        "past it the previous routers go back (default %(default)s)",
    )
    beside.add_argument(
        "--sglang-recorder-dir",
        type=Path,
        help="SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, shared with the engine: count all its traffic "
        "from the expert distribution recorder (--expert-distribution-recorder-mode stat)",
    )
    beside.add_argument(
        "--sglang-recorder-interval",
        type=positive_float,
        default=ServerConfig.sglang_recorder_interval,
        help="seconds between two recorder dumps (default %(default)s)",
    )
    beside.add_argument(
        "--sglang-recorder-buffer",
        type=positive_int,
        default=ServerConfig.sglang_recorder_buffer,
        help="the engine's --expert-distribution-recorder-buffer-size (default %(default)s)",
    )
    beside.add_argument(
        "--sglang-recorder-settle",
        type=non_negative_float,
        default=ServerConfig.sglang_recorder_settle,
        help="seconds a recorder dump that does not read whole must stay unchanged (size and mtime) "
        "before it is set aside as broken: a writer that stalls longer loses it "
        "(default %(default)s)",
    )


def add_cause_flags(serve: argparse.ArgumentParser) -> None:
    """The group of flags that tell traffic from the model: reference prompts, clients, router versions kept."""
    cause = serve.add_argument_group('traffic or model: reference prompts and clients (docs/alerting.md, "Causes")')
    cause.add_argument(
        "--reference-prompts",
        type=Path,
        default=ServerConfig.reference_prompts,
        metavar="DIR",
        help="directory of reference prompt files, one per business line and default.yaml (default: "
        "the shipped ones, references/)",
    )
    cause.add_argument(
        "--reference-interval",
        type=non_negative_float,
        default=ReferenceSettings.interval_seconds,
        metavar="SECONDS",
        help="read every set of reference prompts this often; 0: only when a routing "
        "alert goes pending (default %(default)s)",
    )
    cause.add_argument(
        "--reference-wait",
        type=non_negative_float,
        default=ReferenceSettings.wait_seconds,
        metavar="SECONDS",
        help="an alert due to fire waits at most this long for the reading that "
        "tells its cause, then fires as undetermined (default %(default)s)",
    )
    cause.add_argument(
        "--reference-tolerance",
        type=share,
        default=ReferenceSettings.tolerance_bits,
        metavar="BITS",
        help="Jensen-Shannon divergence of the reference routing from its healthy baseline beyond which "
        "the model changed (default %(default)s)",
    )
    cause.add_argument(
        "--reference-rate",
        type=positive_float,
        default=ReferenceSettings.rate,
        metavar="PER_SECOND",
        help="beside an engine: reference prompts sent a second at most (default %(default)s)",
    )
    cause.add_argument(
        "--reference-max-tokens",
        type=integer_in(16, MAX_ENGINE_PROMPT_TOKENS),
        default=ReferenceSettings.max_tokens,
        metavar="TOKENS",
        help="beside an engine: a reference prompt's tokens read at most, and how "
        "long the generated documents of a long set are (the model served "
        "here: its context) (default %(default)s)",
    )
    cause.add_argument(
        "--reference-long-interval",
        type=non_negative_float,
        default=ReferenceSettings.long_interval_seconds,
        metavar="SECONDS",
        help="read the long sets (long: true) this often; 0: at start and when an alert on far "
        "positions asks (default %(default)s)",
    )
    cause.add_argument(
        "--reference-long-share",
        type=positive_share,
        default=ReferenceSettings.long_share,
        metavar="SHARE",
        help="long sets take at most this share of the reader's time (the engine's prefill, or the "
        "model served here): after a reading of T seconds the next waits T x (1 / SHARE - 1) "
        "(default %(default)s)",
    )
    cause.add_argument(
        "--reference-priority",
        type=int,
        default=None,
        metavar="N",
        help="beside vLLM started with --scheduling-policy priority: the request priority of reference "
        "prompts (vLLM serves a lower value first, and clients send 0: a value above 0 lets "
        "clients go first); default: not sent (vLLM refuses it under its default policy)",
    )
    cause.add_argument(
        "--client-id",
        type=client_id_sources,
        default=DEFAULT_CLIENT_ID,
        metavar="SOURCES",
        help="who sent a request: the first of these it carries, comma-separated: header:NAME, user "
        "(the body's user field), api-key (a hash of the bearer key, never the key), remote "
        "(default %(default)s)",
    )
    cause.add_argument(
        "--capture-max-client-share",
        type=share,
        default=ServerConfig.capture_max_client_share,
        metavar="SHARE",
        help="with --capture: one client fills at most this share of a business "
        "line's captured samples (default %(default)s)",
    )
    cause.add_argument(
        "--router-versions-max",
        type=positive_int,
        default=RetentionPolicy.max_versions,
        metavar="N",
        help="router versions kept in STATE_DIR/routers; older ones nothing needs are deleted (default %(default)s)",
    )
    cause.add_argument(
        "--router-versions-max-bytes",
        type=byte_size,
        default=RetentionPolicy.max_bytes,
        metavar="BYTES",
        help="bytes of router versions kept (default %(default)s)",
    )


def add_fleet_flags(serve: argparse.ArgumentParser) -> None:
    """The group of flags of a fleet of sidecars repaired as one."""
    fleet = serve.add_argument_group('a fleet of sidecars repaired as one (docs/fleet.md, "Repairing a fleet")')
    fleet.add_argument(
        "--fleet",
        type=fleet_url,
        metavar="URL",
        default=os.environ.get(FLEET_URL_ENV) or None,
        help="join the fleet whose shared state lives in this PostgreSQL database "
        "(postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE; never logged): one re-tuning decision "
        "for the fleet, tried on one replica, then rolled out and checked on each (default: "
        f"${FLEET_URL_ENV}, which keeps a password out of process listings; none: no fleet)",
    )
    fleet.add_argument(
        "--fleet-name", metavar="NAME", help="this replica's name in the fleet (default: the host name and the port)"
    )
    fleet.add_argument(
        "--fleet-rollout-batch",
        type=positive_int,
        default=FleetSettings.rollout_batch,
        metavar="N",
        help="replicas taking a new router version at once (default %(default)s)",
    )
    fleet.add_argument(
        "--fleet-lease",
        type=positive_float,
        default=FleetSettings.lease_seconds,
        metavar="SECONDS",
        help="the fleet's re-tuning lease lasts this long past its holder's last renewal: a holder that "
        "stops is replaced after it (default %(default)s)",
    )
    fleet.add_argument(
        "--fleet-poll",
        type=positive_float,
        default=FleetSettings.poll_seconds,
        metavar="SECONDS",
        help="seconds between two rounds of a member (heartbeat, its rollout step, the lease; at most "
        "half of --fleet-lease) (default %(default)s)",
    )
