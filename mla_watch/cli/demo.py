"""``mla-watch demo``: the whole loop in one command, offline, on the bundled model.

It starts the sidecar (traffic capture on) and a local webhook receiver standing in for
on-call, drives traffic for the four business lines (code and SQL requests ask for sampling
the policies clamp or refuse), injects a router collapse into MoE layer 1 (+2 on the
correction bias of six experts), and shows live what follows: the page, the ``bias`` re-tune
job, its promotion, entropy back in band, the alert resolving. At the end it writes
``timeline.png`` (entropy per layer with the thresholds and the events) and ``summary.json``,
and exits 1 if any step of the loop did not happen.

The rule is the shipped RoutingEntropyLow over every line summed, with ``for: 0s`` and windows of
192 tokens per line, the job's samples captured before the fault, and no traffic while the sidecar reads the
alert's cause or fits the job, so that the loop takes about a minute on 2 CPU cores (two to three when
other work shares them: docs/first-hour.md); the job trains on the traffic captured from every line.
Everything else is what ``mla-watch serve`` runs.

The result, and the files and summary made of it: :mod:`mla_watch.cli.demo_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.cli.demo_lines import alert_bits, alert_line, job_line, policy_changes
from mla_watch.cli.demo_report import (
    COLLAPSED,
    FIRE_BELOW,
    OUTPUT_ROOM,
    RESOLVE_ABOVE,
    DemoResult,
    summary_lines,
    timeline_png,
    write_outputs,
)
from mla_watch.common.output_file import OutputError, check_output_dir, write_file

__all__ = ["STEPS", "DemoResult", "run_demo", "summary_lines", "timeline_png", "write_outputs"]

# Router scores are sigmoids, in (0, 1): +2 on six experts' correction bias makes them every token's choice.
FAULT_BIAS = 2.0
JOB_SAMPLES = 48  # captured samples the re-tune job waits for (see run_demo)
STEPS: tuple[str, ...] = (
    "traffic served",
    "sampling clamped",
    "fault injected",
    "on-call paged",
    "re-tune promoted",
    "entropy back in band",
    "alert resolved",
)
RULES = entropy_low_rules(
    below=FIRE_BELOW,
    resolve_above=RESOLVE_ABOVE,
    min_tokens=96,
    business_line="all",
    actions=("notify", "retune"),
    strategies=("bias",),
    annotations={
        "summary": "Routing entropy {value:.2f} bits on {router} (all lines) is below {threshold} bits",
        # rendered again when the alert resolves: the demo's lines say what it is now
        "value": "{value}",
        "threshold": "{threshold}",
        "resolve_threshold": "{resolve_threshold}",
    },
)
# (business line, task, corpus domain, requested sampling): code asks for chat-like sampling,
# temperature 0.9 (clamped to 0.3), SQL too (refused by a reject policy), every other SQL request
# asks correctly.
TRAFFIC = (
    ("customer_service", None, "customer_service", {"temperature": 0.7}),
    ("code_assistant", "code", "code", {"temperature": 0.9, "top_p": 0.95}),
    ("doc_summary", None, "doc_summary", {"temperature": 0.5}),
    ("code_assistant", "sql", "sql", {"temperature": 0.2, "repetition_penalty": 1.2}),
    ("code_assistant", "sql", "sql", {"temperature": 0.9}),
)
EVENT_ROWS = 12  # the live view's table shows the latest events (each distinct one once, with a count)


class _Receiver:
    """On-call, standing in: records the Alertmanager webhooks the sidecar posts."""

    def __init__(self, port: int = 0) -> None:
        self.alerts: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with contextlib.suppress(ValueError):  # not ours to judge: record what parses
                    receiver.alerts.extend(json.loads(body).get("alerts", []))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as error:
            from mla_watch.cli.startup import FlagError

            why = (
                "is in use" if error.errno == errno.EADDRINUSE else f"cannot be listened on ({error.strerror or error})"
            )
            raise FlagError(
                f"--receiver-port {port}: 127.0.0.1:{port} {why}: expected a free port (or --receiver-port 0 for any)"
            ) from None
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seen(self, status: str, router: str = COLLAPSED) -> list[dict[str, Any]]:
        return [
            a
            for a in list(self.alerts)
            if a.get("status") == status
            and a["labels"].get("router") == router
            and a["labels"].get("alertname") == "RoutingEntropyLow"
        ]

    def close(self) -> None:
        self.server.shutdown()


@contextmanager
def _serve(app: Any, sock: socket.socket) -> Iterator[str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the sidecar did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class _View:
    """The live terminal view (rich), or, when ``live`` is off (stdout piped), one plain line per
    phase and per event: only the redraws are left out."""

    def __init__(self, live: bool) -> None:
        from rich.console import Console

        self.console = Console()
        self.live_enabled = live
        # events: (kind, detail) in the order first seen; counts: how often each counted one was seen
        self.state: dict[str, Any] = {"phase": "starting", "bits": {}, "events": [], "requests": {}}
        self.seen: set[tuple[str, str]] = set()
        self.counts: dict[tuple[str, str], int] = {}
        self._live: Any = None

    def __enter__(self) -> _View:
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(self.render(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(*exc)

    def line(self, message: str) -> None:
        """One line that stays, live or not (printed above the live view): never wrapped, no markup."""
        from rich.text import Text

        self.console.print(Text.assemble(("mla-watch demo", "bold"), ": ", message), soft_wrap=True, highlight=False)

    def say(self, message: str) -> None:
        self.state["phase"] = message
        if self._live is None:
            self.line(message)
        else:
            self._live.update(self.render())

    def event(self, kind: str, detail: str, *, counted: bool = False) -> None:
        """Something mla_watch did: a row of the live view's table, or a line when not live (once each);
        ``counted``: the table says how many times it happened (a policy change, once per request)."""
        key = (kind, detail)
        if counted:
            self.counts[key] = self.counts.get(key, 0) + 1
        if key in self.seen:
            if counted:
                self.refresh()
            return
        self.seen.add(key)
        self.state["events"].append(key)
        if self._live is None:
            self.line(detail if kind == "alert" else f"{kind}: {detail}")  # an alert's says paged/resolved
        else:
            self._live.update(self.render())

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        routing = Table(
            title="routing entropy, all lines (bits; fires < 5.0, resolves >= 5.2, ceiling 6.0)", expand=True
        )
        for column in ("router", "bits", "band"):
            routing.add_column(column)
        for name, bits in sorted(self.state["bits"].items()):
            width = 30
            filled = max(0, min(width, round((bits - 2.585) / (6.0 - 2.585) * width)))
            colour = "red" if bits < FIRE_BELOW else ("yellow" if bits < RESOLVE_ABOVE else "green")
            routing.add_row(name, f"{bits:.3f}", Text("█" * filled + "·" * (width - filled), style=colour))
        events = Table(title="what mla_watch did", expand=True)
        events.add_column("kind")
        events.add_column("detail")
        events.add_column("times", justify="right")
        for kind, detail in self.state["events"][-EVENT_ROWS:]:
            events.add_row(kind, Text(detail), str(self.counts.get((kind, detail), "")))
        requests = ", ".join(f"{k} {v}" for k, v in sorted(self.state["requests"].items()))
        return Group(
            Text(f"phase: {self.state['phase']}", style="bold"), Text(f"requests: {requests}"), routing, events
        )


def run_demo(
    out_dir: Path,
    *,
    live: bool = True,
    timeout: float = 600.0,
    inject_fault: bool = True,
    port: int = 0,
    receiver_port: int = 0,
) -> DemoResult:
    """Run the loop; returns what happened (``result.ok`` when every step did). ``port``: the sidecar's on
    127.0.0.1, ``receiver_port`` its webhook receiver's (0: any free one); one in use is a
    :class:`~mla_watch.cli_startup.FlagError` before anything runs."""
    import torch

    from mla_watch.cli.startup import bind_listener, one_thread_for_the_bundled_model
    from mla_watch.models import corpus
    from mla_watch.retune.jobs import FINAL_STATUSES, RetuneSettings
    from mla_watch.server.app import ServerConfig, Sidecar

    sock = bind_listener("127.0.0.1", port)
    try:
        receiver = _Receiver(receiver_port)
    except BaseException:
        sock.close()
        raise
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    one_thread_for_the_bundled_model("bundled", "cpu")
    work = Path(tempfile.mkdtemp(prefix="mla-watch-demo-"))
    (work / "rules").mkdir()
    write_file(work / "rules" / "routing.yaml", RULES)
    os.environ["MLA_WATCH_ONCALL_URL"] = receiver.url
    started = time.monotonic()
    events: dict[str, float] = {}
    paged_bits: float | None = None  # the value the page carried
    samples: list[dict[str, Any]] = []
    adjustments: list[str] = []
    requests: dict[str, int] = {}
    notes: list[str] = []
    job: dict[str, Any] | None = None
    prompts = {domain: itertools.cycle(corpus.prompts(domain, 40, seed=2024)) for domain in corpus.DOMAINS}
    # The job runs once JOB_SAMPLES are captured (36 to train on, a quarter held out), trying again every second
    # until then, and re-fits the bias in steps of 0.02 (default 0.05): a bias fitted on fewer samples, or in
    # coarser steps, lands farther from the healthy routing the reference prompts' gate compares with (its
    # limit is 0.05 bits; 0.008-0.014 in steps of 0.02 on 36 samples, 0.018-0.024 in steps of 0.05, up to
    # 0.061 on 24).
    config = ServerConfig(
        device="cpu",
        rules=work / "rules",
        state_dir=work / "state",
        alert_interval=0.5,
        window_tokens=192,
        capture=True,
        retune=RetuneSettings(min_samples=JOB_SAMPLES, retry_seconds=1.0, strategy_options={"bias": {"gamma": 0.02}}),
        history_interval_seconds=1.0,
        policy_poll_seconds=None,
        admin_token=None,
        public_url=url,
    )
    try:
        sidecar = Sidecar(config)
        with _serve(sidecar.app, sock), _View(live) as view:
            view.line(f"the status page, open while the demo runs: {url}/")
            view.say("loading the bundled model")
            if not sidecar.wait_ready(180):
                raise RuntimeError(f"the sidecar did not become ready: {sidecar.load_error}")
            client = httpx.Client(base_url=url, timeout=120)
            counter = itertools.count()
            seen_alerts = 0
            alert_status: dict[tuple, str | None] = {}

            def now() -> float:
                return time.monotonic() - started

            def sample() -> None:
                records = client.get("/v1/routing").json()["routers"]
                bits = {r["name"]: r["entropy_bits"] for r in records if r["kind"] == "expert" and r["tokens"] > 0}
                nonlocal seen_alerts, paged_bits
                samples.append({"t": now(), "bits": bits})
                view.state["bits"] = bits
                alerts = list(receiver.alerts)
                for alert in alerts[seen_alerts:]:  # a line when an alert changes status (not at each resend)
                    labels = tuple(sorted((alert.get("labels") or {}).items()))
                    if alert_status.get(labels) != alert.get("status"):
                        alert_status[labels] = alert.get("status")
                        view.event("alert", alert_line(alert))
                        if paged_bits is None and alert in receiver.seen("firing"):
                            paged_bits = alert_bits(alert)
                seen_alerts = len(alerts)
                # The page's job is shown once on-call has the page that says it started.
                jobs = client.get("/v1/retune/jobs").json()["jobs"] if receiver.seen("firing") else []
                for job in reversed(jobs):  # oldest first
                    view.event("re-tune", job_line(job))
                view.refresh()

            def request() -> None:
                line, task, domain, sampling = TRAFFIC[next(counter) % len(TRAFFIC)]
                headers = {"X-Business-Line": line, **({"X-Task": task} if task else {})}
                body = {"prompt": next(prompts[domain]), "max_tokens": 24, "seed": len(samples), **sampling}
                response = client.post("/v1/completions", json=body, headers=headers)
                key = f"{line}/{task}" if task else line
                requests[f"{key} {response.status_code}"] = requests.get(f"{key} {response.status_code}", 0) + 1
                view.state["requests"] = requests
                changes = []
                if response.status_code == 200:
                    changes = policy_changes(key, response.json()["mla_watch"]["adjustments"])
                elif response.status_code == 400:
                    changes = [f"{key}: refused: {response.json()['error']['message'].removesuffix(' for ' + key)}"]
                adjustments.extend(changes)
                for change in changes:
                    view.event("policy", change, counted=True)
                sample()

            def until(condition: Any, phase: str, limit: float, busy: Any = lambda: False) -> bool:
                """Traffic until ``condition``; while ``busy()`` (the sidecar at work on what the phase waits for:
                an alert's cause being read, a job fitting) none is sent, only the routing read: on 2 cores more
                requests would only slow that work down."""
                view.say(phase)
                deadline = time.monotonic() + limit
                while not condition():
                    if time.monotonic() > deadline or time.monotonic() - started > timeout:
                        notes.append(f"gave up waiting: {phase}")
                        return False
                    if busy():
                        sample()
                        time.sleep(0.25)
                    else:
                        request()
                return True

            def references_learned() -> bool:  # every set of reference prompts read on the healthy routers
                document = client.get("/v1/reference").json()
                return bool(document.get("available")) and all(s["baseline"] for s in document["sets"])

            for _ in range(16):
                request()

            # A fault injected before the reference prompts' healthy routing is learned would be learned as healthy,
            # and every candidate judged against it.
            def served() -> int:  # requests answered: each one captured
                return sum(count for key, count in requests.items() if key.endswith(" 200"))

            # The job's samples are captured before the fault too, while the reference prompts are read: once paged,
            # it runs at once.
            until(
                lambda: references_learned() and served() >= JOB_SAMPLES,
                "healthy traffic while the reference prompts' healthy routing is learned",
                120,
            )
            view.say("healthy traffic served")
            if inject_fault:
                assert sidecar.model_worker is not None  # the demo serves its bundled model
                with sidecar.model_worker.model_lock, torch.no_grad():
                    sidecar.model_worker.model.model.layers[1].mlp.gate.e_score_correction_bias[:6] += FAULT_BIAS
                events["fault injected"] = now()
                view.say(f"fault injected: +{FAULT_BIAS:g} on six experts' correction bias of {COLLAPSED}")

            def pending() -> bool:  # the alert is due: its cause is being read through the model
                return any(
                    a["state"] == "pending" and a["labels"].get("router") == COLLAPSED
                    for a in client.get("/v1/alerts").json()["alerts"]
                )

            if until(lambda: receiver.seen("firing"), "waiting for the page", 120, busy=pending):
                events["on-call paged"] = now()

                def job_done() -> bool:  # one promoted, or every one ended (a job short of data waits: not yet)
                    jobs = client.get("/v1/retune/jobs").json()["jobs"]
                    return bool(jobs) and (
                        any(j["status"] == "promoted" for j in jobs) or all(j["status"] in FINAL_STATUSES for j in jobs)
                    )

                def fitting() -> bool:  # a job has the data it needs and runs: traffic would only slow it down
                    return any(j["status"] == "running" for j in client.get("/v1/retune/jobs").json()["jobs"])

                if until(job_done, "the re-tune job runs (bias re-fit on the captured traffic)", 300, busy=fitting):
                    jobs = client.get("/v1/retune/jobs").json()["jobs"]
                    job = next((j for j in jobs if j["status"] == "promoted"), jobs[0])
                    if job["status"] == "promoted":
                        events["re-tune promoted"] = now()
                    view.say(f"re-tune job {job['status']}")
                    if until(
                        lambda: receiver.seen("resolved") and not _firing(client),
                        "traffic goes on until the alerts resolve",
                        180,
                    ):
                        events["alert resolved"] = now()
            for _ in range(3):
                request()
            view.say("done")
            client.close()
    finally:
        receiver.close()
        sock.close()
        shutil.rmtree(work, ignore_errors=True)  # the demo sidecar's state: its outputs are in out_dir
    steps = {
        "traffic served": any(key.endswith(" 200") for key in requests),
        "sampling clamped": any(" -> " in a and ": refused: " not in a for a in adjustments),
        "fault injected": "fault injected" in events,
        "on-call paged": "on-call paged" in events,
        "re-tune promoted": "re-tune promoted" in events,
        "entropy back in band": bool(samples)
        and "re-tune promoted" in events
        and samples[-1]["bits"].get(COLLAPSED, 0.0) >= RESOLVE_ABOVE,
        "alert resolved": "alert resolved" in events,
    }
    return DemoResult(steps, events, samples, requests, adjustments, job, out_dir, notes, paged_bits)


def _firing(client: httpx.Client) -> bool:
    return any(a["state"] == "firing" for a in client.get("/v1/alerts").json()["alerts"])


def main(
    out_dir: Path, live: bool, timeout: float, inject_fault: bool = True, port: int = 0, receiver_port: int = 0
) -> int:
    # A directory that cannot take the outputs is said now, not after the run: a device, a read-only or full disk.
    check_output_dir(out_dir, label=f"--out {out_dir}", room=OUTPUT_ROOM)
    result = run_demo(
        out_dir, live=live, timeout=timeout, inject_fault=inject_fault, port=port, receiver_port=receiver_port
    )
    unwritten: OutputError | None = None
    try:
        write_outputs(result)
    except OutputError as error:  # the disk filled during the run: the summary is still worth printing
        unwritten = error
    print()
    for line in summary_lines(result):
        print(line)
    if unwritten is not None:
        raise unwritten
    if not result.ok:
        missing = [step for step, done in result.steps.items() if not done]
        print(f"mla-watch demo: FAILED, these steps did not happen: {', '.join(missing)}")
        return 1
    return 0
