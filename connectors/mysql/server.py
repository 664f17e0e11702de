"""Connecting to MySQL/MariaDB and checking, before anything is captured, that the server can be captured.

Every problem found here is a terminal ``SourceError`` saying what is wrong and how to fix it
(binlog off, ``binlog_format`` not ROW, ``binlog_row_image`` not FULL, row metadata not FULL,
missing REPLICATION SLAVE / REPLICATION CLIENT privileges); a server that cannot be reached is
a transient one. Passwords never appear in messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kappaflow.errors import ConfigError, Retry, SourceError

__all__ = ["ConnectArgs", "ServerInfo", "check_server", "connect", "parse_dsn", "source_error"]

# pymysql error codes
_ER_ACCESS_DENIED = 1045
_ER_DBACCESS_DENIED = 1044
_ER_SPECIFIC_ACCESS_DENIED = 1227
_ER_TABLEACCESS_DENIED = 1142
_ER_BAD_DB = 1049
_CR_CONN_HOST_ERROR = 2003
_CR_SERVER_LOST = 2013
_CR_SERVER_GONE = 2006
_TRANSIENT_CODES = {_CR_CONN_HOST_ERROR, _CR_SERVER_LOST, _CR_SERVER_GONE, 1040, 1205, 1213, 2002, 2005}


@dataclass(frozen=True)
class ConnectArgs:
    """pymysql keyword arguments parsed from a ``mysql://user@host:port/db`` DSN (+ password)."""

    host: str
    port: int
    user: str
    password: str
    database: str | None
    unix_socket: str | None = None

    def kwargs(self, **extra: Any) -> dict[str, Any]:
        d: dict[str, Any] = {"host": self.host, "port": self.port, "user": self.user, "password": self.password,
                             "charset": "utf8mb4", "connect_timeout": 10}
        if self.unix_socket:
            d["unix_socket"] = self.unix_socket
        d.update(extra)
        return d

    def replication_settings(self) -> dict[str, Any]:
        """Connection settings for mysql-replication's BinLogStreamReader."""
        d: dict[str, Any] = {"host": self.host, "port": self.port, "user": self.user, "password": self.password,
                             "charset": "utf8mb4", "connect_timeout": 10}
        if self.unix_socket:
            d["unix_socket"] = self.unix_socket
        return d

    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def parse_dsn(dsn: str, password: str | None = None) -> ConnectArgs:
    parts = urlsplit(dsn)
    if parts.scheme not in ("mysql", "mariadb"):
        raise ConfigError(f"dsn: expected a mysql://user@host:port/db URL, got scheme {parts.scheme!r}")
    try:
        port = parts.port or 3306
    except ValueError:
        raise ConfigError("dsn: the port is not a number") from None
    query = parse_qs(parts.query)
    db = unquote(parts.path.lstrip("/")) or None
    return ConnectArgs(
        host=parts.hostname or "127.0.0.1",
        port=port,
        user=unquote(parts.username or "root"),
        password=password if password is not None else unquote(parts.password or ""),
        database=db,
        unix_socket=query["unix_socket"][0] if query.get("unix_socket") else None,
    )


def source_error(exc: BaseException, what: str, where: str) -> SourceError:
    """A pymysql error -> SourceError with a retry verdict and a readable message."""
    code = exc.args[0] if getattr(exc, "args", None) and isinstance(exc.args[0], int) else None
    msg = exc.args[1] if code is not None and len(exc.args) > 1 else str(exc)
    if code == _ER_ACCESS_DENIED:
        return SourceError(f"{what}: authentication failed for {where} ({msg}); check the user and the password "
                           "(KAPPAFLOW_SOURCE_<NAME>_PASSWORD or password_env)", retry=Retry.TERMINAL)
    if code in (_ER_SPECIFIC_ACCESS_DENIED, _ER_DBACCESS_DENIED, _ER_TABLEACCESS_DENIED):
        return SourceError(f"{what}: permission denied for {where}: {msg}", retry=Retry.TERMINAL)
    if code in _TRANSIENT_CODES or code is None:
        return SourceError(f"{what}: cannot reach {where}: {msg}", retry=Retry.TRANSIENT)
    return SourceError(f"{what}: {where}: error {code}: {msg}", retry=Retry.TERMINAL)


def connect(args: ConnectArgs, *, what: str = "connect", **extra: Any) -> Any:
    import pymysql

    try:
        return pymysql.connect(**args.kwargs(**extra))
    except pymysql.MySQLError as exc:
        raise source_error(exc, what, args.where()) from None


@dataclass(frozen=True)
class ServerInfo:
    """What capture needs to know about the server."""

    version: str
    flavor: str  # "mariadb" | "mysql"
    server_id: int
    gtid_enabled: bool
    binlog_file: str
    binlog_pos: int
    gtid_executed: str

    @property
    def is_mariadb(self) -> bool:
        return self.flavor == "mariadb"


def _variables(cur: Any, names: tuple[str, ...]) -> dict[str, str]:
    cur.execute("SHOW GLOBAL VARIABLES WHERE Variable_name IN (" + ",".join(["%s"] * len(names)) + ")", names)
    return {str(k).lower(): str(v) for k, v in cur.fetchall()}


