"""A private, throwaway PostgreSQL instance with logical WAL, from the machine's binaries.

Used by the tests, the benchmarks and the quickstart demo when no database is configured.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from kappaflow.testing.servers._process import (
    LoopbackServer,
    ServerStartError,
    as_user,
    chown_tree,
)


def find_pg_bin() -> Path:
    """The newest PostgreSQL server binary folder (PG_BIN overrides)."""
    if os.environ.get("PG_BIN"):
        return Path(os.environ["PG_BIN"])
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    for c in reversed(candidates):
        if Path(c, "initdb").exists():
            return Path(c)
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise ServerStartError("no PostgreSQL server binaries found (initdb); install postgresql or set PG_BIN")


class PrivatePostgres(LoopbackServer):
    """initdb + postgres on 127.0.0.1:<free port>, superuser `postgres`, trust auth."""

    name = "postgres"

    def __init__(self, *, wal_level: str = "logical", port: int | None = None, durable: bool = False,
                 settings: dict[str, str] | None = None, workdir: str | Path | None = None,
                 keep: bool = False) -> None:
        super().__init__(port=port, workdir=workdir, keep=keep)
        self.user = "postgres"
        self.wal_level = wal_level
        self.durable = durable
        self.settings = dict(settings or {})
        self.datadir = self.workdir / "data"
        self.sockdir = self.workdir / "sock"
        self.os_user = "postgres" if os.geteuid() == 0 else None

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres", **extra: str) -> str:
        parts = [f"host={self.host}", f"port={self.port}", f"user={self.user}", f"dbname={dbname}"]
        parts += [f"{k}={v}" for k, v in extra.items()]
        return " ".join(parts)

    def start(self, timeout: float = 60.0) -> PrivatePostgres:
        bindir = find_pg_bin()
        self.sockdir.mkdir(exist_ok=True)
        chown_tree(self.workdir, self.os_user)
        if not (self.datadir / "PG_VERSION").exists():
            import subprocess

            res = subprocess.run(
                as_user(self.os_user, [str(bindir / "initdb"), "-D", str(self.datadir), "-U", self.user,
                                       "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]),
                capture_output=True, text=True, check=False,
            )
            if res.returncode != 0:
                raise ServerStartError(f"initdb failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        opts = {
            "listen_addresses": self.host,
            "port": str(self.port),
            "unix_socket_directories": str(self.sockdir),
            "wal_level": self.wal_level,
            "max_replication_slots": "20",
            "max_wal_senders": "20",
            "max_connections": "200",
            "shared_buffers": "256MB",
            "wal_sender_timeout": "60s",
        }
        if not self.durable:
            # Throwaway instance: the tests kill clients, never this server.
            opts.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
        opts.update(self.settings)
        argv = [str(bindir / "postgres"), "-D", str(self.datadir)]
        for k, v in opts.items():
            argv += ["-c", f"{k}={v}"]
        self._spawn(as_user(self.os_user, argv))
        self._wait_ready(timeout, f"PostgreSQL on {self.host}:{self.port}")
        return self

    def _ready(self) -> bool:
        self._check_alive()
        import psycopg

        with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
            conn.execute("select 1")
        return True

    def create_database(self, name: str) -> str:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            # Replication slots pin a database; drop the inactive ones first.
            conn.execute(
                "select pg_drop_replication_slot(slot_name) from pg_replication_slots "
                "where database = %s and not active", (name,))
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
