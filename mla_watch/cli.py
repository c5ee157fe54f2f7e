"""The ``mla-watch`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mla_watch.cli_startup import FlagError
from mla_watch.engines.replay import ReplayBudget
from mla_watch.ingest import INGEST_FLAGS, IngestLimits
from mla_watch.retune.jobs import ENGINE_RETUNE_MODES, RetuneSettings
from mla_watch.server.config import ENGINE_CHOICES, ServerConfig
from mla_watch.shipped import SHIPPED_POLICIES, SHIPPED_RULES
from mla_watch.windows import ALL_LINES

__all__ = ["main"]

DEFAULT_STATE_DIR = ServerConfig.state_dir


def _read_prompts(path: Path) -> list[str]:
    """One prompt per line, or JSONL objects with a ``prompt`` (or ``text``) field."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise FlagError(f"--prompts {path}: cannot read it ({error.strerror})") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise FlagError(f"--prompts {path}:{number}: invalid JSON ({error.msg})") from error
            text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise FlagError(f"--prompts {path}:{number}: expected a 'prompt' or 'text' string field")
            prompts.append(text)
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise FlagError(f"--prompts {path}: no prompts in the file")
    return prompts


def _traffic(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(business_line, text)`` pairs for the routing and baseline commands."""
    from mla_watch.models import corpus

    if args.prompts is not None:
        return [("prompts", text) for text in _read_prompts(args.prompts)]
    if args.domain is not None:
        if args.domain not in corpus.DOMAINS:
            raise FlagError(f"--domain {args.domain!r}: expected one of {', '.join(corpus.DOMAINS)}")
        return [(args.domain, text) for text in corpus.generate(args.domain, args.samples, args.seed)]
    per_domain = max(1, args.samples // len(corpus.DOMAINS))
    return corpus.generate_mixed(per_domain * len(corpus.DOMAINS), args.seed)


def _run(args: argparse.Namespace) -> Any:
    import torch

    import mla_watch
    from mla_watch.cli_startup import check_model_flags

    check_model_flags(args)
    baseline = getattr(args, "baseline", None)
    if baseline is not None and not baseline.is_file():
        raise FlagError(f"--baseline {baseline}: no such file: expected a baseline file `mla-watch baseline` wrote")
    traffic = _traffic(args)  # a --prompts file that cannot be read is refused before the model loads
    model, tokenizer = mla_watch.load_model(args.model, device=args.device)
    probe = mla_watch.attach(model, window_tokens=None)
    if baseline is not None:
        probe.load_baseline(baseline)
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    with torch.no_grad():
        for line, text in traffic:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = [tokenizer.bos_token_id, *ids][: limit - args.generate]
            input_ids = torch.tensor([ids], device=device)
            with probe.attribute(line):
                if args.generate > 0:
                    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   max_new_tokens=args.generate, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
                else:
                    model(input_ids=input_ids)
    return probe


def _format_table(records: list[dict[str, Any]]) -> str:
    columns = [("layer", "layer", "{}"), ("router", "name", "{}"), ("kind", "kind", "{}"),
               ("tokens", "tokens", "{}"), ("entropy", "entropy_bits", "{:.3f}"), ("floor", "floor_bits", "{:.3f}"),
               ("ceiling", "ceiling_bits", "{:.3f}"), ("normalized", "normalized_entropy", "{:.3f}"),
               ("maxvio", "max_violation", "{:.3f}"), ("dead", "dead_slots", "{}"),
               ("js", "js_divergence", "{:.4f}"), ("locality", "locality", "{:.3f}")]
    rows = [[title for title, _, _ in columns]]
    for record in records:
        row = []
        for _, key, form in columns:
            value = record.get(key)
            row.append("-" if value is None else form.format(value))
        if record.get("too_small"):
            row[3] += "*"
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    text = "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    if any(record.get("too_small") for record in records):
        text += "\n* fewer tokens than the router's minimum window: the entropy reads low by chance"
    return text


def _cmd_routing(args: argparse.Namespace) -> int:
    probe = _run(args)
    records = probe.stats()
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(_format_table(records))
    return 0


def _cmd_baseline(args: argparse.Namespace) -> int:
    probe = _run(args)
    out = args.out or (args.state_dir / "baseline.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    document = probe.save_baseline(out)
    routers = {entry["router"] for entry in document["series"]}
    lines = {entry["business_line"] for entry in document["series"]}
    print(f"wrote the healthy baselines of {len(routers)} routers x {len(lines)} business lines "
          f"({', '.join(sorted(lines))}) to {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from mla_watch.cli_startup import bind_listener, check_serve_flags, default_public_url, held_logs, run_server

    check_serve_flags(args)  # before anything loads, binds or logs: a bad value is one line, exit 2
    from mla_watch.server.app import build_sidecar

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The model thread and the event loop hand work to each other; Python's default 5 ms GIL
    # switch interval would add up to that much latency to every handoff.
    sys.setswitchinterval(0.0005)

    try:
        retune = RetuneSettings(cooldown_seconds=args.retune_cooldown, command=args.retune_command,
                                max_perplexity_increase=args.max_perplexity_increase,
                                gate_confidence=args.gate_confidence, min_held_out_tokens=args.min_held_out_tokens,
                                retry_seconds=args.retune_retry, max_wait_seconds=args.retune_max_wait,
                                min_samples=args.retune_min_samples, min_held_out_samples=args.min_held_out_samples,
                                strategy_options=_parse_options(args.retune_option, "--retune-option"))
        from mla_watch.retune.strategies import get_strategy

        for name, options in retune.strategy_options.items():
            get_strategy(name).parse_options(options, f"--retune-option {name}")
        ingest_limits = IngestLimits(**{name: getattr(args, "ingest_" + name) for name in INGEST_FLAGS})
        if args.history_interval > args.history_span:
            raise ValueError(f"--history-interval {args.history_interval!r}: expected at most --history-span "
                             f"({args.history_span!r})")
    except ValueError as error:
        raise FlagError(str(error)) from error
    # --port 0: bound first, so that the status page's URL (in alerts) has the port; any other port once the
    # sidecar is built: a setting it refuses is said whether or not the port is free.
    sock = bind_listener(args.host, args.port) if args.port == 0 else None
    port = args.port if sock is None else sock.getsockname()[1]
    config = ServerConfig(model=args.model, device=args.device, policies=args.policies, rules=args.rules,
                          state_dir=args.state_dir, dataset_dir=args.dataset_dir,
                          public_url=args.public_url or default_public_url(args.host, port),
                          upstream=args.upstream, upstream_max_bytes=args.upstream_max_bytes,
                          attn_implementation=args.attn_implementation,
                          max_queue=args.max_queue, request_timeout=args.request_timeout, capture=args.capture,
                          capture_max_samples=args.capture_max_samples,
                          capture_max_age_seconds=args.capture_max_age, retune=retune,
                          reference_model=args.reference_model,
                          history_interval_seconds=args.history_interval, history_span_seconds=args.history_span,
                          history_retention_days=args.history_retention, history_max_series=args.history_max_series,
                          ingest_limits=ingest_limits, body_timeout_seconds=args.body_timeout,
                          engine=args.engine, model_config=args.model_config, decode_workers=args.decode_workers,
                          count_queue_bytes=args.count_queue_bytes,
                          replay=ReplayBudget(rate=args.replay_rate, concurrency=args.replay_concurrency,
                                              tokens_per_second=args.replay_tokens_per_second),
                          sglang_recorder_dir=args.sglang_recorder_dir,
                          sglang_recorder_interval=args.sglang_recorder_interval,
                          sglang_recorder_buffer=args.sglang_recorder_buffer, engine_retune=args.engine_retune,
                          engine_swap_dir=args.engine_swap_dir, engine_gate_timeout=args.engine_gate_timeout,
                          return_routed_experts=args.return_routed_experts, alert_interval=args.alert_interval,
                          baseline_tokens=args.baseline_tokens)
    with held_logs():  # what building it logs shows once the port is this server's; a port in use: one line
        sidecar = build_sidecar(config)
        if sock is None:
            sock = bind_listener(args.host, args.port)  # before the app starts, which logs the status page's URL
    run_server(sidecar.app, sock, host=args.host, port=port, log_level="info", timeout_graceful_shutdown=30)
    return 0


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate every policy and rule file and lint the rules against the model's routers."""
    from mla_watch.alerting.rules import RuleError, load_rules_dir
    from mla_watch.cli_startup import check_model_flags
    from mla_watch.policy import PolicyError
    from mla_watch.policy_files import load_policy_dir

    if args.model_config is None and args.model is not None:
        check_model_flags(args, full=False)  # a mistyped name; a model that does not load is a finding below
    errors = warnings = 0
    try:
        policies = load_policy_dir(args.policies)
    except PolicyError as error:
        for message in error.errors:
            print(f"error: {message}")
        errors += len(error.errors)
    else:
        for name, policy in policies.lines.items():
            print(f"ok: policy {name} ({policy.source}): tasks {', '.join(policy.tasks)}")
    rules = None
    try:
        rules = load_rules_dir(args.rules)
    except RuleError as error:
        for message in error.errors:
            print(f"error: {message}")
        errors += len(error.errors)
    else:
        print(f"ok: {len(rules.rules)} rules, receivers {', '.join(rules.receivers) or '(none)'}")
        for message in rules.warnings:
            print(f"warning: {message}")
            warnings += 1
    if args.model_config is not None:  # beside an engine: its routers, from the config it loaded
        from mla_watch.engines.geometry import GeometryError, load_geometry

        try:
            geometry = load_geometry(args.model_config)
        except GeometryError as error:
            for message in error.errors:
                print(f"error: {message}")
            errors += len(error.errors)
        else:
            print(f"ok: engine routers: {geometry.describe()}; re-tuning is not available for them")
            found_errors, found_warnings = _lint(rules, geometry.routers(), args)
            errors, warnings = errors + found_errors, warnings + found_warnings
    elif args.model is not None:
        import mla_watch

        try:
            model, _ = mla_watch.load_model(args.model, device="cpu")
        except (OSError, ValueError, ImportError, KeyError, TypeError, RuntimeError) as error:
            # A model that does not load is a finding of check, not a crash: one line, exit 1.
            print(f"error: model {str(args.model)!r} does not load: {_one_line(error)}")
            print(f"{errors + 1} error(s), {warnings} warning(s)")
            return 1
        try:
            probe = mla_watch.attach(model)
        except (mla_watch.UnknownRouterError, mla_watch.NoRoutersFoundError) as error:
            print(f"error: model {str(args.model)!r}: {_one_line(error)}")
            print(f"{errors + 1} error(s), {warnings} warning(s)")
            return 1
        routers = probe.routers
        probe.detach()
        for info in routers:
            notes = "".join([f", zero-compute slots {list(info.zero_slots)}" if info.zero_slots else "",
                             ", hash-routed by token id" if info.hash_routed else ""])
            print(f"ok: router {info.name} (layer {info.layer}, {info.kind}, top-{info.top_k} of {info.num_slots}"
                  f"{notes})")
        from mla_watch.alerting.lint import applies_to
        from mla_watch.retune.strategies import STRATEGIES, supported_strategies

        support = supported_strategies(model)
        for name, reason in support.items():
            print(f"ok: re-tune strategy {name} is supported" if reason is None
                  else f"info: re-tune strategy {name} is not supported: {reason}")
        restoring_only: list[str] = []
        for rule in rules.rules if rules is not None else ():
            if "retune" not in rule.actions or not applies_to(rule, routers):  # a rule for other routers
                continue
            usable = [name for name in rule.retune_strategies or support if support.get(name) is None]
            if not usable:
                print(f"warning: rule {rule.name}: none of its re-tune strategies "
                      f"{list(rule.retune_strategies)} supports this model")
                warnings += 1
            elif not args.capture and all(STRATEGIES[name].needs_traffic for name in usable):
                print(f"warning: rule {rule.name} asks for re-tuning by {', '.join(usable)}, which fit on traffic: "
                      f"serve with --capture (an alert's job trains on captured traffic; it names no dataset)")
                warnings += 1
            elif not args.capture and any(STRATEGIES[name].needs_traffic for name in usable):
                restoring_only.append(rule.name)
        if restoring_only:
            print(f"info: without --capture the re-tune jobs of {', '.join(restoring_only)} can only restore a "
                  "known-good router version (bias and router_finetune fit on captured traffic)")
        if args.reference_model is not None:
            from mla_watch.retune.reference import load_reference_routers
            from mla_watch.retune.registry import router_state

            try:
                reference = load_reference_routers(args.reference_model, router_state(model))
            except ValueError as error:
                print(f"error: {_one_line(error)}")
                errors += 1
            else:
                print(f"ok: {reference.label}: {len(reference.tensors)} router tensors match the model's; "
                      f"`restore` puts them back")
        found_errors, found_warnings = _lint(rules, routers, args)
        errors, warnings = errors + found_errors, warnings + found_warnings
    print(f"{errors} error(s), {warnings} warning(s)")
    return 1 if errors else 0


def _lint(rules: Any, routers: Sequence[Any], args: argparse.Namespace) -> tuple[int, int]:
    """Print the rules' findings against ``routers`` (history as serve's ``args``); return (errors, warnings)."""
    from mla_watch.alerting.lint import lint

    errors = warnings = 0
    findings = lint(rules, routers, history_interval_seconds=args.history_interval,
                    history_retention_seconds=args.history_retention * 86400.0,
                    with_history=args.history_retention > 0) if rules is not None else ()
    for finding in findings:
        print(f"{finding.severity}: rule {finding.rule}: {finding.message}")
        errors += finding.severity == "error"
        warnings += finding.severity == "warning"
    return errors, warnings


def _cmd_rules_export(args: argparse.Namespace) -> int:
    from mla_watch.alerting.promexport import export_prometheus
    from mla_watch.alerting.rules import RuleError, load_rules_dir

    try:
        rules = load_rules_dir(args.rules)
    except RuleError as error:
        raise SystemExit("mla-watch: the rules do not load:\n  " + "\n  ".join(error.errors)) from error
    text = export_prometheus(rules)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {len(rules.rules)} rules to {args.out}", file=sys.stderr)
    return 0


def _admin(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """Call the sidecar's API; exit with its error message on a 4xx/5xx."""
    import os

    import httpx

    token = os.environ.get("MLA_WATCH_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=60)
    except httpx.HTTPError as error:
        raise SystemExit(f"mla-watch retune: cannot reach the sidecar at {args.url}: {error}") from error
    try:
        document = response.json()
    except ValueError:
        document = {"error": {"message": response.text[:500]}}
    if response.status_code >= 400:
        message = document.get("error", {}).get("message", response.text[:500])
        raise SystemExit(f"mla-watch retune: {method} {path} answered {response.status_code}: {message}")
    return document


def _print_jobs(jobs: list[dict[str, Any]]) -> None:
    import time

    rows = [["job", "created", "status", "strategy", "version", "tries", "business line", "routers"]]
    for job in jobs:
        result = job.get("result") or {}
        rows.append([job["id"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["created_at"])), job["status"],
                     str(result.get("strategy") or "/".join(job["spec"]["strategies"])),
                     "-" if result.get("version") is None else str(result["version"]), str(job["attempts"]),
                     job["spec"].get("business_line") or ALL_LINES, ", ".join(job["spec"]["routers"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows))


def _positive_int(text: str) -> int:
    """An argparse type: argparse names the flag in its error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _upstream_url(text: str) -> str:
    """An argparse type for --upstream; its errors never repeat the URL, which may hold a password."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError("expected an http:// or https:// URL with a host (and a port number in "
                                         "[1, 65535] if any); the value given is not shown, it may hold a password")
    del port
    return text


def _byte_size(text: str) -> int:
    """An argparse type for a size in bytes, with an optional K, M or G suffix (powers of 1024)."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 12) or int(digits) * scale < 1024:
        raise argparse.ArgumentTypeError(f"expected a size in bytes of at least 1024, optionally with a K, M or G "
                                         f"suffix (512M), got {text[:40]!r}")
    return int(digits) * scale


def _history_retention(text: str) -> float:
    """An argparse type: argparse names the flag in its error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value == 0 or 1 <= value <= 365):
        raise argparse.ArgumentTypeError(f"expected 0 (no durable history) or a number of days in [1, 365], "
                                         f"got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    """An argparse type: argparse names the flag in its error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _number_at_least(low: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type for a finite number above ``low`` (or at it, when ``inclusive``)."""
    expected = f"a number >= {low:g}" if inclusive else ("a positive number" if low == 0 else f"a number > {low:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_float = _number_at_least(0, inclusive=False)
_non_negative_float = _number_at_least(0, inclusive=True)


def _share(text: str) -> float:
    """An argparse type for a share of all, from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1 (0.25: one in four), got {text[:40]!r}")
    return value


def _margin(text: str) -> str | float:
    """The perplexity gate's margin: ``2%`` (kept as text) or ``0.3``."""
    from mla_watch.retune.paired import parse_margin

    try:
        margin = parse_margin(text[:40])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a relative margin (a percentage up to 100%, e.g. 2%) or an "
                                         f"absolute one (a number >= 0, e.g. 0.3), got {text[:40]!r}") from None
    return f"{margin.value * 100:g}%" if margin.relative else margin.value


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 5) or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}")
    return int(text)


def _parse_options(items: Sequence[str], flag: str = "--option") -> dict[str, dict[str, Any]]:
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        strategy, dot, name = key.partition(".")
        if not sep or not dot or not strategy or not name:
            raise SystemExit(f"{flag} {item!r}: expected STRATEGY.NAME=VALUE, e.g. router_finetune.lr=0.001")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        options.setdefault(strategy, {})[name] = parsed
    return options


def _dataset_name(path: Path, directory: Path) -> str:
    """The name the sidecar's admin API knows ``--dataset`` by; a local file is first copied into ``directory``.

    The API reads datasets only from the sidecar's dataset directory, by bare file name. The
    operator on the sidecar's machine may name any file: it is copied there (0600, never over a
    different file of that name). A bare name that is no local file is sent as it is.
    """
    import filecmp
    import os
    import shutil

    from mla_watch.retune.data import DATASET_NAME_RE
    from mla_watch.statedir import PRIVATE_FILE_MODE, ensure_private_dir

    name = path.name
    if not DATASET_NAME_RE.fullmatch(name) or not name.endswith(".jsonl"):
        raise SystemExit(f"mla-watch retune run: --dataset {str(path)[:200]}: file name {name[:64]!r} is invalid: "
                         "expected letters, digits, '.', '_', '-' (at most 128, the first a letter or digit), "
                         "ending .jsonl")
    if not path.is_file():
        if str(path) == name:  # the name of a file already in the sidecar's dataset directory
            return name
        raise SystemExit(f"mla-watch retune run: --dataset {str(path)[:200]}: no such file: expected a JSONL file, "
                         "or the bare name of one in the sidecar's dataset directory")
    try:
        target = ensure_private_dir(directory) / name
        if target.exists():
            if target.resolve() == path.resolve() or filecmp.cmp(path, target, shallow=False):
                return name
            raise SystemExit(f"mla-watch retune run: --dataset {str(path)[:200]}: {target} exists with other "
                             "content: expected a file name not used there yet (or remove the old file)")
        with path.open("rb") as source, os.fdopen(
                os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE), "wb") as copy:
            shutil.copyfileobj(source, copy)
    except OSError as error:
        raise SystemExit(f"mla-watch retune run: --dataset {str(path)[:200]}: cannot copy it into --dataset-dir "
                         f"{directory}: [Errno {error.errno}] {error.strerror}") from None
    print(f"copied {path} to {target} (the sidecar reads it there if that is its --dataset-dir)", file=sys.stderr)
    return name