_GRANT_RE = re.compile(r"^GRANT (?P<privs>.+?) ON (?P<obj>\S+) TO ", re.IGNORECASE)


def _global_privileges(cur: Any) -> set[str]:
    cur.execute("SHOW GRANTS FOR CURRENT_USER()")
    privs: set[str] = set()
    for (line,) in cur.fetchall():
        m = _GRANT_RE.match(str(line))
        if m and m.group("obj").replace("`", "") == "*.*":
            privs.update(p.strip().upper() for p in m.group("privs").split(","))
    return privs


def master_status(cur: Any) -> tuple[str, int]:
    """(file, position) the binlog is at now: the next transaction will be written there."""
    try:
        cur.execute("SHOW BINARY LOG STATUS")
    except Exception:
        cur.execute("SHOW MASTER STATUS")
    row = cur.fetchone()
    if row is None:
        raise SourceError("the binary log is off (SHOW MASTER STATUS is empty): start the server with "
                          "log_bin=ON (e.g. --log-bin=mysql-bin), binlog_format=ROW, binlog_row_image=FULL, "
                          "binlog_row_metadata=FULL")
    return str(row[0]), int(row[1])


def check_server(conn: Any, where: str) -> ServerInfo:
    """Check binlog settings and privileges; return the server's flavour and binlog position.

    Raises a terminal SourceError naming the setting and the fix.
    """
    import pymysql

    try:
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION()")
            version = str(cur.fetchone()[0])
            flavor = "mariadb" if "mariadb" in version.lower() else "mysql"
            v = _variables(cur, ("log_bin", "binlog_format", "binlog_row_image", "binlog_row_metadata", "server_id",
                                 "gtid_mode", "gtid_binlog_pos", "gtid_executed"))
            problems = []
            if v.get("log_bin", "OFF").upper() not in ("ON", "1"):
                problems.append("log_bin is OFF: start the server with --log-bin")
            if v.get("binlog_format", "").upper() != "ROW":
                problems.append(f"binlog_format is {v.get('binlog_format')!r}, expected 'ROW' "
                                "(SET GLOBAL binlog_format=ROW and my.cnf binlog_format=ROW)")
            if v.get("binlog_row_image", "FULL").upper() != "FULL":
                problems.append(f"binlog_row_image is {v.get('binlog_row_image')!r}, expected 'FULL' "
                                "(updates and deletes must carry whole rows)")
            if v.get("binlog_row_metadata", "FULL").upper() != "FULL":
                problems.append(f"binlog_row_metadata is {v.get('binlog_row_metadata')!r}, expected 'FULL' "
                                "(column names and types in the binlog keep DDL changes decodable)")
            if problems:
                raise SourceError(f"{where}: the server cannot be captured: " + "; ".join(problems))
            privs = _global_privileges(cur)
            if "ALL PRIVILEGES" not in privs and "SUPER" not in privs:
                missing = []
                if "REPLICATION SLAVE" not in privs and "REPLICATION REPLICA" not in privs:
                    missing.append("REPLICATION SLAVE")
                if not privs & {"REPLICATION CLIENT", "BINLOG MONITOR"}:
                    missing.append("REPLICATION CLIENT")
                if missing:
                    user = where.split("@", 1)[0]
                    raise SourceError(
                        f"{where}: missing privilege(s) {', '.join(missing)} to read the binlog; run as an "
                        f"admin: GRANT {', '.join(missing)} ON *.* TO '{user}'@'%' (also grant SELECT on the "
                        "captured tables for the snapshot)")
            file, pos = master_status(cur)
            if flavor == "mariadb":
                gtid_executed = v.get("gtid_binlog_pos", "")
                gtid_enabled = True
            else:
                gtid_executed = v.get("gtid_executed", "").replace("\n", "")
                gtid_enabled = v.get("gtid_mode", "OFF").upper() == "ON"
            return ServerInfo(version, flavor, int(v.get("server_id", "0")), gtid_enabled, file, pos, gtid_executed)
    except pymysql.MySQLError as exc:
        if exc.args and exc.args[0] == _ER_SPECIFIC_ACCESS_DENIED:
            raise SourceError(f"{where}: missing privilege REPLICATION CLIENT (or BINLOG MONITOR) to read the "
                              f"binlog position: {exc.args[1]}") from None
        raise source_error(exc, "check server", where) from None


def binlog_files(conn: Any) -> list[str]:
    with conn.cursor() as cur:
        cur.execute("SHOW BINARY LOGS")
        return [str(r[0]) for r in cur.fetchall()]


def current_gtid(conn: Any, flavor: str) -> str:
    with conn.cursor() as cur:
        if flavor == "mariadb":
            cur.execute("SELECT @@GLOBAL.gtid_binlog_pos")
        else:
            cur.execute("SELECT @@GLOBAL.gtid_executed")
        row = cur.fetchone()
        return str(row[0] or "").replace("\n", "") if row else ""
