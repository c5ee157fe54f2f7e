"""Running one re-tuning job: data, fit, gates, checkpoint, promotion.

For each strategy the job names, in order: skip it if the model cannot use it, fit a
candidate (in this process, or through an external command template), score it on held-out
samples against the live model, write it to the registry as a new version with its
manifest, and promote the first one that passes every gate. A job whose every candidate
fails a gate ends ``rejected`` and leaves the live model exactly as it was.

The external command template runs the fit elsewhere, e.g. under ``torchrun`` on a cluster
for a model too large to tune here. Its fields (``str.format``) are ``{job}`` (the job as
JSON, with ``strategy`` and its ``options``), ``{data}`` (training samples, JSONL of
``{"input_ids": [...], "scored_tokens": n}``, the count only where a loss may use just the first
``n`` ids), ``{routers}`` (the live router tensors, safetensors), ``{output}``
(a directory where the command writes ``routers.safetensors`` and optionally
``result.json``), ``{model}``, ``{strategy}``, ``{job_id}`` and ``{python}``. The template is
split like a shell command line but no shell runs it. ``python -m mla_watch.retune.worker``
is such a command for the models mla_watch can load. These files are written in
``STATE_DIR/retune-work/<job>-<strategy>/`` (mode 0700, the files 0600: ``{data}`` is customer
traffic) and removed as soon as the command's output is read; its failure is reported by the
last line of its output only.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from mla_watch.common.output_file import write_file
from mla_watch.common.state_dir import ensure_private_dir
from mla_watch.common.tensor_files import as_arrays
from mla_watch.models.loss import scored_targets
from mla_watch.quality.local_model import copy_without_hooks, make_batches, score_model
from mla_watch.references.gate import ReferenceGate
from mla_watch.references.readers import model_context, reference_batches
from mla_watch.retune.capture import TokenSample, TrafficCapture
from mla_watch.retune.data import (
    distinct_count,
    evidence_digest,
    load_jsonl_dataset,
    resolve_dataset,
    same_evidence,
    split_held_out,
)
from mla_watch.retune.gates import Band, KnownGood, ModelScore, evaluate_gates
from mla_watch.retune.hosts import ModelRouters
from mla_watch.retune.jobs import JobSpec, RetuneSettings, job_result
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.router_tensors import apply_router_tensors, router_state
from mla_watch.retune.strategies import Candidate, FitContext, get_strategy
from mla_watch.retune.versions import RouterVersions

__all__ = ["JobCannotRun", "Retuner"]

log = logging.getLogger("mla_watch.retune")


class JobCannotRun(Exception):
    """The job cannot run (no data, a bad dataset); the message says what to do.

    ``needs_data``: more captured traffic would let it run (it waits), rather than a missing
    configuration or a bad dataset (it fails).
    """

    def __init__(self, message: str, *, needs_data: bool = False) -> None:
        super().__init__(message)
        self.needs_data = needs_data


class Retuner:
    """Runs jobs against one live model. ``promote(version)`` swaps a version in.

    ``dataset_dir``: where a job's ``dataset`` (then a bare file name, as the admin API accepts)
    is looked up; ``None`` takes ``dataset`` as a path (jobs made in-process). ``workdir`` holds
    the external command's files of a job (``<job>-<strategy>/``, 0700, its files 0600) only
    while that fit runs.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        versions: RouterVersions,
        settings: RetuneSettings,
        workdir: Path,
        promote: Callable[[int], Any],
        capture: TrafficCapture | None = None,
        model_lock: Any = None,
        model_ref: str = "bundled",
        clock: Callable[[], float] = time.time,
        dataset_dir: Path | None = None,
        reference: RouterReference | None = None,
        health_rules: Callable[[], Sequence[Any]] | None = None,
        reference_prompts: ReferenceGate | None = None,
    ) -> None:
        self.model = model
        self.host = ModelRouters(model)  # the service holds the model lock around its swaps
        self._health_rules = health_rules  # the loaded alert rules: a restore is judged by them on the health text
        self.reference_prompts = reference_prompts  # every candidate is judged on them too (mla_watch.references.gate)
        self._reference_batches: dict[str, list[Any]] = {}  # by a set's digest
        self.reference = reference
        self.dataset_dir = None if dataset_dir is None else Path(dataset_dir)
        self.tokenizer = tokenizer
        self.versions = versions
        self.settings = settings
        self.workdir = Path(workdir)
        self.capture = capture
        self.model_ref = model_ref
        self._promote = promote
        self._model_lock = model_lock
        self._clock = clock

    def run(self, spec: JobSpec, previous: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Run ``spec``; returns ``(status, result)`` with status ``promoted``, ``rejected``, ``failed`` or
        ``waiting`` (not enough data to decide; ``result["needs"]`` says what is missing).

        Whatever the outcome, the job's files in ``workdir`` (copies of its training traffic) are gone
        when it returns; what a promotion needs is in the registry by then.
        """
        try:
            return self._run(spec, previous or {})
        finally:
            self.remove_work(spec.id)

    def remove_work(self, job_id: str | None = None) -> None:
        """Delete the work directories of job ``job_id`` (of every job for ``None``: at start-up, none runs)."""
        if not self.workdir.is_dir():
            return
        for entry in self.workdir.iterdir():
            if job_id is None or entry.name.startswith(f"{job_id}-"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _run(self, spec: JobSpec, previous: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        started = self._clock()
        timings: dict[str, float] = {}
        try:
            samples, data = self._samples(spec)
        except JobCannotRun as error:
            # Nothing was tried: the router's cooldown is not held, so the next alert (with more data) runs a job.
            if error.needs_data:
                return "waiting", {"needs": str(error), "attempts": [], "cannot_run": True}
            return "failed", {"error": str(error), "attempts": [], "cannot_run": True}
        if unchanged := same_evidence(previous, data):
            return "waiting", unchanged
        train, held_out = split_held_out(samples, self.settings.held_out_fraction)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        limit = self.settings.max_tokens_per_sample
        train_batches = make_batches(train, batch_size=self.settings.batch_size, pad_id=pad, max_tokens=limit)
        held_batches = make_batches(held_out, batch_size=self.settings.batch_size, pad_id=pad, max_tokens=limit)
        held_tokens = sum(
            int(scored_targets(batch["attention_mask"], batch.get("loss_mask")).sum()) for batch in held_batches
        )
        data.update({"train_samples": len(train), "held_out_samples": len(held_out), "held_out_tokens": held_tokens})
        timings["data_seconds"] = round(self._clock() - started, 3)
        short = self._short_of_evidence(held_tokens, len(held_out))
        restoring = "restore" in spec.strategies and self._health_rules is not None
        if short and not restoring:  # no gate could decide: copy, score and fit nothing yet
            return "waiting", {"needs": short, "attempts": [], "data": data, "cannot_run": True}

        mark = self._clock()
        work = self._copy_live()
        original = router_state(work)
        before = score_model(work, held_batches)
        timings["score_before_seconds"] = round(self._clock() - mark, 3)
        band = Band.from_dict(spec.band)
        watched = list(dict.fromkeys([*spec.routers, *spec.watched]))
        reference_live = self._reference_scores(work, spec.business_line)
        health = _HealthText(self.tokenizer, self._health_rules() if self._health_rules is not None else [])
        attempts: list[dict[str, Any]] = []
        for name in spec.strategies:
            attempt: dict[str, Any] = {"strategy": name}
            attempts.append(attempt)
            strategy = get_strategy(name)
            reason = strategy.unsupported_reason(self.model)
            if reason is not None:
                attempt.update(outcome="unsupported", reason=reason)
                continue
            if short and name != "restore":  # its gates could not decide: not fitted until they can
                attempt.update(outcome="insufficient", reason=short)
                continue
            mark = self._clock()
            try:
                options = strategy.parse_options(
                    {**self.settings.strategy_options.get(name, {}), **spec.options.get(name, {})}, f"options.{name}"
                )
                candidate = self._fit(spec, name, options, train, train_batches)
            except Exception as error:  # one strategy failing must not stop the next one
                log.exception("re-tune job %s: strategy %s failed", spec.id, name)
                attempt.update(outcome="failed", reason=f"{type(error).__name__}: {error}")
                continue
            attempt["fit_seconds"] = round(self._clock() - mark, 3)
            if all(
                name in original and torch.equal(tensor.to(original[name].dtype), original[name])
                for name, tensor in candidate.tensors.items()
            ):
                attempt.update(
                    outcome="unchanged", reason="the candidate's tensors are the ones serving now: nothing to try"
                )
                continue
            mark = self._clock()
            apply_router_tensors(work, candidate.tensors)
            after = score_model(work, held_batches)
            reference_checks = self._reference_checks(
                spec, reference_live, self._reference_scores(work, spec.business_line), watched, band
            )
            known_good = None
            if name == "restore" and health.judged:
                known_good = health.known_good(
                    work,
                    candidate.details.get("reference") or "the restored routers",
                    routers=spec.routers,
                    band=band,
                    live_state=original,
                )
            apply_router_tensors(work, original)
            report = evaluate_gates(
                before,
                after,
                routers=watched,
                band=band,
                max_perplexity_increase=spec.max_perplexity_increase,
                confidence=self.settings.gate_confidence,
                min_tokens=self.settings.min_held_out_tokens,
                min_samples=self.settings.min_held_out_samples,
                known_good=known_good,
                reference=reference_checks,
            )
            attempt["gate_seconds"] = round(self._clock() - mark, 3)
            manifest = {
                "job": spec.id,
                "trigger": spec.trigger,
                "data": data,
                "strategy": name,
                "routers": spec.routers,
                "details": candidate.details,
                "gates": report.as_dict(),
                "timings": {**timings, "fit_seconds": attempt["fit_seconds"], "gate_seconds": attempt["gate_seconds"]},
            }
            version = self.versions.save(as_arrays(candidate.tensors), manifest)
            attempt.update(version=version, gates=report.as_dict())
            if not report.passed:
                outcome = "rejected" if report.decision == "reject" else "insufficient"
                attempt.update(outcome=outcome, reason="; ".join(report.reasons()))
                log.warning(
                    "re-tune job %s: %s (version %d) %s: %s",
                    spec.id,
                    name,
                    version,
                    "rejected" if outcome == "rejected" else "undecided",
                    attempt["reason"],
                )
                continue
            mark = self._clock()
            self._promote(version)
            attempt.update(outcome="promoted", promote_seconds=round(self._clock() - mark, 3))
            log.info("re-tune job %s: %s promoted as router version %d", spec.id, name, version)
            return "promoted", job_result(
                spec,
                attempts,
                data,
                started=started,
                finished=self._clock(),
                timings=timings,
                version=version,
                strategy=name,
            )
        outcomes = {attempt.get("outcome") for attempt in attempts}
        result = job_result(spec, attempts, data, started=started, finished=self._clock(), timings=timings)
        if "insufficient" in outcomes:  # a candidate the held-out data could not judge: more data decides
            result["needs"] = "more held-out data: " + "; ".join(
                f"{a['strategy']}: {a['reason']}" for a in attempts if a.get("outcome") == "insufficient"
            )
            return "waiting", result
        outside = health.outside_band(work, spec.routers, band, before) if "rejected" in outcomes else []
        if outside:  # still broken: a rejection is no reason to stop trying, only to wait for better evidence
            result["needs"] = (
                f"a candidate that passes its gates: every one was rejected while {outside[0]} still "
                f"reads outside its band ({band.describe()}); trying again on newer traffic "
                f"(now {len(held_out)} distinct held-out samples, {held_tokens} tokens)"
            )
            result["rejected_while_outside_band"] = True
            return "waiting", result
        return ("rejected" if "rejected" in outcomes else "failed"), result

    def _reference_scores(self, model: torch.nn.Module, business_line: str | None) -> dict[str, ModelScore]:
        """The reference prompts of the job's line scored by ``model`` (none without reference prompts)."""
        if self.reference_prompts is None:
            return {}
        scores = {}
        for reference in self.reference_prompts.sets_for(business_line):
            batches = self._reference_batches.get(reference.digest)
            if batches is None:
                batches = self._reference_batches[reference.digest] = reference_batches(
                    self.tokenizer, reference, model_context(self.model)
                )  # read as the prober reads them
            scores[reference.name] = score_model(model, batches, business_line=reference.name)
        return scores

    def _reference_checks(
        self,
        spec: JobSpec,
        live: dict[str, ModelScore],
        candidate: dict[str, ModelScore],
        watched: list[str],
        band: Band,
    ) -> list[dict[str, Any]]:
        if self.reference_prompts is None:
            return []
        return self.reference_prompts.checks(
            spec.business_line,
            live,
            candidate,
            routers=watched,
            band=band,
            margin=spec.max_perplexity_increase,
            confidence=self.settings.gate_confidence,
            min_tokens=self.settings.min_held_out_tokens,
            min_samples=self.settings.min_held_out_samples,
        )

    def _short_of_evidence(self, tokens: int, samples: int) -> str | None:
        """Why the held-out samples cannot decide a perplexity gate (``None`` when they can)."""
        if tokens >= self.settings.min_held_out_tokens and samples >= self.settings.min_held_out_samples:
            return None
        return (
            f"{tokens} scored held-out tokens in {samples} distinct samples; the perplexity gate decides on at "
            f"least {self.settings.min_held_out_tokens} tokens in {self.settings.min_held_out_samples} distinct "
            f"samples (let more traffic be captured: a repeated prompt counts once)"
        )

    # ------------------------------------------------------------------ parts
    def _samples(self, spec: JobSpec) -> tuple[list[TokenSample], dict[str, Any]]:
        line = spec.business_line
        if spec.dataset:
            try:
                if self.dataset_dir is not None:  # a name from the admin API: checked again, the file may have moved
                    path, label = resolve_dataset(spec.dataset, self.dataset_dir), spec.dataset
                else:
                    path, label = Path(spec.dataset), None
                samples = load_jsonl_dataset(
                    path, self.tokenizer, business_line=line, max_samples=self.settings.max_samples, label=label
                )
            except ValueError as error:  # DatasetError among them; no message quotes the file's content
                raise JobCannotRun(str(error)) from None
            source = {"source": "dataset", "path": spec.dataset}
        elif self.capture is None:
            raise JobCannotRun(
                "no data: traffic capture is off (serve with --capture to record recent traffic "
                "per business line) and the job names no dataset (a JSONL file)"
            )
        else:
            samples = self.capture.samples(line, limit=self.settings.max_samples)
            source = {"source": "capture"}
        if len(samples) < self.settings.min_samples:
            where = f"business line {line!r}" if line else "all business lines"
            raise JobCannotRun(
                f"{len(samples)} samples of {where} are available; the job needs at least "
                f"{self.settings.min_samples} (let more traffic be captured, or give a dataset)",
                needs_data=source["source"] == "capture",
            )
        distinct = distinct_count(samples)
        if distinct < 2:
            raise JobCannotRun(
                f"the {len(samples)} samples hold {distinct} distinct text(s); the job needs at least 2 "
                f"(one to train on, one held out)",
                needs_data=source["source"] == "capture",
            )
        return samples, {
            **source,
            "business_line": line,
            "samples": len(samples),
            "distinct_samples": distinct,
            "evidence": evidence_digest(samples),
            "tokens": sum(min(len(s), self.settings.max_tokens_per_sample) for s in samples),
        }

    def _copy_live(self) -> torch.nn.Module:
        if self._model_lock is None:
            return copy_without_hooks(self.model).eval()
        with self._model_lock:  # a consistent snapshot even if a promotion is under way
            return copy_without_hooks(self.model).eval()

    def _fit(
        self, spec: JobSpec, name: str, options: dict[str, Any], train: Sequence[TokenSample], batches: list[Any]
    ) -> Candidate:
        if self.settings.command and name != "restore":  # restore is a registry lookup: always here
            return self._fit_external(spec, name, options, train)
        context = FitContext(
            model=self.model,
            batches=batches,
            routers=list(spec.routers),
            versions=self.versions,
            options=options,
            reference=self.reference,
        )
        return get_strategy(name).fit(context)

    def _fit_external(
        self, spec: JobSpec, name: str, options: dict[str, Any], train: Sequence[TokenSample]
    ) -> Candidate:
        directory = self.workdir / f"{spec.id}-{name}"
        shutil.rmtree(directory, ignore_errors=True)
        ensure_private_dir(self.workdir)
        directory.mkdir(mode=0o700)
        try:
            return self._run_external(spec, name, options, train, ensure_private_dir(directory))
        finally:  # the samples are customer traffic: they live only as long as the fit
            shutil.rmtree(directory, ignore_errors=True)

    def _run_external(
        self, spec: JobSpec, name: str, options: dict[str, Any], train: Sequence[TokenSample], directory: Path
    ) -> Candidate:
        output = directory / "output"
        output.mkdir(mode=0o700)
        job_file, data_file = directory / "job.json", directory / "data.jsonl"
        routers_file = directory / "routers.safetensors"
        write_file(
            job_file,
            json.dumps(
                {
                    **spec.as_dict(),
                    "strategy": name,
                    "options": options,
                    "batch_size": self.settings.batch_size,
                    "max_tokens_per_sample": self.settings.max_tokens_per_sample,
                },
                indent=2,
            ),
            private=True,
        )
        write_file(data_file, "".join(json.dumps(sample.as_record()) + "\n" for sample in train), private=True)
        write_file(routers_file, save(router_state(self.model)), private=True)
        fields = {
            "job": job_file,
            "data": data_file,
            "routers": routers_file,
            "output": output,
            "model": self.model_ref,
            "strategy": name,
            "job_id": spec.id,
            "python": sys.executable,
        }
        try:
            command = [
                part.format(**{key: str(value) for key, value in fields.items()})
                for part in shlex.split(self.settings.command or "")
            ]
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"retune command template {self.settings.command!r} is invalid: {error!r}; fields are {sorted(fields)}"
            ) from error
        log.info("re-tune job %s: running %s", spec.id, command[0] if command else "")
        try:
            completed = subprocess.run(
                command, capture_output=True, text=True, timeout=self.settings.command_timeout, check=False
            )
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"the external command ran past {self.settings.command_timeout:g} s") from error
        except OSError as error:
            raise RuntimeError(f"the external command {command[:1]} cannot start: {error}") from error
        if completed.returncode != 0:
            # Its last line only (a traceback's is the error): the rest may quote the data it read.
            lines = [line for line in (completed.stderr or completed.stdout or "").splitlines() if line.strip()]
            last = lines[-1].strip()[-300:] if lines else "(no output)"
            raise RuntimeError(f"the external command exited with status {completed.returncode}: {last}")
        checkpoint = output / "routers.safetensors"
        if not checkpoint.is_file():
            raise RuntimeError(f"the external command exited 0 but wrote no {checkpoint.name} in its output directory")
        # Copies in memory: the directory is removed when the fit ends, the registry keeps what passes.
        tensors = {key: tensor.clone() for key, tensor in load_file(str(checkpoint)).items()}
        details: dict[str, Any] = {"command": command[0] if command else "", "external": True}
        result_file = output / "result.json"
        if result_file.is_file():
            try:
                details.update(json.loads(result_file.read_text()))
            except ValueError as error:
                raise RuntimeError(f"{result_file.name} of the external command is not JSON: {error}") from error
        return Candidate(tensors, details)