def _cmd_retune(args: argparse.Namespace) -> int:
    if args.retune_command == "run":
        body: dict[str, Any] = {"force": args.force}
        for key, value in (("routers", args.router), ("business_line", args.business_line),
                           ("strategy", args.strategy), ("rule", args.rule),
                           ("dataset", _dataset_name(args.dataset, args.dataset_dir) if args.dataset else None),
                           ("options", _parse_options(args.option) if args.option else None)):
            if value:
                body[key] = value
        job = _admin(args, "POST", "/admin/retune", body)
        print(f"scheduled re-tune job {job['id']} ({'/'.join(job['spec']['strategies'])} on "
              f"{', '.join(job['spec']['routers'])})")
        return _wait_for_job(args, job)
    if args.retune_command == "apply":
        job = _admin(args, "POST", "/admin/retune/apply", {"version": args.version})
        print(f"scheduled re-tune job {job['id']}: router version {args.version} swapped into the engine, gated "
              f"through it, kept or rolled back")
        return _wait_for_job(args, job)
    return _retune_versions(args)


def _wait_for_job(args: argparse.Namespace, job: dict[str, Any]) -> int:
    """Follow ``job`` for ``--wait`` seconds; 0 once it promoted (or when not waiting at all)."""
    import time

    if args.wait <= 0:
        return 0
    deadline = time.monotonic() + args.wait
    while job["status"] in ("pending", "running", "waiting") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = _admin(args, "GET", f"/v1/retune/jobs/{job['id']}")
    _print_jobs([job])
    result = job.get("result") or {}
    if job["status"] == "waiting":
        print(f"waiting for more data after --wait: {result.get('needs')}")
    elif job["status"] != "promoted":
        print(f"{job['status']}: {result.get('error') or 'still running after --wait'}")
    return 0 if job["status"] == "promoted" else 1


