"""From alert to promoted router: the re-tuning loop of a running sidecar, per strategy.

    python -m bench.retune                 # three scenarios, about five minutes on 2 CPU cores
    python -m bench.retune --scenario bias
    python -m bench.retune --json figures.json   # also write the figures as JSON
    python -m bench.retune --scenario deployed_broken --engine vllm   # the replay, and a real vLLM
    python -m bench.retune --engine vllm --skip-embedded              # the real vLLM only

Each scenario starts a real sidecar on the bundled model (traffic capture on, a loopback webhook
receiver as on-call), sends healthy code-assistant traffic, injects a fault into MoE layer 1,
keeps the traffic going until RoutingEntropyLow fires (it asks for a re-tune with the scenario's
strategy), waits for the job to end, then sends traffic again until the alert resolves.

* ``bias``: collapse (+10 on the correction bias of six experts), re-fitted with the bias rule.
* ``router_finetune``: damage (Gaussian noise, std 1, on the router weights), router-only
  fine-tuning with the recipe's defaults on the ~20 captured requests. It does not bring this
  router back in band, so the gates reject it (on-call is told, nothing changes); the last
  column shows the rejected candidate's figures. (lr 1e-2, 4 epochs, balance weight 1.0 lifted
  the router to 4.72 bits but pushed perplexity to 2.92: rejected on both gates.)
* ``restore``: the same damage, undone by re-applying router version 0.
* ``deployed_broken``: the checkpoint itself has layer 1 collapsed, so router version 0 is the
  damage (``harness/broken_deploy.py``): served with capture on, ``--reference-model`` the bundled
  checkpoint, the shipped rules with 0 s holds, four short chat prompts in turn ("Where is my
  parcel?", "def add(a, b):", "SELECT * FROM t WHERE", "Summarize: sales rose."), 16 tokens each,
  until every layer-1 alert has resolved; ``--runs`` times (5). Printed: how many runs closed,
  and per run the seconds from the first request to the first page and to the last resolution,
  the jobs' outcomes and the checks that promoted.
* ``--engine vllm``: a real vLLM (harness/real_vllm.py) serving a tiny Qwen3-MoE whose layer 2 gate
  is zeroed, dev mode on, the sidecar beside it with ``--engine-retune apply`` and its reference
  prompts read as served (one at a time, yielding to clients): seconds from the first request to
  the alert and to on-call's page (with its cause), from the alert to the promoted router and to
  the resolved alert, how long the candidate served before its gate decided, the pause of each
  swap; the clients' latency through the sidecar meanwhile against the same requests straight to
  the engine afterwards; and the engine's throughput (4 clients, 32 tokens each) with a swap
  every 0.5 s against without, as a ratio measured in one run.

Printed per scenario: the job's outcome, seconds from the alert to the promoted router (the
job's own ``trigger_to_promoted_seconds``) and from the fault to the resolved alert, layer 1's
entropy and the model's held-out perplexity healthy / during the fault / after, and the ratio
of the perplexity after to the healthy one (1.00 = fully recovered). Perplexity is measured on
32 held-out code samples with a hook-free copy of the live model. The last column is what the
job's gates measured for the (last) candidate on the held-out part of the captured traffic
(the model's own completions, hence another perplexity scale).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

import mla_watch
from harness.broken_deploy import final_jobs, run_scenario  # the broken-deploy scenario, shared with its test
from harness.receivers import running_receiver
from harness.support import serve_app  # the tests' loopback server helpers
from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.models import corpus
from mla_watch.models.train import perplexity
from mla_watch.quality.local_model import copy_without_hooks
from mla_watch.retune.jobs import FINAL_STATUSES, RetuneSettings
from mla_watch.server.app import ServerConfig, Sidecar

LAYER1 = "model.layers.1.mlp.gate"
FINETUNE: dict[str, float] = {}  # the recipe's defaults: lr 1e-4, 2 epochs, balance weight 0.1
SCENARIOS = {"bias": "collapse", "router_finetune": "damage", "restore": "damage"}


def inject(model: torch.nn.Module, fault: str) -> None:
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        if fault == "collapse":
            gate.e_score_correction_bias[:6] += 10.0
        else:
            gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(5)))


PROMPTS = corpus.prompts("code", 128, seed=31)  # function signatures, ~20 tokens each: what the gate scores


def send(url: str, count: int, start: int) -> None:
    for index in range(start, start + count):
        response = httpx.post(
            url + "/v1/completions",
            timeout=120,
            headers={"X-Business-Line": "code_assistant"},
            json={"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 24, "seed": index},
        )
        response.raise_for_status()


def layer1_bits(url: str) -> float:
    records = httpx.get(url + "/v1/routing", params={"business_line": "code_assistant"}).json()["routers"]
    return next(r["entropy_bits"] for r in records if r["name"] == LAYER1)


def layer1_alert(url: str) -> dict:
    for alert in httpx.get(url + "/v1/alerts").json()["alerts"]:
        if alert["labels"]["router"] == LAYER1 and alert["labels"]["business_line"] == "code_assistant":
            return alert
    return {}


def alert_state(url: str) -> str | None:
    return layer1_alert(url).get("state")


def ended(sidecar: Sidecar) -> bool:
    """One job promoted, or every job ended."""
    jobs = sidecar.retune.store.list(limit=20)
    return bool(jobs) and (
        any(job["status"] == "promoted" for job in jobs) or all(job["status"] in FINAL_STATUSES for job in jobs)
    )


def run(strategy: str, held_out: list[list[int]]) -> dict:
    fault = SCENARIOS[strategy]
    work = Path(tempfile.mkdtemp(prefix="mla-watch-bench-retune-"))
    (work / "rules").mkdir()
    (work / "rules" / "routing.yaml").write_text(
        entropy_low_rules(group_by=False, actions=("notify", "retune"), strategies=(strategy,))
    )
    with running_receiver() as receiver:
        os.environ["MLA_WATCH_ONCALL_URL"] = receiver.url + "/hook"
        settings = RetuneSettings(min_samples=12, retry_seconds=5.0, strategy_options={"router_finetune": FINETUNE})
        config = ServerConfig(
            device="cpu",
            rules=work / "rules",
            state_dir=work / "state",
            alert_interval=0.2,
            window_tokens=256,
            capture=True,
            retune=settings,
            policy_poll_seconds=None,
            admin_token=None,
        )
        sidecar = Sidecar(config)
        with serve_app(sidecar.app) as url:
            assert sidecar.wait_ready(120), sidecar.load_error
            model = sidecar.model_worker.model

            def ppl() -> float:
                with sidecar.model_worker.model_lock:  # a hook-free copy: the evaluation must not count as traffic
                    copy = copy_without_hooks(model)
                with torch.no_grad():
                    return perplexity(copy, held_out)

            send(url, 14, 0)
            figures = {"strategy": strategy, "fault": fault, "bits_healthy": layer1_bits(url), "ppl_healthy": ppl()}
            with sidecar.model_worker.model_lock:
                inject(model, fault)
            figures["ppl_fault"] = ppl()  # now: a fast job (restore) may be done by the time the alert fires
            fault_at = time.monotonic()
            sent = 14
            while alert_state(url) != "firing" and sent < 40:
                send(url, 1, sent)
                sent += 1
            figures["bits_fault"] = layer1_alert(url).get("value") or layer1_bits(url)  # what paged
            deadline = time.monotonic() + 900
            while not ended(sidecar) and time.monotonic() < deadline:  # a job short of data waits for more
                send(url, 1, sent)
                sent += 1
            jobs = sidecar.retune.store.list(limit=20)
            job = next((j for j in jobs if j["status"] == "promoted"), jobs[0])
            gates = job["result"]["attempts"][-1].get("gates") or {"after": {"perplexity": None, "entropy_bits": {}}}
            figures.update(
                outcome=job["status"],
                candidate_ppl=gates["after"]["perplexity"],
                candidate_bits=gates["after"]["entropy_bits"].get(LAYER1),
                alert_to_promoted_s=job["result"]["timings"].get("trigger_to_promoted_seconds"),
            )
            limit = sent + 40
            while alert_state(url) == "firing" and sent < limit:
                send(url, 1, sent)
                sent += 1
            figures.update(
                fault_to_resolved_s=time.monotonic() - fault_at if alert_state(url) != "firing" else None,
                bits_after=layer1_bits(url),
                ppl_after=ppl(),
            )
    return figures


def deployed_broken(runs: int = 5) -> dict:
    """The deployed-broken replay with four short chat prompts in turn, ``runs`` times: how many close."""
    results = []
    for run in range(runs):
        outcome = run_scenario(
            Path(tempfile.mkdtemp(prefix="mla-watch-bench-broken-")),
            reference=True,
            settings=RetuneSettings(retry_seconds=5.0),
            timeout=600,
            chat=True,
            seed=run,
        )
        jobs = final_jobs(outcome)
        promoted = next((job for job in jobs if job["status"] == "promoted"), None)
        gates = promoted["result"]["attempts"][-1]["gates"] if promoted else {}
        results.append(
            {
                "fired_after_s": outcome.fired_after_s,
                "resolved_after_s": outcome.resolved_after_s,
                "requests": outcome.requests,
                "bits_before": outcome.bits_before,
                "bits_after": outcome.bits_after,
                "jobs": [job["status"] for job in jobs],
                "promoted_by": promoted["result"]["strategy"] if promoted else None,
                "checks": {check["gate"]: check["decision"] for check in gates.get("checks", [])},
                "pages": {f"{name}/{line}": statuses for (name, line), statuses in outcome.pages.items()},
            }
        )
    return {"runs": results, "closed": sum(1 for r in results if r["resolved_after_s"] is not None)}


def engine_vllm() -> dict:
    """Against a real vLLM (harness/real_vllm.py): alert -> promoted -> resolved with --engine-retune apply, the
    pause of each swap, and the engine's throughput while swaps happen against without (one run, a ratio)."""
    import threading

    from harness.real_vllm import build_checkpoint, cache_root, running_vllm
    from harness.real_vllm_retune import LAYER, ROUTER, alert_state, jobs, layer_pages, pages, retuning_sidecar, send
    from mla_watch.engines.vllm_weights import VllmWeights, read_router_tensors, write_router_checkpoint

    root = cache_root() / "checkpoints"
    collapsed = build_checkpoint(root, "qwen3_moe", collapsed_layer=LAYER)
    healthy = build_checkpoint(root, "qwen3_moe")
    work = Path(tempfile.mkdtemp(prefix="mla-watch-bench-engine-"))
    figures: dict = {"router": ROUTER}
    with running_vllm(collapsed, routing=True, dev_mode=True, log_path=work / "vllm.log") as engine_url:
        with (
            running_receiver() as receiver,
            retuning_sidecar(engine_url, (collapsed, healthy), work / "state", "apply", receiver.url) as url,
        ):
            start = time.monotonic()
            latencies: dict[str, list[float]] = {"alert": [], "promoted": [], "resolved": []}  # per phase, to it
            paged: list[float] = []

            def request(index: int, phase: str) -> None:
                began = time.monotonic()
                send(url, index, 1)
                latencies[phase].append(time.monotonic() - began)
                if not paged and ("RoutingEntropyLow", "firing") in layer_pages(receiver):
                    paged.append(time.monotonic())  # within one request's latency of the page's arrival

            index = 0
            while alert_state(url) is None and index < 60:
                request(index, "alert")
                index += 1
            fired = time.monotonic()
            while not any(job["status"] == "promoted" for job in jobs(url)) and time.monotonic() - fired < 300:
                request(index, "promoted")
                index += 1
            promoted = time.monotonic()
            while alert_state(url) != "resolved" and time.monotonic() - fired < 600:
                request(index, "resolved")
                index += 1
            resolved = time.monotonic()
            job = next(job for job in jobs(url) if job["status"] == "promoted")
            attempt = job["result"]["attempts"][-1]
            page = next(
                (
                    alert
                    for alert in pages(receiver)
                    if alert["labels"].get("router") == ROUTER and alert["status"] == "firing"
                ),
                None,
            )
            reference = httpx.get(url + "/v1/reference", timeout=30).json()
            figures.update(
                first_request_to_alert_s=round(fired - start, 2),
                first_request_to_page_s=round(paged[0] - start, 2) if paged else None,
                page_cause=None if page is None else page["labels"].get("cause"),
                alert_to_promoted_s=round(promoted - fired, 2),
                alert_to_resolved_s=round(resolved - fired, 2) if alert_state(url) == "resolved" else None,
                gate_live_seconds=attempt.get("live_seconds"),
                job_pause_s=attempt["swap"]["paused_seconds"],
                requests=index,
                rounds_deferred=reference.get("rounds_deferred"),
                client_latency_s={
                    phase: {
                        "requests": len(values),
                        "p50": round(statistics.median(values), 3),
                        "max": round(max(values), 3),
                    }
                    for phase, values in latencies.items()
                    if values
                },
            )
        direct: list[float] = []  # the same requests straight to the engine, no sidecar and no reading beside them
        for number in range(24):
            began = time.monotonic()
            body = {
                "model": "tiny",
                "max_tokens": 6,
                "seed": number,
                "messages": [{"role": "user", "content": f"Where is my parcel, order {4400 + number * 7}?"}],
            }
            httpx.post(engine_url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
            direct.append(time.monotonic() - began)
        figures.update(
            engine_latency_p50_s=round(statistics.median(direct), 3),
            engine_latency_max_s=round(max(direct), 3),
            client_latency_p50_ratio={
                phase: round(values["p50"] / statistics.median(direct), 2)
                for phase, values in figures["client_latency_s"].items()
            },
        )
        weights = VllmWeights(engine_url)
        states = [read_router_tensors(healthy), read_router_tensors(collapsed)]
        directories = []
        for number, state in enumerate(states):
            directory = work / "swaps" / f"state{number}"
            directory.parent.mkdir(exist_ok=True)
            directories.append(write_router_checkpoint(directory, state, collapsed / "config.json"))

        def throughput(seconds: float, swapping: bool) -> tuple[float, list[float]]:
            tokens = [0]
            stop = time.monotonic() + seconds
            pauses: list[float] = []

            def load() -> None:
                with httpx.Client(base_url=engine_url, timeout=120) as client:
                    while time.monotonic() < stop:
                        answer = client.post(
                            "/v1/completions",
                            json={"prompt": "Where is my parcel?", "max_tokens": 32, "ignore_eos": True},
                        )
                        tokens[0] += answer.json()["usage"]["completion_tokens"]

            workers = [threading.Thread(target=load) for _ in range(4)]
            for worker in workers:
                worker.start()
            swap = 0
            while swapping and time.monotonic() < stop - 1:
                pauses.append(weights.swap(directories[swap % 2].resolve()).paused_seconds)
                swap += 1
                time.sleep(0.5)
            for worker in workers:
                worker.join()
            return tokens[0] / seconds, pauses

        steady, _ = throughput(20.0, swapping=False)
        during, pauses = throughput(20.0, swapping=True)
        weights.close()
        figures.update(
            tokens_per_s_steady=round(steady, 1),
            tokens_per_s_swapping=round(during, 1),
            throughput_ratio=round(during / steady, 3),
            swaps=len(pauses),
            pause_p50_s=round(sorted(pauses)[len(pauses) // 2], 4),
            pause_max_s=round(max(pauses), 4),
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "deployed_broken"], action="append")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    parser.add_argument("--engine", choices=["vllm"], help="also re-tune a real vLLM's routers (harness/real_vllm.py)")
    parser.add_argument("--runs", type=int, default=5, help="runs of the deployed_broken replay (default 5)")
    parser.add_argument("--skip-embedded", action="store_true", help="with --engine vllm: only the engine's part")
    args = parser.parse_args()
    _, tokenizer = mla_watch.load_model("bundled", device="cpu")
    held_out = [
        [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        for text in corpus.generate("code", 32, seed=777)
    ]
    chosen = [] if args.skip_embedded else args.scenario or [*SCENARIOS, "deployed_broken"]
    rows = [run(strategy, held_out) for strategy in chosen if strategy in SCENARIOS]
    broken = deployed_broken(args.runs) if "deployed_broken" in chosen else None
    engine = engine_vllm() if args.engine == "vllm" else None

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    if rows:
        print(
            f"{'strategy':<16}{'fault':<10}{'outcome':<10}{'alert->promoted s':>18}{'fault->resolved s':>18}"
            f"{'bits healthy/fault/after':>26}{'ppl healthy/fault/after':>25}{'ppl after/healthy':>19}"
            f"{'gate bits/ppl':>15}"
        )
        for row in rows:
            bits = f"{row['bits_healthy']:.2f}/{row['bits_fault']:.2f}/{row['bits_after']:.2f}"
            ppl = f"{row['ppl_healthy']:.3f}/{row['ppl_fault']:.3f}/{row['ppl_after']:.3f}"
            print(
                f"{row['strategy']:<16}{row['fault']:<10}{row['outcome']:<10}{seconds(row['alert_to_promoted_s']):>18}"
                f"{seconds(row['fault_to_resolved_s']):>18}{bits:>26}{ppl:>25}"
                f"{row['ppl_after'] / row['ppl_healthy']:>19.3f}"
                f"{row['candidate_bits'] or 0:>9.2f}/{row['candidate_ppl'] or 0:.3f}"
            )
    if broken is not None:
        print(f"\ndeployed_broken, four short chat prompts in turn: closed {broken['closed']} of {len(broken['runs'])}")
        for number, replay in enumerate(broken["runs"]):
            print(
                f"  run {number}: first page {seconds(replay['fired_after_s'])} s, every layer-1 alert resolved "
                f"{seconds(replay['resolved_after_s'])} s after the first request ({replay['requests']} requests); "
                f"layer 1 {replay['bits_before'] or 0:.2f} -> {replay['bits_after'] or 0:.2f} bits; "
                f"jobs {replay['jobs']}; promoted by {replay['promoted_by']} ({replay['checks']})"
            )
    if engine is not None:
        print(
            f"\nvllm engine: alert after {engine['first_request_to_alert_s']} s of traffic, page (cause "
            f"{engine['page_cause']}) after {engine['first_request_to_page_s']} s; alert -> promoted "
            f"{engine['alert_to_promoted_s']} s, -> resolved {engine['alert_to_resolved_s']} s "
            f"({engine['requests']} requests, {engine['rounds_deferred']} reference rounds deferred); the candidate "
            f"served {engine['gate_live_seconds']} s before its gate decided; the job's swap paused "
            f"{engine['job_pause_s']} s"
        )
        phases = {"alert": "to the alert", "promoted": "to the promoted router", "resolved": "to the resolution"}
        print(
            "  client latency through the sidecar (p50 / max s): "
            + "; ".join(
                f"{phases[phase]} {values['p50']} / {values['max']} ({values['requests']} requests, p50 "
                f"x{engine['client_latency_p50_ratio'][phase]})"
                for phase, values in engine["client_latency_s"].items()
            )
            + f"; the same requests straight to the engine afterwards {engine['engine_latency_p50_s']} / "
            f"{engine['engine_latency_max_s']}"
        )
        print(
            f"  throughput {engine['tokens_per_s_steady']} tokens/s steady, {engine['tokens_per_s_swapping']} with "
            f"a swap every 0.5 s: ratio {engine['throughput_ratio']}; {engine['swaps']} swaps paused "
            f"{engine['pause_p50_s']} s at p50, {engine['pause_max_s']} s at most"
        )
    if args.json:
        scenarios = [{**row, "ppl_after_over_healthy": row["ppl_after"] / row["ppl_healthy"]} for row in rows]
        if broken is not None:
            scenarios.append({"scenario": "deployed_broken", **broken})
        if engine is not None:
            scenarios.append({"scenario": "engine_vllm", **engine})
        Path(args.json).write_text(
            json.dumps({"bench": "retune", "args": vars(args), "scenarios": scenarios}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
