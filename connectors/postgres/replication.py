"""PostgreSQL streaming replication protocol over psycopg 3's low-level ``pgconn``.

psycopg 3 has no replication API, but its libpq binding can drive the protocol:
a ``replication=database`` connection accepts the replication commands
(``IDENTIFY_SYSTEM``, ``CREATE_REPLICATION_SLOT ... LOGICAL pgoutput EXPORT_SNAPSHOT``,
``START_REPLICATION``), after which the connection is in COPY_BOTH mode:

* the server sends XLogData (``w``: start LSN, server WAL end, send time, then the
  pgoutput message) and primary keepalives (``k``: WAL end, send time, reply flag);
* the client sends standby status updates (``r``: write/flush/apply LSN, time,
  reply flag) with ``put_copy_data``. The *flush* LSN is what the server stores
  as the slot's ``confirmed_flush_lsn``: everything before it may be recycled.

Reading uses libpq's non-blocking ``get_copy_data(1)`` with ``select`` on the
socket, so a blocked read never holds the GIL (a writer thread keeps appending
to the log meanwhile) and a read can time out to send status updates.
"""

from __future__ import annotations

import select
import struct
import time
from dataclasses import dataclass
from typing import Final

from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq.abc import PGresult

from kappaflow.connectors.postgres.types import SESSION_OPTIONS
from kappaflow.errors import Retry, SourceError

__all__ = [
    "KEEPALIVE",
    "XLOGDATA",
    "ReplicationConnection",
    "SlotCreated",
    "SystemInfo",
    "redact_dsn",
]

XLOGDATA: Final = 0x77  # 'w'
KEEPALIVE: Final = 0x6B  # 'k'
PG_EPOCH_US: Final = 946_684_800_000_000
_STATUS = struct.Struct(">cQQQqB")
_KEEPALIVE = struct.Struct(">QqB")
_XLOG_HEADER = struct.Struct(">QQq")


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, for messages (never print secrets)."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return "<unparseable DSN>"
    params.pop("password", None)
    shown = {k: params[k] for k in ("host", "port", "dbname", "user") if params.get(k)}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or "<default libpq settings>"


