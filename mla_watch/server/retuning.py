"""Re-tuning as the sidecar starts it: the re-tune service for the local model's routers or for the engine's
beside it (``--engine-retune propose|apply``), traffic capture, and the callbacks that connect it to the
alerts (a rule's ``retune`` action; on-call hears of rejected and proposed candidates) and to the routing
windows (restarted after a promotion or rollback).

:class:`Retuning` writes ``serving.retune``; the handlers and the read views read it there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mla_watch.alerting.alert_engine import Action
from mla_watch.alerting.alert_service import AlertService
from mla_watch.alerting.causes import CAUSE_LABEL
from mla_watch.common.state_dir import DATASETS_DIR_NAME, ensure_private_dir
from mla_watch.common.state_writes import StateWrites
from mla_watch.engines.backends import SWAPPING_ENGINES, engine_weights
from mla_watch.retune.availability import RetuneConditions, no_job_note, why_retune_is_off
from mla_watch.retune.jobs import JobSpec
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER
from mla_watch.routing.windows import ALL_LINES
from mla_watch.server.config import ServerConfig
from mla_watch.server.handler_context import Serving
from mla_watch.server.metrics import ServerMetrics
from mla_watch.server.reference_readings import References
from mla_watch.server.sources import RoutingSources

if TYPE_CHECKING:
    from mla_watch.retune.service import RetuneService

__all__ = ["Retuning", "proposed_notice", "rejected_notice"]

log = logging.getLogger("mla_watch.server")
RUNBOOK = "https://github.com/mla-watch/mla_watch/blob/main/docs/runbooks.md"


class Retuning:
    """Starts the re-tune service (beside the local model or the engine) and answers its callbacks."""

    def __init__(
        self,
        *,
        config: ServerConfig,
        serving: Serving,
        sources: RoutingSources,
        metrics: ServerMetrics,
        alerts: AlertService | None,
        references: References,
        writes: StateWrites | None = None,
    ) -> None:
        self.config = config
        self.writes = writes  # told by the router versions and the capture whether they can write
        self.serving = serving
        self.sources = sources
        self.metrics = metrics
        self.alerts = alerts
        self.references = references
        # what re-tuning the engine's routers depends on, known once start_engine ran (capture, the engine's answer)
        self.engine_conditions = RetuneConditions(
            "engine", engine=config.engine, swaps=config.engine in SWAPPING_ENGINES, engine_retune=config.engine_retune
        )

    # ------------------------------------------------------------------ beside the local model
    def start_local(self, model: Any, tokenizer: Any) -> None:
        """The re-tune service for the loaded model's routers (``serving.model_worker`` runs it), with capture if on."""
        from mla_watch.retune.runner import Retuner
        from mla_watch.retune.service import RetuneService
        from mla_watch.retune.versions import RouterVersions

        assert self.serving.model_worker is not None  # the loaded model's worker starts first
        state = ensure_private_dir(self.config.state_dir)  # 0700: it holds captured traffic
        # Jobs from the admin API read datasets from here only (a bare file name, resolved inside it).
        datasets = self.config.dataset_dir if self.config.dataset_dir is not None else state / DATASETS_DIR_NAME
        ensure_private_dir(datasets)
        versions = RouterVersions(state / "routers", self.config.router_versions, writes=self.writes)
        capture = self.open_capture()
        if capture is not None:
            record = self.capture_answers(capture)
            self.serving.model_worker.capture = lambda line, token_ids, prompt_tokens, client: record(
                line, [(token_ids, prompt_tokens)], client
            )
        reference = None
        if self.config.reference_model is not None:
            from mla_watch.retune.reference import load_reference_routers
            from mla_watch.retune.router_tensors import router_state

            reference = load_reference_routers(self.config.reference_model, router_state(model))
        retuner = Retuner(
            model=model,
            tokenizer=tokenizer,
            versions=versions,
            settings=self.config.retune,
            workdir=state / "retune-work",
            # the service is made below, before any job runs
            promote=lambda version: cast(RetuneService, self.serving.retune).promote(version),
            capture=capture,
            model_lock=self.serving.model_worker.model_lock,
            model_ref=self.config.model,
            dataset_dir=datasets,
            reference=reference,
            health_rules=None if self.alerts is None else lambda: cast(AlertService, self.alerts).rules.rules,
            reference_prompts=self.references.gate,
        )
        self.serving.retune = RetuneService(
            state_dir=state,
            settings=self.config.retune,
            retuner=retuner,
            versions=versions,
            model_lock=self.serving.model_worker.model_lock,
            on_promoted=self.routers_changed,
            on_rejected=self.rejected,
            on_outcome=lambda strategy, outcome: self.metrics.retune_jobs.labels(strategy, outcome).inc(),
            health_check=self._router_health(tokenizer),
            resume_jobs=self.config.fleet is None,
        )
        self.serving.retune.start()
        self._started(self.serving.retune)

    # ------------------------------------------------------------------ re-tuning beside an engine
    def open_capture(self) -> Any:
        """STATE_DIR/capture.sqlite (0600) when serving with --capture, else ``None``."""
        if not self.config.capture:
            return None
        from mla_watch.retune.capture import TrafficCapture

        return TrafficCapture(
            self.config.state_dir / "capture.sqlite",
            max_samples_per_line=self.config.capture_max_samples,
            max_age_seconds=self.config.capture_max_age_seconds,
            max_client_share=self.config.capture_max_client_share,
            writes=self.writes,
        )

    def capture_answers(self, capture: Any) -> Callable[[str, list[tuple[list[int], int]], str | None], None]:
        from mla_watch.retune.capture import CaptureError

        def record(line: str, samples: list[tuple[list[int], int]], client: str | None = None) -> None:
            try:
                for token_ids, prompt_tokens in samples:
                    capture.add(line, token_ids, prompt_tokens=prompt_tokens, client=client)
                    self.metrics.captured_samples.labels(line).inc()
            except CaptureError as error:  # the client has its answer: a full disk costs the capture, not it
                if self.writes is None:  # else the state directory's writes said it, once per change
                    log.warning("an answer of %s was not captured: %s", line, error)

        return record

    def start_engine(self, capture: Any) -> None:
        """The re-tune service for the engine's routers (``--engine-retune propose|apply``); in
        ``serving.engine_retune_note`` (``GET /v1/status``'s ``engine.retune``, logged), what it does or why there
        is none (:func:`~mla_watch.retune.availability.why_retune_is_off`)."""
        config = self.config
        self.engine_conditions = RetuneConditions(
            "engine" if self.sources.engine_routing is not None else "none",
            engine=config.engine,
            swaps=config.engine in SWAPPING_ENGINES,
            engine_retune=config.engine_retune,
            capture=capture is not None,
        )
        if self.sources.engine_routing is None or config.engine_retune == "off" or not self.engine_conditions.swaps:
            self._engine_note(None)
            return
        from mla_watch.engines.router_checkpoint import read_router_tensors
        from mla_watch.retune.engine_retuning import EngineRetuner, EngineRouters
        from mla_watch.retune.service import RetuneService
        from mla_watch.retune.versions import RouterVersions

        geometry = self.sources.engine_routing.geometry
        # --model-config names the config.json or its directory: the router tensors are read from the safetensors
        # beside it, in the checkpoint directory the engine loaded.
        given = Path(config.model_config)  # type: ignore[arg-type]
        checkpoint = given if given.is_dir() else given.parent
        try:
            initial = read_router_tensors(checkpoint, geometry.moe_layers)
        except ValueError as error:
            self.engine_conditions = replace(self.engine_conditions, checkpoint_problem=str(error))
            self._engine_note(None)
            return
        assert config.upstream is not None  # beside an engine: --upstream
        weights = engine_weights(
            config.engine,
            config.upstream,
            timeout=max(config.request_timeout, 60.0),
            geometry=geometry,
            api_key=os.environ.get("MLA_WATCH_ENGINE_API_KEY"),
            admin_api_key=os.environ.get("MLA_WATCH_ENGINE_ADMIN_API_KEY"),
        )
        assert weights is not None  # a swapping engine's (checked above)
        state = ensure_private_dir(config.state_dir)
        swap_dir = config.engine_swap_dir or state / "engine-swaps"
        host = EngineRouters(
            weights,
            geometry,
            initial,
            swap_dir=swap_dir,
            config_json=given if given.is_file() else checkpoint / "config.json",
        )
        versions = RouterVersions(state / "routers", self.config.router_versions, writes=self.writes)
        reference = None
        if config.reference_model is not None:
            from mla_watch.retune.reference import load_reference_routers

            reference = load_reference_routers(config.reference_model, initial)
        windows = self.sources.engine_routing

        def loads(router: str, line: str | None) -> Any:
            return windows.counts(line).get(router)

        retuner = EngineRetuner(
            host=host,
            versions=versions,
            settings=config.retune,
            mode=config.engine_retune,
            capture=capture,  # the service is made below, before any job runs
            promote=lambda version: cast(RetuneService, self.serving.retune).promote(version),
            rollback=lambda: cast(RetuneService, self.serving.retune).rollback(),
            loads=loads,
            reference=reference,
            gate_timeout=config.engine_gate_timeout,
            reference_prompts=self.references.gate,
            reference_reader=self.references.engine_reader(geometry),
        )
        self.serving.retune = RetuneService(
            state_dir=state,
            settings=config.retune,
            retuner=retuner,
            versions=versions,
            model_lock=threading.Lock(),
            on_promoted=self.routers_changed,
            on_rejected=self.rejected,
            on_proposed=self.proposed,
            on_outcome=lambda strategy, outcome: self.metrics.retune_jobs.labels(strategy, outcome).inc(),
            resume_jobs=config.fleet is None,
        )
        self.serving.retune.start()
        self._started(self.serving.retune)

        running = f"re-tuning the engine's routers: {config.engine_retune} (swaps written to {swap_dir})"
        self._engine_note(running)

        def check() -> None:  # an engine still starting must not hold up the sidecar's own start
            problem = weights.problem()
            if problem is not None:
                self.engine_conditions = replace(self.engine_conditions, engine_problem=problem)
                self._engine_note(running)

        threading.Thread(target=check, name="mla-watch-engine-check", daemon=True).start()

    def _engine_note(self, running: str | None) -> None:
        """``serving.engine_retune_note`` from :attr:`engine_conditions` (and the service's line where it runs),
        logged: a warning where re-tuning was asked for and cannot work."""
        why = why_retune_is_off(self.engine_conditions)
        if running is None:
            note = why or "re-tuning the engine's routers is off"  # a reason always applies where it does not run
        else:
            note = running if why is None else f"{running}, but {why}"
        self.serving.engine_retune_note = note
        asked = self.config.engine_retune != "off" and self.engine_conditions.routers == "engine"
        log.log(
            logging.WARNING if asked and why is not None and not why.startswith("an alert") else logging.INFO,
            "%s",
            note,
        )

    # ------------------------------------------------------------------ the fleet
    def _started(self, service: RetuneService) -> None:
        """The re-tune service runs: say which router version serves, and join the fleet (``--fleet``), adopting its
        version before the routers are judged."""
        self.metrics.router_version.set(service.versions.live_version() or 0)
        if self.config.fleet is None:
            self._version_changed(service)
            return
        from mla_watch.fleet.check import StepCheck
        from mla_watch.fleet.fleet_store import FleetStore
        from mla_watch.fleet.member import FleetMember

        settings = self.config.fleet
        references, alerts = self.references, self.alerts
        member = FleetMember(
            FleetStore(settings.url),
            settings,
            retune=service,
            check=StepCheck(
                references.gate,
                lambda: None if references.prober is None else references.prober.reader,
                lambda: alerts.rules.rules if alerts is not None else [],
            ),
            health=references.router_health,
            still_wanted=self._still_wanted,
            page=self._page,
            on_store=self._fleet_store,
            on_step=lambda outcome: self.metrics.fleet_rollout_steps.labels(outcome).inc(),
            on_serving=lambda version, digest: self.metrics.serving_version(
                "unknown" if version is None else version, digest
            ),
            read_again=references.read_again,
            url=self.config.public_url or None,
        )
        self.serving.fleet = member
        member.join()
        member.start()
        log.info(
            "fleet member %s of %s: serving fleet version %s (digest %s)",
            settings.name,
            member.store.where,
            member.version,
            member.digest[:12],
        )

    def _version_changed(self, service: RetuneService) -> None:
        from mla_watch.common.tensor_files import router_digest

        self.metrics.serving_version(service.versions.live_version(), router_digest(service.retuner.host.state()))

    def _fleet_store(self, up: bool, why: str | None) -> None:
        self.metrics.fleet_store_up.set(1 if up else 0)

    def _still_wanted(self, router: str, business_line: str | None) -> bool:
        """Whether a model-caused alert on ``router`` still fires here (the fleet asks before deciding again)."""
        if self.alerts is None:
            return False
        return any(
            alert.state == "firing"
            and alert.labels.get(ROUTER) == router
            and (alert.cause or {}).get("name") == "model"
            for alert in self.alerts.engine.alerts()
        )

    def _page(self, labels: dict[str, str], annotations: dict[str, str]) -> None:
        if self.alerts is not None:
            self.alerts.notify_event(labels=labels, annotations=annotations)

    # ------------------------------------------------------------------ callbacks
    def proposed(self, spec: JobSpec, result: dict[str, Any]) -> None:
        if self.alerts is not None:
            labels, annotations = proposed_notice(spec, result)
            self.alerts.notify_event(labels=labels, annotations=annotations, receivers=spec.trigger.get("receivers"))

    def _router_health(self, tokenizer: Any) -> Callable[[Any], dict[str, Any]] | None:
        """The start-up health check of router version 0, by the loaded alert rules (none without rules)."""
        if self.alerts is None:
            return None
        from mla_watch.retune.health import startup_health

        rules = self.alerts.rules.rules
        return lambda host: startup_health(host.model, tokenizer, rules)

    def on_retune_action(self, action: Action) -> str:
        """Schedule the job a rule's ``retune`` action asks for; say what became of it (for the page)."""
        router = action.alert.labels.get(ROUTER, "")
        cause = action.alert.labels.get(CAUSE_LABEL)
        if cause != "model":  # the alert engine asks only for these; a guard all the same
            return (
                f"no re-tune job: the cause is {cause or 'undetermined'}, not the model (a router is re-tuned only "
                "when its reference prompts show the model changed)"
            )
        engine = router in self.sources.engine_routers()
        if engine and self.serving.retune is None:
            return no_job_note(self.engine_conditions, f" for {router}, the engine's router")
        if self.serving.retune is None:
            return no_job_note(RetuneConditions("none"))
        if router not in self.serving.retune.watched_by(None):
            return (
                f"no re-tune job: {router} is not an expert router of this sidecar's model (routing shipped by "
                "another process is watched, not re-tuned here)"
            )
        if self.serving.retune.retuner.capture is None:  # the job would have no data (the other reasons: quoted)
            return no_job_note(self.engine_conditions if engine else RetuneConditions("local", capture=False))
        if self.serving.fleet is not None:
            return self.serving.fleet.on_model_alert(action)
        record = self.serving.retune.on_alert(action)
        if record is None:
            return "no new re-tune job: this router is in its re-tune cooldown (see /v1/retune/jobs)"
        return f"re-tune job {record['id']} {record.get('status', 'scheduled')}"

    def routers_changed(self, kind: str, routers: list[str]) -> None:
        """After a promotion or rollback: the windows restart, describing the routers now serving."""
        windows = self.sources.own_windows()  # the counts so far collected first: they belong to the routers before
        if windows is not None:
            windows.reset(routers)
        self.metrics.router_promotions.labels(kind).inc()
        assert self.serving.retune is not None  # a promotion or rollback is the service's
        self.metrics.router_version.set(self.serving.retune.versions.live_version() or 0)
        if self.serving.fleet is None:  # a fleet member says its fleet version itself
            self._version_changed(self.serving.retune)
        self.sources.trust_baselines(self.serving.retune)

    def rejected(self, spec: JobSpec, result: dict[str, Any]) -> None:
        if self.alerts is not None:
            labels, annotations = rejected_notice(spec, result)
            self.alerts.notify_event(labels=labels, annotations=annotations, receivers=spec.trigger.get("receivers"))


