"""On-demand snapshots of a running capture: the request channel and the progress kept with the offsets.

Why a channel: `kappaflow snapshot SOURCE --tables ...` runs in another process than the capture,
often while the capture holds the embedded log's writer lock, so the request cannot be appended to
the offsets topic by the CLI. The channel is durable and writable by any process:

* embedded log: ``ondemand.db`` in the log's directory (SQLite, WAL; like ``groups.db`` and
  ``control.db``, any process may write it, so it never contends with the log's appends);
* any other log (Kafka): the compacted topic ``_kappaflow_requests`` (one partition), which any
  client may append to.

Requests are numbered (``seq``) in the order they were submitted. The capture polls the channel once
per loop turn (cheap: ``PRAGMA data_version`` / the topic's end offset), applies every request after
the last one it applied, and stores that number in its offset (:class:`OnDemandState` ``seq``), in
the same offset record as the snapshot's progress. A kill -9 therefore either lost the request's
effect and the offset together (the request is applied again on restart) or kept both: each request
takes effect exactly once.

The capture also writes a *beat* (pid, time, live progress) to the channel every few seconds: the
CLI refuses a request for a source nobody is capturing, and shows live rows/s and ETA.
"""

from __future__ import annotations

import abc
import contextlib
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from kappaflow.errors import LogError, ValidationError
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig

__all__ = [
    "ACTIONS",
    "BEAT_INTERVAL_S",
    "REQUESTS_TOPIC",
    "OnDemandState",
    "RequestChannel",
    "SnapshotRequest",
    "TableRun",
    "channel_for",
    "progress_view",
]

REQUESTS_TOPIC = "_kappaflow_requests"
BEAT_INTERVAL_S = 2.0
ALIVE_S = 15.0  # a beat older than this: the capture is not running
ACTIONS = ("start", "pause", "resume", "stop", "add_table", "remove_table")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class SnapshotRequest:
    """One request to the running capture of ``source``."""

    seq: int
    source: str
    action: str  # one of ACTIONS
    tables: tuple[str, ...] = ()
    where: str | None = None
    requested_ms: int = 0

    def body(self) -> dict[str, Any]:
        return {"source": self.source, "action": self.action, "tables": list(self.tables), "where": self.where,
                "requested_ms": self.requested_ms, "id": uuid.uuid4().hex}

    @classmethod
    def from_body(cls, seq: int, d: Mapping[str, Any]) -> SnapshotRequest:
        action = str(d.get("action"))
        if action not in ACTIONS:
            raise ValidationError(f"on-demand request {seq}: action: expected one of {', '.join(ACTIONS)}, "
                                  f"got {action!r}")
        where = d.get("where")
        return cls(seq, str(d.get("source")), action, tuple(str(t) for t in d.get("tables") or ()),
                   None if where is None else str(where), int(d.get("requested_ms") or 0))


class RequestChannel(abc.ABC):
    """Submit requests (any process), read them and beat (the capture). See the module docstring."""

    @abc.abstractmethod
    def submit(self, source: str, action: str, tables: list[str] | tuple[str, ...] = (),
               where: str | None = None) -> int:
        """Store a request for ``source``; its number (the order requests are applied in)."""

    @abc.abstractmethod
    def since(self, source: str, seq: int) -> list[SnapshotRequest]:
        """Requests for ``source`` numbered above ``seq``, in order."""

    @abc.abstractmethod
    def beat(self, source: str, status: Mapping[str, Any]) -> None:
        """The capture's heartbeat with its live progress (pid and time added)."""

    @abc.abstractmethod
    def last_beat(self, source: str) -> dict[str, Any] | None:
        """The newest beat of ``source``, or None."""

    def alive(self, source: str, *, within_s: float = ALIVE_S) -> dict[str, Any] | None:
        """The capture's last beat when it is recent (the capture runs), else None."""
        beat = self.last_beat(source)
        if beat is None or beat.get("stopped") or _now_ms() - int(beat.get("ts_ms", 0)) > within_s * 1000:
            return None
        return beat

    def close(self) -> None:  # noqa: B027 -- optional hook: a channel with nothing to release keeps it
        """Release what the channel holds (a connection, a consumer)."""


