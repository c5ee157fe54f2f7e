"""Ship a probe's counts to a running sidecar (``attach(model, agent_url=...)``).

Inside an inference worker of another engine (vLLM, SGLang, a training job), the probe
counts on the device as usual; a background thread reads the counters every
``interval`` seconds and POSTs the deltas to the sidecar's ``/v1/routing/ingest`` with
the ingestion bearer token (``MLA_WATCH_INGEST_TOKEN``, else ``MLA_WATCH_ADMIN_TOKEN``).
The sidecar watches them as ``<source>/<router>``. Deltas that cannot be delivered stay pending - summed, so memory
stays bounded - and go with the next attempt: a sidecar restart loses no counts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

import numpy as np

from mla_watch.routing.ingest import INGEST_PATH, snapshot_body
from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.windows import NAME_RE, NAME_RULE

__all__ = ["Shipper"]

log = logging.getLogger("mla_watch.agent")


class Shipper:
    """Pending count deltas per (router, business line), delivered over HTTP."""

    def __init__(
        self,
        url: str,
        routers: Sequence[RouterInfo],
        *,
        token: str | None = None,
        source: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"agent_url={url!r}: expected an http:// or https:// URL of a running sidecar")
        self.url = url.rstrip("/") + INGEST_PATH
        self.routers = list(routers)
        self.token = (
            token
            if token is not None
            else (os.environ.get("MLA_WATCH_INGEST_TOKEN") or os.environ.get("MLA_WATCH_ADMIN_TOKEN"))
        )
        self.source = source or f"pid-{os.getpid()}"
        if not NAME_RE.fullmatch(self.source):
            raise ValueError(
                f"agent_source={self.source!r}: expected {NAME_RULE} (the sidecar watches this "
                "worker's routers as <source>/<router>)"
            )
        self.timeout = timeout
        self._pending: dict[tuple[str, str], CountDelta] = {}
        self._lock = threading.Lock()
        self.delivered = 0
        self.failures = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, router: str, line: str, delta: CountDelta) -> None:
        with self._lock:
            entry = self._pending.get((router, line))
            if entry is None:
                self._pending[(router, line)] = CountDelta(
                    delta.counts.astype(np.int64, copy=True),
                    delta.tokens,
                    delta.local_selections,
                    delta.choice_selections,
                )
            else:
                entry.merge(delta)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self) -> bool:
        """Deliver everything pending; keep it when the sidecar cannot take it."""
        with self._lock:
            taken, self._pending = self._pending, {}
        if not taken:
            return True
        body = json.dumps(snapshot_body(self.source, self.routers, taken)).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
            self.delivered += 1
            return True
        except (urllib.error.URLError, OSError, TimeoutError) as error:
            self.failures += 1
            self.last_error = str(error)
            if isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500 and error.code not in (408, 429):
                log.error("the sidecar refused routing counts (%s); dropping them: %s", error.code, error.read()[:500])
                return False
            log.warning("cannot ship routing counts to %s (%s); keeping them for the next attempt", self.url, error)
            for (router, line), delta in taken.items():
                self.add(router, line, delta)
            return False

    def start(self, collect: Callable[[], None], interval: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                collect()
                self.flush()

        self._thread = threading.Thread(target=loop, name="mla-watch-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
