"""Asking the running writer of an embedded log to compact (``control.db``).

Why: only the writer process may compact (it holds ``writer.lock`` and the topic files'
write connections), and while a capture runs the writer *is* the capture. So
``kappaflow log compact`` does not open the log for writing; it leaves a request here, the
writer's maintenance thread (every writer has one) notices it (``PRAGMA data_version``: a
cheap check of whether another connection wrote the file), compacts, and writes the result
back, which the requester prints.

Any process may write this file (like ``groups.db``), so it never contends with appends.
A request a writer took but did not finish (the writer died) is taken again by the next
writer: compaction is idempotent. Finished requests are removed after a day.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from kappaflow.errors import LogError, LogUnavailableError, Retry

__all__ = ["CompactionReport", "CompactionRequest", "ControlChannel", "RequestState", "compact_embedded", "writer_pid"]

_BUSY_TIMEOUT_S = 30.0
_KEEP_DONE_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class CompactionRequest:
    """One request: a topic (None: every compacted topic) and whether a full VACUUM may run."""

    id: int
    topic: str | None
    full_vacuum: bool


@dataclass(frozen=True, slots=True)
class RequestState:
    """Where a request is: ``pending``, ``running``, ``done`` (``result`` set) or ``failed`` (``error``)."""

    id: int
    state: str
    writer_pid: int | None
    result: dict[str, Any] | None
    error: str | None


def writer_pid(log_dir: Path) -> int | None:
    """The pid the writer wrote into ``writer.lock`` if that process is alive, else None.

    Reads the file without taking the lock, so asking never gets in the way of a writer
    starting at the same moment.
    """
    try:
        text = (log_dir / "writer.lock").read_text().strip()
        pid = int(text)
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


class ControlChannel:
    """The request table; the writer uses ``take``/``finish``/``fail``, any process ``submit``/``state``."""

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / "control.db"
        self._lock = threading.Lock()
        self._version = -1
        try:
            conn = sqlite3.connect(f"file:{quote(str(self.path))}?mode=rwc", uri=True, isolation_level=None,
                                   check_same_thread=False, timeout=_BUSY_TIMEOUT_S)
        except sqlite3.OperationalError as exc:
            raise LogUnavailableError(f"cannot open {self.path}: {exc}") from None
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS requests(id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT, "
                "full_vacuum INTEGER NOT NULL, requested_ms INTEGER NOT NULL, requester_pid INTEGER NOT NULL, "
                "state TEXT NOT NULL, writer_pid INTEGER, done_ms INTEGER, result TEXT, error TEXT)")
        except sqlite3.Error as exc:
            conn.close()
            raise LogError(f"embedded log control file {self.path}: {exc}") from None
        self._conn = conn

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._conn.close()

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise LogError(f"embedded log control file {self.path}: {exc}") from None

    # --- any process ---------------------------------------------------------------------
    def submit(self, topic: str | None, *, full_vacuum: bool = False) -> int:
        rows = self._run(
            "INSERT INTO requests(topic, full_vacuum, requested_ms, requester_pid, state) "
            "VALUES (?, ?, ?, ?, 'pending') RETURNING id",
            (topic, int(full_vacuum), time.time_ns() // 1_000_000, os.getpid()))
        return int(rows[0][0])

    def state(self, request_id: int) -> RequestState:
        rows = self._run("SELECT state, writer_pid, result, error FROM requests WHERE id = ?", (request_id,))
        if not rows:
            raise LogError(f"embedded log control file {self.path}: no request {request_id}")
        state, pid, result, error = rows[0]
        return RequestState(request_id, state, pid, orjson.loads(result) if result else None, error)

    # --- the writer ----------------------------------------------------------------------
    def changed(self) -> bool:
        """Has another connection written the file since the last call? (cheap: no table read)"""
        version = self._run("PRAGMA data_version")[0][0]
        if version == self._version:
            return False
        self._version = version
        return True

    def take(self) -> list[CompactionRequest]:
        """Requests to run now, marked running by this process (unfinished ones of a dead writer included)."""
        pid = os.getpid()
        rows = self._run(
            "UPDATE requests SET state = 'running', writer_pid = ? WHERE state = 'pending' OR "
            "(state = 'running' AND writer_pid IS NOT ?) RETURNING id, topic, full_vacuum", (pid, pid))
        return [CompactionRequest(int(i), t, bool(v)) for i, t, v in sorted(rows)]

    def finish(self, request_id: int, result: dict[str, Any]) -> None:
        self._run("UPDATE requests SET state = 'done', done_ms = ?, result = ? WHERE id = ?",
                  (time.time_ns() // 1_000_000, orjson.dumps(result).decode(), request_id))

    def requeue(self, request_id: int) -> None:
        """Back to pending (the writer is closing): the next writer runs it."""
        self._run("UPDATE requests SET state = 'pending', writer_pid = NULL WHERE id = ?", (request_id,))

    def fail(self, request_id: int, error: str) -> None:
        self._run("UPDATE requests SET state = 'failed', done_ms = ?, error = ? WHERE id = ?",
                  (time.time_ns() // 1_000_000, error, request_id))

    def prune(self) -> None:
        self._run("DELETE FROM requests WHERE done_ms IS NOT NULL AND done_ms < ?",
                  (time.time_ns() // 1_000_000 - _KEEP_DONE_MS,))


@dataclass(frozen=True, slots=True)
class CompactionReport:
    """What `compact_embedded` did: who compacted (None: this process), per-topic stats, time taken."""

    writer_pid: int | None
    topics: dict[str, Any]  # topic -> CompactionStats.to_dict()
    seconds: float


def compact_embedded(log_dir: Path, topic: str | None, *, open_writer: Callable[[], Any], timeout_s: float = 600.0,
                     poll_s: float = 0.1) -> CompactionReport:
    """Compact an embedded log now, whoever writes it, and give the space back (full VACUUM allowed).

    No writer running: this process opens the log for writing and compacts. A writer
    running (a capture): the request goes to it through ``control.db`` and this waits for
    its result; if that writer exits before answering, this process becomes the writer and
    its own maintenance thread runs the request. ``open_writer`` opens the log as its
    writer (with the configuration's options).
    """
    started = time.monotonic()
    try:
        log = open_writer()
    except LogUnavailableError:
        if writer_pid(log_dir) is None:
            raise
    else:
        with log:
            stats = log.compact_all(topic, full_vacuum=True)
        return CompactionReport(None, {n: s.to_dict() for n, s in stats.items()}, time.monotonic() - started)
    channel = ControlChannel(log_dir)
    own: Any = None
    try:
        request = channel.submit(topic, full_vacuum=True)
        deadline = time.monotonic() + timeout_s
        while True:
            st = channel.state(request)
            if st.state == "done" and st.result is not None:
                pid = None if st.writer_pid == os.getpid() else st.writer_pid
                return CompactionReport(pid, st.result["topics"], time.monotonic() - started)
            if st.state == "failed":
                who = f"the running writer (pid {st.writer_pid})" if st.writer_pid != os.getpid() else "compaction"
                raise LogError(f"{who} could not compact {topic or 'the log'}: {st.error}")
            if own is None and writer_pid(log_dir) is None:
                with contextlib.suppress(LogUnavailableError):  # another writer got there first: it will answer
                    own = open_writer()  # its maintenance thread takes the request
            if time.monotonic() > deadline:
                holder = writer_pid(log_dir)
                raise LogError(
                    f"the writer of {log_dir} (pid {holder}) has not finished compacting within {timeout_s:.0f} s; "
                    f"the request (id {request}) stays queued and the writer runs it; run `kappaflow log compact` "
                    "again later to see the result", retry=Retry.TRANSIENT)
            time.sleep(poll_s)
    finally:
        if own is not None:
            own.close()
        channel.close()
