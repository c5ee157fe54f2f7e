"""Re-tuning the routers of a running engine (vLLM beside the sidecar): swap, score, keep or roll back.

``serve --upstream URL --engine vllm --engine-retune propose|apply`` re-tunes the engine's own
routers. Nothing of the model is loaded here: the routers' tensors are read from the engine's
checkpoint directory (``--model-config DIR``) once, and from then on the sidecar knows them by what
it wrote (:class:`EngineRouters`). A job, for each strategy it names:

1. makes a candidate without any model copy: ``restore`` (the routers of ``--reference-model``,
   of a version marked good or one that passed its gates, else the engine's own checkpoint) or
   ``bias`` (DeepSeek's auxiliary-loss-free rule, :func:`bias_step`, from the loads the engine's
   routing shows);
2. saves it as a registry version, with its manifest;
3. ``propose``: stops there and tells on-call the one command that applies it,
   ``mla-watch retune apply N``; ``apply`` (or that command): swaps it into the engine, has the
   engine score the held-out captured samples (``prompt_logprobs``) and route them, and judges it
   against the engine's own scores from before the swap (:func:`mla_watch.retune.gates.evaluate_gates`:
   the paired perplexity gate and the band gate). A pass keeps it; anything else puts the previous
   tensors back at once. ``bias`` steps again from what the engine routed, until the router is back
   in its band or ``steps`` run out.

The time a candidate serves live traffic before its gate decides (from the end of its swap to the
decision) is measured in each attempt (``live_seconds``) and bounded by ``--engine-gate-timeout``.

The router tensors are numpy arrays (bf16 as ``ml_dtypes.bfloat16``): beside an engine no torch is needed.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.common.output_file import write_error
from mla_watch.common.setting_errors import SettingProblem, SettingsError
from mla_watch.common.tensor_files import as_array, as_arrays
from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.router_checkpoint import write_router_checkpoint
from mla_watch.engines.swap import EngineWeights
from mla_watch.quality.score import engine_score
from mla_watch.references.gate import ReferenceGate
from mla_watch.references.readers import ReferenceReader
from mla_watch.retune.capture import TokenSample, TrafficCapture
from mla_watch.retune.data import same_evidence
from mla_watch.retune.engine_scores import (
    health_by_band,
    held_out_samples,
    loads_of,
    no_routing_check,
    reference_scores,
    score_samples,
    short_of_band,
    worse,
)
from mla_watch.retune.gates import Band, KnownGood, ModelScore, evaluate_gates
from mla_watch.retune.hosts import RouterHost
from mla_watch.retune.jobs import ENGINE_RETUNE_MODES, JobSpec, RetuneSettings, job_result
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.strategies import BiasSchedule, BiasStrategy, RestoreStrategy, bias_step, get_strategy
from mla_watch.retune.versions import RouterVersions
from mla_watch.routing.routers import RouterInfo

__all__ = ["ENGINE_STRATEGIES", "BiasSchedule", "EngineRetuner", "EngineRouters", "bias_step", "engine_score"]

log = logging.getLogger("mla_watch.retune")

ENGINE_STRATEGIES = ("restore", "bias")  # router_finetune needs the model's weights, which the engine holds
KEEP_SWAP_DIRS = 2  # the one serving and the one before it: what a rollback reloads from is written anew


class EngineRouters(RouterHost):
    """The routers of a running engine: known by what was loaded at start-up and what was swapped in since.

    ``initial``: the router tensors of the engine's checkpoint (read once, with
    :func:`mla_watch.engines.router_checkpoint.read_router_tensors`). Each :meth:`apply` writes the whole router
    state (a layer's weight and bias together, every MoE layer) as a router-only checkpoint in a new
    directory under ``swap_dir`` (which the engine must read at the same path) and has ``weights`` load it.
    """

    def __init__(
        self,
        weights: EngineWeights,
        geometry: EngineGeometry,
        initial: Mapping[str, np.ndarray],
        *,
        swap_dir: Path,
        config_json: Path,
    ) -> None:
        if not initial:
            raise ValueError("the engine's checkpoint holds no router tensor")
        self.weights = weights
        self.geometry = geometry
        self.swap_dir = Path(swap_dir)
        self.config_json = Path(config_json)
        self._state = as_arrays(initial)
        self._lock = threading.Lock()  # one swap in flight at a time

    def routers(self) -> list[RouterInfo]:
        return self.geometry.routers()

    def state(self, routers: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        prefixes = None if routers is None else tuple(f"{name}." for name in routers)
        with self._lock:
            return {
                name: array.copy()
                for name, array in self._state.items()
                if prefixes is None or name.startswith(prefixes)
            }

    def apply(self, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        tensors = {name: as_array(value) for name, value in tensors.items()}
        problems = [f"{name} is not a router tensor of the engine" for name in tensors if name not in self._state]
        problems += [
            f"{name} has shape {tuple(tensor.shape)}, the engine's is {tuple(self._state[name].shape)}"
            for name, tensor in tensors.items()
            if name in self._state and tuple(tensor.shape) != tuple(self._state[name].shape)
        ]
        if problems:
            raise ValueError("cannot swap router tensors into the engine: " + "; ".join(problems))
        with self._lock:
            whole = {
                **self._state,
                **{
                    name: np.ascontiguousarray(tensor, dtype=self._state[name].dtype)
                    for name, tensor in tensors.items()
                },
            }
            directory = self.swap_dir / f"routers-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            try:  # nothing half-written stays: the checkpoint is renamed into place once whole
                self.swap_dir.mkdir(parents=True, exist_ok=True)
                write_router_checkpoint(directory, whole, self.config_json)
            except OSError as error:  # a full or read-only --engine-swap-dir: one line, the engine untouched
                raise write_error(f"engine swap directory {self.swap_dir}", error) from None
            result = self.weights.swap(directory.resolve())  # SwapError: the engine kept what it served
            self._state = whole
            self._prune(keep=directory)
        return result.as_dict()

    def describe(self) -> str:
        return f"{self.weights.name} engine ({self.geometry.model_type})"

    def _prune(self, keep: Path) -> None:
        older = sorted(
            (
                entry
                for entry in self.swap_dir.iterdir()
                if entry.is_dir() and entry.name.startswith("routers-") and entry != keep
            ),
            key=lambda entry: entry.stat().st_mtime,
        )
        for entry in older[: max(0, len(older) - (KEEP_SWAP_DIRS - 1))]:
            shutil.rmtree(entry, ignore_errors=True)


class EngineRetuner:
    """Runs re-tune jobs against the routers of a running engine (see the module docstring).

    ``promote(version)`` and ``rollback()`` are the re-tune service's (they hold its swap lock and
    restart the routing windows of what changed); ``loads(router, business_line)`` returns the counts
    of the engine's routing for a router over its live window.
    """

    def __init__(
        self,
        *,
        host: EngineRouters,
        versions: RouterVersions,
        settings: RetuneSettings,
        mode: str,
        capture: TrafficCapture | None,
        promote: Callable[[int], Any],
        rollback: Callable[[], int],
        loads: Callable[[str, str | None], np.ndarray | None],
        reference: RouterReference | None = None,
        bias_schedule: BiasSchedule | None = None,
        gate_timeout: float = 300.0,
        clock: Callable[[], float] = time.time,
        reference_prompts: ReferenceGate | None = None,
        reference_reader: ReferenceReader | None = None,
    ) -> None:
        if mode not in ENGINE_RETUNE_MODES[1:]:
            raise SettingsError([SettingProblem("engine_retune", repr(mode), "propose or apply")])
        self.host = host
        self.model = None  # no model in this process: the engine holds it
        self.versions = versions
        self.settings = settings
        self.mode = mode
        self.capture = capture
        self.reference = reference
        self.bias_schedule = bias_schedule or BiasSchedule()
        self.gate_timeout = gate_timeout
        self._promote = promote
        self._rollback = rollback
        self._loads = loads
        self._clock = clock
        # Every candidate is judged on the reference prompts too, read through the engine (mla_watch.references.gate).
        self.reference_prompts = reference_prompts if reference_reader is not None else None
        self._reference_reader = reference_reader
        self._reference_live: dict[str, ModelScore] = {}  # the line's reference prompts, before the job's swaps

    def remove_work(self, job_id: str | None = None) -> None:
        """Nothing to remove: an engine job writes no work files (its swaps live in ``--engine-swap-dir``)."""

    def supported(self, name: str) -> str | None:
        """Why strategy ``name`` cannot re-tune this engine's routers (``None``: it can)."""
        return get_strategy(name).engine_unsupported_reason(self.host.state())

    # ------------------------------------------------------------------ a job
    def run(self, spec: JobSpec, previous: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        started = self._clock()
        if spec.version is not None:
            return self._apply_version(spec, started)
        if self.mode == "propose":
            return self._propose(spec, started)
        held_out, data = held_out_samples(self.capture, self.settings, spec.business_line)
        if isinstance(held_out, str):
            return "waiting", {"needs": held_out, "attempts": [], "data": data, "cannot_run": True}
        if unchanged := same_evidence(previous or {}, data):
            return "waiting", unchanged
        band = Band.from_dict(spec.band)
        before = self._score(held_out)
        self._reference_live = reference_scores(self.reference_prompts, self._reference_reader, spec.business_line)
        attempts: list[dict[str, Any]] = []
        for name, attempt in self._attempts(spec, attempts):
            try:
                if name == "bias":
                    outcome = self._bias_steps(spec, attempt, held_out, before, band, data)
                else:
                    tensors, details = self._restore(spec)
                    if self._serving_already(tensors):
                        attempt.update(
                            outcome="unchanged",
                            reason=f"{details['source']} holds the tensors serving now: nothing to restore",
                        )
                        continue
                    version = self._save(spec, name, tensors, details, data)
                    outcome = self._gate(spec, attempt, version, held_out, before, band, known_good=details["source"])
            except Exception as error:  # one strategy failing must not stop the next one
                log.exception("re-tune job %s: strategy %s failed", spec.id, name)
                attempt.update(outcome="failed", reason=f"{type(error).__name__}: {error}")
                continue
            if outcome == "promoted":
                return "promoted", self._result(
                    spec, attempts, data, started, version=attempt.get("version"), strategy=name
                )
        return self._undecided(spec, attempts, data, started, before, band)

    def _apply_version(self, spec: JobSpec, started: float) -> tuple[str, dict[str, Any]]:
        """``mla-watch retune apply N``: gate version N through the engine, keep it or roll it back."""
        version = int(spec.version)  # type: ignore[arg-type]
        held_out, data = held_out_samples(self.capture, self.settings, spec.business_line)
        if isinstance(held_out, str):
            return "waiting", {"needs": held_out, "attempts": [], "data": data, "cannot_run": True}
        manifest = self.versions.manifest(version)
        band = Band.from_dict(spec.band)
        before = self._score(held_out)
        self._reference_live = reference_scores(self.reference_prompts, self._reference_reader, spec.business_line)
        attempt: dict[str, Any] = {"strategy": manifest.get("strategy", "apply"), "version": version}
        outcome = self._gate(
            spec, attempt, version, held_out, before, band, known_good=(manifest.get("details") or {}).get("source")
        )
        result = self._result(
            spec,
            [attempt],
            data,
            started,
            version=version if outcome == "promoted" else None,
            strategy=attempt["strategy"],
        )
        if outcome == "promoted":
            return "promoted", result
        # The version an operator named was judged and rolled back: the end (a retry would swap it in again).
        return ("rejected" if outcome == "rejected" else "failed"), result

    def _propose(self, spec: JobSpec, started: float) -> tuple[str, dict[str, Any]]:
        attempts: list[dict[str, Any]] = []
        for name, attempt in self._attempts(spec, attempts):
            try:
                if name == "bias":
                    tensors, details = self._bias_candidate(spec, 0, self._window_loads(spec))
                else:
                    tensors, details = self._restore(spec)
            except Exception as error:
                attempt.update(outcome="failed", reason=f"{type(error).__name__}: {error}")
                continue
            version = self._save(spec, name, tensors, {**details, "proposed": True}, {})
            command = f"mla-watch retune apply {version}"
            attempt.update(outcome="proposed", version=version, command=command)
            result = self._result(spec, attempts, {}, started, version=version, strategy=name)
            result.update(error=None, command=command)
            return "proposed", result
        return "failed", self._result(spec, attempts, {}, started)

    def _attempts(self, spec: JobSpec, attempts: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each strategy the engine can use, with its attempt record (added to ``attempts``; the others are
        recorded ``unsupported`` with the reason)."""
        for name in spec.strategies:
            attempt: dict[str, Any] = {"strategy": name}
            attempts.append(attempt)
            reason = self.supported(name)
            if reason is not None:
                attempt.update(outcome="unsupported", reason=reason)
                continue
            yield name, attempt

    # ------------------------------------------------------------------ candidates
    def _restore(self, spec: JobSpec) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        # nothing known good: the checkpoint the engine was started from
        tensors, source, _ = RestoreStrategy().known_good(
            spec.routers, reference=self.reference, versions=self.versions, initial_if_none_good=True
        )
        return tensors, {"source": source, "reference": source, "routers": list(spec.routers)}

    def _serving_already(self, tensors: Mapping[str, np.ndarray]) -> bool:
        live = self.host.state()
        return all(
            name in live
            and tensor.shape == live[name].shape
            and bool(np.array_equal(tensor.astype(live[name].dtype), live[name]))
            for name, tensor in tensors.items()
        )

    def _bias_candidate(
        self, spec: JobSpec, step: int, loads: Mapping[str, np.ndarray | None]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        gamma = self.bias_schedule.gamma_at(step)
        tensors = BiasStrategy().engine_step(self.host.state(spec.routers), loads, spec.routers, gamma)
        return tensors, {
            "step": step,
            "gamma": round(gamma, 6),
            "rule": "b += gamma * min(1, 1 - load / mean)",
            "routers": list(spec.routers),
        }

    def _window_loads(self, spec: JobSpec) -> dict[str, np.ndarray | None]:
        return {router: self._loads(router, spec.business_line) for router in spec.routers}

    def _bias_steps(
        self,
        spec: JobSpec,
        attempt: dict[str, Any],
        held_out: list[TokenSample],
        before: ModelScore,
        band: Band,
        data: dict[str, Any],
    ) -> str:
        """Step, swap and gate until the routers are in band, a gate rejects, or the steps run out."""
        loads: dict[str, np.ndarray | None] = {router: loads_of(before, router) for router in spec.routers}
        if any(value is None for value in loads.values()):  # the held-out samples were not routed: the live window
            loads = self._window_loads(spec)
        steps: list[dict[str, Any]] = []
        attempt["steps"] = steps
        kept = 0  # bias steps promoted and still serving
        for step in range(self.bias_schedule.steps):
            tensors, details = self._bias_candidate(spec, step, loads)
            version = self._save(spec, "bias", tensors, details, data)
            record: dict[str, Any] = {"step": step}
            steps.append(record)
            outcome = self._gate(spec, record, version, held_out, before, band, known_good=None, keep_unless=True)
            attempt.update(version=version, gates=record.get("gates"), live_seconds=record.get("live_seconds"))
            if outcome == "promoted":
                attempt["outcome"] = "promoted"
                return "promoted"
            if outcome != "stepped":  # rejected on quality (rolled back): no further step from here
                break
            kept += 1
            after = record.pop("_after")
            loads = {router: loads_of(after, router) for router in spec.routers}
            if any(value is None for value in loads.values()):
                break
        for _ in range(kept):  # the steps that did not reach the band go, back to what served before the job
            self._rollback()
        last = steps[-1] if steps else {}
        attempt.update(
            outcome=last.get("outcome", "failed") if last.get("outcome") != "stepped" else "rejected",
            reason=last.get("reason")
            or f"{len(steps)} bias steps did not bring the routers into the "
            f"band ({band.describe()}); every step was rolled back",
        )
        return attempt["outcome"]

    # ------------------------------------------------------------------ the gate, through the engine
    def _gate(
        self,
        spec: JobSpec,
        attempt: dict[str, Any],
        version: int,
        held_out: list[TokenSample],
        before: ModelScore,
        band: Band,
        *,
        known_good: str | None,
        keep_unless: bool = False,
    ) -> str:
        """Swap ``version`` in, score it with the engine, keep it or roll it back; the attempt's outcome.

        ``keep_unless`` (a bias step): a candidate that is no worse but reads a router still outside its band
        stays live for the next step (``stepped``); anything else short of a pass goes back at once.
        """
        watched = list(dict.fromkeys([*spec.routers, *spec.watched]))
        taken = self._promote(version)
        live_from = self._clock()
        try:
            after = self._score(held_out)
            reference_after = reference_scores(self.reference_prompts, self._reference_reader, spec.business_line)
        except Exception as error:  # an engine that cannot score: the candidate goes back, undecided
            self._rollback()
            attempt.update(
                outcome="failed",
                version=version,
                swap=taken,
                live_seconds=round(self._clock() - live_from, 3),
                reason=f"the engine could not score the held-out samples after the swap: {error}",
            )
            return "failed"
        routed = bool(after.routers)
        known = None
        if known_good is not None and routed:
            known = KnownGood(
                source=known_good,
                health=health_by_band(after, spec.routers, band),
                score=after,
                live_outside_band=bool(before.outside(spec.routers, band)),
            )
        report = evaluate_gates(
            before,
            after,
            routers=watched if routed else [],
            band=band,
            max_perplexity_increase=spec.max_perplexity_increase,
            confidence=self.settings.gate_confidence,
            min_tokens=self.settings.min_held_out_tokens,
            min_samples=self.settings.min_held_out_samples,
            known_good=known,
            reference=self._reference_checks(spec, reference_after, watched, band),
        )
        if not routed:  # the engine returns no routing (vLLM without --enable-return-routed-experts)
            report.checks.insert(0, no_routing_check(band))
        attempt.update(version=version, gates=report.as_dict(), swap=taken)
        self.versions.update_manifest(version, {"gates": report.as_dict()})
        if report.passed:
            attempt.update(outcome="promoted", live_seconds=round(self._clock() - live_from, 3))
            return "promoted"
        if keep_unless and not worse(report) and short_of_band(report):
            attempt.update(
                outcome="stepped",
                live_seconds=round(self._clock() - live_from, 3),
                _after=after,
                reason="; ".join(report.reasons()),
            )
            return "stepped"
        self._rollback()
        attempt.update(
            outcome="rejected" if report.decision == "reject" else "insufficient",
            live_seconds=round(self._clock() - live_from, 3),
            reason="; ".join(report.reasons()),
            rolled_back=True,
        )
        log.warning(
            "re-tune job %s: version %d %s through the engine and rolled back: %s",
            spec.id,
            version,
            attempt["outcome"],
            attempt["reason"],
        )
        return attempt["outcome"]

    def _reference_checks(
        self, spec: JobSpec, candidate: dict[str, ModelScore], watched: list[str], band: Band
    ) -> list[dict[str, Any]]:
        if self.reference_prompts is None:
            return []
        return self.reference_prompts.checks(
            spec.business_line,
            self._reference_live,
            candidate,
            routers=watched,
            band=band,
            margin=spec.max_perplexity_increase,
            confidence=self.settings.gate_confidence,
            min_tokens=self.settings.min_held_out_tokens,
            min_samples=self.settings.min_held_out_samples,
        )

    def _score(self, samples: Sequence[TokenSample]) -> ModelScore:
        return score_samples(
            self.host.weights,
            self.host.geometry,
            samples,
            max_tokens=self.settings.max_tokens_per_sample,
            timeout=self.gate_timeout,
            clock=self._clock,
        )

    # ------------------------------------------------------------------ records
    def _save(
        self,
        spec: JobSpec,
        strategy: str,
        tensors: dict[str, np.ndarray],
        details: dict[str, Any],
        data: dict[str, Any],
    ) -> int:
        manifest = {
            "job": spec.id,
            "trigger": spec.trigger,
            "data": data,
            "strategy": strategy,
            "routers": spec.routers,
            "details": details,
            "engine": self.host.describe(),
            "gates": {"passed": False, "decision": "pending", "checks": []},
        }
        return self.versions.save(tensors, manifest)

    def _undecided(
        self,
        spec: JobSpec,
        attempts: list[dict[str, Any]],
        data: dict[str, Any],
        started: float,
        before: ModelScore,
        band: Band,
    ) -> tuple[str, dict[str, Any]]:
        result = self._result(spec, attempts, data, started)
        outcomes = {attempt.get("outcome") for attempt in attempts}
        outside = bool(before.outside(spec.routers, band)) or spec.trigger.get("source") == "alert"
        if outcomes & {"rejected", "insufficient"} and outside:
            result["needs"] = (
                f"a candidate that passes its gates through the engine: every one was rolled back "
                f"while {spec.routers[0]} still reads outside its band ({band.describe()}); trying "
                f"again on newer traffic"
            )
            result["rejected_while_outside_band"] = "rejected" in outcomes
            return "waiting", result
        return ("rejected" if "rejected" in outcomes else "failed"), result

    def _result(
        self,
        spec: JobSpec,
        attempts: list[dict[str, Any]],
        data: dict[str, Any],
        started: float,
        *,
        version: int | None = None,
        strategy: str | None = None,
    ) -> dict[str, Any]:
        return job_result(
            spec,
            attempts,
            data,
            started=started,
            finished=self._clock(),
            version=version,
            strategy=strategy,
            engine=True,
        )
