"""``mla-watch check`` and ``mla-watch rules export``: the policy and rule files, judged offline.

``check`` validates every policy and rule file and lints the rules against a model's routers (the
model loaded here, or an engine's ``config.json``); ``rules export`` writes the rules as a
Prometheus rule file, a Prometheus Operator PrometheusRule or a Mimir ruler namespace file, and with
``--fleet`` adds the fleet's recording rules and alerts (:mod:`mla_watch.alerting.fleet`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.fleet import (
    DEFAULT_FLEET_LABELS,
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_OUTLIER_BITS,
    DEFAULT_OUTLIER_FACTOR,
    DEFAULT_OUTLIER_INTERVAL_SECONDS,
    DEFAULT_REPLICA_LABEL,
    DEFAULT_SHARDS,
    FLEET_SCALE_NOTE,
    OUTLIER_FOR_SECONDS,
    SCOPE_LABEL,
    FleetOptions,
    fleet_groups,
    fleet_notes,
    parse_label_list,
)
from mla_watch.alerting.fleet_versions import DEFAULT_SKEW_FOR_SECONDS, VERSION_SKEW_ALERT, version_group
from mla_watch.cli.flags import DOCS, non_negative_float, positive_float
from mla_watch.cli.setting_flags import flag_text
from mla_watch.common.output_file import write_file, write_stdout
from mla_watch.server.config import ServerConfig
from mla_watch.shipped import SHIPPED_POLICIES, SHIPPED_RULES

__all__ = ["add_parsers"]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate every policy and rule file and lint the rules against the model's routers."""
    from mla_watch.alerting.rules import RuleError, load_rules_dir
    from mla_watch.cli.startup import check_model_flags
    from mla_watch.policy.files import load_policy_dir
    from mla_watch.policy.model import PolicyError

    if args.model_config is None and args.model is not None:
        check_model_flags(args, full=False)  # a mistyped name; a model that does not load is a finding below
        from mla_watch.cli.startup import require_model_extra

        require_model_extra(f"--model {args.model} (loaded here to lint the rules; --model-config needs no model)")
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
        from mla_watch.retune.availability import RetuneConditions, why_retune_is_off

        try:
            geometry = load_geometry(args.model_config)
        except GeometryError as error:
            for message in error.errors:
                print(f"error: {message}")
            errors += len(error.errors)
        else:
            print(
                f"ok: engine routers: {geometry.describe()}; {why_retune_is_off(RetuneConditions('engine'))}"
            )  # serve's flags and the engine: unknown here
            found_errors, found_warnings = _lint(rules, geometry.routers(), args)
            errors, warnings = errors + found_errors, warnings + found_warnings
    elif args.model is not None:
        import mla_watch
        from mla_watch.common.progress import Progress

        sys.stdout.flush()  # what was found so far, before the wait
        Progress("mla-watch check").say(f"loading the model {args.model} to lint the rules against its routers")
        try:
            model, _ = (args.model_loader or mla_watch.load_model)(args.model, device="cpu")
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
            notes = "".join(
                [
                    f", zero-compute slots {list(info.zero_slots)}" if info.zero_slots else "",
                    ", hash-routed by token id" if info.hash_routed else "",
                ]
            )
            print(
                f"ok: router {info.name} (layer {info.layer}, {info.kind}, top-{info.top_k} of {info.num_slots}{notes})"
            )
        from mla_watch.alerting.lint import applies_to
        from mla_watch.retune.strategies import STRATEGIES, supported_strategies

        support = supported_strategies(model)
        for name, reason in support.items():
            print(
                f"ok: re-tune strategy {name} is supported"
                if reason is None
                else f"info: re-tune strategy {name} is not supported: {reason}"
            )
        restoring_only: list[str] = []
        for rule in rules.rules if rules is not None else ():
            if "retune" not in rule.actions or not applies_to(rule, routers):  # a rule for other routers
                continue
            usable = [name for name in rule.retune_strategies or support if support.get(name) is None]
            if not usable:
                print(
                    f"warning: rule {rule.name}: none of its re-tune strategies "
                    f"{list(rule.retune_strategies)} supports this model"
                )
                warnings += 1
            elif not args.capture and all(STRATEGIES[name].needs_traffic for name in usable):
                print(
                    f"warning: rule {rule.name} asks for re-tuning by {', '.join(usable)}, which fit on traffic: "
                    f"serve with --capture (an alert's job trains on captured traffic; it names no dataset)"
                )
                warnings += 1
            elif not args.capture and any(STRATEGIES[name].needs_traffic for name in usable):
                restoring_only.append(rule.name)
        if restoring_only:
            print(
                f"info: without --capture the re-tune jobs of {', '.join(restoring_only)} can only restore a "
                "known-good router version (bias and router_finetune fit on captured traffic)"
            )
        if args.reference_model is not None:
            from mla_watch.retune.reference import load_reference_routers
            from mla_watch.retune.router_tensors import router_state

            try:
                reference = load_reference_routers(args.reference_model, router_state(model))
            except ValueError as error:
                print(f"error: {' '.join(flag_text(error).split())}")
                errors += 1
            else:
                print(
                    f"ok: {reference.label}: {len(reference.tensors)} router tensors match the model's; "
                    f"`restore` puts them back"
                )
        found_errors, found_warnings = _lint(rules, routers, args)
        errors, warnings = errors + found_errors, warnings + found_warnings
    print(f"{errors} error(s), {warnings} warning(s)")
    return 1 if errors else 0


