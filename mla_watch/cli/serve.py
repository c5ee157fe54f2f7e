"""``mla-watch serve``: its flags, and the sidecar built from them and served.

The flag values are checked before anything loads, binds or logs (:mod:`mla_watch.cli.startup`);
they become one :class:`~mla_watch.server.config.ServerConfig`.
Three of its flag groups (beside an engine, reference prompts and clients, the fleet) are added by
:mod:`mla_watch.cli.serve_flags`.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from mla_watch.cli.flags import (
    DOCS,
    byte_size,
    expert_selection,
    history_retention,
    non_negative_float,
    parse_options,
    perplexity_margin,
    positive_float,
    positive_int,
    share,
    tcp_port,
    upstream_url,
)
from mla_watch.cli.logs import LOG_LEVELS, configure_logging
from mla_watch.cli.serve_flags import add_cause_flags, add_engine_flags, add_fleet_flags
from mla_watch.cli.setting_flags import flag_of, flag_text
from mla_watch.cli.startup import FlagError
from mla_watch.common.setting_errors import SettingsError
from mla_watch.common.stop_budget import CONNECTIONS_SECONDS
from mla_watch.engines.replay import ReplayBudget
from mla_watch.references.prober import ReferenceSettings
from mla_watch.retune.jobs import RetentionPolicy, RetuneSettings
from mla_watch.routing.client_mix import ClientGate
from mla_watch.routing.ingest import INGEST_FLAGS, IngestLimits
from mla_watch.routing.series import EXPERT_OVERFLOW_SELECTIONS, EXPERT_WINDOW_SELECTIONS, EXPERT_WINDOW_TOKENS
from mla_watch.server.config import ServerConfig
from mla_watch.server.expert_counts import BUDGET_FLAG, EXPORT_FLAG, SELECTION_FORM

__all__ = ["add_parser"]


def _cmd_serve(args: argparse.Namespace) -> int:
    from mla_watch.cli.startup import (
        bind_listener,
        check_serve_flags,
        default_public_url,
        end_abandoned_work,
        held_logs,
        one_thread_for_the_bundled_model,
        run_server,
    )

    check_serve_flags(args)  # before anything loads, binds or logs: a bad value is one line, exit 2
    from mla_watch.server.app import build_sidecar

    configure_logging(args.log_level)  # the libraries' own lines (every engine call, every request) at debug only
    # The model thread and the event loop hand work to each other; Python's default 5 ms GIL
    # switch interval would add up to that much latency to every handoff.
    sys.setswitchinterval(0.0005)

    try:
        retune = RetuneSettings(
            cooldown_seconds=args.retune_cooldown,
            command=args.retune_command,
            max_perplexity_increase=args.max_perplexity_increase,
            gate_confidence=args.gate_confidence,
            min_held_out_tokens=args.min_held_out_tokens,
            retry_seconds=args.retune_retry,
            max_wait_seconds=args.retune_max_wait,
            min_samples=args.retune_min_samples,
            min_held_out_samples=args.min_held_out_samples,
            strategy_options=parse_options(args.retune_option, "--retune-option"),
        )
        for name, options in retune.strategy_options.items():
            from mla_watch.retune.strategies import get_strategy  # only when options are given

            get_strategy(name).parse_options(options, f"--retune-option {name}")
        ingest_limits = IngestLimits(**{name: getattr(args, "ingest_" + name) for name in INGEST_FLAGS})
        if gate_problems := ClientGate(args.baseline_max_client_share, args.baseline_min_clients).problems():
            raise SettingsError(gate_problems)
        if args.history_interval > args.history_span:
            raise ValueError(
                f"--history-interval {args.history_interval!r}: expected at most --history-span ({args.history_span!r})"
            )
    except ValueError as error:
        raise FlagError(flag_text(error)) from error
    fleet = None
    if args.fleet is not None:
        from mla_watch.fleet.settings import FleetSettings

        fleet = FleetSettings(
            url=args.fleet,
            name=args.fleet_name or f"{socket.gethostname()}:{args.port}",
            rollout_batch=args.fleet_rollout_batch,
            lease_seconds=args.fleet_lease,
            poll_seconds=args.fleet_poll,
        )
        problems = fleet.problems()
        if problems:
            raise FlagError(_fleet_flag(problems[0]))
    # --port 0: bound first, so that the status page's URL (in alerts) has the port; any other port once the
    # sidecar is built: a setting it refuses is said whether or not the port is free.
    sock = bind_listener(args.host, args.port) if args.port == 0 else None
    port = args.port if sock is None else sock.getsockname()[1]
    config = ServerConfig(
        model=args.model,
        device=args.device,
        policies=args.policies,
        rules=args.rules,
        state_dir=args.state_dir,
        dataset_dir=args.dataset_dir,
        public_url=args.public_url or default_public_url(args.host, port),
        upstream=args.upstream,
        upstream_max_bytes=args.upstream_max_bytes,
        upstream_max_line_bytes=args.upstream_max_line_bytes,
        attn_implementation=args.attn_implementation,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        capture=args.capture,
        capture_max_samples=args.capture_max_samples,
        capture_max_age_seconds=args.capture_max_age,
        retune=retune,
        reference_model=args.reference_model,
        history_interval_seconds=args.history_interval,
        history_span_seconds=args.history_span,
        history_retention_days=args.history_retention,
        history_max_series=args.history_max_series,
        ingest_limits=ingest_limits,
        body_timeout_seconds=args.body_timeout,
        engine=args.engine,
        model_config=args.model_config,
        decode_workers=args.decode_workers,
        count_queue_bytes=args.count_queue_bytes,
        replay=ReplayBudget(
            rate=args.replay_rate, concurrency=args.replay_concurrency, tokens_per_second=args.replay_tokens_per_second
        ),
        sglang_recorder_dir=args.sglang_recorder_dir,
        sglang_recorder_interval=args.sglang_recorder_interval,
        sglang_recorder_buffer=args.sglang_recorder_buffer,
        sglang_recorder_settle=args.sglang_recorder_settle,
        engine_retune=args.engine_retune,
        engine_swap_dir=args.engine_swap_dir,
        engine_gate_timeout=args.engine_gate_timeout,
        return_routed_experts=args.return_routed_experts,
        routing_by_position=not args.no_routing_by_position,
        position_metrics=args.position_metrics,
        alert_interval=args.alert_interval,
        baseline_tokens=args.baseline_tokens,
        baseline_max_client_share=args.baseline_max_client_share,
        baseline_min_clients=args.baseline_min_clients,
        export_expert_counts=args.export_expert_counts,
        expert_series_budget=args.expert_series_budget,
        reference_prompts=args.reference_prompts,
        reference=ReferenceSettings(
            interval_seconds=args.reference_interval,
            wait_seconds=args.reference_wait,
            tolerance_bits=args.reference_tolerance,
            rate=args.reference_rate,
            max_tokens=args.reference_max_tokens,
            long_interval_seconds=args.reference_long_interval,
            long_share=args.reference_long_share,
            priority=args.reference_priority,
        ),
        client_id=args.client_id,
        capture_max_client_share=args.capture_max_client_share,
        router_versions=RetentionPolicy(
            max_versions=args.router_versions_max, max_bytes=args.router_versions_max_bytes
        ),
        fleet=fleet,
    )
    with held_logs():  # what building it logs shows once the port is this server's; a port in use: one line
        # every configuration file judged here, before the model loads (at start)
        sidecar = build_sidecar(config, name_field=flag_of)
        if sock is None:
            sock = bind_listener(args.host, args.port)  # before the app starts, which logs the status page's URL
    if not args.upstream:  # after the configuration is judged: this imports torch, which takes seconds
        one_thread_for_the_bundled_model(args.model, args.device)
    # SIGTERM to the process's end within STOP_SECONDS: requests in flight get CONNECTIONS_SECONDS, the sidecar's
    # parts PARTS_SECONDS (mla_watch.common.stop_budget).
    run_server(
        sidecar.app,
        sock,
        host=args.host,
        port=port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=CONNECTIONS_SECONDS,
    )
    end_abandoned_work()
    return 0


_FLEET_FLAGS = {
    "url": "--fleet",
    "name": "--fleet-name",
    "rollout_batch": "--fleet-rollout-batch",
    "lease_seconds": "--fleet-lease",
    "poll_seconds": "--fleet-poll",
}


def _fleet_flag(problem: str) -> str:
    """A fleet setting's problem (``field ...``) worded by its flag."""
    field, _, rest = problem.partition(" ")
    return f"{_FLEET_FLAGS.get(field.rstrip(':'), field)}{':' if field.endswith(':') else ''} {rest}"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` subcommand."""
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API with policies enforced and routers watched",
        epilog=f"The manual: {DOCS}serving.md; every flag: {DOCS}operations.md; what serve "
        f"prints while it starts: {DOCS}first-hour.md",
    )
    serve.add_argument("--model", default=ServerConfig.model, help="'bundled' or a save_pretrained directory")
    serve.add_argument("--device", default=ServerConfig.device, help="auto | cpu | cuda | cuda:N")
    serve.add_argument("--policies", type=Path, default=ServerConfig.policies, help="directory of policy YAML files")
    serve.add_argument("--rules", type=Path, default=ServerConfig.rules, help="directory of alert rule YAML files")
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=ServerConfig.state_dir,
        help="alert state and the notification outbox (default ./mla-watch-state)",
    )
    serve.add_argument(
        "--dataset-dir",
        type=Path,
        default=None,
        help="the only directory re-tune jobs from the admin API read JSONL datasets from, named by "
        "bare file name (default STATE_DIR/datasets; created 0700)",
    )
    serve.add_argument("--public-url", help="the URL on-call uses to reach this sidecar (links in alerts)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=tcp_port, default=8000, help="the TCP port to listen on; 0: any free one")
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the least severe log line printed; the libraries' own lines (each request the HTTP "
        "client sends to the engine, each request answered) only at debug, else their warnings",
    )
    serve.add_argument(
        "--upstream",
        type=upstream_url,
        help="forward generation to this OpenAI-compatible server instead (user:password@ in it is "
        "sent as basic auth and never shown)",
    )
    serve.add_argument(
        "--upstream-max-bytes",
        type=byte_size,
        default=ServerConfig.upstream_max_bytes,
        help="the largest upstream answer, or line of its stream, read after decompression; a larger "
        "one is a 502 (default 512M: DeepSeek-V3's routing at its whole context)",
    )
    serve.add_argument(
        "--upstream-max-line-bytes",
        type=byte_size,
        default=ServerConfig.upstream_max_line_bytes,
        help="the longest line of an upstream stream that carries no routing (a line with routing "
        "may reach --upstream-max-bytes); a longer one ends the stream with an error event "
        "(default 16M)",
    )
    add_engine_flags(serve)
    serve.add_argument(
        "--return-routed-experts",
        action="store_true",
        help="answer with the model's routing per token, in vLLM's and SGLang's fields",
    )
    serve.add_argument(
        "--no-routing-by-position",
        action="store_true",
        help="do not count the embedded model's expert routing per position bucket (on by default: "
        "the long-context drift of each router and line)",
    )
    serve.add_argument(
        "--position-metrics",
        action="store_true",
        help="export routing by position bucket on /metrics (routing_position_tokens and "
        "routing_position_js_divergence: routers x lines x buckets series each)",
    )
    serve.add_argument(
        "--attn-implementation",
        default=ServerConfig.attn_implementation,
        help="attention to serve with, if the start-up self-test agrees with eager (default sdpa)",
    )
    serve.add_argument(
        "--max-queue",
        type=positive_int,
        default=ServerConfig.max_queue,
        help="requests queued for the model before 429",
    )
    serve.add_argument(
        "--request-timeout",
        type=positive_float,
        default=ServerConfig.request_timeout,
        help="seconds per request, queue included; with --upstream, for the whole answer (a stream: "
        "its headers, then each line)",
    )
    serve.add_argument(
        "--capture",
        action="store_true",
        help="record recent traffic (token ids) per business line in STATE_DIR for re-tuning",
    )
    serve.add_argument(
        "--capture-max-samples",
        type=positive_int,
        default=ServerConfig.capture_max_samples,
        help="captured samples kept per line",
    )
    serve.add_argument(
        "--capture-max-age",
        type=positive_float,
        default=ServerConfig.capture_max_age_seconds,
        help="seconds a capture is kept",
    )
    serve.add_argument(
        "--retune-command",
        help='run re-tuning fits with this external command template (docs/retuning.md, "Beyond one machine")',
    )
    serve.add_argument(
        "--retune-cooldown",
        type=non_negative_float,
        default=RetuneSettings.cooldown_seconds,
        help="seconds between two re-tune jobs of one router (default %(default)s)",
    )
    serve.add_argument(
        "--max-perplexity-increase",
        type=perplexity_margin,
        default=RetuneSettings.max_perplexity_increase,
        help="quality gate: how much worse than the live model a candidate's perplexity may be, "
        "relative (2%%) or absolute (0.3) (default %(default)s)",
    )
    serve.add_argument(
        "--gate-confidence",
        type=float,
        default=RetuneSettings.gate_confidence,
        help="quality gate: one-sided confidence of a pass or a rejection (default %(default)s)",
    )
    serve.add_argument(
        "--min-held-out-tokens",
        type=positive_int,
        default=RetuneSettings.min_held_out_tokens,
        help="quality gate: scored held-out tokens below which it does not decide; the job waits "
        "for more captured traffic (default %(default)s)",
    )
    serve.add_argument(
        "--retune-retry",
        type=positive_float,
        default=RetuneSettings.retry_seconds,
        help="seconds between two tries of a re-tune job waiting for data (default %(default)s)",
    )
    serve.add_argument(
        "--retune-max-wait",
        type=non_negative_float,
        default=RetuneSettings.max_wait_seconds,
        help="seconds a re-tune job may wait for data before it fails (default %(default)s)",
    )
    serve.add_argument(
        "--reference-model",
        type=Path,
        help="the checkpoint the served model came from: `restore` puts its router tensors back (only those are read)",
    )
    serve.add_argument(
        "--retune-option",
        action="append",
        default=[],
        help="default strategy option, STRATEGY.NAME=VALUE (repeat), e.g. router_finetune.lr=1e-3",
    )
    serve.add_argument(
        "--min-held-out-samples",
        type=positive_int,
        default=RetuneSettings.min_held_out_samples,
        help="quality gate: distinct held-out texts below which it does not decide (a prompt repeated "
        "counts once) (default %(default)s)",
    )
    serve.add_argument(
        "--retune-min-samples",
        type=positive_int,
        default=RetuneSettings.min_samples,
        help="samples a re-tune job needs at least (default %(default)s)",
    )
    serve.add_argument(
        "--alert-interval",
        type=positive_float,
        default=ServerConfig.alert_interval,
        help="seconds between two evaluations of the alert rules (default %(default)s)",
    )
    serve.add_argument(
        "--baseline-tokens",
        type=positive_int,
        default=ServerConfig.baseline_tokens,
        help="tokens a router's window of one business line holds before it is learned as that "
        "line's healthy baseline (once the routers served passed their health check; "
        "default %(default)s)",
    )
    serve.add_argument(
        "--baseline-max-client-share",
        type=share,
        default=ServerConfig.baseline_max_client_share,
        metavar="SHARE",
        help="a window is learned as a healthy baseline only if no client sent more "
        "than this share of its tokens (of an indexer's, those that carry its "
        "signal) (default %(default)s)",
    )
    serve.add_argument(
        "--baseline-min-clients",
        type=positive_int,
        default=ServerConfig.baseline_min_clients,
        metavar="N",
        help="a window is learned as a healthy baseline only if at least this many "
        "clients sent its tokens (default %(default)s)",
    )
    serve.add_argument(
        "--history-interval",
        type=positive_float,
        default=ServerConfig.history_interval_seconds,
        help="status page: seconds between two points of the entropy heat map (default %(default)s)",
    )
    serve.add_argument(
        "--history-span",
        type=positive_float,
        default=ServerConfig.history_span_seconds,
        help="status page: seconds of entropy history kept (default %(default)s)",
    )
    serve.add_argument(
        "--history-retention",
        type=history_retention,
        default=ServerConfig.history_retention_days,
        help="days of routing history kept in STATE_DIR/history.sqlite (1-minute points for a day, "
        "15-minute ones beyond; 1 to 365, 0: none; docs/status-page.md) (default %(default)s)",
    )
    serve.add_argument(
        "--history-max-series",
        type=positive_int,
        default=ServerConfig.history_max_series,
        help="(router, business line) series the routing history keeps, the status page's hour included "
        "(default %(default)s)",
    )
    serve.add_argument(
        EXPORT_FLAG,
        type=expert_selection,
        metavar="SELECTION",
        help="export each window's per-expert counts, which Prometheus can sum across replicas "
        f"({EXPERT_WINDOW_SELECTIONS}, {EXPERT_WINDOW_TOKENS}) for the expert "
        f"routers and business lines chosen: {SELECTION_FORM.replace('%', '%%')}; "
        "docs/fleet.md; default: none",
    )
    serve.add_argument(
        BUDGET_FLAG,
        type=positive_int,
        default=ServerConfig.expert_series_budget,
        metavar="N",
        help=f"the most per-expert series {EXPORT_FLAG} exports, one per expert and one of tokens per "
        f"router and line; pairs past it show in {EXPERT_OVERFLOW_SELECTIONS} "
        "(default %(default)s: one business line of DeepSeek-V3)",
    )
    serve.add_argument(
        "--body-timeout",
        type=positive_float,
        default=ServerConfig.body_timeout_seconds,
        help="seconds a request body may take to arrive before 408 (default %(default)s)",
    )
    add_cause_flags(serve)
    add_fleet_flags(serve)
    for name, text in INGEST_FLAGS.items():
        serve.add_argument(
            "--ingest-" + name.replace("_", "-"),
            type=type(getattr(IngestLimits, name)),
            default=getattr(IngestLimits, name),
            help=f"{text} (default %(default)s)",
        )
    serve.set_defaults(handler=_cmd_serve)