def _lsn(text: bytes | str) -> int:
    s = text.decode() if isinstance(text, bytes) else text
    hi, _, lo = s.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def lsn_str(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


@dataclass(frozen=True, slots=True)
class SystemInfo:
    system_id: str
    timeline: int
    xlogpos: int
    dbname: str | None


@dataclass(frozen=True, slots=True)
class SlotCreated:
    name: str
    consistent_lsn: int
    snapshot_name: str | None


def _classify(message: str, sqlstate: str | None, what: str, dsn: str) -> SourceError:
    """Turn a server/libpq error into a SourceError with an actionable message and retry verdict."""
    msg = message.strip().replace("ERROR:  ", "").replace("FATAL:  ", "")
    where = redact_dsn(dsn)
    if sqlstate == "55006" or "is active for PID" in msg:
        return SourceError(
            f"{what}: {msg}. Another process is consuming this replication slot: stop it "
            f"(or use a different slot name) and retry [{where}]",
            retry=Retry.TRANSIENT,
        )
    if "wal_level" in msg:
        return SourceError(
            f"{what}: {msg}. Set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) "
            f"and restart PostgreSQL [{where}]",
            retry=Retry.TERMINAL,
        )
    if sqlstate == "42501" or "must be superuser or replication role" in msg or "permission denied" in msg:
        return SourceError(
            f"{what}: {msg}. The role needs the REPLICATION attribute: ALTER ROLE <user> WITH REPLICATION [{where}]",
            retry=Retry.TERMINAL,
        )
    if "invalidated" in msg or "can no longer get changes" in msg:
        return SourceError(
            f"{what}: {msg}. The slot lost WAL it needed (max_slot_wal_keep_size exceeded?): changes are missing; "
            f"recover with `kappaflow capture SOURCE --resnapshot` (a new slot and a full snapshot) [{where}]",
            retry=Retry.TERMINAL,
        )
    if sqlstate == "42704" and "replication slot" in msg:
        return SourceError(
            f"{what}: {msg}. The replication slot was dropped while kappaflow still depends on it; "
            f"changes since the last capture may be lost: recover with `kappaflow capture SOURCE --resnapshot` "
            f"[{where}]",
            retry=Retry.TERMINAL,
        )
    if sqlstate in ("28P01", "28000") or "password authentication failed" in msg:
        return SourceError(f"{what}: authentication failed for {where}: check the user and password",
                           retry=Retry.TERMINAL)
    if sqlstate == "3D000" or ("database" in msg and "does not exist" in msg):
        return SourceError(f"{what}: {msg} [{where}]: check the dbname in the DSN", retry=Retry.TERMINAL)
    if (sqlstate or "").startswith("08") or "could not connect" in msg or "Connection refused" in msg \
            or "timeout expired" in msg or "server closed the connection" in msg:
        return SourceError(f"{what}: cannot reach PostgreSQL at {where}: {msg.splitlines()[0] if msg else ''}",
                           retry=Retry.TRANSIENT)
    if (sqlstate or "").startswith(("57", "53", "40")) or "terminating connection" in msg:
        # operator intervention (shutdown, backend terminated), resources, serialization: try again
        return SourceError(f"{what}: {msg} [{where}]", retry=Retry.TRANSIENT)
    return SourceError(f"{what}: {msg} [{where}]", retry=Retry.TERMINAL if sqlstate else Retry.TRANSIENT)


class ReplicationConnection:
    """One ``replication=database`` connection: slot commands, then the COPY_BOTH stream."""

    def __init__(self, dsn: str, *, application_name: str = "kappaflow", connect_timeout: int = 10) -> None:
        self.dsn = dsn
        params = conninfo_to_dict(dsn)
        params["replication"] = "database"
        params.setdefault("application_name", application_name)
        params.setdefault("connect_timeout", str(connect_timeout))
        extra = params.get("options") or ""
        params["options"] = f"{extra} {SESSION_OPTIONS}".strip()
        self._conn = pq.PGconn.connect(make_conninfo("", **params).encode())
        if self._conn.status != pq.ConnStatus.OK:
            err = self._conn.error_message.decode(errors="replace")
            self._conn.finish()
            raise _classify(err, None, "connecting for replication", dsn)
        self._streaming = False
        self._fd = self._conn.socket

    # -- plain replication commands ------------------------------------------------
    def _command(self, sql: str, what: str) -> PGresult:
        res = self._conn.exec_(sql.encode())
        if res.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK, pq.ExecStatus.COPY_BOTH):
            sqlstate = res.error_field(pq.DiagnosticField.SQLSTATE)
            raise _classify(
                (res.error_message or self._conn.error_message).decode(errors="replace"),
                sqlstate.decode() if sqlstate else None,
                what,
                self.dsn,
            )
        return res

    def identify_system(self) -> SystemInfo:
        res = self._command("IDENTIFY_SYSTEM", "IDENTIFY_SYSTEM")
        vals = [res.get_value(0, i) for i in range(res.nfields)]
        return SystemInfo(
            system_id=(vals[0] or b"").decode(),
            timeline=int(vals[1] or 0),
            xlogpos=_lsn(vals[2] or b"0/0"),
            dbname=vals[3].decode() if len(vals) > 3 and vals[3] else None,
        )

    def create_slot(self, name: str, *, export_snapshot: bool) -> SlotCreated:
        """CREATE_REPLICATION_SLOT name LOGICAL pgoutput; with an exported snapshot if asked.

        The exported snapshot stays valid only while this connection runs no other
        command: read it (SET TRANSACTION SNAPSHOT) before ``start()``.
        """
        mode = "EXPORT_SNAPSHOT" if export_snapshot else "NOEXPORT_SNAPSHOT"
        res = self._command(f'CREATE_REPLICATION_SLOT "{_ident(name)}" LOGICAL pgoutput {mode}',
                            f"creating replication slot {name!r}")
        snap = res.get_value(0, 2)
        return SlotCreated(
            name=(res.get_value(0, 0) or b"").decode(),
            consistent_lsn=_lsn(res.get_value(0, 1) or b"0/0"),
            snapshot_name=snap.decode() if snap else None,
        )

    def drop_slot(self, name: str) -> None:
        self._command(f'DROP_REPLICATION_SLOT "{_ident(name)}"', f"dropping replication slot {name!r}")

    def start(self, slot: str, start_lsn: int, publications: list[str], *, messages: bool = True) -> None:
        """START_REPLICATION ... LOGICAL with pgoutput protocol 1; enters COPY_BOTH."""
        pubs = ",".join(f'"{_ident(p)}"' for p in publications)
        opts = f"proto_version '1', publication_names '{_literal(pubs)}'"
        if messages:
            opts += ", messages 'true'"
        self._command(
            f'START_REPLICATION SLOT "{_ident(slot)}" LOGICAL {lsn_str(start_lsn)} ({opts})',
            f"starting replication from slot {slot!r}",
        )
        self._streaming = True
        self._conn.nonblocking = 1

    # -- the stream ----------------------------------------------------------------
    def read(self, timeout: float) -> bytes | None:
        """The next CopyData message (``w``/``k`` + payload), or None after ``timeout`` seconds.

        Raises SourceError when the server ends the stream or the connection breaks.
        """
        conn = self._conn
        n, data = conn.get_copy_data(1)
        if n > 0:
            return bytes(data)
        deadline = None
        while True:
            if n == 0:
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if not wait_fd(self._fd, remaining):
                    return None
                conn.consume_input()
                n, data = conn.get_copy_data(1)
                if n > 0:
                    return bytes(data)
                continue
            # n == -1: COPY ended by the server; n == -2: error
            self._streaming = False
            res = conn.get_result()
            msg = conn.error_message.decode(errors="replace")
            sqlstate = None
            if res is not None:
                if res.error_message:
                    msg = res.error_message.decode(errors="replace")
                s = res.error_field(pq.DiagnosticField.SQLSTATE)
                sqlstate = s.decode() if s else None
            raise _classify(msg or "replication stream ended by the server", sqlstate,
                            "reading the replication stream", self.dsn)

    def read_many(self, timeout: float, limit: int = 4096) -> list[bytes]:
        """Every message already buffered (at least one, waiting up to ``timeout``), up to ``limit``."""
        first = self.read(timeout)
        if first is None:
            return []
        out = [first]
        get = self._conn.get_copy_data
        append = out.append
        while len(out) < limit:
            n, data = get(1)
            if n <= 0:
                if n == 0:
                    # pull what the socket already holds without waiting
                    if wait_fd(self._fd, 0):
                        self._conn.consume_input()
                        n, data = get(1)
                        if n > 0:
                            append(bytes(data))
                            continue
                    break
                # let read() classify the end of the stream on the next call
                break
            append(bytes(data))
        return out

    def send_status(self, lsn: int, *, reply: bool = False) -> None:
        """Standby status update: write = flush = apply = ``lsn`` (everything before it is durable)."""
        now = int(time.time() * 1_000_000) - PG_EPOCH_US
        msg = _STATUS.pack(b"r", lsn, lsn, lsn, now, 1 if reply else 0)
        conn = self._conn
        if conn.put_copy_data(msg) != 1:
            raise _classify(conn.error_message.decode(errors="replace"), None,
                            "sending a standby status update", self.dsn)
        # non-blocking: flush until libpq's output buffer is empty
        while conn.flush() == 1:
            wait_fd(self._fd, 1.0, write=True)

    @property
    def backend_pid(self) -> int:
        return int(self._conn.backend_pid)

    def close(self) -> None:
        """End the connection. The server releases the slot when the walsender exits."""
        if self._streaming and self._conn.status == pq.ConnStatus.OK:
            try:
                self._conn.put_copy_end()
                self._conn.flush()
            except Exception:
                pass
        self._conn.finish()
        self._streaming = False

    def __enter__(self) -> ReplicationConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_keepalive(msg: bytes) -> tuple[int, bool]:
    """(server WAL end, reply requested) of a primary keepalive message."""
    wal_end, _ts, reply = _KEEPALIVE.unpack_from(msg, 1)
    return wal_end, bool(reply)


def parse_xlog_header(msg: bytes) -> tuple[int, int]:
    """(start LSN of the payload, server WAL end) of an XLogData message; payload at byte 25."""
    start, wal_end, _ts = _XLOG_HEADER.unpack_from(msg, 1)
    return start, wal_end


def _ident(name: str) -> str:
    """Replication commands take identifiers; names are validated by config, quote defensively."""
    if "\x00" in name:
        raise SourceError(f"identifier {name!r} contains a NUL byte")
    return name.replace('"', '""')


def _literal(text: str) -> str:
    return text.replace("'", "''")

def wait_fd(fd: int, timeout: float, *, write: bool = False) -> bool:
    """Wait up to ``timeout`` seconds until ``fd`` is readable (or writable); True when it is.

    poll, not select: select() refuses descriptors numbered 1024 and above, which a long-running
    process holding many files and sockets reaches.
    """
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))
