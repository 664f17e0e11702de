"""The embedded log: a directory of SQLite files in WAL mode (the default backend).

Layout of the directory::

    writer.lock             flock'ed by the one writer process (holds its pid, for messages)
    meta.db                 topics: name, id, config (written by the writer only)
    groups.db               consumer-group committed offsets (written by any process)
    topics/NAME.ID.db       one file per topic: a table per partition of record batches,
                            the partitions' end offsets and the tombstones compaction has seen

Why this shape:

* One writer, many readers: the writer holds an exclusive ``flock`` on ``writer.lock``
  (released by the kernel when the process dies, even by kill -9). WAL mode lets readers
  in other processes read a consistent snapshot while the writer appends; readers never
  take a write lock on topic files, so they never block the writer. Committing consumer
  offsets is allowed to readers (consumers run in other processes) and goes to
  ``groups.db``, a separate file, so it never contends with appends either.
* Durability: each `append` is one SQLite transaction (all partitions at once, so a
  crash leaves all or none of it) committed with ``synchronous=FULL``: the WAL is
  fsync'd before `append` returns. ``synchronous="normal"`` survives a killed process
  (kill -9) but not power loss; it is offered for throwaway logs.
* Speed: records are stored in batches (see `codec`), one SQLite row per up to
  `batch_records` records, so the per-row B-tree cost is paid once per batch.
* Offsets never change: each partition's end offset is stored (not derived from the last
  record), so compaction may remove any record, including the last, without reuse.
* Corruption: every batch index and every record carries a CRC32; damaged data raises
  CorruptLogError naming the file, topic, partition and first bad offset, and `read`
  returns the records before the damage first.
* A topic file's name carries a random id, so a reader that still has a deleted topic
  open never mixes it up with a new topic of the same name.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import struct
import threading
import time
import uuid
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate, repeat
from operator import add, attrgetter, itemgetter
from pathlib import Path
from typing import Any, Literal, NamedTuple
from urllib.parse import quote

import numpy as np

from kappaflow.errors import (
    ConfigError,
    CorruptLogError,
    LogError,
    LogUnavailableError,
    RecordTooLargeError,
    UnknownTopicError,
    ValidationError,
)
from kappaflow.log.base import (
    Appended,
    CleanupPolicy,
    CompactionStats,
    Log,
    LogRecord,
    Record,
    TopicConfig,
    TopicPartition,
    check_commit_offset,
    check_group,
    check_partition,
    check_read_args,
    split_commit_key,
    validate_topic_name,
)
from kappaflow.log.embedded.codec import (
    Batch,
    BatchDamaged,
    build,
    decode,
    decode_fields,
    decode_index,
    encode,
    encode_headers,
    first_bad,
    lengths,
    partitions_for,
)
from kappaflow.log.embedded.control import CompactionRequest, ControlChannel
from kappaflow.log.embedded.space import (
    AUTO_VACUUM_INCREMENTAL,
    Pacer,
    Stopped,
    auto_vacuum,
    file_bytes,
    free_pages,
    reclaim,
    vacuum_full,
)

__all__ = ["EmbeddedLog", "RecordColumns"]

_log = logging.getLogger("kappaflow.log.embedded")

_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_BUSY_TIMEOUT_S = 30.0
_PAGE_SIZE = 16384
_FILE_FORMAT = 1
_COMPACT_CHUNK_RECORDS = 50_000  # records rewritten per compaction transaction (appends wait this long)
_COMPACT_CHUNK_BYTES = 16 << 20  # ... or this many bytes, whichever comes first
_COMPACT_SCAN_BATCHES = 16  # stored batches read per query (each query is its own short read transaction)
_MIN_DIRTY_RATIO = 0.5  # background compaction when dirty >= ratio * kept (Kafka's min.cleanable.dirty.ratio)
_BACKGROUND_SHARE = 0.3  # background compaction works at most this share of wall time (appends go on)
_RECLAIM_MIN_BYTES = 4 << 20  # give free pages back once at least this much is free
_REQUEST_POLL_S = 0.25  # how often the writer looks for `kappaflow log compact` requests

_headers_of = attrgetter("headers")
_key_of = attrgetter("key")
_value_of = attrgetter("value")
_timestamp_of = attrgetter("timestamp_ms")
_BATCH_SELECT = "SELECT base, last, n, idx, data, crc FROM p{p}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class RecordColumns(NamedTuple):
    """Consecutive records of one partition as parallel columns, one entry per record.

    What `EmbeddedLog.read_columns` yields: the stored batches' fields without a
    `LogRecord` per record, ready for column builders such as ``pyarrow.array``.
    `headers` are the encoded header blobs (``b""`` for none;
    `kappaflow.log.embedded.codec.decode_headers` turns one into header pairs).
    """

    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    timestamps_ms: list[int]
    headers: list[bytes]


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


def _config_row(config: TopicConfig) -> tuple[int, str, int, int]:
    return (config.partitions, config.cleanup_policy.value, config.delete_retention_ms,
            config.max_record_bytes)


class EmbeddedLog(Log):
    """A log in a local directory; see the module docstring for the layout and guarantees.

    `EmbeddedLog(path)` is the writer (at most one per directory, across processes);
    `EmbeddedLog(path, read_only=True)` is a reader (any number, in any process).

    Compaction runs in the writer only. Every writer has a maintenance thread that serves
    compaction requests from other processes (`kappaflow log compact`, see
    `control`); `compact_interval_s` makes it also compact compact-policy topics on
    its own once enough has been appended since their last compaction (Kafka's log cleaner),
    at most `_BACKGROUND_SHARE` of the time, and give the freed space back to the file system.
    `min_compaction_lag_ms` (Kafka's ``min.compaction.lag.ms``) keeps every record
    uncompacted for at least that long after its timestamp (the append time unless the
    producer set one), so readers that follow the log that closely see every change, not
    only the latest per key.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        read_only: bool = False,
        compact_interval_s: float | None = None,
        min_compaction_lag_ms: int = 0,
        synchronous: Literal["full", "normal"] = "full",
        batch_records: int = 4096,
        batch_bytes: int = 1 << 20,
    ) -> None:
        self._path = Path(path)
        self._read_only = bool(read_only)
        self._closed = False
        if synchronous not in ("full", "normal"):
            raise ConfigError(f"embedded log 'synchronous': expected 'full' or 'normal', got {synchronous!r}")
        self._sync = synchronous.upper()
        if not isinstance(batch_records, int) or not 1 <= batch_records <= 65536:
            raise ConfigError(f"embedded log 'batch_records': expected 1..65536, got {batch_records!r}")
        if not isinstance(batch_bytes, int) or batch_bytes < 1024:
            raise ConfigError(f"embedded log 'batch_bytes': expected an integer >= 1024, got {batch_bytes!r}")
        self._batch_records = batch_records
        self._batch_bytes = batch_bytes
        if compact_interval_s is not None:
            if read_only:
                raise ConfigError("embedded log 'compact_interval_s': only the writer compacts (read_only=True)")
            if not isinstance(compact_interval_s, int | float) or compact_interval_s <= 0:
                raise ConfigError(
                    f"embedded log 'compact_interval_s': expected a number > 0, got {compact_interval_s!r}")
        if type(min_compaction_lag_ms) is not int or min_compaction_lag_ms < 0:
            raise ConfigError(
                f"embedded log 'min_compaction_lag_ms': expected an integer >= 0, got {min_compaction_lag_ms!r}")
        self._min_lag_ms = min_compaction_lag_ms
        self._meta_lock = threading.RLock()
        self._groups_lock = threading.Lock()
        self._topics: dict[str, _Topic] = {}
        self._meta_version = -1
        self._lock_fd: int | None = None
        self._groups: sqlite3.Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._control: ControlChannel | None = None
        #: Background compaction bookkeeping (for monitoring and tests).
        self.compaction_runs = 0
        self.last_compaction: dict[str, CompactionStats] = {}
        self.background_errors: list[BaseException] = []

        if self._path.exists() and not self._path.is_dir():
            raise ConfigError(f"embedded log path {str(self._path)!r}: expected a directory, found a file")
        try:
            if read_only:
                if not (self._path / "meta.db").exists():
                    raise LogUnavailableError(
                        f"no embedded log at {str(self._path)!r} (no meta.db): open it once as the writer "
                        "(EmbeddedLog(path)) to create it"
                    )
                self._meta = self._connect(self._path / "meta.db", create=False, writer=False)
            else:
                self._path.mkdir(parents=True, exist_ok=True)
                (self._path / "topics").mkdir(exist_ok=True)
                self._acquire_writer_lock()
                self._meta = self._connect(self._path / "meta.db", create=True, writer=True)
                try:
                    self._meta.execute(
                        "CREATE TABLE IF NOT EXISTS topics(name TEXT PRIMARY KEY, id TEXT NOT NULL, "
                        "partitions INTEGER NOT NULL, cleanup_policy TEXT NOT NULL, "
                        "delete_retention_ms INTEGER NOT NULL, max_record_bytes INTEGER NOT NULL, "
                        "created_ms INTEGER NOT NULL)"
                    )
                except sqlite3.Error as exc:
                    raise self._db_error(exc, self._path / "meta.db") from None
                self._groups_conn()
            self._load_topics()
            if not read_only:
                self._remove_orphans()
                self._control = ControlChannel(self._path)
                self._control.prune()
        except BaseException:
            self.close()
            raise
        if not read_only:
            self._thread = threading.Thread(
                target=self._maintain, args=(None if compact_interval_s is None else float(compact_interval_s),),
                name=f"kappaflow-compaction[{self._path}]", daemon=True,
            )
            self._thread.start()

    # --- plumbing -------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._path

    @property
    def read_only(self) -> bool:
        return self._read_only

    def __repr__(self) -> str:
        return f"EmbeddedLog({str(self._path)!r}{', read_only=True' if self._read_only else ''})"

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

    # --- topics ---------------------------------------------------------------------------
    def _topic_path(self, name: str, tid: str) -> Path:
        return self._path / "topics" / f"{name}.{tid}.db"

    def _load_topics(self) -> None:
        with self._meta_lock:
            try:
                version = self._meta.execute("PRAGMA data_version").fetchone()[0]
                if version == self._meta_version:
                    return
                rows = self._meta.execute(
                    "SELECT name, id, partitions, cleanup_policy, delete_retention_ms, max_record_bytes "
                    "FROM topics"
                ).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):  # a writer is creating the log right now
                    rows, version = [], -1
                else:
                    raise self._db_error(exc, self._path / "meta.db") from None
            except sqlite3.DatabaseError as exc:
                raise self._db_error(exc, self._path / "meta.db") from None
            seen = {}
            for name, tid, parts, policy, retention, max_bytes in rows:
                old = self._topics.get(name)
                if old is not None and old.id == tid:
                    seen[name] = old
                    continue
                config = TopicConfig(partitions=parts, cleanup_policy=CleanupPolicy(policy),
                                     delete_retention_ms=retention, max_record_bytes=max_bytes)
                seen[name] = _Topic(name, tid, config, self._topic_path(name, tid))
            # Topics that went away are dropped, not closed: another thread may be reading from
            # them right now; their connections close when the last reference goes.
            self._topics = seen
            self._meta_version = version

    def _topic(self, name: str) -> _Topic:
        self._check_open()
        if self._read_only:
            self._load_topics()
        t = self._topics.get(name)
        if t is None:
            raise UnknownTopicError(name)
        return t

    def _remove_orphans(self) -> None:
        """Delete topic files no topic refers to (left by a crash inside create/delete_topic)."""
        wanted = {t.path.name for t in self._topics.values()}
        for f in (self._path / "topics").iterdir():
            base = f.name
            for suffix in ("-wal", "-shm", "-journal"):
                base = base.removesuffix(suffix)
            if base not in wanted:
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()

    def create_topic(self, name: str, config: TopicConfig | None = None, *, exist_ok: bool = True) -> TopicConfig:
        self._require_writer("create_topic")
        validate_topic_name(name)
        if config is not None and not isinstance(config, TopicConfig):
            raise ConfigError(f"topic {name!r} config: expected a TopicConfig, got {type(config).__name__}")
        with self._meta_lock:
            existing = self._topics.get(name)
            if existing is not None:
                if not exist_ok:
                    raise ConfigError(f"topic {name!r} already exists")
                if config is not None and config != existing.config:
                    raise ConfigError(
                        f"topic {name!r} already exists with a different config: "
                        f"existing {existing.config}, requested {config}"
                    )
                return existing.config
            config = config or TopicConfig()
            tid = uuid.uuid4().hex[:12]
            path = self._topic_path(name, tid)
            conn = self._connect(path, create=True, writer=True, page_size=_PAGE_SIZE)
            try:
                tables = "".join(
                    f"CREATE TABLE p{p}(base INTEGER PRIMARY KEY, last INTEGER NOT NULL, n INTEGER NOT NULL, "
                    "idx BLOB NOT NULL, data BLOB NOT NULL, crc INTEGER NOT NULL);"
                    for p in range(config.partitions)
                )
                conn.executescript(
                    "BEGIN;"
                    "CREATE TABLE topic(name TEXT NOT NULL, id TEXT NOT NULL, partitions INTEGER NOT NULL, "
                    "cleanup_policy TEXT NOT NULL, delete_retention_ms INTEGER NOT NULL, "
                    "max_record_bytes INTEGER NOT NULL);"
                    "CREATE TABLE ends(partition INTEGER PRIMARY KEY, end_offset INTEGER NOT NULL);"
                    "CREATE TABLE tombstones(partition INTEGER NOT NULL, offset INTEGER NOT NULL, "
                    "seen_ms INTEGER NOT NULL, PRIMARY KEY (partition, offset)) WITHOUT ROWID;"
                    + tables
                    + f"PRAGMA user_version={_FILE_FORMAT};"
                )
                conn.execute("INSERT INTO topic VALUES (?, ?, ?, ?, ?, ?)", (name, tid, *_config_row(config)))
                conn.executemany("INSERT INTO ends VALUES (?, 0)", [(p,) for p in range(config.partitions)])
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                conn.close()
                raise self._db_error(exc, path, name) from None
            conn.close()
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the new file's directory entry survives power loss too
            finally:
                os.close(dir_fd)
            try:
                self._meta.execute(
                    "INSERT INTO topics VALUES (?, ?, ?, ?, ?, ?, ?)", (name, tid, *_config_row(config), _now_ms())
                )
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "meta.db") from None
            self._topics[name] = _Topic(name, tid, config, path)
            return config

    def delete_topic(self, name: str) -> None:
        self._require_writer("delete_topic")
        t = self._topic(name)
        with t.clock, t.wlock, t.rlock, self._meta_lock:
            try:
                self._meta.execute("DELETE FROM topics WHERE name = ?", (name,))
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "meta.db") from None
            del self._topics[name]
            t.close()
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{t.path}{suffix}")
        with self._groups_lock:
            try:
                self._groups_conn().execute("DELETE FROM offsets WHERE topic = ?", (name,))
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "groups.db") from None

    def list_topics(self) -> dict[str, TopicConfig]:
        self._check_open()
        if self._read_only:
            self._load_topics()
        return {name: t.config for name, t in sorted(self._topics.items())}

    def topic_config(self, name: str) -> TopicConfig:
        return self._topic(name).config

    def partitions(self, topic: str) -> int:
        return self._topic(topic).config.partitions

    # --- connections per topic ------------------------------------------------------------
    def _wconn(self, t: _Topic) -> sqlite3.Connection:
        """The writer's connection (caller holds t.wlock); loads and checks the end offsets."""
        if t.wconn is None:
            conn = self._open_topic_file(t, writer=True)
            try:
                ends = dict(conn.execute("SELECT partition, end_offset FROM ends").fetchall())
                for p in range(t.config.partitions):
                    last = conn.execute(f"SELECT max(last) FROM p{p}").fetchone()[0]
                    if p not in ends or (last is not None and last >= ends[p]):
                        raise CorruptLogError(
                            f"embedded log file is damaged: {t.path}: partition {p} end offset "
                            f"{ends.get(p)} is not past its last record {last}",
                            path=str(t.path), topic=t.name, partition=p, offset=ends.get(p))
            except sqlite3.Error as exc:
                conn.close()
                raise self._db_error(exc, t.path, t.name) from None
            except BaseException:
                conn.close()
                raise
            t.ends = [ends[p] for p in range(t.config.partitions)]
            t.wconn = conn
        return t.wconn

    def _rconn(self, t: _Topic) -> sqlite3.Connection:
        if t.rconn is None:
            t.rconn = self._open_topic_file(t, writer=False)
        return t.rconn

    def _open_topic_file(self, t: _Topic, *, writer: bool) -> sqlite3.Connection:
        if not t.path.exists():
            if self._read_only:
                self._meta_version = -1
                self._load_topics()
                if self._topics.get(t.name) is not t:
                    raise UnknownTopicError(t.name)
            raise CorruptLogError(f"embedded log file is missing: {t.path} (topic {t.name!r})",
                                  path=str(t.path), topic=t.name)
        conn = self._connect(t.path, create=False, writer=writer)
        try:
            if not writer:
                # A query_only connection cannot write the schema; the pragma only makes SQLite
                # read a file shorter than its header says (truncated) up to the missing pages,
                # so the records before the damage stay readable.
                conn.execute("PRAGMA writable_schema=ON")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as exc:
            conn.close()
            raise self._db_error(exc, t.path, t.name) from None
        if version != _FILE_FORMAT:
            conn.close()
            raise CorruptLogError(
                f"embedded log file {t.path} has format version {version}, expected {_FILE_FORMAT}",
                path=str(t.path), topic=t.name)
        return conn

    # --- validation helpers ---------------------------------------------------------------
    @staticmethod
    def _check_partition(t: _Topic, partition: object) -> int:
        return check_partition(t.name, partition, t.config.partitions)

    # --- write ----------------------------------------------------------------------------
    def append(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> list[Appended]:
        return self._append(topic, records, partition, True)  # type: ignore[return-value]

    def append_quiet(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> None:
        """`append` without the per-record results (same checks, same durability).

        For callers that only need "durable when this returns" (the capture writer): building
        one result object per record is a sizeable part of an append's CPU.
        """
        self._append(topic, records, partition, False)

    def _append(self, topic: str, records: Sequence[Record], partition: int | None,
                results: bool) -> list[Appended] | None:
        self._require_writer("append")
        t = self._topic(topic)
        n = len(records)
        if n == 0:
            return [] if results else None
        config = t.config
        types = set(map(type, records))
        if not all(issubclass(tp, Record) for tp in types):
            i = next(i for i, r in enumerate(records) if not isinstance(r, Record))
            raise ValidationError(
                f"topic {topic!r} record {i}: expected a kappaflow.log.Record, got {type(records[i]).__name__}")
        keys = list(map(_key_of, records))
        values = list(map(_value_of, records))
        given = list(map(_timestamp_of, records))
        now = _now_ms()
        stamps: list[int] = [now if s is None else s for s in given] if None in given else given
        try:
            ts_arr = array("q", stamps)
        except (TypeError, OverflowError):
            i = next(i for i, s in enumerate(stamps) if type(s) is not int or not -(2**63) <= s < 2**63)
            raise ValidationError(
                f"topic {topic!r} record {i}: timestamp_ms: expected an int (ms since the epoch) or None, "
                f"got {stamps[i]!r}") from None
        klen = lengths(keys)
        vlen = lengths(values)
        heads: list[bytes] | None = None
        hs = list(map(_headers_of, records))
        if any(hs):
            # Encoded once per distinct headers object: producers share one headers tuple per
            # kind of record (a connector's per-operation headers), so most appends encode 1-3.
            ids = list(map(id, hs))
            first = dict(zip(reversed(ids), range(n - 1, -1, -1), strict=True))  # id -> first index
            memo = {k: encode_headers(hs[i], i) if hs[i] else b""
                    for k, i in sorted(first.items(), key=itemgetter(1))}
            heads = list(map(memo.__getitem__, ids))
        if config.compacted and -1 in klen:
            i = klen.index(-1)
            raise ValidationError(
                f"topic {topic!r} record {i}: a compacted topic needs a key on every record, got key None")
        limit = config.max_record_bytes
        if -1 in klen or -1 in vlen:
            sizes = [max(a, 0) + max(b, 0) for a, b in zip(klen, vlen, strict=True)]
        else:
            sizes = list(map(add, klen, vlen))
        if heads is not None:
            sizes = list(map(add, sizes, map(len, heads)))
        biggest = max(sizes)
        if biggest > limit:
            i = sizes.index(biggest)
            raise RecordTooLargeError(
                f"topic {topic!r} record {i}: {biggest} bytes (key + value + headers) is over the topic's "
                f"max.message.bytes of {limit}; nothing of this append was written"
            )
        nparts = config.partitions
        if partition is not None:
            self._check_partition(t, partition)
            groups: dict[int, list[int] | None] = {partition: None}
            parts: list[int] | None = None
        elif nparts == 1:
            groups = {0: None}
            parts = None
        else:
            parts = partitions_for(keys, nparts)
            pa = np.asarray(parts, dtype=np.int64)
            order = np.argsort(pa, kind="stable")
            counts = np.bincount(pa, minlength=nparts)
            groups = {}
            pos = 0
            for p, c in enumerate(counts.tolist()):
                if c:
                    groups[p] = order[pos : pos + c].tolist()
                    pos += c
            if len(groups) == 1:
                groups = dict.fromkeys(groups)
        return self._write(t, groups, parts, n, keys, values, ts_arr, heads, klen, vlen, sizes, results)

    def _write(self, t: _Topic, groups: dict[int, list[int] | None], parts: list[int] | None, n: int,
               keys: list[bytes | None], values: list[bytes | None], ts_arr: array,
               heads: list[bytes] | None, klen: list[int], vlen: list[int], sizes: list[int],
               results: bool = True) -> list[Appended] | None:
        with t.wlock:
            self._check_open()
            conn = self._wconn(t)
            ends = t.ends
            assert ends is not None
            rows: list[tuple[int, list[Batch]]] = []
            new_ends: dict[int, int] = {}
            firsts: dict[int, int] = {}
            for p, idx in groups.items():
                if idx is None:
                    g_keys, g_values, g_ts, g_heads, g_sizes = keys, values, ts_arr, heads, sizes
                    g_klen, g_vlen = klen, vlen
                else:
                    get = itemgetter(*idx) if len(idx) > 1 else (lambda s, i=idx[0]: (s[i],))
                    g_keys, g_values, g_sizes = list(get(keys)), list(get(values)), list(get(sizes))
                    g_klen, g_vlen = list(get(klen)), list(get(vlen))
                    g_ts = array("q", get(ts_arr))
                    g_heads = None if heads is None else list(get(heads))
                base = ends[p]
                firsts[p] = base
                batches = []
                for a, b in self._chunks(g_sizes):
                    batches.append(encode(None, base + a, g_keys[a:b], g_values[a:b], g_ts[a:b],
                                          None if g_heads is None else g_heads[a:b],
                                          klens=g_klen[a:b], vlens=g_vlen[a:b]))
                rows.append((p, batches))
                new_ends[p] = base + len(g_keys)
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for p, batches in rows:
                        conn.executemany(t.insert_sql[p], batches)
                    conn.executemany("UPDATE ends SET end_offset = ? WHERE partition = ?",
                                     [(e, p) for p, e in new_ends.items()])
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name) from None
            for p, e in new_ends.items():
                ends[p] = e
            t.dirty += n
        if not results:
            return None
        if parts is None:
            p = next(iter(groups))
            return build(Appended, n, repeat(p, n), range(firsts[p], firsts[p] + n))
        offsets = np.empty(n, dtype=np.int64)
        for p, idx in groups.items():
            if idx is None:  # every record went to p
                return build(Appended, n, repeat(p, n), range(firsts[p], firsts[p] + n))
            offsets[idx] = np.arange(firsts[p], firsts[p] + len(idx))
        return build(Appended, n, parts, offsets.tolist())

    def _chunks(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Split records into batches of at most batch_records records and ~batch_bytes bytes."""
        m = len(sizes)
        cap = self._batch_records
        total = sum(sizes)
        if total <= self._batch_bytes:
            return [(a, min(a + cap, m)) for a in range(0, m, cap)]
        cum = list(accumulate(sizes))
        out = []
        a = 0
        while a < m:
            before = cum[a - 1] if a else 0
            b = bisect_right(cum, before + self._batch_bytes, a, min(a + cap, m))
            b = max(b, a + 1)
            out.append((a, b))
            a = b
        return out

    # --- read -----------------------------------------------------------------------------
    def read(self, topic: str, partition: int, offset: int, max_records: int = 10_000) -> list[LogRecord]:
        t = self._topic(topic)
        self._check_partition(t, partition)
        check_read_args(topic, partition, offset, max_records)
        out: list[LogRecord] = []
        with t.rlock:
            conn = self._rconn(t)
            nxt = offset
            try:
                cur = conn.execute(t.read_sql[partition], (offset,))
                try:
                    while len(out) < max_records:
                        row = cur.fetchone()
                        if row is None:
                            break
                        if row[1] < nxt:
                            continue
                        try:
                            recs = decode(topic, partition, row, nxt, max_records - len(out))
                        except BatchDamaged as dmg:
                            out += dmg.records
                            if out:
                                return out
                            raise CorruptLogError(
                                f"embedded log file is damaged: {t.path} (topic {topic!r} partition "
                                f"{partition} offset {dmg.offset}): {dmg.reason}; records before offset "
                                f"{dmg.offset} are readable",
                                path=str(t.path), topic=topic, partition=partition, offset=dmg.offset,
                            ) from None
                        if recs:
                            out += recs
                            nxt = recs[-1].offset + 1
                finally:
                    cur.close()
            except sqlite3.Error as exc:
                if out:
                    return out
                raise self._db_error(exc, t.path, topic, partition, nxt) from None
        return out

    def read_columns(self, topic: str, partition: int, start: int = 0, end: int | None = None, *,
                     batches_per_fetch: int = 16) -> Iterator[RecordColumns]:
        """Records with ``start <= offset < end`` (default: the end offset now), as columns.

        Why: a bulk reader (the projections' Spark data source) that wants columns pays
        about half of `read`'s cost per record: stored batches are cut straight into
        columns, headers stay encoded, and no `LogRecord` is built. The same checks as
        `read` apply (batch index and record CRC32s). One chunk per stored batch;
        `batches_per_fetch` batches are fetched per query, and the read lock is not held
        between chunks, so the writer and other readers go on meanwhile. At a damaged
        batch the records before the damage are still yielded, then CorruptLogError
        names the file, topic, partition and offset (as `read` does).
        """
        t = self._topic(topic)
        self._check_partition(t, partition)
        if type(start) is not int or start < 0:
            raise ValidationError(f"topic {topic!r} partition {partition} start: expected an int >= 0, got {start!r}")
        if end is not None and (type(end) is not int or end < 0):
            raise ValidationError(f"topic {topic!r} partition {partition} end: expected an int >= 0 or None, "
                                  f"got {end!r}")
        if type(batches_per_fetch) is not int or batches_per_fetch < 1:
            raise ValidationError(f"read_columns batches_per_fetch: expected an int >= 1, got {batches_per_fetch!r}")
        stop = self.end_offset(topic, partition) if end is None else end
        sql = t.read_sql[partition]
        # The first row may be the batch before `offset` (offset in a compaction gap): fetch
        # at least two, so a fetch that moves nothing forward means the partition has ended.
        fetch = max(2, batches_per_fetch)
        offset = start
        while offset < stop:
            with t.rlock:
                try:
                    cur = self._rconn(t).execute(sql, (offset,))
                    try:
                        rows = cur.fetchmany(fetch)
                    finally:
                        cur.close()
                except sqlite3.Error as exc:
                    raise self._db_error(exc, t.path, topic, partition, offset) from None
            progressed = False
            for base, last, n, idx, data, crc in rows:
                if last < offset:
                    continue
                try:
                    d = decode_index(base, last, n, idx, crc)
                    lo = bisect_left(d.offsets, offset)
                    hi = bisect_left(d.offsets, stop)
                    if lo >= hi:
                        if hi < n:
                            return  # the range ends before this batch's records
                        continue
                    keys, values, heads = decode_fields(d, data, lo, hi)
                    damaged = first_bad(d, keys, values, heads, lo) is not None
                except (ValueError, struct.error):
                    damaged = True
                if damaged:
                    # `read` returns the verified records before the damage, then names it
                    yield from self._columns_via_read(topic, partition, offset, stop)
                    return
                yield RecordColumns(d.offsets[lo:hi], keys, values, d.timestamps[lo:hi].tolist(), heads)
                offset = d.offsets[hi - 1] + 1
                progressed = True
                if hi < n:
                    return
            if not progressed:
                return

    def _columns_via_read(self, topic: str, partition: int, offset: int, stop: int) -> Iterator[RecordColumns]:
        while offset < stop:
            recs = [r for r in self.read(topic, partition, offset, min(10_000, stop - offset)) if r.offset < stop]
            if not recs:
                return
            yield RecordColumns([r.offset for r in recs], [r.key for r in recs], [r.value for r in recs],
                                [r.timestamp_ms for r in recs],
                                [encode_headers(r.headers, i) for i, r in enumerate(recs)])
            offset = recs[-1].offset + 1

    def end_offset(self, topic: str, partition: int) -> int:
        t = self._topic(topic)
        self._check_partition(t, partition)
        if t.ends is not None:
            return t.ends[partition]
        with t.rlock:
            try:
                row = self._rconn(t).execute("SELECT end_offset FROM ends WHERE partition = ?", (partition,)).fetchone()
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, topic, partition) from None
        if row is None:
            raise CorruptLogError(f"embedded log file is damaged: {t.path}: no end offset for partition {partition}",
                                  path=str(t.path), topic=topic, partition=partition)
        return int(row[0])

    def end_offsets(self, topic: str) -> dict[int, int]:
        t = self._topic(topic)
        if t.ends is not None:
            return dict(enumerate(t.ends))
        with t.rlock:
            try:
                rows = self._rconn(t).execute("SELECT partition, end_offset FROM ends").fetchall()
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, topic) from None
        return {p: e for p, e in sorted(rows) if p < t.config.partitions}

    # --- consumer groups ------------------------------------------------------------------
    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        self._check_open()
        check_group(group)
        rows = []
        now = _now_ms()
        for tp, nxt in offsets.items():
            topic, partition = split_commit_key(tp)
            t = self._topic(topic)
            self._check_partition(t, partition)
            check_commit_offset(topic, partition, nxt)
            rows.append((group, topic, t.id, partition, nxt, now))
        if not rows:
            return
        with self._groups_lock:
            conn = self._groups_conn()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.executemany(
                        "INSERT INTO offsets VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (grp, topic, partition) "
                        "DO UPDATE SET topic_id = excluded.topic_id, next_offset = excluded.next_offset, "
                        "committed_ms = excluded.committed_ms", rows)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "groups.db") from None

    def committed(self, group: str, topic: str) -> dict[int, int]:
        t = self._topic(topic)
        with self._groups_lock:
            try:
                rows = self._groups_conn().execute(
                    "SELECT partition, next_offset FROM offsets WHERE grp = ? AND topic = ? AND topic_id = ?",
                    (group, topic, t.id)).fetchall()
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "groups.db") from None
        return dict(sorted(rows))

    # --- compaction -----------------------------------------------------------------------
    def compact(self, topic: str, *, now_ms: int | None = None) -> CompactionStats:
        """Keep the latest record per key; remove tombstones `delete_retention_ms` after compaction first saw them.

        Like Kafka (KIP-534), a tombstone's retention starts when compaction first sees it
        as the latest record of its key; with retention 0 it goes in that same pass. From the
        first record whose timestamp (the append time, unless the producer gave one) is less
        than `min_compaction_lag_ms` old, records are neither removed nor count as superseding
        older ones (Kafka's uncleanable head). Runs in chunks of transactions so
        appends (which wait on the same lock) proceed in between; a crash mid-compaction
        leaves a valid, partly compacted log (each chunk swaps old batches for rewritten
        ones in one transaction). Afterwards the freed pages go back to the file system
        (incremental auto-vacuum; `bytes_before`/`bytes_after` in the result).
        """
        self._require_writer("compact")
        now = _now_ms() if now_ms is None else now_ms
        if type(now) is not int:
            raise ValidationError(f"compact now_ms: expected an int, got {now_ms!r}")
        return self._compact_topic(self._topic(topic), now, Pacer())

    def compact_all(self, topic: str | None = None, *, full_vacuum: bool = False,
                    now_ms: int | None = None) -> dict[str, CompactionStats]:
        """Compact one topic or every compact-policy topic, then give the space back.

        ``full_vacuum``: every free page goes back (`vacuum`); a file created without
        incremental auto-vacuum (an older log) is rewritten once by a full VACUUM, which blocks
        appends to that topic while it runs (see `space`). Without it such files only
        reuse their free pages, and incremental files keep up to a few MiB free.
        """
        self._require_writer("compact")
        now = _now_ms() if now_ms is None else now_ms
        if type(now) is not int:
            raise ValidationError(f"compact now_ms: expected an int, got {now_ms!r}")
        return self._compact_all(topic, full_vacuum, now, Pacer())

    def _compact_all(self, topic: str | None, full_vacuum: bool, now: int, pacer: Pacer) -> dict[str, CompactionStats]:
        names = [topic] if topic is not None else [n for n, c in self.list_topics().items() if c.compacted]
        out: dict[str, CompactionStats] = {}
        for name in names:
            stats = self._compact_topic(self._topic(name), now, pacer)
            if full_vacuum:
                self.vacuum(name, stats)
            out[name] = stats
        return out

    def vacuum(self, topic: str, stats: CompactionStats | None = None) -> CompactionStats:
        """Give every free page of a topic file back to the file system.

        An incremental auto-vacuum file frees them in short steps (appends go on). A file
        created without auto-vacuum (an older log) is rewritten once by a full VACUUM, which
        switches it to incremental mode; appends to the topic wait while that runs (the whole
        file is rewritten in one transaction).
        """
        self._require_writer("vacuum")
        t = self._topic(topic)
        stats = stats or CompactionStats(topic=topic)
        with t.clock:
            with t.wlock:
                conn = self._wconn(t)
                if stats.bytes_before is None:
                    stats.bytes_before = file_bytes(t.path)
                incremental = auto_vacuum(conn) == AUTO_VACUUM_INCREMENTAL
            try:
                if incremental:
                    reclaim(conn, t.wlock)
                else:
                    vacuum_full(conn, t.wlock)
                    stats.full_vacuum = True
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name) from None
            stats.bytes_after = file_bytes(t.path)
        return stats

    def _compact_topic(self, t: _Topic, now: int, pacer: Pacer) -> CompactionStats:
        stats = CompactionStats(topic=t.name)
        if not t.config.compacted:
            return stats
        with t.clock:
            stats.bytes_before = file_bytes(t.path)
            dirty = t.dirty
            due: list[int] = []
            head = 0  # records left out as younger than min_compaction_lag_ms: still dirty
            for p in range(t.config.partitions):
                nd, young = self._compact_partition(t, p, now, stats, pacer)
                head += young
                if nd is not None:
                    due.append(nd)
            t.dirty = max(0, t.dirty - dirty) + head
            t.kept = stats.kept
            t.next_due_ms = min(due) if due else None
            self.last_compaction[t.name] = stats
            self._reclaim(t, pacer)
            stats.bytes_after = file_bytes(t.path)
        return stats

    def _reclaim(self, t: _Topic, pacer: Pacer) -> None:
        """Give free pages back (incremental auto-vacuum files only; caller holds t.clock)."""
        with t.wlock:
            conn = self._wconn(t)
            try:
                if auto_vacuum(conn) != AUTO_VACUUM_INCREMENTAL or free_pages(conn) * _PAGE_SIZE < _RECLAIM_MIN_BYTES:
                    return
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name) from None
        try:
            reclaim(conn, t.wlock, pacer.step)
        except sqlite3.Error as exc:
            raise self._db_error(exc, t.path, t.name) from None

    def _scan(self, conn: sqlite3.Connection, t: _Topic, p: int, start: int, end: int) -> Iterator[
            tuple[int, int, int, bytes, bytes, int]]:
        """Stored batches of partition `p` with start <= base < end, a few per short read transaction.

        Never one long read transaction: that would stop WAL checkpoints (the WAL would grow
        by everything compaction rewrites, and freed pages could not be given back).
        """
        sql = _BATCH_SELECT.format(p=p) + " WHERE base >= ? AND base < ? ORDER BY base LIMIT ?"
        while start < end:
            try:
                rows = conn.execute(sql, (start, end, _COMPACT_SCAN_BATCHES)).fetchall()
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name, p, start) from None
            if not rows:
                return
            yield from rows
            start = rows[-1][1] + 1  # past the last batch's last offset: batches rewritten meanwhile start below

    def _compact_partition(self, t: _Topic, p: int, now: int, stats: CompactionStats,
                           pacer: Pacer) -> tuple[int | None, int]:
        """Compact partition `p`: (when its oldest kept tombstone expires, how many offsets the lag left out)."""
        retention = t.config.delete_retention_ms
        with t.wlock:
            self._wconn(t)
            assert t.ends is not None
            end = t.ends[p]
        # Pass 1, on short private read snapshots (appends continue): the latest offset of each
        # key below the horizon: the first record younger than min_compaction_lag_ms (by its
        # timestamp, as Kafka does), or the end. Records from the horizon on stay as they are
        # and supersede nothing.
        cutoff = now - self._min_lag_ms if self._min_lag_ms else None
        horizon = end
        scan = self._open_topic_file(t, writer=False)
        try:
            latest: dict[bytes | None, int] = {}
            for n_rows, row in enumerate(self._scan(scan, t, p, 0, end), 1):
                d, keys, _, _ = self._verified(t, p, row)
                if cutoff is not None and max(d.timestamps) > cutoff:
                    young = next(i for i, ts in enumerate(d.timestamps) if ts > cutoff)
                    horizon = d.offsets[young]
                    latest.update(zip(keys[:young], d.offsets[:young], strict=True))
                    break
                latest.update(zip(keys, d.offsets, strict=True))
                if n_rows % _COMPACT_SCAN_BATCHES == 0:
                    pacer.step()
            try:
                seen = dict(scan.execute("SELECT offset, seen_ms FROM tombstones WHERE partition = ? AND offset < ?",
                                         (p, horizon)))
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name, p) from None
            latest.pop(None, None)  # keyless records (never in compacted topics) are kept
            # Pass 2: rewrite batches that hold superseded records or expired tombstones.
            keep_seen: dict[int, int] = {}
            removed = kept = tomb_removed = 0
            deletes: list[int] = []
            out: list[tuple[int, int | None, bytes | None, bytes, int, int]] = []  # off,key,val,head,ts,crc
            inserts: list[Batch] = []
            pending = pending_bytes = 0

            def flush_out() -> None:
                if out:
                    offs, ks, vs, hs, ts, cs = zip(*out, strict=True)
                    heads = list(hs) if any(hs) else None
                    inserts.append(encode(list(offs), 0, ks, vs, ts, heads, cs))
                    out.clear()

            def commit_chunk() -> None:
                flush_out()
                if not deletes and not inserts:
                    return
                with t.wlock:
                    conn = self._wconn(t)
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                        try:
                            conn.executemany(f"DELETE FROM p{p} WHERE base = ?", [(b,) for b in deletes])
                            conn.executemany(t.insert_sql[p], inserts)
                            conn.execute("COMMIT")
                        except BaseException:
                            if conn.in_transaction:
                                conn.execute("ROLLBACK")
                            raise
                    except sqlite3.Error as exc:
                        raise self._db_error(exc, t.path, t.name, p) from None
                deletes.clear()
                inserts.clear()
                pacer.step()

            for row in self._scan(scan, t, p, 0, horizon):
                base, n = row[0], row[2]
                d, keys, values, heads = self._verified(t, p, row)
                offsets = d.offsets
                lat = [latest.get(k, o) if k is not None and o < horizon else o
                       for k, o in zip(keys, offsets, strict=True)]
                has_tombs = -1 in d.vlen
                if lat == offsets and not has_tombs:
                    kept += n
                    if n * 2 >= self._batch_records:
                        flush_out()  # keep this batch as it is; merged output must not span it
                        continue
                    keep = range(n)
                else:
                    keep_list = []
                    for i, (o, lo, vl) in enumerate(zip(offsets, lat, d.vlen, strict=True)):
                        if lo != o:
                            removed += 1
                            continue
                        if vl < 0 and o < horizon:
                            first = seen.get(o, now)
                            if now >= first + retention:
                                removed += 1
                                tomb_removed += 1
                                continue
                            keep_seen[o] = first
                        keep_list.append(i)
                    keep = keep_list  # type: ignore[assignment]
                    kept += len(keep_list)
                    if len(keep_list) == n and n * 2 >= self._batch_records:
                        flush_out()
                        continue
                deletes.append(base)
                ts = d.timestamps
                crcs = d.crcs
                for i in keep:
                    out.append((offsets[i], keys[i], values[i], heads[i], ts[i], crcs[i]))  # type: ignore[arg-type]
                    if len(out) >= self._batch_records:
                        flush_out()
                pending += n
                pending_bytes += len(row[4])
                if pending >= _COMPACT_CHUNK_RECORDS or pending_bytes >= _COMPACT_CHUNK_BYTES:
                    commit_chunk()
                    pending = pending_bytes = 0
            commit_chunk()
            with t.wlock:
                conn = self._wconn(t)
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    conn.execute("DELETE FROM tombstones WHERE partition = ? AND offset < ?", (p, horizon))
                    conn.executemany("INSERT INTO tombstones VALUES (?, ?, ?)",
                                     [(p, o, s) for o, s in keep_seen.items()])
                    conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise self._db_error(exc, t.path, t.name, p) from None
        finally:
            scan.close()
        stats.removed += removed
        stats.kept += kept
        stats.tombstones_removed += tomb_removed
        stats.per_partition[p] = removed
        return min((s + retention for s in keep_seen.values()), default=None), end - horizon

    def _verified(self, t: _Topic, p: int, row: tuple[int, int, int, bytes, bytes, int]) -> tuple[
            Any, list[bytes | None], list[bytes | None], list[bytes]]:
        """Decode a whole batch for compaction, refusing to rewrite damaged data."""
        base, last, n, idx, data, crc = row
        try:
            d = decode_index(base, last, n, idx, crc)
            keys, values, heads = decode_fields(d, data)
        except Exception as exc:
            raise CorruptLogError(
                f"embedded log file is damaged: {t.path} (topic {t.name!r} partition {p} offset {base}): {exc}; "
                "compaction stopped without changing this batch",
                path=str(t.path), topic=t.name, partition=p, offset=base) from None
        bad = first_bad(d, keys, values, heads)
        if bad is not None:
            raise CorruptLogError(
                f"embedded log file is damaged: {t.path} (topic {t.name!r} partition {p} offset "
                f"{d.offsets[bad]}): record CRC32 mismatch; compaction stopped without changing this batch",
                path=str(t.path), topic=t.name, partition=p, offset=d.offsets[bad])
        return d, keys, values, heads

    # --- the maintenance thread: requests from other processes, background compaction ----------
    def _maintain(self, interval: float | None) -> None:
        """Serve `kappaflow log compact` requests; with `interval`, compact dirty topics on our own."""
        poll = min(_REQUEST_POLL_S, interval) if interval is not None else _REQUEST_POLL_S
        next_auto = time.monotonic() + interval if interval is not None else None
        while not self._stop.wait(poll):
            self._serve_requests()
            if next_auto is not None and interval is not None and time.monotonic() >= next_auto:
                self._background_pass()
                next_auto = time.monotonic() + interval

    def _serve_requests(self) -> None:
        control = self._control
        if control is None:
            return
        try:
            if not control.changed():
                return
            requests = control.take()
        except LogError as exc:
            if not self._closed:
                _log.warning("embedded log %s: cannot read compaction requests: %s", self._path, exc)
            return
        for req in requests:
            self.serve(req, control)

    def serve(self, req: CompactionRequest, control: ControlChannel) -> None:
        """Run one compaction request and write its result back (any error is the request's result)."""
        started = time.monotonic()
        try:
            stats = self._compact_all(req.topic, req.full_vacuum, _now_ms(), Pacer(1.0, self._stop))
        except Stopped:  # closing: the next writer runs it
            with contextlib.suppress(LogError):
                control.requeue(req.id)
            return
        except Exception as exc:  # the requester prints it; the writer goes on
            with contextlib.suppress(LogError):
                control.fail(req.id, f"{type(exc).__name__}: {exc}")
            return
        result = {"writer_pid": os.getpid(), "seconds": round(time.monotonic() - started, 3),
                  "topics": {name: st.to_dict() for name, st in stats.items()}}
        with contextlib.suppress(LogError):
            control.finish(req.id, result)

    def _background_pass(self) -> None:
        """Compact each compact-policy topic whose dirty share or tombstone clock says so, paced."""
        pacer = Pacer(_BACKGROUND_SHARE, self._stop)
        for t in [t for t in list(self._topics.values()) if t.config.compacted]:
            if self._stop.is_set():
                return
            now = _now_ms()
            dirty = t.dirty > 0 and t.dirty >= _MIN_DIRTY_RATIO * t.kept
            if not dirty and (t.next_due_ms is None or now < t.next_due_ms):
                continue
            try:
                self._compact_topic(t, now, pacer)
            except Stopped:
                return
            except UnknownTopicError:
                continue
            except Exception as exc:  # surface it, keep serving the other topics
                if self._closed:
                    return
                _log.exception("background compaction of topic %r in %s failed", t.name, self._path)
                self.background_errors.append(exc)
                t.dirty, t.next_due_ms = 0, None  # retried after the next append, not every tick
            self._serve_requests()  # a waiting `log compact` goes before the next topic
        self.compaction_runs += 1

    # --- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for t in list(self._topics.values()):
            with t.clock, t.wlock, t.rlock:
                t.close()
        with self._meta_lock, self._groups_lock:
            for conn in (getattr(self, "_meta", None), self._groups):
                if conn is not None:
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)  # no pid: nobody mistakes this process for the writer now
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
