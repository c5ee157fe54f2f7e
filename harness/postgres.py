"""A throwaway PostgreSQL cluster for the tests: ``initdb -A trust`` in a temporary directory, the server on a
loopback port with its socket in that directory, as the ``postgres`` user when the tests run as root (PostgreSQL
refuses to run as root). ``./test`` and ``.ci/run`` install Debian's ``postgresql`` where ``initdb`` is missing.

The server runs in the foreground as a process of :mod:`harness.processes` (not daemonised by ``pg_ctl``), so it ends
with the fixture that started it, and the run's process guard knows it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from harness import processes
from harness.support import free_port

__all__ = ["PostgresCluster", "postgres_bin", "running_cluster"]


def postgres_bin(name: str) -> str | None:
    """A PostgreSQL server program: on PATH, else in Debian's versioned directory."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class PostgresCluster:
    """One cluster in its own directory; :meth:`start`, :meth:`stop` (and start again), :meth:`create_database`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.socket_dir = root / "socket"
        self.log = root / "postgres.log"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0
        self._databases = 0
        initdb = postgres_bin("initdb")
        assert initdb, "initdb is missing: ./test installs Debian's postgresql"
        self._postgres = postgres_bin("postgres") or "postgres"
        self._server: subprocess.Popen | None = None
        self.socket_dir.mkdir(parents=True)
        if self._as_postgres:
            shutil.chown(root, "postgres")
            shutil.chown(self.socket_dir, "postgres")
        self._run(initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

    def _command(self, *command: str) -> list[str]:
        return [*(["runuser", "-u", "postgres", "--"] if self._as_postgres else []), *command]

    def _run(self, *command: str) -> None:
        done = processes.run(self._command(*command), capture_output=True, text=True, timeout=120, cwd=self.root)
        assert done.returncode == 0, f"{command[0]} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def start(self) -> None:
        """Start the server and wait until it takes connections."""
        import psycopg

        with open(self.log, "ab") as log:
            self._server = processes.start(
                self._command(
                    self._postgres,
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.socket_dir),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "fsync=off",
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        deadline = time.monotonic() + 60
        while True:
            assert self._server.poll() is None, f"postgres exited: {self.log.read_text()[-2000:]}"
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, f"postgres did not answer: {self.log.read_text()[-2000:]}"
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server: a fast shutdown (SIGINT: clients are cut off, not waited for), then
        :func:`harness.processes.stop` for whatever is left."""
        if self._server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._server.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._server.wait(timeout=30)
            processes.stop(self._server, grace=5)
            self._server = None

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg

        self._databases += 1
        name = f"fleet_{os.getpid()}_{self._databases}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.database_url(name)


@contextlib.contextmanager
def running_cluster() -> Iterator[PostgresCluster]:
    root = Path(tempfile.mkdtemp(prefix="mla-watch-pg-"))
    try:
        cluster = PostgresCluster(root)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
