"""The embedded log: a directory of SQLite files in WAL mode (the default backend).

`EmbeddedLog` puts the roles together, one module each: `files` (the writer lock, connections,
error mapping), `topics` (meta.db and the topic files), `append`, `read`, `groups` (committed
offsets), `compaction` (with `space` and `control`); `codec` encodes the stored batches.

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
import os
import sqlite3
import threading
from pathlib import Path
from typing import Literal

from kappaflow.errors import ConfigError, LogUnavailableError
from kappaflow.log.base import CompactionStats, Log
from kappaflow.log.embedded.append import EmbeddedAppend
from kappaflow.log.embedded.compaction import EmbeddedCompaction
from kappaflow.log.embedded.control import ControlChannel
from kappaflow.log.embedded.files import _Topic
from kappaflow.log.embedded.groups import EmbeddedGroups
from kappaflow.log.embedded.read import EmbeddedRead, RecordColumns

__all__ = ["EmbeddedLog", "RecordColumns"]


class EmbeddedLog(EmbeddedAppend, EmbeddedRead, EmbeddedGroups, EmbeddedCompaction, Log):
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
