"""Versioned router checkpoints: record, save, verify, promote into a live model, roll back.

Layout under the registry directory (``STATE_DIR/routers``)::

    v0000/routers.safetensors   the routers the server started with (:meth:`RouterVersions.record_initial`)
    v0000/manifest.json         manifest + version + created_at + sha256 of routers.safetensors
    v0001/...                   one directory per saved version, written atomically
    promotions.jsonl            one line per promotion: kind, version, previous, at (+ snapshot)
    marked_good.jsonl           one line per version an operator marked good: version, at
    snapshots/pNNNNN-vMMMM.safetensors   the values a promotion overwrote, for an exact rollback

Only router tensors (:mod:`mla_watch.retune.router_tensors`: gate weight, gate bias,
``e_score_correction_bias`` of every expert router) ever enter the registry. They are numpy arrays
(:mod:`mla_watch.common.tensor_files`: bf16 as ``ml_dtypes.bfloat16``), so the registry runs without torch
beside an engine; the files are the safetensors torch writes, byte for byte. Expert weights,
indexers and everything else are never saved and never overwritten by :meth:`RouterVersions.promote`.

A version may hold a subset of the router tensors (e.g. only the re-fitted biases of one
router). The live router state is therefore the overlay of the versions on the promotion
stack, bottom (version 0, complete) to top. :meth:`RouterVersions.rollback` puts back the
snapshot of the values the last promotion overwrote: exactly the state before it, even when a
router had been changed in place outside the registry (a bad deploy).

A version is *good* when its gates passed, when an operator marked it good
(:meth:`RouterVersions.mark_good`), or, for version 0, when the routers the server started
with passed the start-up health check: a model deployed broken is recorded as version 0 too,
and must not be what ``restore`` puts back.

A write the disk refuses (full, read-only) leaves no half version behind (a version is a directory
renamed into place once whole) and fails the operation with one line naming the file and the cause
(:func:`mla_watch.common.output_file.write_error`); ``writes`` is told, for ``/readyz`` and the metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mla_watch.common.describe import describe_value
from mla_watch.common.output_file import write_error, write_file
from mla_watch.common.state_writes import StateWrites
from mla_watch.common.tensor_files import as_arrays, load_tensors, save_tensors
from mla_watch.common.values import is_integer
from mla_watch.retune.hosts import RouterHost, as_host
from mla_watch.retune.jobs import RetentionPolicy

if TYPE_CHECKING:
    import torch

__all__ = ["RouterVersions"]

_VERSION_DIR = re.compile(r"^v(\d{4,})$")
_TENSORS_FILE = "routers.safetensors"
_MANIFEST_FILE = "manifest.json"
log = logging.getLogger(__name__)

_PROMOTIONS_FILE = "promotions.jsonl"
_MARKS_FILE = "marked_good.jsonl"
_SNAPSHOT_DIR = "snapshots"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RouterVersions:
    """Router checkpoints under ``directory`` (see the module docstring for the layout)."""

    WHAT = "router versions"

    def __init__(
        self, directory: str | Path, retention: RetentionPolicy | None = None, *, writes: StateWrites | None = None
    ) -> None:
        self.directory = Path(directory)
        self.retention = retention or RetentionPolicy()
        self.writes = writes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"router registry {self.directory}: cannot create the directory: {error}") from error
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK | os.X_OK):
            raise OSError(f"router registry {self.directory}: not a writable directory")
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Any:
        """Writes to ``path``: one the disk refuses becomes one line naming it (:class:`OutputError`)."""
        try:
            yield
        except OSError as error:
            failure = write_error(f"{self.WHAT} {path}", error)
            if self.writes is not None:
                self.writes.failed(
                    path,
                    error,
                    what=self.WHAT,
                    kept="nothing half-written is kept: the operation failed, and the next one tries again",
                )
            raise failure from None
        if self.writes is not None:
            self.writes.written(path, what=self.WHAT)

    # ------------------------------------------------------------------ versions
    def _dir(self, version: int) -> Path:
        return self.directory / f"v{version:04d}"

    def _version_numbers(self) -> list[int]:
        numbers = []
        for entry in self.directory.iterdir():
            match = _VERSION_DIR.match(entry.name)
            if match and entry.is_dir():
                numbers.append(int(match.group(1)))
        return sorted(numbers)

    def _manifest(self, version: int) -> dict[str, Any]:
        path = self._dir(version) / _MANIFEST_FILE
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"router version {version}: cannot read {path}: {error}") from error

    def record_initial(self, model: torch.nn.Module | RouterHost, health: Mapping[str, Any] | None = None) -> int:
        """Version 0 = the routers the server started with; live version becomes 0.

        Written once, with ``health`` (the start-up health check: ``{"passed": bool, ...}``; ``None``:
        not checked, so version 0 is not known to be good). When version 0 exists its tensor names
        must equal the model's (else ``ValueError`` naming the differences); its values and its
        health are left as recorded.
        """
        host = as_host(model)
        state = host.state()
        with self._lock:
            if self._dir(0).is_dir():
                recorded = set(self._manifest(0).get("tensors", []))
                if recorded != set(state):
                    raise ValueError(
                        f"router registry {self.directory}: version 0 was recorded for other router tensors; "
                        f"only in version 0: {sorted(recorded - set(state))}; "
                        f"only in the model: {sorted(set(state) - recorded)}"
                    )
            else:
                checked = (
                    dict(health)
                    if health is not None
                    else {"passed": False, "checked": False, "reason": "no start-up health check ran"}
                )
                self._write(
                    0,
                    state,
                    {
                        "source": "initial",
                        "model": host.describe(),
                        "health": checked,
                        "gates": {"passed": checked.get("passed") is True},
                    },
                )
            self._append_promotion({"kind": "initial", "version": 0, "previous": None, "at": _now()})
        return 0

    def save(self, tensors: Mapping[str, np.ndarray], manifest: Mapping[str, object]) -> int:
        """Write the next version (``tensors`` only) atomically; returns its number.

        Tensors identical to a version already written (the same file, byte for byte) are not written again: that
        version's number is returned, and the job is added to its manifest's ``candidate_of``. Past the retention
        policy, the oldest versions nothing needs are deleted afterwards.
        """
        if not tensors:
            raise ValueError("save(): no tensors given")
        with self._lock:
            numbers = self._version_numbers()
            version = (numbers[-1] + 1) if numbers else 1  # 0 is reserved for record_initial
            written = self._write(version, tensors, manifest)
        if written != version:
            log.info("router version %d holds these tensors already: not written again", written)
            self.update_manifest(
                written, {"candidate_of": [*self._manifest(written).get("candidate_of", []), manifest.get("job")][-50:]}
            )
            return written
        self.prune()
        return version

    def _same_file(self, sha256: str) -> int | None:
        for number in self._version_numbers():
            try:
                if self._manifest(number).get("sha256") == sha256:
                    return number
            except ValueError:
                continue
        return None

    def _write(self, version: int, tensors: Mapping[str, np.ndarray], manifest: Mapping[str, object]) -> int:
        """Write ``version``; the number of a version holding the very same file instead, if there is one."""
        reserved = {"version", "created_at", "sha256", "tensors"} & set(manifest)
        if reserved:
            raise ValueError(f"manifest keys {sorted(reserved)} are written by the registry")
        record: dict[str, Any] = dict(manifest)
        cpu = as_arrays(tensors)  # a torch tensor a caller passes is copied too
        with self._writing(self._dir(version)):
            return self._write_files(version, cpu, record)

    def _write_files(self, version: int, cpu: Mapping[str, np.ndarray], record: dict[str, Any]) -> int:
        temp = Path(tempfile.mkdtemp(prefix=f".tmp-v{version:04d}-", dir=self.directory))
        try:
            save_tensors(cpu, temp / _TENSORS_FILE)
            digest = _sha256(temp / _TENSORS_FILE)
            if version and (same := self._same_file(digest)) is not None:
                shutil.rmtree(temp, ignore_errors=True)
                return same
            record.update(
                {
                    "version": version,
                    "created_at": _now(),
                    "sha256": digest,
                    "tensors": sorted(cpu),
                }
            )
            write_file(temp / _MANIFEST_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n", private=True)
            os.rename(temp, self._dir(version))  # fails if the version exists: nothing is overwritten
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return version

    def prune(self) -> list[int]:
        """Delete the oldest versions nothing needs while more than the retention policy's versions or bytes are
        kept; the versions deleted. Kept always: version 0, every version on the promotion stack or in a snapshot
        of it, versions marked good, the newest good version, the newest version, and proposals no job decided yet."""
        with self._lock:
            numbers = self._version_numbers()
            sizes = {number: _dir_bytes(self._dir(number)) for number in numbers}
            kept = {0, *self._stack(), *self.marked_good(), *numbers[-1:]}  # the newest: a job is judging it
            good = [number for number in numbers if self._good(number)]
            if good:
                kept.add(good[-1])
            for number in numbers:  # a proposal waiting for `retune apply`, or a gate through the engine under way
                if (self._manifest(number).get("gates") or {}).get("decision") == "pending":
                    kept.add(number)
            count, total = len(numbers), sum(sizes.values())
            deleted = []
            for number in numbers:
                if count <= self.retention.max_versions and total <= self.retention.max_bytes:
                    break
                if number in kept:
                    continue
                shutil.rmtree(self._dir(number), ignore_errors=True)
                deleted.append(number)
                count -= 1
                total -= sizes[number]
        if deleted:
            log.info(
                "router versions %s deleted: the registry keeps at most %d versions in %d bytes",
                ", ".join(map(str, deleted)),
                self.retention.max_versions,
                self.retention.max_bytes,
            )
        return deleted

    def update_manifest(self, version: int, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``changes`` into ``version``'s manifest (an engine gate decides after the version is saved)."""
        with self._lock:
            manifest = {**self._manifest(version), **changes}
            path = self._dir(version) / _MANIFEST_FILE
            with self._writing(path):
                write_file(path, json.dumps(manifest, indent=2, sort_keys=True), private=True)
        return manifest

    def record_initial_health(self, health: Mapping[str, Any]) -> bool:
        """Give version 0 the start-up health check it was recorded without (beside an engine the routers can be
        judged only once the engine answers: on the first reading of the reference prompts). A check already
        recorded is kept; True when ``health`` was recorded."""
        with self._lock:
            if not self._dir(0).is_dir():
                return False
            recorded = self._manifest(0).get("health")
            if isinstance(recorded, Mapping) and recorded.get("checked") is not False:
                return False
        self.update_manifest(0, {"health": dict(health), "gates": {"passed": health.get("passed") is True}})
        return True

    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of ``version`` (``ValueError`` naming the file if it cannot be read)."""
        return self._manifest(version)

    def versions(self) -> list[dict[str, Any]]:
        """The manifests of every version, oldest first."""
        return [self._manifest(version) for version in self._version_numbers()]

    def version_numbers(self) -> list[int]:
        """The numbers of the versions saved, ascending."""
        return self._version_numbers()

    def check_version(self, version: object) -> int:
        """``version`` if it is a saved version; else ``ValueError`` naming the value and the versions there are."""
        numbers = self._version_numbers()
        if not is_integer(version) or version not in numbers:
            there = f"one of the versions {numbers[0]} to {numbers[-1]}" if numbers else "a version (none saved yet)"
            raise ValueError(f"router version {describe_value(version)} does not exist: expected {there}")
        return version

    def load(self, version: int) -> dict[str, np.ndarray]:
        """The tensors of ``version``, after checking the file's sha256 against the manifest."""
        self.check_version(version)
        path = self._dir(version) / _TENSORS_FILE
        if not path.is_file():
            raise ValueError(f"router version {version}: {path} does not exist")
        expected = self._manifest(version).get("sha256")
        actual = _sha256(path)
        if actual != expected:
            raise ValueError(f"router version {version}: sha256 of {path} is {actual}, manifest says {expected}")
        return load_tensors(path)

    def last_good(self) -> int | None:
        """The newest good version (gates passed, marked good, or version 0 healthy at start-up), or ``None``."""
        for version in reversed(self._version_numbers()):
            if self._good(version):
                return version
        return None

    def mark_good(self, version: object) -> int:
        """An operator vouches for ``version``: ``restore`` may put back the routers as they were with it live.

        It must be on the promotion stack (live, or beneath the live version): its router state
        is the stack's overlay up to it.
        """
        number = self.check_version(version)
        with self._lock:
            stack = self._stack()
            if number not in stack:
                raise ValueError(
                    f"router version {number} is not on the promotion stack {stack}: expected the live "
                    f"version or one beneath it (promote it first)"
                )
            with self._writing(self.directory / _MARKS_FILE):
                _append_line(self.directory / _MARKS_FILE, {"version": number, "at": _now()})
        return number

    def marked_good(self) -> list[int]:
        """The versions an operator marked good, in the order marked."""
        path = self.directory / _MARKS_FILE
        if not path.is_file():
            return []
        return [entry["version"] for entry in _read_lines(path, ("version",))]

    # ------------------------------------------------------------------ promotions
    def _append_promotion(self, entry: dict[str, Any]) -> None:
        with self._writing(self.directory / _PROMOTIONS_FILE):
            _append_line(self.directory / _PROMOTIONS_FILE, entry)

    def promotions(self) -> list[dict[str, Any]]:
        """Every line of ``promotions.jsonl``, oldest first."""
        path = self.directory / _PROMOTIONS_FILE
        if not path.is_file():
            return []
        return _read_lines(path, ("kind", "version"))

    def _stack_entries(self) -> list[dict[str, Any]]:
        """The promotion stack replayed from the log: initial resets, promote pushes, rollback pops."""
        stack: list[dict[str, Any]] = []
        for entry in self.promotions():
            if entry["kind"] == "initial":
                stack = [entry]
            elif entry["kind"] == "promote":
                stack.append(entry)
            elif entry["kind"] == "rollback" and stack:
                stack.pop()
        return stack

    def _stack(self) -> list[int]:
        return [entry["version"] for entry in self._stack_entries()]

    def live_version(self) -> int | None:
        """The version now live (0 after :meth:`record_initial`); ``None`` before anything was recorded."""
        stack = self._stack()
        return stack[-1] if stack else None

    def last_good_state(self, routers: Sequence[str] | None = None) -> tuple[int, dict[str, np.ndarray], str]:
        """The known-good router state ``restore`` puts back: ``(version, tensors, why it is good)``.

        The live stack's newest version an operator marked good, else its newest good version
        (version 0 only if it passed the start-up health check). The state is the overlay of the
        promotion stack from version 0 up to that version (optionally only the tensors of
        ``routers``): what undoes damage done in place. Versions rolled back are not on the
        stack. ``ValueError`` when no version on the stack is known to be good.
        """
        stack = self._stack()
        if not stack:
            raise ValueError(f"router registry {self.directory}: nothing recorded yet (no version 0)")
        marked = set(self.marked_good())
        chosen = [index for index, version in enumerate(stack) if version in marked]
        why = "marked good by an operator"
        if not chosen:
            chosen = [index for index, version in enumerate(stack) if self._good(version)]
            why = "passed its start-up health check" if chosen and stack[chosen[-1]] == 0 else "passed its gates"
        if not chosen:
            health = self._manifest(0).get("health") or {}
            raise ValueError(
                f"no known-good router state to restore: version 0 (the routers the server started with) "
                f"{_health_summary(health)}, and no version on the promotion stack {stack} passed its "
                f"gates or was marked good (serve with --reference-model DIR, or mark a version good "
                f"with `mla-watch retune mark-good N`)"
            )
        top = chosen[-1]
        state: dict[str, np.ndarray] = {}
        for version in stack[: top + 1]:
            state.update(self.load(version))
        if routers is not None:
            prefixes = tuple(f"{name}." for name in routers)
            state = {name: tensor for name, tensor in state.items() if name.startswith(prefixes)}
        return stack[top], state, why

    def live_state(self) -> dict[str, np.ndarray]:
        """The router state the promotion stack makes (version 0 overlaid with every promoted version)."""
        state: dict[str, np.ndarray] = {}
        for version in self._stack():
            state.update(self.load(version))
        return state

    def initial_differences(self, model: torch.nn.Module | RouterHost) -> list[str]:
        """Router tensors of ``model`` whose values differ from version 0 (``[]``: the same base model)."""
        recorded = self.load(0)
        live = as_host(model).state()
        return sorted(
            name for name, tensor in recorded.items() if name not in live or not _same_values(live[name], tensor)
        )

    def is_good(self, version: int) -> bool:
        """Whether ``version`` is known to be good: its gates passed (version 0: its start-up health check), or
        an operator marked it good."""
        return self._good(version)

    def _good(self, version: int) -> bool:
        gates = self._manifest(version).get("gates")
        return (isinstance(gates, Mapping) and gates.get("passed") is True) or version in self.marked_good()

    def promote(
        self, model: torch.nn.Module | RouterHost, version: int, lock: threading.Lock | None = None
    ) -> dict[str, Any]:
        """Serve ``version``'s tensors on ``model`` (holding ``lock``) and log the promotion; what the swap took.

        The values it overwrites are saved first (``snapshots/``), so that :meth:`rollback` puts
        back exactly what served before, even router tensors changed outside the registry.
        """
        host = as_host(model)
        tensors = self.load(version)
        snapshots = self.directory / _SNAPSHOT_DIR
        snapshot = snapshots / f"p{len(self.promotions()):05d}-v{version:04d}.safetensors"
        with lock if lock is not None else contextlib.nullcontext():
            with self._writing(snapshot):  # before the swap: a promotion that cannot be rolled back is none
                snapshots.mkdir(exist_ok=True)
                save_tensors({name: value for name, value in host.state().items() if name in tensors}, snapshot)
            taken = host.apply(tensors)
        self._append_promotion(
            {
                "kind": "promote",
                "version": version,
                "previous": self.live_version(),
                "at": _now(),
                "snapshot": snapshot.name,
                "snapshot_sha256": _sha256(snapshot),
            }
        )
        return taken

    def rollback(self, model: torch.nn.Module | RouterHost, lock: threading.Lock | None = None) -> int:
        """Restore exactly the router state before the last promotion; returns the version now live."""
        host = as_host(model, lock)
        entries = self._stack_entries()
        stack = [entry["version"] for entry in entries]
        if len(stack) < 2:
            raise ValueError(f"router registry {self.directory}: nothing to roll back to (promotion stack {stack})")
        snapshot = entries[-1].get("snapshot")
        if snapshot:
            path = self.directory / _SNAPSHOT_DIR / snapshot
            if not path.is_file() or _sha256(path) != entries[-1].get("snapshot_sha256"):
                raise ValueError(f"cannot roll back version {stack[-1]} exactly: {path} is missing or altered")
            host.apply(load_tensors(path))
            self._append_promotion({"kind": "rollback", "version": stack[-2], "previous": stack[-1], "at": _now()})
            return stack[-2]
        current_names = set(self.load(stack[-1]))
        target: dict[str, np.ndarray] = {}
        for version in stack[:-1]:
            target.update(self.load(version))
        missing = sorted(current_names - set(target))
        if missing:
            raise ValueError(f"cannot roll back version {stack[-1]} exactly: no earlier version holds {missing}")
        host.apply(target)
        self._append_promotion({"kind": "rollback", "version": stack[-2], "previous": stack[-1], "at": _now()})
        return stack[-2]


