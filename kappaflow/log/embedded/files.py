"""Files and locking of the embedded log: the writer lock, SQLite connections, error mapping, groups.db."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import quote

from kappaflow.errors import CorruptLogError, LogError, LogUnavailableError
from kappaflow.log.base import CompactionStats, TopicConfig
from kappaflow.log.embedded.control import ControlChannel
from kappaflow.log.embedded.space import AUTO_VACUUM_INCREMENTAL

__all__ = ["EmbeddedFiles"]

_log = logging.getLogger("kappaflow.log.embedded")

_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_BUSY_TIMEOUT_S = 30.0
_PAGE_SIZE = 16384
_FILE_FORMAT = 1
_BATCH_SELECT = "SELECT base, last, n, idx, data, crc FROM p{p}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Topic:
    """Per-process state of one topic: its config, connections and (writer) end offsets."""

    def __init__(self, name: str, tid: str, config: TopicConfig, path: Path) -> None:
        self.name = name
        self.id = tid
        self.config = config
        self.path = path
        self.wconn: sqlite3.Connection | None = None
        self.rconn: sqlite3.Connection | None = None
        self.wlock = threading.Lock()  # the write connection; held per append / compaction chunk
        self.rlock = threading.Lock()  # the read connection
        self.clock = threading.Lock()  # one compaction at a time
        self.ends: list[int] | None = None  # writer only: next offset per partition
        self.dirty = 1  # records appended since the last compaction (unknown at open: 1)
        self.kept = 0  # records left by the last compaction
        self.next_due_ms: int | None = None  # earliest time a seen tombstone may be removed
        n = config.partitions
        self.read_sql = [
            _BATCH_SELECT.format(p=p)
            + f" WHERE base >= coalesce((SELECT max(base) FROM p{p} WHERE base <= ?), 0) ORDER BY base"
            for p in range(n)
        ]
        self.insert_sql = [f"INSERT INTO p{p} VALUES (?, ?, ?, ?, ?, ?)" for p in range(n)]

    def close(self) -> None:
        for conn in (self.wconn, self.rconn):
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
        self.wconn = self.rconn = None


class EmbeddedFiles:
    """The files of an embedded log directory and the state every role shares.

    Holds the writer lock, opens SQLite connections (WAL, synchronous mode, read-only for
    readers), maps sqlite3 errors to kappaflow errors naming the file, and owns ``groups.db``.
    The role mixins (`topics`, `append`, `read`, `groups`, `compaction`) build on it; `EmbeddedLog`
    (`log`) sets these attributes in its constructor.
    """

    _path: Path
    _read_only: bool
    _closed: bool
    _sync: str
    _batch_records: int
    _batch_bytes: int
    _min_lag_ms: int
    _meta: sqlite3.Connection
    _meta_lock: threading.RLock
    _groups_lock: threading.Lock
    _topics: dict[str, _Topic]
    _meta_version: int
    _lock_fd: int | None
    _groups: sqlite3.Connection | None
    _stop: threading.Event
    _thread: threading.Thread | None
    _control: ControlChannel | None
    compaction_runs: int
    last_compaction: dict[str, CompactionStats]
    background_errors: list[BaseException]

    def _acquire_writer_lock(self) -> None:
        lock_path = self._path / "writer.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogUnavailableError(
                f"embedded log {str(self._path)!r} is already open for writing (writer pid {holder}); "
                "a log has one writer at a time: stop the other writer, or open this one with "
                "read_only=True to read"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _connect(self, path: Path, *, create: bool, writer: bool,
                 page_size: int | None = None) -> sqlite3.Connection:
        uri = f"file:{quote(str(path))}?mode={'rwc' if create else 'rw'}"
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False,
                                   timeout=_BUSY_TIMEOUT_S)
        except sqlite3.OperationalError as exc:
            raise LogUnavailableError(f"cannot open {path}: {exc}") from None
        try:
            if page_size is not None:  # only effective before the file's first write (new topic files)
                conn.execute(f"PRAGMA page_size={page_size}")
                conn.execute(f"PRAGMA auto_vacuum={AUTO_VACUUM_INCREMENTAL}")  # see space.py
            if writer:
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise LogError(f"{path}: could not switch to WAL mode (got {mode!r})")
                conn.execute(f"PRAGMA synchronous={self._sync}")
                conn.execute("PRAGMA journal_size_limit=67108864")
            else:
                conn.execute("PRAGMA query_only=1")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise self._db_error(exc, path) from None
        return conn

    def _db_error(self, exc: sqlite3.Error, path: Path, topic: str | None = None,
                  partition: int | None = None, offset: int | None = None) -> LogError:
        """Map a sqlite3 error to a kappaflow error that names the file (and position)."""
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        where = f"{path}" + (f" (topic {topic!r} partition {partition} offset {offset})"
                            if partition is not None else f" (topic {topic!r})" if topic else "")
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or type(exc) is sqlite3.DatabaseError:
            return CorruptLogError(f"embedded log file is damaged: {where}: {exc}", path=str(path),
                                   topic=topic, partition=partition, offset=offset)
        if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return LogUnavailableError(f"embedded log file is busy: {where}: {exc}")
        return LogError(f"embedded log I/O failed: {where}: {exc}")

    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"{self!r} is closed")

    def _require_writer(self, what: str) -> None:
        self._check_open()
        if self._read_only:
            raise LogError(
                f"embedded log {str(self._path)!r} is open read-only: {what} needs the writer "
                "(EmbeddedLog(path) without read_only)"
            )

    def _groups_conn(self) -> sqlite3.Connection:
        if self._groups is None:
            path = self._path / "groups.db"
            conn = self._connect(path, create=True, writer=True)
            try:
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS offsets(grp TEXT NOT NULL, topic TEXT NOT NULL, "
                    "topic_id TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL, "
                    "committed_ms INTEGER NOT NULL, PRIMARY KEY (grp, topic, partition)) WITHOUT ROWID"
                )
            except sqlite3.Error as exc:
                conn.close()
                raise self._db_error(exc, path) from None
            self._groups = conn
        return self._groups
