"""A private MariaDB/MySQL instance with a row-based binary log, from the machine's binaries."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from kappaflow.testing.servers._process import (
    LoopbackServer,
    ServerStartError,
    chown_tree,
)


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
        if path:
            return path
    raise ServerStartError(f"none of {', '.join(names)} found; install mariadb-server")


class PrivateMariaDB(LoopbackServer):
    """mariadbd with log_bin, binlog_format=ROW, binlog_row_image=FULL, binlog_row_metadata=FULL."""

    name = "mariadb"

    def __init__(self, *, port: int | None = None, binlog_format: str = "ROW", row_image: str = "FULL",
                 extra_args: list[str] | None = None, workdir: str | Path | None = None,
                 keep: bool = False) -> None:
        super().__init__(port=port, workdir=workdir, keep=keep)
        self.user = "root"
        self.password = ""
        self.binlog_format = binlog_format
        self.row_image = row_image
        self.extra_args = list(extra_args or [])
        self.datadir = self.workdir / "data"
        self.unix_socket = str(self.workdir / "mysqld.sock")
        self.os_user = "mysql" if os.geteuid() == 0 else None

    def dsn(self, db: str = "") -> str:
        return f"mysql://{self.user}@{self.host}:{self.port}/{db}"

    def connect_args(self, db: str | None = None) -> dict[str, object]:
        args: dict[str, object] = {"host": self.host, "port": self.port, "user": self.user,
                                   "password": self.password}
        if db:
            args["database"] = db
        return args

    def start(self, timeout: float = 60.0) -> PrivateMariaDB:
        self.datadir.mkdir(exist_ok=True)
        chown_tree(self.workdir, self.os_user)
        if not (self.datadir / "mysql").exists():
            install = _binary("mariadb-install-db", "mysql_install_db")
            argv = [install, f"--datadir={self.datadir}", "--auth-root-authentication-method=normal",
                    "--skip-test-db", "--skip-name-resolve"]
            if self.os_user:
                argv.append(f"--user={self.os_user}")
            res = subprocess.run(argv, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise ServerStartError(f"mariadb-install-db failed: {(res.stdout + res.stderr)[-2000:]}")
        server = _binary("mariadbd", "mysqld")
        argv = [server, "--no-defaults", f"--datadir={self.datadir}", f"--port={self.port}",
                f"--bind-address={self.host}", f"--socket={self.unix_socket}",
                f"--pid-file={self.workdir / 'mysqld.pid'}", f"--log-bin={self.datadir / 'binlog'}",
                f"--binlog-format={self.binlog_format}", f"--binlog-row-image={self.row_image}",
                "--binlog-row-metadata=FULL", "--server-id=1", "--skip-name-resolve",
                "--innodb-buffer-pool-size=128M", "--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0",
                "--max-connections=200", "--log-error=" + str(self.logfile), *self.extra_args]
        if self.os_user:
            argv.append(f"--user={self.os_user}")
        self._spawn(argv)
        self._wait_ready(timeout, f"MariaDB on {self.host}:{self.port}")
        return self

    def _ready(self) -> bool:
        self._check_alive()
        import pymysql

        conn = pymysql.connect(connect_timeout=2, **self.connect_args())
        conn.close()
        return True

    def execute(self, *statements: str, db: str | None = None) -> list[tuple[object, ...]]:
        import pymysql

        conn = pymysql.connect(autocommit=True, **self.connect_args(db))
        try:
            rows: list[tuple[object, ...]] = []
            with conn.cursor() as cur:
                for stmt in statements:
                    cur.execute(stmt)
                    rows = list(cur.fetchall())
            return rows
        finally:
            conn.close()