def _same_values(live: np.ndarray, recorded: np.ndarray) -> bool:
    """``recorded`` (cast to ``live``'s dtype) holds ``live``'s values, shape and all."""
    return live.shape == recorded.shape and bool(np.array_equal(live, recorded.astype(live.dtype)))


def _dir_bytes(directory: Path) -> int:
    return sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())


def _health_summary(health: Mapping[str, Any]) -> str:
    if health.get("checked") is False:
        return f"was not health-checked ({health.get('reason', 'no check ran')})"
    return f"failed its start-up health check ({health.get('reason', 'no reason recorded')})"


def _append_line(path: Path, entry: dict[str, Any]) -> None:
    """Append one JSON line, durably. A line a crash cut short is closed first, so it spoils only itself."""
    with path.open("ab") as handle:
        if handle.tell() and _last_byte(path) != b"\n":
            handle.write(b"\n")
        handle.write(json.dumps(entry).encode() + b"\n")
        handle.flush()
        os.fsync(handle.fileno())


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1)


def _read_lines(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` log, oldest first; a line that is not one (a crash mid-append) is
    skipped and logged by its number, never by its content."""
    if not path.is_file():
        return []
    entries = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if (
            not isinstance(entry, dict)
            or any(key not in entry for key in required)
            or not isinstance(entry["version"], int)
        ):
            log.warning("%s line %d: not a JSON object with %s; skipped", path, number, ", ".join(required))
            continue
        entries.append(entry)
    return entries