class FileChannel(RequestChannel):
    """``ondemand.db`` in an embedded log's directory (any process may write it)."""

    def __init__(self, log_dir: Path) -> None:
        self.path = Path(log_dir) / "ondemand.db"
        self._lock = threading.Lock()
        self._version = -1
        try:
            conn = sqlite3.connect(f"file:{quote(str(self.path))}?mode=rwc", uri=True, isolation_level=None,
                                   check_same_thread=False, timeout=30.0)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE IF NOT EXISTS requests(seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "source TEXT NOT NULL, body TEXT NOT NULL)")
            conn.execute("CREATE TABLE IF NOT EXISTS beats(source TEXT PRIMARY KEY, body TEXT NOT NULL)")
        except sqlite3.Error as exc:
            raise LogError(f"on-demand request file {self.path}: {exc}") from None
        self._conn = conn

    def _run(self, q: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            try:
                return self._conn.execute(q, args).fetchall()
            except sqlite3.Error as exc:
                raise LogError(f"on-demand request file {self.path}: {exc}") from None

    def submit(self, source: str, action: str, tables: list[str] | tuple[str, ...] = (),
               where: str | None = None) -> int:
        body = SnapshotRequest(0, source, action, tuple(tables), where, _now_ms()).body()
        rows = self._run("INSERT INTO requests(source, body) VALUES (?, ?) RETURNING seq",
                         (source, orjson.dumps(body).decode()))
        return int(rows[0][0])

    def since(self, source: str, seq: int) -> list[SnapshotRequest]:
        rows = self._run("SELECT seq, body FROM requests WHERE source = ? AND seq > ? ORDER BY seq", (source, seq))
        return [SnapshotRequest.from_body(int(s), orjson.loads(b)) for s, b in rows]

    def changed(self) -> bool:
        """Has another connection written the file since the last call? (no table read)"""
        version = self._run("PRAGMA data_version")[0][0]
        if version == self._version:
            return False
        self._version = version
        return True

    def beat(self, source: str, status: Mapping[str, Any]) -> None:
        body = orjson.dumps({**status, "pid": os.getpid(), "ts_ms": _now_ms()}).decode()
        self._run("INSERT INTO beats VALUES (?, ?) ON CONFLICT (source) DO UPDATE SET body = excluded.body",
                  (source, body))  # our own write leaves `changed` as it was (data_version counts others')

    def last_beat(self, source: str) -> dict[str, Any] | None:
        rows = self._run("SELECT body FROM beats WHERE source = ?", (source,))
        return orjson.loads(rows[0][0]) if rows else None

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._conn.close()


class TopicChannel(RequestChannel):
    """The compacted topic ``_kappaflow_requests`` (logs any client may append to, e.g. Kafka)."""

    def __init__(self, log: Log, topic: str = REQUESTS_TOPIC) -> None:
        self.log = log
        self.topic = topic
        # per source: the topic offset scanned up to and the requests found below it (each record is read once)
        self._cursor: dict[str, int] = {}
        self._found: dict[str, list[SnapshotRequest]] = {}
        if topic not in log.list_topics():
            log.create_topic(topic, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT), exist_ok=True)

    def submit(self, source: str, action: str, tables: list[str] | tuple[str, ...] = (),
               where: str | None = None) -> int:
        body = SnapshotRequest(0, source, action, tuple(tables), where, _now_ms()).body()
        key = orjson.dumps({"request": body["id"]})
        appended = self.log.append(self.topic, [Record(key, orjson.dumps(body))], partition=0)
        return int(appended[0].offset) + 1  # seq = offset + 1: numbers start at 1

    def since(self, source: str, seq: int) -> list[SnapshotRequest]:
        found = self._found.setdefault(source, [])
        end = self.log.end_offset(self.topic, 0)
        start = self._cursor.get(source, 0)
        if end > start:
            for rec in self.log.iter_partition(self.topic, 0, start, end):
                if rec.value is None:
                    continue
                d = orjson.loads(rec.value)
                if isinstance(d, dict) and "action" in d and d.get("source") == source:
                    found.append(SnapshotRequest.from_body(rec.offset + 1, d))
            self._cursor[source] = end
        return [r for r in found if r.seq > seq]

    def beat(self, source: str, status: Mapping[str, Any]) -> None:
        body = {**status, "pid": os.getpid(), "ts_ms": _now_ms(), "beat": source}
        self.log.append(self.topic, [Record(orjson.dumps({"beat": source}), orjson.dumps(body))], partition=0)

    def last_beat(self, source: str) -> dict[str, Any] | None:
        from kappaflow.connectors.offsets import find_last

        key = orjson.dumps({"beat": source})
        rec = find_last(self.log, self.topic, 0, lambda r: r.key == key)
        return None if rec is None or rec.value is None else orjson.loads(rec.value)


def channel_for(log: Log) -> RequestChannel:
    """The request channel of the log's deployment (see the module docstring)."""
    path = getattr(log, "_path", None)
    if path is not None and (Path(path) / "meta.db").exists():
        return FileChannel(Path(path))
    return TopicChannel(log)


# -- progress, stored in the capture's offset ------------------------------------------------------

@dataclass
class TableRun:
    """One table of an on-demand snapshot: its filter and how far the chunks got."""

    table: str
    where: str | None = None
    last_key: Any = None  # the connector's text form of the last key read (None: from the start)
    rows: int = 0  # rows written as op=r
    dropped: int = 0  # chunk rows left out because the stream changed the key in the window
    chunks: int = 0
    done: bool = False
    estimate: int = 0  # the server's row estimate, for the ETA

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "where": self.where, "last_key": self.last_key, "rows": self.rows,
                "dropped": self.dropped, "chunks": self.chunks, "done": self.done, "estimate": self.estimate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TableRun:
        return cls(str(d["table"]), d.get("where"), d.get("last_key"), int(d.get("rows", 0)),
                   int(d.get("dropped", 0)), int(d.get("chunks", 0)), bool(d.get("done", False)),
                   int(d.get("estimate", 0)))