def _lint(rules: Any, routers: Sequence[Any], args: argparse.Namespace) -> tuple[int, int]:
    """Print the rules' findings against ``routers`` (history as serve's ``args``); return (errors, warnings)."""
    from mla_watch.alerting.lint import lint

    errors = warnings = 0
    findings = (
        lint(
            rules,
            routers,
            history_interval_seconds=args.history_interval,
            history_retention_seconds=args.history_retention * 86400.0,
            with_history=args.history_retention > 0,
        )
        if rules is not None
        else ()
    )
    for finding in findings:
        print(f"{finding.severity}: rule {finding.rule}: {finding.message}")
        errors += finding.severity == "error"
        warnings += finding.severity == "warning"
    return errors, warnings


def _export_command(args: argparse.Namespace) -> str:
    """The command line that writes this export again (said in the file's header)."""
    parts = ["mla-watch rules export", f"--format {args.format}"]
    if args.fleet:
        parts.append("--fleet")
        for flag, value in (
            ("--fleet-interval", args.fleet_interval),
            ("--fleet-shards", args.fleet_shards),
            ("--fleet-labels", args.fleet_labels),
            ("--replica-label", args.replica_label),
            ("--outlier-interval", args.outlier_interval),
            ("--outlier-bits", args.outlier_bits),
            ("--outlier-factor", args.outlier_factor),
            ("--outlier-for", args.outlier_for),
            ("--version-skew-for", args.version_skew_for),
        ):
            if value is not None:
                parts.append(f"{flag} {value}")
    return " ".join(parts)


def _fleet_options(args: argparse.Namespace) -> FleetOptions | None:
    """The --fleet* flags as FleetOptions; exit 2 naming the flag, its value and what was expected."""
    from mla_watch.alerting.durations import parse_duration
    from mla_watch.alerting.vocabulary import RuleError

    fleet_only = {
        "--fleet-interval": args.fleet_interval,
        "--fleet-shards": args.fleet_shards,
        "--fleet-labels": args.fleet_labels,
        "--replica-label": args.replica_label,
        "--outlier-interval": args.outlier_interval,
        "--outlier-bits": args.outlier_bits,
        "--outlier-factor": args.outlier_factor,
        "--outlier-for": args.outlier_for,
        "--version-skew-for": args.version_skew_for,
    }
    if not args.fleet:
        given = [f"{flag} {value}" for flag, value in fleet_only.items() if value is not None]
        if given:
            args.parser.error(f"{given[0]}: only used with --fleet; expected --fleet as well")
        return None
    values: dict[str, Any] = {}
    try:
        for flag, key, text in (
            ("--fleet-interval", "interval_seconds", args.fleet_interval),
            ("--outlier-interval", "outlier_interval_seconds", args.outlier_interval),
            ("--outlier-for", "outlier_for_seconds", args.outlier_for),
        ):
            if text is not None:
                try:
                    values[key] = parse_duration(text, flag)
                except RuleError as error:
                    raise ValueError(error.errors[0].replace(f"{flag} =", flag)) from None
        if args.fleet_shards is not None:
            if not args.fleet_shards.isdigit() or not args.fleet_shards.isascii():
                raise ValueError(
                    f"--fleet-shards {args.fleet_shards[:80]!r}: expected a whole number, a divisor of "
                    "100 (e.g. 2 or 10)"
                )
            values["shards"] = int(args.fleet_shards)
        if args.fleet_labels is not None:
            values["fleet_labels"] = parse_label_list(args.fleet_labels)
        if args.replica_label is not None:
            values["replica_label"] = args.replica_label
        for flag, key, text in (
            ("--outlier-bits", "outlier_bits", args.outlier_bits),
            ("--outlier-factor", "outlier_factor", args.outlier_factor),
        ):
            if text is not None:
                try:
                    values[key] = float(text)
                except ValueError:
                    raise ValueError(f"{flag} {text[:80]!r}: expected a number") from None
        return FleetOptions(**values)
    except ValueError as error:
        cast(argparse.ArgumentParser, args.parser).error(flag_text(error))  # exits


