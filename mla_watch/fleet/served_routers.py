"""The router tensors a fleet member serves, against its fleet's versions: the base (the digest of its own version 0),
the digest of what serves now, a fleet version's full state, adopting one (saved and promoted as a local router
version), and what a canary's version changes against its parent."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from mla_watch.common.tensor_files import router_digest
from mla_watch.fleet.fleet_rows import FleetView, VersionRow
from mla_watch.fleet.fleet_store import FleetStore, FleetStoreError
from mla_watch.retune.service import RetuneService

__all__ = ["ServedRouters", "router_of", "same_tensor"]

log = logging.getLogger("mla_watch.fleet")


def router_of(tensor: str) -> str:
    """The router a router tensor belongs to (``model.layers.1.mlp.gate.weight`` -> ``model.layers.1.mlp.gate``)."""
    return tensor.rsplit(".", 1)[0]


def same_tensor(left: np.ndarray, right: np.ndarray) -> bool:
    """Whether two tensors are one: shape, dtype and bytes."""
    return left.shape == right.shape and left.dtype == right.dtype and left.tobytes() == right.tobytes()


class ServedRouters:
    """This replica's routers against the fleet's versions of its base (``store``): ``base`` and ``digest`` (what
    serves now, as last computed: :meth:`refresh` hashes again); ``read_again`` reads the reference prompts again
    once a version taken on trust serves (the peers hear of these)."""

    def __init__(self, store: FleetStore, retune: RetuneService, read_again: Callable[[], None]) -> None:
        self.store = store
        self.retune = retune
        self._read_again = read_again
        self.base = router_digest(retune.versions.load(0))
        self.digest = self.serving_digest()
        self._failed_target: str | None = None  # a version this member could not adopt: said once, not every round

    def serving_digest(self) -> str:
        """The digest of the router tensors serving now."""
        return router_digest(self.retune.retuner.host.state())

    def refresh(self) -> str:
        """Hash the routers serving again: ``digest``, now."""
        self.digest = self.serving_digest()
        return self.digest

    def full_state(self, number: int) -> dict[str, np.ndarray]:
        """The router tensors of fleet version ``number``: this replica's version 0 (the base) overlaid with what
        each version from the base up to it changes; ``ValueError`` for a tensor its routers do not hold so."""
        state = dict(self.retune.versions.load(0))
        for version, changes in reversed(self.store.changes(self.base, number)):
            for name, tensor in changes.items():
                known = state.get(name)
                if known is None or known.shape != tensor.shape or known.dtype != tensor.dtype:
                    here = "lack" if known is None else f"hold as {tuple(known.shape)} {known.dtype}"
                    raise ValueError(
                        f"fleet version {version} holds {name[:200]} {tuple(tensor.shape)} "
                        f"{tensor.dtype}, which this replica's routers {here}"
                    )
            state.update(changes)
        return state

    def adopt(self, version: VersionRow, *, checked: bool, why: str, force_routers: tuple[str, ...] = ()) -> int | None:
        """Serve fleet version ``version`` here: the tensors that differ from what serves now (and every tensor of
        ``force_routers``) are saved as a local router version and promoted. The local version promoted, or
        ``None`` when nothing differed."""
        full = self.full_state(version.number)
        live = self.retune.retuner.host.state()
        changed = {
            name: tensor
            for name, tensor in full.items()
            if name not in live or not same_tensor(live[name], tensor) or router_of(name) in force_routers
        }
        if not changed:
            self.refresh()
            return None
        local = self.retune.versions.save(
            changed,
            {
                "source": "fleet",
                "fleet_version": version.number,
                "fleet_digest": version.digest,
                "why": why,
                "strategy": version.manifest.get("strategy"),
                "routers": sorted({router_of(name) for name in changed}),
                "gates": {"passed": checked, "fleet": "checked by the fleet" if checked else "this replica's step"},
            },
        )
        self.retune.promote(local)
        self.refresh()
        if checked:  # a step's own check reads the prompts; a version taken on trust is read again for the peers
            self._read_again()
        if self.digest != version.digest:
            log.error(
                "fleet version %d was promoted here as router version %d, but the routers serving read digest "
                "%s, not the version's %s",
                version.number,
                local,
                self.digest[:12],
                version.digest[:12],
            )
        else:
            log.info("fleet version %d serves here (router version %d): %s", version.number, local, why)
        return local

    def changes_from(
        self, parent: int, tensors: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, dict[str, np.ndarray]], str]:
        """What a local version's ``tensors`` change against fleet version ``parent``, by router, and the digest of
        the full state they make."""
        parent_state = self.full_state(parent)
        changes: dict[str, dict[str, np.ndarray]] = {}
        for name, tensor in tensors.items():
            if name not in parent_state or not same_tensor(parent_state[name], tensor):
                changes.setdefault(router_of(name), {})[name] = tensor
        digest = router_digest({**parent_state, **{name: t for group in changes.values() for name, t in group.items()}})
        return changes, digest

    def converge(self, target: VersionRow, view: FleetView, *, why: str) -> bool:
        """Adopt ``target``, the version the fleet (``view``) says this member serves, if it serves another; whether
        it changed. A version that cannot be adopted is said once, and tried again by every round."""
        if self.digest == target.digest:
            return False
        known = view.version_of(self.digest)
        reason = (
            f"{why}: this replica served routers the fleet does not know (digest {self.digest[:12]})"
            if known is None
            else f"{why}: this replica served fleet version {known}"
        )
        try:
            self.adopt(target, checked=True, why=reason)
        except FleetStoreError:
            raise
        except Exception as error:  # an engine not up yet, a swap refused: tried again every round, said once
            if self._failed_target != target.digest:
                log.error(
                    "fleet version %d could not be adopted here (%s: %s); trying again every round",
                    target.number,
                    type(error).__name__,
                    str(error)[:300],
                )
                self._failed_target = target.digest
            return False
        self._failed_target = None
        return True
