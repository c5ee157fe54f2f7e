"""Which flag sets which setting: the one place a field path (``reference.long_share``) becomes a flag's name.

The core names a setting by where :class:`~mla_watch.server.config.ServerConfig` holds it; ``serve``,
``check`` and the other commands word the same problem with the flag the user typed.
"""

from __future__ import annotations

from mla_watch.common.setting_errors import SettingsError
from mla_watch.routing.ingest import INGEST_FLAGS

__all__ = ["FIELD_FLAGS", "flag_messages", "flag_of", "flag_text"]

FIELD_FLAGS: dict[str, str] = {
    "engine": "--engine",
    "engine_retune": "--engine-retune",
    "upstream": "--upstream",
    "model_config": "--model-config",
    "sglang_recorder_dir": "--sglang-recorder-dir",
    "decode_workers": "--decode-workers",
    "client_id": "--client-id",
    "reference_model": "--reference-model",
    "capture_max_client_share": "--capture-max-client-share",
    "baseline_max_client_share": "--baseline-max-client-share",
    "baseline_min_clients": "--baseline-min-clients",
    "replay.rate": "--replay-rate",
    "replay.concurrency": "--replay-concurrency",
    "replay.tokens_per_second": "--replay-tokens-per-second",
    "reference.interval_seconds": "--reference-interval",
    "reference.wait_seconds": "--reference-wait",
    "reference.tolerance_bits": "--reference-tolerance",
    "reference.rate": "--reference-rate",
    "reference.long_interval_seconds": "--reference-long-interval",
    "reference.long_share": "--reference-long-share",
    "reference.max_tokens": "--reference-max-tokens",
    "reference.priority": "--reference-priority",
    **{f"ingest_limits.{name}": f"--ingest-{name.replace('_', '-')}" for name in INGEST_FLAGS},
    # rules export --fleet / check --fleet: FleetOptions
    "fleet_rules.fleet_labels": "--fleet-labels",
    "fleet_rules.replica_label": "--replica-label",
    "fleet_rules.outlier_bits": "--outlier-bits",
    "fleet_rules.outlier_factor": "--outlier-factor",
    "fleet_rules.interval_seconds": "--fleet-interval",
    "fleet_rules.outlier_interval_seconds": "--outlier-interval",
    "fleet_rules.outlier_for_seconds": "--outlier-for",
    "fleet_rules.shards": "--fleet-shards",
}


def flag_of(field: str) -> str | None:
    """The flag that sets ``field``, or ``None`` when no flag does."""
    return FIELD_FLAGS.get(field)


def flag_messages(error: SettingsError) -> list[str]:
    """``error``'s messages, each setting named by its flag."""
    return error.messages(flag_of)


def flag_text(error: Exception) -> str:
    """The first problem of ``error`` with its setting named by its flag (a command stops at the first)."""
    return error.first(flag_of) if isinstance(error, SettingsError) else str(error)
