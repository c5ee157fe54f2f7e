"""``mla-watch retune``: a running sidecar's re-tune jobs and router versions, through its API.

Every subcommand is one call to the sidecar (admin calls send ``MLA_WATCH_ADMIN_TOKEN``); ``run``
and ``apply`` may follow the job they scheduled for up to ``--wait`` seconds, until it ends or waits for data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mla_watch.cli.flags import DEFAULT_STATE_DIR, DOCS, non_negative_float, parse_options, positive_int
from mla_watch.cli.sidecar_api import call_sidecar, sidecar_url_flag
from mla_watch.cli.tables import format_table
from mla_watch.common.state_dir import DATASETS_DIR_NAME
from mla_watch.routing.windows import ALL_LINES

__all__ = ["WAITING_EXIT", "add_parser"]

WAITING_EXIT = 3  # retune run / apply --wait: the job waits for more data, and tries again by itself


def _admin(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    return call_sidecar("mla-watch retune", args.url, method, path, body)


def _print_jobs(jobs: list[dict[str, Any]]) -> None:
    import time

    rows = [["job", "created", "status", "strategy", "version", "tries", "business line", "routers"]]
    for job in jobs:
        result = job.get("result") or {}
        rows.append(
            [
                job["id"],
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["created_at"])),
                job["status"],
                str(result.get("strategy") or "/".join(job["spec"]["strategies"])),
                "-" if result.get("version") is None else str(result["version"]),
                str(job["attempts"]),
                job["spec"].get("business_line") or ALL_LINES,
                ", ".join(job["spec"]["routers"]),
            ]
        )
    print(format_table(rows))


def _dataset_name(path: Path, directory: Path) -> str:
    """The name the sidecar's admin API knows ``--dataset`` by; a local file is first copied into ``directory``.

    The API reads datasets only from the sidecar's dataset directory, by bare file name. The
    operator on the sidecar's machine may name any file: it is copied there (0600, never over a
    different file of that name). A bare name that is no local file is sent as it is.
    """
    import filecmp
    import os
    import shutil

    from mla_watch.common.output_file import write_error
    from mla_watch.common.state_dir import PRIVATE_FILE_MODE, ensure_private_dir
    from mla_watch.retune.data import DATASET_NAME_RE

    name = path.name
    if not DATASET_NAME_RE.fullmatch(name) or not name.endswith(".jsonl"):
        raise SystemExit(
            f"mla-watch retune run: --dataset {str(path)[:200]}: file name {name[:64]!r} is invalid: "
            "expected letters, digits, '.', '_', '-' (at most 128, the first a letter or digit), "
            "ending .jsonl"
        )
    if not path.is_file():
        if str(path) == name:  # the name of a file already in the sidecar's dataset directory
            return name
        raise SystemExit(
            f"mla-watch retune run: --dataset {str(path)[:200]}: no such file: expected a JSONL file, "
            "or the bare name of one in the sidecar's dataset directory"
        )
    try:
        target = ensure_private_dir(directory) / name
        if target.exists():
            if target.resolve() == path.resolve() or filecmp.cmp(path, target, shallow=False):
                return name
            raise SystemExit(
                f"mla-watch retune run: --dataset {str(path)[:200]}: {target} exists with other "
                "content: expected a file name not used there yet (or remove the old file)"
            )
        with (
            path.open("rb") as source,
            os.fdopen(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE), "wb") as copy,
        ):
            shutil.copyfileobj(source, copy)
    except OSError as error:  # the words of every write error: the disk is full, read-only file system, ...
        failure = write_error(f"--dataset-dir {directory}", error)
        raise SystemExit(
            f"mla-watch retune run: --dataset {str(path)[:200]}: cannot copy it into --dataset-dir "
            f"{directory}: {failure.problem}; {failure.advice}"
        ) from None
    print(f"copied {path} to {target} (the sidecar reads it there if that is its --dataset-dir)", file=sys.stderr)
    return name


def _cmd_retune(args: argparse.Namespace) -> int:
    if args.retune_command == "run":
        body: dict[str, Any] = {"force": args.force}
        for key, value in (
            ("routers", args.router),
            ("business_line", args.business_line),
            ("strategy", args.strategy),
            ("rule", args.rule),
            ("dataset", _dataset_name(args.dataset, args.dataset_dir) if args.dataset else None),
            ("options", parse_options(args.option) if args.option else None),
        ):
            if value:
                body[key] = value
        job = _admin(args, "POST", "/admin/retune", body)
        print(
            f"scheduled re-tune job {job['id']} ({'/'.join(job['spec']['strategies'])} on "
            f"{', '.join(job['spec']['routers'])})"
        )
        return _wait_for_job(args, job)
    if args.retune_command == "apply":
        job = _admin(args, "POST", "/admin/retune/apply", {"version": args.version})
        print(
            f"scheduled re-tune job {job['id']}: router version {args.version} swapped into the engine, gated "
            f"through it, kept or rolled back"
        )
        return _wait_for_job(args, job)
    return _retune_versions(args)


def _wait_for_job(args: argparse.Namespace, job: dict[str, Any]) -> int:
    """Follow ``job`` for at most ``--wait`` seconds, a line each time its status changes; return as soon as it
    ended or parked waiting for data (it retries by itself: there is nothing to wait for here).

    0: promoted (or not waiting at all); 1: it ended otherwise, or still ran at the end of ``--wait``;
    :data:`WAITING_EXIT`: it waits for more data.
    """
    import time

    if args.wait <= 0:
        return 0
    started = time.monotonic()
    shown = None
    while True:
        if job["status"] != shown:
            shown = job["status"]
            print(f"job {job['id']}: {shown} ({time.monotonic() - started:.0f} s)", flush=True)
        if job["status"] not in ("pending", "running") or time.monotonic() - started >= args.wait:
            break
        time.sleep(0.5)
        job = _admin(args, "GET", f"/v1/retune/jobs/{job['id']}")
    _print_jobs([job])
    result = job.get("result") or {}
    if job["status"] == "waiting":
        retry_at = result.get("retry_at")
        when = (
            ""
            if not isinstance(retry_at, (int, float))
            else (
                f" at {time.strftime('%H:%M:%S UTC', time.gmtime(retry_at))} "
                f"(in {max(0.0, retry_at - time.time()):.0f} s)"
            )
        )
        print(f"job {job['id']} waits for more data and tries again by itself{when}: {result.get('needs')}")
        return WAITING_EXIT
    if job["status"] == "promoted":
        return 0
    status = job["status"]
    print(f"{status}: {result.get('error') or f'still {status} after --wait {args.wait:g} s'}")
    return 1


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
                raise SystemExit(
                    f"mla-watch retune show: --version {args.version} does not exist; versions are "
                    f"{[v['version'] for v in versions['versions']]}"
                )
            print(json.dumps({**found[0], "live": versions["live"] == args.version}, indent=1))
        else:
            print(json.dumps(_admin(args, "GET", f"/v1/retune/jobs/{args.job}"), indent=1))
        return 0
    if args.retune_command == "promote":
        print(
            f"router version {_admin(args, 'POST', '/admin/retune/promote', {'version': args.version})['live']} is live"
        )
        return 0
    if args.retune_command == "mark-good":
        marked = _admin(args, "POST", "/admin/retune/mark-good", {"version": args.version})["marked_good"]
        print(f"router version {marked} marked good: `restore` puts it back")
        return 0
    print(f"rolled back; router version {_admin(args, 'POST', '/admin/retune/rollback', {})['live']} is live")
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``retune`` subcommand and its own subcommands."""
    retune = commands.add_parser(
        "retune",
        help="router re-tuning jobs and versions of a running sidecar",
        epilog=f"The manual: {DOCS}retuning.md",
    )
    retune_commands = retune.add_subparsers(dest="retune_command", required=True)

    def sidecar_url(parser: argparse.ArgumentParser) -> None:
        sidecar_url_flag(parser, "the sidecar (admin calls need MLA_WATCH_ADMIN_TOKEN)")

    run = retune_commands.add_parser("run", help="schedule a re-tune job now")
    sidecar_url(run)
    run.add_argument("--router", action="append", help="a router to re-tune (repeat; default: those out of band)")
    run.add_argument("--business-line", help="whose captured traffic to train on (default: every line)")
    run.add_argument("--strategy", action="append", help="bias | router_finetune | restore (repeat: tried in order)")
    run.add_argument("--rule", help="the rule whose band the routers must meet (default: the first retune rule)")
    run.add_argument(
        "--dataset",
        type=Path,
        help="a JSONL file to train on instead of captured traffic: a path here (copied into "
        "--dataset-dir first) or the bare name of a file already in the sidecar's dataset directory",
    )
    run.add_argument(
        "--dataset-dir",
        type=Path,
        default=DEFAULT_STATE_DIR / DATASETS_DIR_NAME,
        help="the sidecar's dataset directory (its serve --dataset-dir; default "
        "./mla-watch-state/datasets), where a --dataset file is copied",
    )
    run.add_argument("--option", action="append", default=[], help="STRATEGY.NAME=VALUE, e.g. router_finetune.lr=1e-3")
    run.add_argument("--force", action="store_true", help="ignore the per-router cooldown")
    wait_help = (
        "seconds to follow the job; it returns as soon as the job ends (exit 0 if promoted, else 1) or "
        f"waits for more data, saying why and when it tries again (exit {WAITING_EXIT}); 0: do not follow"
    )
    run.add_argument("--wait", type=non_negative_float, default=0.0, help=wait_help)
    listing = retune_commands.add_parser("list", help="recent jobs")
    sidecar_url(listing)
    listing.add_argument("--limit", type=positive_int, default=20, help="the most recent jobs listed")
    listing.add_argument("--json", action="store_true", help="print the jobs as JSON instead of a table")
    show = retune_commands.add_parser("show", help="one job, or one router version's manifest")
    sidecar_url(show)
    show.add_argument("job", nargs="?")
    show.add_argument("--version", type=int, help="instead of a job: this router version's manifest")
    promote = retune_commands.add_parser("promote", help="make a router version live")
    sidecar_url(promote)
    promote.add_argument("version", type=int)
    apply = retune_commands.add_parser(
        "apply",
        help="swap a proposed router version into the engine, gate it through the engine, keep it or roll it back",
    )
    sidecar_url(apply)
    apply.add_argument("version", type=int)
    apply.add_argument("--wait", type=non_negative_float, default=0.0, help=wait_help)
    rollback = retune_commands.add_parser("rollback", help="undo the last promotion exactly")
    sidecar_url(rollback)
    mark_good = retune_commands.add_parser("mark-good", help="vouch for a router version: `restore` may put it back")
    sidecar_url(mark_good)
    mark_good.add_argument("version", type=int)
    retune.set_defaults(handler=_cmd_retune)