def rejected_notice(spec: JobSpec, result: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of the ``RouterRetuneRejected`` event for on-call, with every
    strategy's figures before -> after."""
    figures = []
    for attempt in result.get("attempts", []):
        line = f"{attempt['strategy']}: {attempt.get('outcome')}"
        gates = attempt.get("gates")
        if gates:
            metric = gates["band"]["metric"]
            paired = gates.get("perplexity") or {}
            interval = (
                f" [{paired.get('low')}, {paired.get('high')}] at {paired.get('confidence')} each side, "
                f"limit {paired.get('limit')}, {paired.get('decision')} on {paired.get('tokens')} held-out "
                f"tokens"
                if paired
                else ""
            )
            line += (
                f" (perplexity {gates['before']['perplexity']} -> {gates['after']['perplexity']}{interval}, "
                f"{metric} "
                + ", ".join(
                    f"{name} {gates['before'][metric].get(name)} -> {value}"
                    for name, value in gates["after"][metric].items()
                )
                + ")"
            )
        if attempt.get("reason"):
            line += f": {attempt['reason']}"
        figures.append(line)
    line_name = spec.business_line or ALL_LINES
    labels = {
        "alertname": "RouterRetuneRejected",
        "severity": "warning",
        ROUTER: ",".join(spec.routers),
        LAYER: str(spec.trigger.get("layer", "")),
        BUSINESS_LINE: line_name,
        "job": spec.id,
    }
    annotations = {
        "summary": f"Re-tune job {spec.id} for {', '.join(spec.routers)} ({line_name}) was rejected by its gates; "
        "the live routers are unchanged"
        + ("; the job keeps trying on newer traffic" if result.get("rejected_while_outside_band") else ""),
        "description": "; ".join(figures + ([result["needs"]] if result.get("needs") else [])),
        "runbook_url": f"{RUNBOOK}#routerretunerejected",
    }
    return labels, annotations


def proposed_notice(spec: JobSpec, result: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The ``RouterRetuneProposed`` event: a candidate for the engine's routers is saved; the one command that
    swaps it in, gates it through the engine and keeps it or rolls it back."""
    line_name = spec.business_line or ALL_LINES
    labels = {
        "alertname": "RouterRetuneProposed",
        "severity": "warning",
        ROUTER: ",".join(spec.routers),
        LAYER: str(spec.trigger.get("layer", "")),
        BUSINESS_LINE: line_name,
        "job": spec.id,
    }
    attempt: dict[str, Any] = next((a for a in result.get("attempts", []) if a.get("outcome") == "proposed"), {})
    details = ", ".join(
        f"{a['strategy']}: {a.get('outcome')}" + (f" ({a['reason']})" if a.get("reason") else "")
        for a in result.get("attempts", [])
    )
    annotations = {
        "summary": f"Re-tune job {spec.id} proposes router version {result.get('version')} "
        f"({result.get('strategy')}) for {', '.join(spec.routers)} ({line_name}); apply it with: "
        f"{result.get('command')}",
        "description": f"{details}. The command swaps the candidate into the engine, has the engine score the "
        f"held-out captured traffic before and after, and keeps it only if it passes; else the "
        f"previous routers go back at once." + (f" Candidate: {attempt.get('version')}." if attempt else ""),
        "runbook_url": f"{RUNBOOK}#routerretuneproposed",
    }
    return labels, annotations
