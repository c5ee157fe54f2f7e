"""The alert engine's state file: its instances written after a change and read again at start.

Every instance that is not inactive is persisted (JSON, written to a temporary file and
``os.replace``-d) after each evaluation that changed a state or a timer (an instance's latest
value is saved with its changes, not on every evaluation), and loaded again at start: after a
restart a firing alert stays firing without paging again, a pending one keeps its
``active_since``, and a resolution is notified normally. A file that cannot be read or parsed is
set aside as ``NAME.corrupt`` and the engine starts with no alerts. A save the disk refuses (full,
read-only) leaves the file as it was: the engine keeps its state in memory and saves it again at its
next evaluation, and the state directory's writes say so once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from mla_watch.alerting.instances import InstanceState
from mla_watch.common.output_file import write_file
from mla_watch.common.state_dir import set_aside
from mla_watch.common.state_writes import StateWrites

__all__ = ["STATE_FORMAT", "read_state", "save_state"]

log = logging.getLogger("mla_watch.alerting.alert_engine")  # the alert engine's records keep their logger's name

STATE_FORMAT = "mla_watch.alert_state/1"


WHAT = "alert state file"


def save_state(
    path: Path,
    instances: Iterable[Mapping[str, InstanceState]],
    clock: Callable[[], float],
    writes: StateWrites | None = None,
) -> bool:
    """Write every instance of ``instances`` (record key -> {rule id -> instance}) to ``path``; whether it was
    written. An error is logged (by ``writes``, once per change), not raised: the caller saves again later."""
    try:
        # An instance is serialized again only when its state or a timer changed since the last
        # save (its latest value is refreshed then too), so a save during a storm of transitions
        # does not re-encode thousands of unchanged instances.
        fragments = []
        for by_rule in instances:
            for inst in by_rule.values():
                if inst.json is None:
                    inst.json = json.dumps(inst.to_json(), separators=(",", ":"))
                fragments.append(inst.json)
        text = (
            f'{{"format":{json.dumps(STATE_FORMAT)},"saved_at":{json.dumps(clock())},'
            f'"instances":[{",".join(fragments)}]}}'
        )
        write_file(path, text, private=True, parents=True, label=f"{WHAT} {path}")
    except OSError as error:  # keep evaluating; the next evaluation saves again
        if writes is not None:
            writes.failed(path, error, what=WHAT)
        else:
            log.error("%s", error)
        return False
    except (TypeError, ValueError) as error:
        log.error("cannot write the %s %s: %s", WHAT, path, error)
        return False
    if writes is not None:
        writes.written(path, what=WHAT)
    return True


def read_state(path: Path) -> list[InstanceState] | None:
    """The instances saved in ``path``; ``None`` when there is no such file, or when it is corrupt (then it
    is set aside)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        _set_aside(path, f"cannot read it: {error}")
        return None
    try:
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
            raise ValueError(f"key 'format' must be {STATE_FORMAT!r}")
        entries = document.get("instances")
        if not isinstance(entries, list):
            raise ValueError("key 'instances' must be a list")
        return [InstanceState.from_json(entry) for entry in entries]
    except (ValueError, TypeError) as error:
        _set_aside(path, str(error))
        return None


def _set_aside(path: Path, why: str) -> None:
    aside = path.with_name(path.name + ".corrupt")
    try:
        set_aside(path)
        log.error("alert state file %s is corrupt (%s); starting with no alerts, kept it as %s", path, why, aside)
    except OSError as error:
        log.error(
            "alert state file %s is corrupt (%s); starting with no alerts; could not move it to %s: %s",
            path,
            why,
            aside,
            error,
        )
