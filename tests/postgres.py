"""A throwaway PostgreSQL cluster for the tests: ``initdb -A trust`` in a temporary directory, ``pg_ctl`` on a
loopback port with its socket in that directory, as the ``postgres`` user when the tests run as root (PostgreSQL
refuses to run as root). ``./test`` and ``.ci/run`` install Debian's ``postgresql`` where ``initdb`` is missing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests import processes
from tests.support import free_port

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
        self._pg_ctl = postgres_bin("pg_ctl")
        self.socket_dir.mkdir(parents=True)
        if self._as_postgres:
            shutil.chown(root, "postgres")
            shutil.chown(self.socket_dir, "postgres")
        self._run(initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        done = processes.run([*prefix, *command], capture_output=True, text=True, timeout=120, cwd=self.root)
        assert done.returncode == 0, f"{command[0]} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(self._pg_ctl or "pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t",
                  "60", "start")

    def stop(self) -> None:
        with contextlib.suppress(AssertionError):
            self._run(self._pg_ctl or "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg

        self._databases += 1
        name = f"fleet_{os.getpid()}_{self._databases}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.database_url(name)

    def wait_down(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.data / "postmaster.pid").exists():
            time.sleep(0.1)


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