def _retune_versions(args: argparse.Namespace) -> int:
    if args.retune_command == "list":
        jobs = _admin(args, "GET", f"/v1/retune/jobs?limit={args.limit}")["jobs"]
        if args.json:
            print(json.dumps(jobs, indent=1))
        else:
            _print_jobs(jobs)
        return 0
    if args.retune_command == "show":
        if args.job is None and args.version is None:
            raise SystemExit("mla-watch retune show: give a job id or --version N")
        if args.version is not None:
            versions = _admin(args, "GET", "/v1/retune/versions")
            found = [v for v in versions["versions"] if v["version"] == args.version]
            if not found:
                raise SystemExit(f"mla-watch retune show: --version {args.version} does not exist; versions are "
                                 f"{[v['version'] for v in versions['versions']]}")
            print(json.dumps({**found[0], "live": versions["live"] == args.version}, indent=1))
        else:
            print(json.dumps(_admin(args, "GET", f"/v1/retune/jobs/{args.job}"), indent=1))
        return 0
    if args.retune_command == "promote":
        print(f"router version {_admin(args, 'POST', '/admin/retune/promote', {'version': args.version})['live']} "
              "is live")
        return 0
    if args.retune_command == "mark-good":
        marked = _admin(args, "POST", "/admin/retune/mark-good", {"version": args.version})["marked_good"]
        print(f"router version {marked} marked good: `restore` puts it back")
        return 0
    print(f"rolled back; router version {_admin(args, 'POST', '/admin/retune/rollback', {})['live']} is live")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import logging

    from mla_watch.demo import main as demo

    logging.basicConfig(level=logging.ERROR)
    return demo(args.out, live=not args.no_live and sys.stdout.isatty(), timeout=args.timeout,
                inject_fault=not args.no_fault)