def _skew_for(args: argparse.Namespace) -> float:
    """--version-skew-for in seconds (1m to 31d); exit 2 naming the flag."""
    from mla_watch.alerting.durations import parse_duration
    from mla_watch.alerting.vocabulary import RuleError

    if args.version_skew_for is None:
        return DEFAULT_SKEW_FOR_SECONDS
    try:
        seconds = parse_duration(args.version_skew_for, "--version-skew-for")
    except RuleError as error:
        cast(argparse.ArgumentParser, args.parser).error(
            error.errors[0].replace("--version-skew-for =", "--version-skew-for")
        )
    if not 60 <= seconds <= 31 * 86400:
        cast(argparse.ArgumentParser, args.parser).error(
            f"--version-skew-for {args.version_skew_for[:40]!r}: expected a duration from 1m to 31d, longer than a "
            "rollout takes (e.g. 30m)"
        )
    return seconds


def _cmd_rules_export(args: argparse.Namespace) -> int:
    from mla_watch.alerting.promexport import export_prometheus, export_rules
    from mla_watch.alerting.rules import RuleError, load_rules_dir

    fleet = _fleet_options(args)
    try:
        rules = load_rules_dir(args.rules)
    except RuleError as error:
        raise SystemExit("mla-watch: the rules do not load:\n  " + "\n  ".join(error.errors)) from error
    if args.format == "prometheus" and fleet is None:
        text = export_prometheus(rules)  # what this command has always written
    else:
        text = export_rules(
            rules,
            command=_export_command(args),
            file_format=args.format,
            labels={SCOPE_LABEL: "replica"} if fleet is not None else None,
            extra_groups=[*fleet_groups(rules, fleet), version_group(fleet.fleet_labels, fleet.job, _skew_for(args))]
            if fleet is not None
            else (),
            notes=fleet_notes(fleet) if fleet is not None else (),
            source_root=args.rules.resolve(),
        )
    if args.out is None:
        write_stdout(text)
    else:  # a file replaced atomically; a device or a FIFO written through; a directory refused; one line on error
        write_file(args.out, text, label=f"--out {args.out}")
        alerts, recordings = _rule_counts(text)
        print(
            f"wrote {alerts} alert{'s' * (alerts != 1)} and {recordings} recording rule{'s' * (recordings != 1)} "
            f"to {args.out}",
            file=sys.stderr,
        )
    if fleet is not None:  # the file's header says it too; a file written to stdout must stay a rule file
        print(f"note: {' '.join(FLEET_SCALE_NOTE.split())}", file=sys.stderr)
    return 0


