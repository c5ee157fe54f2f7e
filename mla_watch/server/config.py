"""The sidecar's settings: every default once, here; ``mla-watch serve`` builds its flags from them (no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.common.values import is_integer, is_number
from mla_watch.engines.count_queue import COUNT_QUEUE_BYTES
from mla_watch.engines.reading import ENGINE_CHOICES, NO_ENGINE  # ENGINE_CHOICES: the flag's, re-exported
from mla_watch.engines.replay import ReplayBudget
from mla_watch.fleet.settings import FleetSettings
from mla_watch.references.prober import ReferenceSettings
from mla_watch.retune.jobs import RetentionPolicy, RetuneSettings
from mla_watch.routing.baselines import DEFAULT_LEARN_TOKENS
from mla_watch.routing.client_mix import DEFAULT_MAX_CLIENT_SHARE, DEFAULT_MIN_CLIENTS, ClientGate
from mla_watch.routing.clients import DEFAULT_CLIENT_ID, parse_client_id_sources
from mla_watch.routing.ingest import IngestLimits
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS
from mla_watch.server.expert_counts import DEFAULT_EXPERT_SERIES_BUDGET, ExpertSelection
from mla_watch.shipped import SHIPPED_POLICIES, SHIPPED_REFERENCES, SHIPPED_RULES

__all__ = [
    "ADMIN_TOKEN_ENV",
    "ENGINE_CHOICES",
    "INGEST_TOKEN_ENV",
    "MIN_TOKEN_LENGTH",
    "SERVER_SETTINGS",
    "UPSTREAM_MAX_BYTES",
    "UPSTREAM_MAX_LINE_BYTES",
    "ServerConfig",
    "ServerConfigError",
    "check_tokens",
    "split_credentials",
]

ADMIN_TOKEN_ENV = "MLA_WATCH_ADMIN_TOKEN"
INGEST_TOKEN_ENV = "MLA_WATCH_INGEST_TOKEN"
MIN_TOKEN_LENGTH = 16  # a bearer token anyone could guess is refused at start-up
# The largest engine answer read (after decompression): DeepSeek-V3's routing at its whole context,
# 163,840 tokens x 61 layers x top-8, is 427 MB as SGLang's base64 int32 (107 MB as vLLM's uint8 .npy).
UPSTREAM_MAX_BYTES = 512 << 20
# One line of a stream: a chunk is not an answer. A line that carries routing (its key within its first
# ROUTING_KEY_WINDOW bytes: SGLang's routing chunk, vLLM's terminal chunk) may be as long as an answer.
UPSTREAM_MAX_LINE_BYTES = 16 << 20


@dataclass
class ServerConfig:
    model: str = "bundled"
    device: str = "auto"
    policies: Path = SHIPPED_POLICIES
    rules: Path | None = SHIPPED_RULES  # None: no alerting
    # Reference prompts per business line (mla_watch.references): read through the model to tell the model's changes
    # from the traffic's, on a schedule and whenever a routing alert goes pending.
    reference_prompts: Path = SHIPPED_REFERENCES
    reference: ReferenceSettings = field(default_factory=ReferenceSettings)
    # Who sent a request (mla_watch.routing.clients): the first of these a request carries.
    client_id: tuple[str, ...] = field(default_factory=lambda: parse_client_id_sources(DEFAULT_CLIENT_ID))
    state_dir: Path = Path("mla-watch-state")
    dataset_dir: Path | None = None  # re-tune datasets named over the admin API; None: STATE_DIR/datasets
    alert_interval: float = 15.0
    public_url: str = ""  # how on-call reaches this sidecar; links in alerts point there
    upstream: str | None = None  # credentials in it (user:password@) move to upstream_credentials
    # Basic auth for the upstream, taken out of its URL so that no page, answer or log line shows it.
    upstream_credentials: tuple[str, str] | None = field(default=None, repr=False)
    upstream_max_bytes: int = UPSTREAM_MAX_BYTES  # one engine answer (or a stream line with routing), decompressed
    upstream_max_line_bytes: int = UPSTREAM_MAX_LINE_BYTES  # one line of its stream that carries no routing
    upstream_check_seconds: float = 5.0  # the upstream's GET /health, this often: /readyz says whether it answers
    # Beside vLLM or SGLang (mla_watch.engines): how the upstream returns routing, and where its routers sit.
    engine: str = NO_ENGINE  # one of ENGINE_CHOICES (auto: asked of the upstream's /v1/models)
    model_config: Path | None = None  # the config.json the engine loaded, or its directory
    decode_workers: int = 1  # processes decoding engine routing off the event loop; 0: a thread
    count_queue_bytes: int = COUNT_QUEUE_BYTES  # answers whose routing is still to be counted
    replay: ReplayBudget = field(default_factory=ReplayBudget)  # vLLM streams, counted by replaying them
    sglang_recorder_dir: Path | None = None  # SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, shared with the engine
    sglang_recorder_interval: float = 10.0  # seconds between dumps
    sglang_recorder_buffer: int = 1000  # the engine's --expert-distribution-recorder-buffer-size
    # a dump that does not read whole is set aside only once unchanged (size, mtime) this long: a writer may stall
    sglang_recorder_settle: float = 30.0
    # Re-tuning the engine's routers in place (vLLM's dev mode): off | propose | apply, the directory the
    # sidecar writes router checkpoints to and the engine reads at the same path (a shared volume; default
    # STATE_DIR/engine-swaps, right where both run on one host), and how long a candidate may serve live
    # traffic before its gate through the engine decides.
    engine_retune: str = "propose"
    engine_swap_dir: Path | None = None
    engine_gate_timeout: float = 300.0
    # The embedded model's expert routing is also counted per position bucket (mla_watch.routing.positions).
    routing_by_position: bool = True
    position_metrics: bool = False  # export it per position bucket on /metrics (routers x lines x buckets series)
    return_routed_experts: bool = False  # the embedded model answers with its routing, in vLLM's and SGLang's fields
    attn_implementation: str = "sdpa"
    max_queue: int = 32
    request_timeout: float = 60.0
    max_body_bytes: int = 1_000_000
    window_tokens: int | None = DEFAULT_WINDOW_TOKENS
    window_seconds: float | None = None
    # A (router, business line) window is learned as that series' healthy baseline once it holds this many tokens.
    baseline_tokens: int = DEFAULT_LEARN_TOKENS
    # ... and only where it is the line's traffic, not one client's: no client sent more than this share of its tokens
    # (of an indexer's, those that carry its signal), and at least this many clients sent some.
    baseline_max_client_share: float = DEFAULT_MAX_CLIENT_SHARE
    baseline_min_clients: int = DEFAULT_MIN_CLIENTS
    policy_poll_seconds: float | None = 1.0
    admin_token: str | None = field(default_factory=lambda: os.environ.get(ADMIN_TOKEN_ENV) or None)
    # Workers shipping routing counts hold this one, not the admin key (falls back to the admin token).
    ingest_token: str | None = field(default_factory=lambda: os.environ.get(INGEST_TOKEN_ENV) or None)
    ingest_limits: IngestLimits = field(default_factory=IngestLimits)
    body_timeout_seconds: float = 10.0  # a request body still arriving after this is refused (408)
    capture: bool = False  # opt-in: record recent traffic (token ids) per business line for re-tuning
    capture_max_samples: int = 2000  # per business line
    capture_max_age_seconds: float = 7 * 86400.0
    capture_max_client_share: float = 0.25  # of a line's captured samples, one client's at most
    retune: RetuneSettings = field(default_factory=RetuneSettings)
    reference_model: Path | None = None  # a checkpoint whose router tensors `restore` puts back
    router_versions: RetentionPolicy = field(default_factory=RetentionPolicy)  # STATE_DIR/routers kept within it
    history_interval_seconds: float = 10.0  # the status page's heat map: one point per interval ...
    history_span_seconds: float = 3600.0  # ... over this span
    # The durable history (STATE_DIR/history.sqlite): 1-minute points for a day, 15-minute ones for this many days;
    # 0: none (no file, no /v1/history).
    history_retention_days: float = 30.0
    history_max_series: int = 1024  # (router, business line) pairs it keeps; 119 routers x 6 lines fit
    # Opt-in cumulative counters per expert (mla_watch.server.expert_counts): None exports none. The Python API
    # may also give a selection's text, as --export-expert-counts takes it: it is parsed here.
    export_expert_counts: ExpertSelection | None = None
    expert_series_budget: int = DEFAULT_EXPERT_SERIES_BUDGET
    # A fleet of sidecars sharing a PostgreSQL store (serve --fleet URL): one re-tuning decision, a canary, a rollout.
    fleet: FleetSettings | None = None

    def __post_init__(self) -> None:
        if self.upstream:
            self.upstream, credentials = split_credentials(self.upstream)
            self.upstream_credentials = credentials or self.upstream_credentials
        if self.export_expert_counts is not None and not isinstance(self.export_expert_counts, ExpertSelection):
            try:
                self.export_expert_counts = ExpertSelection.parse(self.export_expert_counts, "export_expert_counts =")
            except ValueError as error:
                raise SettingsError([str(error)], what=SERVER_SETTINGS) from None
        problems: list[str | SettingProblem] = [*self.reference.problems()]
        if self.fleet is not None:
            problems += [f"fleet.{problem}" for problem in self.fleet.problems()]
        problems += self.baseline_gate.problems()
        share = self.capture_max_client_share
        if not is_number(share) or not 0 < share <= 1:
            problems.append(SettingProblem("capture_max_client_share", repr(share), "a share in (0, 1]"))
        check = self.upstream_check_seconds
        if not is_number(check) or not 0 < check < float("inf"):
            problems.append(SettingProblem("upstream_check_seconds", repr(check), "a number of seconds > 0"))
        if problems:
            raise SettingsError(problems, what=SERVER_SETTINGS)
        budget = self.expert_series_budget
        if not is_integer(budget) or budget < 1:
            raise SettingsError(
                [SettingProblem("expert_series_budget", repr(budget), "an integer >= 1 (series)")], what=SERVER_SETTINGS
            )

    @property
    def baseline_gate(self) -> ClientGate:
        """Which windows' clients may make a healthy baseline."""
        return ClientGate(self.baseline_max_client_share, self.baseline_min_clients)


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its ``user:password@`` part, and that part (percent-decoded), if there was one."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    public = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return public, (unquote(parts.username or ""), unquote(parts.password or ""))


SERVER_SETTINGS = "server configuration"
"""What a :class:`SettingsError` about the server's own settings (an environment variable, a flag) calls them."""

ServerConfigError = SettingsError
"""The former name of :class:`~mla_watch.common.setting_errors.SettingsError`, kept for one release."""


def check_tokens(config: ServerConfig) -> None:
    """Refuse a bearer token anyone could guess (shorter than :data:`MIN_TOKEN_LENGTH`)."""
    for variable, token in ((ADMIN_TOKEN_ENV, config.admin_token), (INGEST_TOKEN_ENV, config.ingest_token)):
        if token is not None and len(token) < MIN_TOKEN_LENGTH:
            raise SettingsError(
                [
                    f"{variable} has {len(token)} characters: expected at least {MIN_TOKEN_LENGTH}, "
                    "random (python -c 'import secrets; print(secrets.token_urlsafe())')"
                ],
                what=SERVER_SETTINGS,
            )