def _traffic_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled", help="'bundled' or a save_pretrained directory")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--domain", help="traffic of one domain: customer_service, code, sql, doc_summary")
    source.add_argument("--prompts", type=Path, help="a file of prompts: one per line, or JSONL with 'prompt'")
    parser.add_argument("--samples", type=int, default=64, help="generated samples (default 64)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the generated traffic")
    parser.add_argument("--generate", type=int, default=0,
                        help="tokens to generate after each prompt (default 0: one forward pass over it)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-watch", description="Watch the routers of an MLA/MoE model.")
    commands = parser.add_subparsers(dest="command", required=True)

    routing = commands.add_parser("routing", help="run traffic through the model and print per-router statistics")
    _traffic_options(routing)
    routing.add_argument("--baseline", type=Path, help="a baseline file, to report drift (js)")
    routing.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    routing.set_defaults(handler=_cmd_routing)

    baseline = commands.add_parser("baseline", help="save the routing counts that drift checks compare against")
    _traffic_options(baseline)
    baseline.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                          help="where baseline.json is written unless --out says")
    baseline.add_argument("--out", type=Path, help="file to write (default STATE_DIR/baseline.json)")
    baseline.set_defaults(handler=_cmd_baseline)

    serve = commands.add_parser("serve", help="serve the OpenAI API with policies enforced and routers watched")
    serve.add_argument("--model", default=ServerConfig.model, help="'bundled' or a save_pretrained directory")
    serve.add_argument("--device", default=ServerConfig.device, help="auto | cpu | cuda | cuda:N")
    serve.add_argument("--policies", type=Path, default=ServerConfig.policies, help="directory of policy YAML files")
    serve.add_argument("--rules", type=Path, default=ServerConfig.rules, help="directory of alert rule YAML files")
    serve.add_argument("--state-dir", type=Path, default=ServerConfig.state_dir,
                       help="alert state and the notification outbox (default ./mla-watch-state)")
    serve.add_argument("--dataset-dir", type=Path, default=None,
                       help="the only directory re-tune jobs from the admin API read JSONL datasets from, named by "
                            "bare file name (default STATE_DIR/datasets; created 0700)")
    serve.add_argument("--public-url", help="the URL on-call uses to reach this sidecar (links in alerts)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=_port, default=8000, help="the TCP port to listen on; 0: any free one")
    serve.add_argument("--upstream", type=_upstream_url,
                       help="forward generation to this OpenAI-compatible server instead (user:password@ in it is "
                            "sent as basic auth and never shown)")
    serve.add_argument("--upstream-max-bytes", type=_byte_size, default=ServerConfig.upstream_max_bytes,
                       help="the largest upstream answer, or line of its stream, read after decompression; a larger "
                            "one is a 502 (default 512M: DeepSeek-V3's routing at its whole context)")
    beside = serve.add_argument_group("beside vLLM or SGLang (with --upstream)")
    beside.add_argument("--engine", choices=ENGINE_CHOICES, default=ServerConfig.engine,
                        help="read the routing the upstream returns in this engine's format; auto: ask its "
                             "/v1/models (default %(default)s: read none)")
    beside.add_argument("--model-config", type=Path,
                        help="the config.json the engine loaded, or its directory: where the MoE layers are")
    beside.add_argument("--decode-workers", type=_non_negative_int, default=ServerConfig.decode_workers,
                        help="processes decoding routing off the event loop; 0: a thread (default %(default)s)")
    beside.add_argument("--count-queue-bytes", type=_byte_size, default=ServerConfig.count_queue_bytes,
                        help="engine answers waiting to have their routing counted, after the client has them; an "
                             "answer that finds it full is not counted (default 256M)")
    beside.add_argument("--replay-rate", type=_share, default=ReplayBudget.rate,
                        help="the share of vLLM streams replayed to count their routing (vLLM puts none in a "
                             "stream); 0: none (default %(default)s)")
    beside.add_argument("--replay-concurrency", type=_positive_int, default=ReplayBudget.concurrency,
                        help="stream replays sent to vLLM at once (default %(default)s)")
    beside.add_argument("--replay-tokens-per-second", type=_non_negative_float, default=ReplayBudget.tokens_per_second,
                        help="tokens replayed per second at most, all replays together; a stream past it is not "
                             "counted; 0: no limit (default %(default)g)")
    beside.add_argument("--engine-retune", choices=ENGINE_RETUNE_MODES, default=ServerConfig.engine_retune,
                        help="re-tune the engine's routers in place (vLLM: VLLM_SERVER_DEV_MODE=1, its port "
                             "reachable by the sidecar only; --model-config its checkpoint directory): propose pages "
                             "on-call with the command that applies a candidate, apply swaps, gates and keeps or rolls "
                             "back by itself (default %(default)s)")
    beside.add_argument("--engine-swap-dir", type=Path,
                        help="where router checkpoints are written for the engine to load, at the same path in both "
                             "containers (a shared volume; default STATE_DIR/engine-swaps)")
    beside.add_argument("--engine-gate-timeout", type=_positive_float, default=ServerConfig.engine_gate_timeout,
                        help="seconds a candidate may serve live traffic before its gate through the engine decides; "
                             "past it the previous routers go back (default %(default)s)")
    beside.add_argument("--sglang-recorder-dir", type=Path,
                        help="SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, shared with the engine: count all its traffic "
                             "from the expert distribution recorder (--expert-distribution-recorder-mode stat)")
    beside.add_argument("--sglang-recorder-interval", type=_positive_float,
                        default=ServerConfig.sglang_recorder_interval,
                        help="seconds between two recorder dumps (default %(default)s)")
    beside.add_argument("--sglang-recorder-buffer", type=_positive_int, default=ServerConfig.sglang_recorder_buffer,
                        help="the engine's --expert-distribution-recorder-buffer-size (default %(default)s)")
    serve.add_argument("--return-routed-experts", action="store_true",
                       help="answer with the model's routing per token, in vLLM's and SGLang's fields")
    serve.add_argument("--attn-implementation", default=ServerConfig.attn_implementation,
                       help="attention to serve with, if the start-up self-test agrees with eager (default sdpa)")
    serve.add_argument("--max-queue", type=_positive_int, default=ServerConfig.max_queue,
                       help="requests queued for the model before 429")
    serve.add_argument("--request-timeout", type=_positive_float, default=ServerConfig.request_timeout,
                       help="seconds per request, queue included; with --upstream, for the whole answer (a stream: "
                            "its headers, then each line)")
    serve.add_argument("--capture", action="store_true",
                       help="record recent traffic (token ids) per business line in STATE_DIR for re-tuning")
    serve.add_argument("--capture-max-samples", type=_positive_int, default=ServerConfig.capture_max_samples,
                       help="captured samples kept per line")
    serve.add_argument("--capture-max-age", type=_positive_float, default=ServerConfig.capture_max_age_seconds,
                       help="seconds a capture is kept")
    serve.add_argument("--retune-command",
                       help="run re-tuning fits with this external command template (see the README)")
    serve.add_argument("--retune-cooldown", type=_non_negative_float, default=RetuneSettings.cooldown_seconds,
                       help="seconds between two re-tune jobs of one router (default %(default)s)")
    serve.add_argument("--max-perplexity-increase", type=_margin, default=RetuneSettings.max_perplexity_increase,
                       help="quality gate: how much worse than the live model a candidate's perplexity may be, "
                            "relative (2%%) or absolute (0.3) (default %(default)s)")
    serve.add_argument("--gate-confidence", type=float, default=RetuneSettings.gate_confidence,
                       help="quality gate: one-sided confidence of a pass or a rejection (default %(default)s)")
    serve.add_argument("--min-held-out-tokens", type=_positive_int, default=RetuneSettings.min_held_out_tokens,
                       help="quality gate: scored held-out tokens below which it does not decide; the job waits "
                            "for more captured traffic (default %(default)s)")
    serve.add_argument("--retune-retry", type=_positive_float, default=RetuneSettings.retry_seconds,
                       help="seconds between two tries of a re-tune job waiting for data (default %(default)s)")
    serve.add_argument("--retune-max-wait", type=_non_negative_float, default=RetuneSettings.max_wait_seconds,
                       help="seconds a re-tune job may wait for data before it fails (default %(default)s)")
    serve.add_argument("--reference-model", type=Path,
                       help="the checkpoint the served model came from: `restore` puts its router tensors back "
                            "(only those are read)")
    serve.add_argument("--retune-option", action="append", default=[],
                       help="default strategy option, STRATEGY.NAME=VALUE (repeat), e.g. router_finetune.lr=1e-3")
    serve.add_argument("--min-held-out-samples", type=_positive_int, default=RetuneSettings.min_held_out_samples,
                       help="quality gate: distinct held-out texts below which it does not decide (a prompt repeated "
                            "counts once) (default %(default)s)")
    serve.add_argument("--retune-min-samples", type=_positive_int, default=RetuneSettings.min_samples,
                       help="samples a re-tune job needs at least (default %(default)s)")
    serve.add_argument("--alert-interval", type=_positive_float, default=ServerConfig.alert_interval,
                       help="seconds between two evaluations of the alert rules (default %(default)s)")
    serve.add_argument("--baseline-tokens", type=_positive_int, default=ServerConfig.baseline_tokens,
                       help="tokens a router's window of one business line holds before it is learned as that "
                            "line's healthy baseline (once the routers served passed their health check)")
    serve.add_argument("--history-interval", type=_positive_float, default=ServerConfig.history_interval_seconds,
                       help="status page: seconds between two points of the entropy heat map (default %(default)s)")
    serve.add_argument("--history-span", type=_positive_float, default=ServerConfig.history_span_seconds,
                       help="status page: seconds of entropy history kept (default %(default)s)")
    serve.add_argument("--history-retention", type=_history_retention, default=ServerConfig.history_retention_days,
                       help="days of routing history kept in STATE_DIR/history.sqlite (1-minute points for a day, "
                            "15-minute ones beyond; 1 to 365, 0: none) (default %(default)s)")
    serve.add_argument("--history-max-series", type=_positive_int, default=ServerConfig.history_max_series,
                       help="(router, business line) series the durable history keeps (default %(default)s)")
    serve.add_argument("--body-timeout", type=_positive_float, default=ServerConfig.body_timeout_seconds,
                       help="seconds a request body may take to arrive before 408 (default %(default)s)")
    for name, text in INGEST_FLAGS.items():
        serve.add_argument("--ingest-" + name.replace("_", "-"), type=type(getattr(IngestLimits, name)),
                           default=getattr(IngestLimits, name), help=f"{text} (default %(default)s)")
    serve.set_defaults(handler=_cmd_serve)

    check = commands.add_parser("check", help="validate policies and rules; lint the rules against the model")
    check.add_argument("--policies", type=Path, default=SHIPPED_POLICIES, help="directory of policy YAML files")
    check.add_argument("--rules", type=Path, default=SHIPPED_RULES, help="directory of alert rule YAML files")
    check.add_argument("--model", default="bundled",
                       help="lint the rules against this model's routers ('bundled' or a path)")
    check.add_argument("--model-config", type=Path,
                       help="instead: lint them against an engine's routers, from the config.json it loaded")
    check.add_argument("--history-interval", type=_positive_float, default=ServerConfig.history_interval_seconds,
                       help="as serve --history-interval: trend rules need a look-back of several points")
    check.add_argument("--history-retention", type=_non_negative_float, default=ServerConfig.history_retention_days,
                       help="as serve --history-retention (days; 0: none, and trend rules are never judged)")
    check.add_argument("--capture", action="store_true",
                       help="as serve --capture would run: rules asking for re-tuning have captured traffic to use")
    check.add_argument("--reference-model", type=Path,
                       help="as serve --reference-model: check that its router tensors match the model's")
    check.set_defaults(handler=_cmd_check)

    rules = commands.add_parser("rules", help="alert rules").add_subparsers(dest="rules_command", required=True)
    export = rules.add_parser("export", help="write the rules as a Prometheus rule file")
    export.add_argument("--format", choices=["prometheus"], default="prometheus", help="the rule file's format")
    export.add_argument("--rules", type=Path, default=SHIPPED_RULES, help="directory of alert rule YAML files")
    export.add_argument("--out", type=Path, help="file to write (default: standard output)")
    export.set_defaults(handler=_cmd_rules_export)

    demo = commands.add_parser("demo", help="the whole loop in about half a minute (2 CPU cores), offline, on "
                                            "the bundled model")
    demo.add_argument("--out", type=Path, default=Path("mla-watch-demo"),
                      help="where timeline.png and summary.json go (default ./mla-watch-demo)")
    demo.add_argument("--no-live", action="store_true", help="print progress lines instead of the live view")
    demo.add_argument("--timeout", type=_positive_float, default=600.0, help="give up after this many seconds")
    demo.add_argument("--no-fault", action="store_true", help=argparse.SUPPRESS)  # the failure path, for tests
    demo.set_defaults(handler=_cmd_demo)

    retune = commands.add_parser("retune", help="router re-tuning jobs and versions of a running sidecar")
    retune_commands = retune.add_subparsers(dest="retune_command", required=True)

    def sidecar_url(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000",
                            help="the sidecar (admin calls need MLA_WATCH_ADMIN_TOKEN)")

    run = retune_commands.add_parser("run", help="schedule a re-tune job now")
    sidecar_url(run)
    run.add_argument("--router", action="append", help="a router to re-tune (repeat; default: those out of band)")
    run.add_argument("--business-line", help="whose captured traffic to train on (default: every line)")
    run.add_argument("--strategy", action="append", help="bias | router_finetune | restore (repeat: tried in order)")
    run.add_argument("--rule", help="the rule whose band the routers must meet (default: the first retune rule)")
    run.add_argument("--dataset", type=Path,
                     help="a JSONL file to train on instead of captured traffic: a path here (copied into "
                          "--dataset-dir first) or the bare name of a file already in the sidecar's dataset directory")
    run.add_argument("--dataset-dir", type=Path, default=DEFAULT_STATE_DIR / "datasets",
                     help="the sidecar's dataset directory (its serve --dataset-dir; default "
                          "./mla-watch-state/datasets), where a --dataset file is copied")
    run.add_argument("--option", action="append", default=[], help="STRATEGY.NAME=VALUE, e.g. router_finetune.lr=1e-3")
    run.add_argument("--force", action="store_true", help="ignore the per-router cooldown")
    run.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the outcome (exit 1 unless promoted)")
    listing = retune_commands.add_parser("list", help="recent jobs")
    sidecar_url(listing)
    listing.add_argument("--limit", type=_positive_int, default=20, help="the most recent jobs listed")
    listing.add_argument("--json", action="store_true", help="print the jobs as JSON instead of a table")
    show = retune_commands.add_parser("show", help="one job, or one router version's manifest")
    sidecar_url(show)
    show.add_argument("job", nargs="?")
    show.add_argument("--version", type=int, help="instead of a job: this router version's manifest")
    promote = retune_commands.add_parser("promote", help="make a router version live")
    sidecar_url(promote)
    promote.add_argument("version", type=int)
    apply = retune_commands.add_parser("apply", help="swap a proposed router version into the engine, gate it "
                                                      "through the engine, keep it or roll it back")
    sidecar_url(apply)
    apply.add_argument("version", type=int)
    apply.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the outcome (exit 1 unless "
                                                               "promoted)")
    rollback = retune_commands.add_parser("rollback", help="undo the last promotion exactly")
    sidecar_url(rollback)
    mark_good = retune_commands.add_parser("mark-good", help="vouch for a router version: `restore` may put it back")
    sidecar_url(mark_good)
    mark_good.add_argument("version", type=int)
    retune.set_defaults(handler=_cmd_retune)
    from mla_watch.cli_startup import finish_parser

    return finish_parser(parser)


def _loads_model(args: argparse.Namespace) -> bool:
    """Whether the command loads a model here (its weight-loading progress bars are kept out of the output)."""
    if args.command == "serve":
        return not args.upstream
    if args.command == "check":
        return args.model_config is None and args.model is not None
    return args.command in ("routing", "baseline", "demo")


def main(argv: Sequence[str] | None = None) -> int:
    from mla_watch.cli_startup import parse_args, prog, quiet_progress_bars

    args = parse_args(build_parser(), argv)
    try:
        if getattr(args, "samples", 1) < 1:
            raise FlagError(f"--samples {args.samples}: expected a positive number")
        if getattr(args, "generate", 0) < 0:
            raise FlagError(f"--generate {args.generate}: expected 0 or more")
        with quiet_progress_bars() if _loads_model(args) else contextlib.nullcontext():
            return int(args.handler(args))
    except FlagError as error:  # one line naming the flag, its value and what was expected: no traceback
        print(f"{prog(args)}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