def _rule_counts(text: str) -> tuple[int, int]:
    """(alerts, recording rules) in an exported file, whatever its format: Prometheus' ``groups``, a
    PrometheusRule's ``spec.groups``, a Mimir namespace file."""
    import yaml

    kinds: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "expr" in node and ("alert" in node or "record" in node):
                kinds.append("alert" if "alert" in node else "record")
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(text))
    return kinds.count("alert"), kinds.count("record")


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``check`` subcommand and ``rules export``."""
    check = commands.add_parser(
        "check",
        help="validate policies and rules; lint the rules against the model",
        epilog=f'The manual: {DOCS}alerting.md ("Lint: mla-watch check")',
    )
    check.add_argument("--policies", type=Path, default=SHIPPED_POLICIES, help="directory of policy YAML files")
    check.add_argument("--rules", type=Path, default=SHIPPED_RULES, help="directory of alert rule YAML files")
    check.add_argument(
        "--model", default="bundled", help="lint the rules against this model's routers ('bundled' or a path)"
    )
    check.add_argument(
        "--model-config",
        type=Path,
        help="instead: lint them against an engine's routers, from the config.json it loaded",
    )
    check.add_argument(
        "--history-interval",
        type=positive_float,
        default=ServerConfig.history_interval_seconds,
        help="as serve --history-interval: trend rules need a look-back of several points",
    )
    check.add_argument(
        "--history-retention",
        type=non_negative_float,
        default=ServerConfig.history_retention_days,
        help="as serve --history-retention (days; 0: none, and trend rules are never judged)",
    )
    check.add_argument(
        "--capture",
        action="store_true",
        help="as serve --capture would run: rules asking for re-tuning have captured traffic to use",
    )
    check.add_argument(
        "--reference-model",
        type=Path,
        help="as serve --reference-model: check that its router tensors match the model's",
    )
    check.set_defaults(handler=_cmd_check)

    rules = commands.add_parser("rules", help="alert rules", epilog=f"The manual: {DOCS}alerting.md").add_subparsers(
        dest="rules_command", required=True
    )
    export = rules.add_parser(
        "export",
        help="write the rules as a Prometheus rule file",
        epilog=f'The manual: {DOCS}alerting.md ("Prometheus export"); --fleet: {DOCS}fleet.md',
    )
    export.add_argument(
        "--format",
        choices=["prometheus", "operator", "mimir"],
        default="prometheus",
        help="prometheus: a rule file (Prometheus, Thanos ruler); operator: a Prometheus Operator "
        "PrometheusRule; mimir: a Mimir / Cortex ruler namespace file (mimirtool rules load)",
    )
    export.add_argument("--rules", type=Path, default=SHIPPED_RULES, help="directory of alert rule YAML files")
    export.add_argument("--out", type=Path, help="file to write (default: standard output)")
    export.add_argument(
        "--fleet",
        action="store_true",
        help="add the fleet's recording rules (from the per-expert window counts of serve "
        "--export-expert-counts), a fleet twin of every alert, and the replica-outlier alert",
    )
    export.add_argument(
        "--fleet-interval",
        metavar="DURATION",
        help="with --fleet: how often Prometheus evaluates the fleet group(s) "
        f"(default {format_duration(DEFAULT_INTERVAL_SECONDS)})",
    )
    export.add_argument(
        "--fleet-shards",
        metavar="N",
        help="with --fleet: split the fleet group by layer into N groups (a divisor of 100), each "
        "exact for its routers: evaluated side by side, spread by a ruler, or one per Prometheus "
        f"server scraping /metrics?shard=K/N (default {DEFAULT_SHARDS})",
    )
    export.add_argument(
        "--fleet-labels",
        metavar="LABEL[,LABEL...]",
        help=f"with --fleet: the target labels one fleet shares (default {','.join(DEFAULT_FLEET_LABELS)})",
    )
    export.add_argument(
        "--replica-label",
        metavar="LABEL",
        help=f"with --fleet: the target label that tells a fleet's replicas apart (default {DEFAULT_REPLICA_LABEL})",
    )
    export.add_argument(
        "--outlier-interval",
        metavar="DURATION",
        help="with --fleet: how often Prometheus evaluates each replica's divergence from its fleet "
        f"and the outlier alert (default {format_duration(DEFAULT_OUTLIER_INTERVAL_SECONDS)})",
    )
    export.add_argument(
        "--outlier-bits",
        metavar="BITS",
        help="with --fleet: the least KL from the fleet, in bits, that makes a replica an outlier "
        f"(default {DEFAULT_OUTLIER_BITS:g})",
    )
    export.add_argument(
        "--outlier-factor",
        metavar="X",
        help="with --fleet: how many times the median replica's KL an outlier exceeds "
        f"(default {DEFAULT_OUTLIER_FACTOR:g})",
    )
    export.add_argument(
        "--outlier-for",
        metavar="DURATION",
        help="with --fleet: how long a replica must stay an outlier before the alert fires "
        f"(default {format_duration(OUTLIER_FOR_SECONDS)})",
    )
    export.add_argument(
        "--version-skew-for",
        metavar="DURATION",
        help="with --fleet: how long the replicas may serve different router versions before "
        f"{VERSION_SKEW_ALERT} fires; longer than a rollout takes "
        f"(default {format_duration(DEFAULT_SKEW_FOR_SECONDS)})",
    )
    export.set_defaults(handler=_cmd_rules_export, parser=export)