class _HealthText:
    """The health text of one job (:mod:`mla_watch.retune.health`), scored on demand: what a restore is judged by."""

    def __init__(self, tokenizer: Any, rules: Sequence[Any]) -> None:
        from mla_watch.retune.health import threshold_rules

        self.rules = list(rules)
        self.judged = bool(threshold_rules(self.rules))
        self._tokenizer = tokenizer
        self._batches: list[Any] | None = None
        self._live: ModelScore | None = None

    def _score(self, model: torch.nn.Module) -> ModelScore:
        from mla_watch.retune.health import health_batches

        if self._batches is None:
            self._batches = health_batches(self._tokenizer)
        return score_model(model, self._batches, business_line="health")

    def live(self, model: torch.nn.Module) -> ModelScore:
        """The live routers on the health text; ``model`` must hold them (scored once per job)."""
        if self._live is None:
            self._live = self._score(model)
        return self._live

    def known_good(
        self,
        model: torch.nn.Module,
        source: str,
        *,
        routers: Sequence[str],
        band: Band,
        live_state: dict[str, torch.Tensor],
    ) -> KnownGood:
        """``model`` holds the candidate; ``live_state`` the live routers (put back to read them)."""
        from mla_watch.retune.health import judge_health

        candidate = self._score(model)
        if self._live is None:
            restored = router_state(model)
            apply_router_tensors(model, live_state)
            self.live(model)
            apply_router_tensors(model, restored)
        return KnownGood(
            source=source,
            health=judge_health(candidate, self.rules),
            score=candidate,
            live_outside_band=self._live is not None and bool(self._live.outside(routers, band)),
        )

    def outside_band(
        self, model: torch.nn.Module, routers: Sequence[str], band: Band, held_out: ModelScore
    ) -> list[str]:
        """The routers that read outside ``band`` now (``model`` holds the live routers): on the health text when
        there are rules to judge it by, else on the held-out samples (``held_out``: the live model's score)."""
        score = self.live(model) if self.judged else held_out
        return [] if score is None else score.outside(routers, band)
