"""The settings of the reference readings (``ServerConfig.reference``, the ``--reference-*`` flags): how often the
reference prompts are read, how long an alert waits for its reading, the tolerance that tells the model changed, and
how the readings share an engine with its clients; and what is wrong with them (:meth:`ReferenceSettings.problems`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_watch.common.setting_errors import SettingProblem
from mla_watch.common.values import is_integer, is_number
from mla_watch.references.readers import DEFAULT_ENGINE_PROMPT_TOKENS, MAX_ENGINE_PROMPT_TOKENS

__all__ = ["DEFAULT_TOLERANCE_BITS", "ReferenceSettings"]

# The same prompts through the same routers route identically on the model served here (JS 0); an engine's
# batching moves a few near-tied picks (measured on the real vLLM: bench/traffic_or_damage.py). The faults
# mla_watch pages for move the reference routing by 0.05 bits and more.
DEFAULT_TOLERANCE_BITS = 0.01


@dataclass(frozen=True)
class ReferenceSettings:
    interval_seconds: float = 300.0  # every set read this often (0: at start, then only on demand)
    wait_seconds: float = 120.0  # an alert due to fire waits this long past its `for` for the reading it asked for
    tolerance_bits: float = DEFAULT_TOLERANCE_BITS  # JS from the set's baseline beyond which the model changed
    rate: float = 16.0  # reference prompts a second, at most, to an engine beside the sidecar
    retry_seconds: float = 30.0  # a set whose reading failed (an engine restarting, a full queue) is read again then
    max_tokens: int = DEFAULT_ENGINE_PROMPT_TOKENS  # beside an engine: a prompt's tokens read at most
    long_interval_seconds: float = 1800.0  # the long sets read this often (0: at start, then only when an alert asks)
    long_share: float = 0.05  # of the reader's time, at most, spent reading long sets
    # Beside vLLM run with --scheduling-policy priority: the request priority of reference prompts (vLLM serves a
    # lower value first; clients send 0). None: the field is not sent (vLLM refuses it under its default policy).
    priority: int | None = None

    def problems(self) -> list[SettingProblem]:
        """What is wrong with the settings, each named as ``ServerConfig.reference`` holds it."""
        checks = [
            ("interval_seconds", self.interval_seconds, self.interval_seconds >= 0, "seconds >= 0"),
            ("wait_seconds", self.wait_seconds, self.wait_seconds >= 0, "seconds >= 0"),
            ("tolerance_bits", self.tolerance_bits, 0 <= self.tolerance_bits < 1, "bits in [0, 1)"),
            ("rate", self.rate, self.rate > 0, "prompts a second > 0"),
            ("long_interval_seconds", self.long_interval_seconds, self.long_interval_seconds >= 0, "seconds >= 0"),
            ("long_share", self.long_share, 0 < self.long_share <= 1, "a share of the reader's time in (0, 1]"),
        ]
        found = [
            SettingProblem(f"reference.{name}", repr(value), expected)
            for name, value, ok, expected in checks
            if not (is_number(value, finite=True) and ok)
        ]
        if self.priority is not None and not (is_integer(self.priority) and -(2**31) < self.priority < 2**31):
            found.append(
                SettingProblem("reference.priority", repr(self.priority), "an integer (vLLM's request priority)")
            )
        if not (is_integer(self.max_tokens) and 16 <= self.max_tokens <= MAX_ENGINE_PROMPT_TOKENS):
            found.append(
                SettingProblem(
                    "reference.max_tokens",
                    repr(self.max_tokens),
                    f"tokens a prompt from 16 to {MAX_ENGINE_PROMPT_TOKENS}",
                )
            )
        return found