@dataclass
class OnDemandState:
    """The on-demand snapshot state a capture keeps in its offset (``offset.ondemand``).

    ``seq``: the last request applied (exactly-once application, see the module docstring).
    ``state``: idle | running | paused | stopped | done. ``tables``: the queue, in order.
    ``active_s``: seconds spent running (pauses excluded), for rows/s and the ETA.
    """

    seq: int = 0
    state: str = "idle"
    tables: list[TableRun] = field(default_factory=list)
    active_s: float = 0.0
    started_ms: int = 0
    finished_ms: int = 0
    removed: list[str] = field(default_factory=list)  # tables removed from capture by remove-table
    added: list[str] = field(default_factory=list)  # tables added to capture by add-table
    # the next snapshot row number (MySQL positions (H, snapshot, n): two chunks may share H)
    next_index: int = 0
    error: str = ""  # why the capture stopped the snapshot itself (a chunk query failed), else ""

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "state": self.state, "tables": [t.to_dict() for t in self.tables],
                "active_s": round(self.active_s, 3), "started_ms": self.started_ms, "finished_ms": self.finished_ms,
                "removed": list(self.removed), "added": list(self.added), "next_index": self.next_index,
                "error": self.error}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> OnDemandState:
        if not d:
            return cls()
        try:
            return cls(int(d.get("seq", 0)), str(d.get("state", "idle")),
                       [TableRun.from_dict(t) for t in d.get("tables") or ()], float(d.get("active_s", 0.0)),
                       int(d.get("started_ms", 0)), int(d.get("finished_ms", 0)),
                       [str(t) for t in d.get("removed") or ()], [str(t) for t in d.get("added") or ()],
                       int(d.get("next_index", 0)), str(d.get("error") or ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError(f"offset.ondemand: malformed on-demand snapshot state ({exc}); expected the dict "
                                  "written by OnDemandState.to_dict") from None

    @property
    def current(self) -> TableRun | None:
        return next((t for t in self.tables if not t.done), None)

    @property
    def active(self) -> bool:
        return self.state in ("running", "paused") and self.current is not None

    def apply(self, req: SnapshotRequest) -> str:
        """Apply a start / pause / resume / stop request; a line saying what happened."""
        self.seq = max(self.seq, req.seq)
        if req.action in ("start", "add_table"):
            queued = {t.table for t in self.tables if not t.done} if self.active else set()
            if not self.active:
                self.error = ""
                self.tables = [t for t in self.tables if not t.done] if self.state == "paused" else []
                self.active_s = 0.0
                self.started_ms = _now_ms()
                self.finished_ms = 0
            for name in req.tables:
                if name not in queued:
                    self.tables.append(TableRun(name, req.where))
            if self.state != "paused":
                self.state = "running"
            return f"on-demand snapshot of {', '.join(req.tables)} queued (request {req.seq})"
        if req.action == "pause":
            if self.state == "running":
                self.state = "paused"
            return f"on-demand snapshot {self.state} (request {req.seq})"
        if req.action == "resume":
            if self.state == "paused":
                self.state = "running" if self.current is not None else "done"
            return f"on-demand snapshot {self.state} (request {req.seq})"
        if req.action == "stop":
            if self.state in ("running", "paused"):
                self.state = "stopped"
                self.finished_ms = _now_ms()
            return f"on-demand snapshot {self.state} (request {req.seq})"
        return ""

    def finish_if_done(self) -> None:
        if self.state == "running" and self.current is None:
            self.state = "done"
            self.finished_ms = _now_ms()


def progress_view(state: OnDemandState | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Rows, rows/s and ETA of an on-demand snapshot, for the CLI, `source status` and the metrics."""
    if state is None:
        return None
    st = state if isinstance(state, OnDemandState) else OnDemandState.from_dict(state)
    if st.state == "idle" and not st.tables:
        return None
    rows = sum(t.rows for t in st.tables)
    rate = rows / st.active_s if st.active_s > 0 else None
    remaining = sum(max(0, t.estimate - t.rows - t.dropped) for t in st.tables if not t.done)
    eta = remaining / rate if rate and st.state in ("running", "paused") else (0.0 if st.state == "done" else None)
    return {
        "state": st.state, "rows": rows, "rows_per_s": None if rate is None else round(rate, 1),
        "eta_s": None if eta is None else round(eta, 1), "active_s": round(st.active_s, 3),
        "tables": {t.table: {"rows": t.rows, "estimate": t.estimate, "chunks": t.chunks, "dropped": t.dropped,
                             "done": t.done, "where": t.where} for t in st.tables},
        "current": None if st.current is None else st.current.table,
        **({"error": st.error} if st.error else {}),
    }
