"""The ledger store: atomic multi-stream appends with optimistic concurrency, reads.

Gap-safe order (why positions are assigned under one lock)
----------------------------------------------------------
Every append runs one server-side body (the function ``<schema>.append(...)``, or the procedure
``<schema>.append_durable(...)`` with group commit, below) in one transaction:

1. idempotency key: a committed append with the key returns its result;
2. streams: upsert every touched stream in id order, bumping its version (row locks in a fixed
   order, so multi-stream appends cannot deadlock each other), then check expected versions;
3. payloads are parsed and content digests computed, the idempotency key is inserted (a
   concurrent append with the same key waits here) -- all of this runs concurrently;
4. LAST, a transaction-scoped advisory lock (one key per ledger schema) is taken; the head is the
   last committed event (read after the lock, so with a fresh snapshot); positions head+1..head+n
   are assigned, the hash chain is extended, events are inserted. The lock is held until COMMIT,
   and PostgreSQL makes a transaction visible before it releases its locks, so the next appender
   can only take positions after the previous one is visible. The lock is taken by "barging"
   (try; while busy sleep 1 ms and try again, queue after 20 tries): a queued waiter is granted
   the lock at release and holds it while it is being woken up, which on a busy machine takes
   longer than the critical section itself (a lock convoy: half the throughput at 8 writers).

Hence positions are dense (no sequence, no holes from rollbacks) and in commit order: a reader
that has seen position p has seen every position < p, and ``WHERE position > last`` never skips
an event that commits late. The alternative -- sequence positions plus readers that stop below
the oldest in-flight transaction (pg_snapshot_xmin, as Marten/eventsourcing do) -- allows more
parallel commits but cannot extend a hash chain at append time, because the predecessor of an
event is not known until older transactions finish. The serial section here is only step 4
(a few index inserts) plus the commit; everything else runs in parallel.

Group commit (default). With a synchronous commit the lock would be held across the WAL fsync,
capping throughput at one append per fsync (~3-5 ms on a virtual disk). So the append
transaction commits with ``synchronous_commit = off`` (the lock is released as soon as the commit
record is in the WAL buffers, still in position order), then a tiny synchronous "barrier"
transaction (upsert of the session's row in ``durability_barrier``) commits before the client
gets its answer: its flush covers the append's commit record, and concurrent writers share
fsyncs. Both run in one round trip: the procedure ``<schema>.append_durable`` commits twice.
An acknowledged append is therefore as durable as with synchronous commit. The price: other
sessions may *see* an append a moment before it is flushed; if the server crashed in that
window, the append would vanish (the writer got no acknowledgement and retries with its
idempotency key). Logical decoding (the connector) only ships flushed WAL, and `TailReader`
runs a barrier before delivering, so nothing downstream sees an event that can vanish.
``group_commit=False`` restores plain synchronous commits.

Appends inside a caller's transaction (``connection=``) hold the ledger lock until that
transaction ends (keep it short), use the caller's commit settings, and need READ COMMITTED.
"""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from kappaflow.ledger.connection import ConnectionPool, configure_connection
from kappaflow.ledger.errors import (
    AppendConditionFailedError,
    IdempotencyKeyReusedError,
    ImmutableLedgerError,
    InvalidAppendError,
    LedgerNotInstalledError,
    LedgerUnavailableError,
    StreamTypeMismatchError,
    WrongExpectedVersionError,
)
from kappaflow.ledger.events import (
    DEFAULT_MAX_EVENT_BYTES,
    EventRegistry,
    ExpectedVersion,
    RecordedEvent,
    check_identifier,
    encode_event,
    parse_expected_version,
    stream_category,
)
from kappaflow.ledger.query import AppendCondition, Query, QueryResult
from kappaflow.ledger.schema import DEFAULT_SCHEMA, LedgerTables

if TYPE_CHECKING:
    from kappaflow.ledger.snapshots import Fold, Loaded

S = TypeVar("S")
_DEADLOCK_RETRIES = 5

# What a read returns, in this order (+ "hash" when asked for).
EVENT_COLUMNS = ("position", "stream_id", "stream_type", "stream_version", "event_type", "schema_version",
                 "payload", "metadata", "recorded_at", "idempotency_key", "tags")


@dataclass(frozen=True, slots=True)
class StreamAppend:
    """One stream's part of an atomic (possibly multi-stream) append."""

    stream_id: str
    events: Sequence[Any]
    expected_version: int | ExpectedVersion | str = ExpectedVersion.ANY
    stream_type: str | None = None  # default: the stream id's category ("account-7" -> "account")


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Where an append landed. `position` is the global position of its last event."""

    first_position: int
    position: int
    versions: dict[str, int]
    recorded_at: dt.datetime
    duplicate: bool = False  # the idempotency key matched an earlier append; nothing was written


@dataclass(frozen=True, slots=True)
class Head:
    position: int
    hash: bytes
    recorded_at: dt.datetime | None


@dataclass(frozen=True, slots=True)
class LedgerStats:
    head_position: int
    head_hash: str
    streams: int
    events_by_stream_type: dict[str, int] = field(default_factory=dict)
    idempotency_keys: int = 0
    first_recorded_at: str | None = None
    last_recorded_at: str | None = None
    table_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "head_position": self.head_position, "head_hash": self.head_hash, "streams": self.streams,
            "events": sum(self.events_by_stream_type.values()),
            "events_by_stream_type": self.events_by_stream_type, "idempotency_keys": self.idempotency_keys,
            "first_recorded_at": self.first_recorded_at, "last_recorded_at": self.last_recorded_at,
            "table_bytes": self.table_bytes,
        }


class Ledger:
    """An append-only, hash-chained event store in PostgreSQL.

    Thread-safe: appends and reads borrow connections from an internal pool.
    """

    def __init__(self, dsn: str, *, schema: str = DEFAULT_SCHEMA, registry: EventRegistry | None = None,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES, pool_size: int = 8,
                 connect_timeout: float = 10.0, group_commit: bool = True,
                 snapshot_every: Mapping[str, int] | None = None) -> None:
        from kappaflow.errors import ConfigError

        if not isinstance(max_event_bytes, int) or max_event_bytes < 1:
            raise ConfigError(f"ledger max_event_bytes: expected an integer >= 1, got {max_event_bytes!r}")
        self.dsn = dsn
        self.tables = LedgerTables(schema)
        self.registry = registry
        self.max_event_bytes = max_event_bytes
        self.group_commit = group_commit
        self._pool = ConnectionPool(dsn, max_size=pool_size, connect_timeout=connect_timeout)
        from kappaflow.ledger.personal import KeyStore
        from kappaflow.ledger.snapshots import Snapshots

        self.snapshots = Snapshots(self, snapshot_every)
        self.keys = KeyStore(self.connection, schema)
        self._cursors: weakref.WeakKeyDictionary[psycopg.Connection, psycopg.Cursor[Any]] = \
            weakref.WeakKeyDictionary()
        t = self.tables
        self._append_sql: Any = sql.SQL(
            "select first_position, last_position, stream_ids, versions, recorded_at, duplicate, conflict "
            "from {fn}(%s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::int[], %s::text[], "
            "%s::int[], %s::text[], %s::text[], %s::text[], %s::text, %s::bytea, %s::jsonb, %s::bigint, "
            "%s::boolean)"
        ).format(fn=t.append_fn)
        # Group commit: the append and its durability barrier in one round trip (a procedure
        # that commits twice; see the migrations).
        self._append_durable_sql: Any = sql.SQL(
            "call {fn}(%s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::int[], %s::text[], "
            "%s::int[], %s::text[], %s::text[], %s::text[], %s::text, %s::bytea, %s::jsonb, %s::bigint, "
            "null, null, null, null, null, null, null)"
        ).format(fn=t.table("append_durable"))
        self._barrier_sql: Any = sql.SQL(
            "insert into {} as b (pid, n) values (pg_backend_pid(), 1) "
            "on conflict (pid) do update set n = b.n + 1").format(t.table("durability_barrier"))
        # JSON columns as text: orjson parses them in `_records` (psycopg's jsonb loader is a Python
        # call per value; the server renders jsonb as text either way). The hash only when asked.
        def cols(hashes: bool) -> sql.Composable:
            names = EVENT_COLUMNS + (("hash",) if hashes else ())
            return sql.SQL(", ").join(
                sql.SQL("e.{}::text").format(sql.Identifier(c)) if c in ("payload", "metadata")
                else sql.SQL("e.{}").format(sql.Identifier(c)) for c in names)

        self._cols = cols
        self._reads: dict[tuple[str, bool], bytes] = {}
        self._query_sql: dict[tuple[tuple[int, bool], ...], bytes] = {}
        for h in (False, True):
            # Rendered once: composing identifiers on every call costs more than the round trip.
            self._reads["stream", h] = sql.SQL(
                "select {cols} from {events} e where stream_id = %s and stream_version >= %s "
                "order by stream_version limit %s").format(cols=cols(h), events=t.events).as_bytes(None)
            self._reads["all", h] = sql.SQL(
                "select {cols} from {events} e where position >= %s order by position limit %s"
            ).format(cols=cols(h), events=t.events).as_bytes(None)
            self._reads["types", h] = sql.SQL(
                "select {cols} from {events} e where position >= %s and stream_type = any(%s::text[]) "
                "order by position limit %s").format(cols=cols(h), events=t.events).as_bytes(None)
        # Only what folding an aggregate needs (see `load_events`).
        self._load_sql: Any = sql.SQL(
            "select stream_version, event_type, schema_version, payload::text, position from {events} "
            "where stream_id = %s and stream_version >= %s order by stream_version").format(
            events=t.events).as_bytes(None)
        self._append_sql = self._append_sql.as_bytes(None)
        self._append_durable_sql = self._append_durable_sql.as_bytes(None)
        self._barrier_sql = self._barrier_sql.as_bytes(None)

    # --- lifecycle ----------------------------------------------------------
    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """Borrow a pooled autocommit connection (mapped errors)."""
        with self._pool.connection() as conn, self._mapped_errors():
            yield conn

    # --- append -------------------------------------------------------------
    def append(self, stream_id: str, events: Sequence[Any],
               expected_version: int | ExpectedVersion | str = ExpectedVersion.ANY, *,
               stream_type: str | None = None, idempotency_key: str | None = None,
               metadata: Mapping[str, Any] | None = None, condition: AppendCondition | None = None,
               connection: psycopg.Connection | None = None) -> AppendResult:
        """Append events to one stream; see `append_many`."""
        return self.append_many([StreamAppend(stream_id, events, expected_version, stream_type)],
                                idempotency_key=idempotency_key, metadata=metadata, condition=condition,
                                connection=connection)

    def append_many(self, parts: Sequence[StreamAppend], *, idempotency_key: str | None = None,
                    metadata: Mapping[str, Any] | None = None, condition: AppendCondition | None = None,
                    connection: psycopg.Connection | None = None) -> AppendResult:
        """Append to several streams in one commit: all events or none.

        Each part carries its own expected version; the first mismatch raises
        `WrongExpectedVersionError` and nothing is written. `condition` (`AppendCondition`, usually
        ``ledger.read_query(q).condition``) fails the append with `AppendConditionFailedError` if an
        event matching its query was appended after its position. Both are conflicts the server
        reports as a result, not as an error. With `idempotency_key`, a repeat of the same request
        returns the original result (``duplicate=True``) and writes nothing; the same key with a
        different request raises `IdempotencyKeyReusedError`. `metadata` is merged into every
        event's metadata. With `connection`, the append runs inside the caller's open transaction
        (committed by the caller; after a conflict the transaction is still usable: the append
        took back what it wrote).
        """
        params = self._build_params(parts, idempotency_key, metadata, condition)
        if connection is not None:
            with self._mapped_errors():
                row = connection.execute(self._append_sql, (*params, False)).fetchone()
            return _result(row, condition)
        if self.group_commit:
            query, args = self._append_durable_sql, params
        else:
            query, args = self._append_sql, (*params, False)
        for attempt in range(_DEADLOCK_RETRIES):
            try:
                return _result(self._fetch(query, args, one=True), condition)
            except _Retryable:
                if attempt == _DEADLOCK_RETRIES - 1:
                    raise LedgerUnavailableError("append kept deadlocking; giving up") from None
                time.sleep(0.001 * (2 ** attempt))
        raise AssertionError("unreachable")

    def _build_params(self, parts: Sequence[StreamAppend], key: str | None,
                      metadata: Mapping[str, Any] | None, condition: AppendCondition | None) -> tuple[Any, ...]:
        if isinstance(parts, StreamAppend) or not isinstance(parts, Sequence) or not parts:
            raise InvalidAppendError("expected a non-empty list of StreamAppend", field="parts")
        if key is not None:
            check_identifier(key, field="idempotency_key")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise InvalidAppendError(f"expected a mapping, got {type(metadata).__name__}", field="metadata")
        streams: list[tuple[str, str, int, int]] = []  # (id, type, expected, count) in input order
        ev_stream: list[int] = []
        ev_types: list[str] = []
        ev_schema: list[int] = []
        payloads: list[str] = []
        metas: list[str] = []
        tags: list[tuple[str, ...]] = []
        seen: set[str] = set()
        registry, limit = self.registry, self.max_event_bytes
        subject_keys: dict[str, bytes] = {}

        def key_for(subject: str) -> bytes:  # personal fields: the subject's key, once per append
            key = subject_keys.get(subject)
            if key is None:
                key = subject_keys[subject] = self.keys.key_for_write(subject, field="events")
            return key

        for si, part in enumerate(parts):
            if not isinstance(part, StreamAppend):
                raise InvalidAppendError(f"expected a StreamAppend, got {type(part).__name__}",
                                         field=f"parts[{si}]")
            sid = check_identifier(part.stream_id, field="stream_id")
            if sid in seen:
                raise InvalidAppendError(f"stream {sid!r} appears twice in one append; merge its events",
                                         field="stream_id")
            seen.add(sid)
            stype = part.stream_type if part.stream_type is not None else stream_category(sid)
            check_identifier(stype, field=f"stream_type (stream {sid!r})")
            exp = parse_expected_version(part.expected_version, field=f"expected_version (stream {sid!r})")
            evs = part.events
            if isinstance(evs, str | bytes) or not isinstance(evs, Sequence) or not evs:
                raise InvalidAppendError("expected a non-empty list of events", field=f"events (stream {sid!r})")
            prefix = "events" if len(parts) == 1 else f"parts[{si}].events"
            for ei, ev in enumerate(evs):
                enc = encode_event(ev, field=f"{prefix}[{ei}]", registry=registry,
                                   common_metadata=metadata, max_bytes=limit, key_for=key_for)
                ev_stream.append(si)
                ev_types.append(enc.type)
                ev_schema.append(enc.schema_version)
                payloads.append(enc.payload)
                metas.append(enc.metadata)
                tags.append(enc.tags)
            streams.append((sid, stype, exp, len(evs)))
        # The database locks streams in array order: send them sorted by id (no deadlocks).
        order = sorted(range(len(streams)), key=lambda k: streams[k][0])
        rank = {old: new + 1 for new, old in enumerate(order)}
        stream_ids = [streams[k][0] for k in order]
        stream_types = [streams[k][1] for k in order]
        expected = [streams[k][2] for k in order]
        counts = [streams[k][3] for k in order]
        ev_stream = [rank[k] for k in ev_stream]
        tagged = any(tags)
        request_hash: bytes | None = None
        if key is not None:
            # What is written, not the expected versions (nor the condition): a retry after an
            # unknown outcome may re-read and send newer expectations; it is still the same request.
            written: list[Any] = [stream_ids, stream_types, ev_stream, ev_types, ev_schema, payloads, metas]
            if tagged:
                written.append(tags)
            request_hash = hashlib.sha256(orjson.dumps(written)).digest()
        if condition is not None and not isinstance(condition, AppendCondition):
            raise InvalidAppendError(f"expected an AppendCondition, got {type(condition).__name__}",
                                     field="condition")
        # Array parameters go as PostgreSQL array literals: building them here costs a fraction
        # of psycopg's generic list dumping (a third of an append's client CPU).
        return (_text_array(stream_ids), _text_array(stream_types), _int_array(expected), _int_array(counts),
                _int_array(ev_stream), _text_array(ev_types), _int_array(ev_schema), _text_array(payloads),
                _text_array(metas),
                _nullable_text_array([_text_array(list(t)) if t else None for t in tags]) if tagged else None,
                key, request_hash,
                None if condition is None else condition.query.to_json().decode(),
                None if condition is None else condition.after)

    def idempotent_result(self, idempotency_key: str) -> AppendResult | None:
        """The result of the committed append that used `idempotency_key`, or None."""
        check_identifier(idempotency_key, field="idempotency_key")
        t = self.tables
        with self.connection() as conn:
            row = conn.execute(sql.SQL(
                "select f.position, f.position + k.events - 1, array_agg(e.stream_id order by e.stream_id), "
                "array_agg(e.v order by e.stream_id), min(e.at), true from {keys} k "
                "join {events} f on f.stream_id = k.stream_id and f.stream_version = k.stream_version "
                "join lateral (select stream_id, max(stream_version) as v, min(recorded_at) as at from {events} "
                "where position between f.position and f.position + k.events - 1 group by stream_id) e on true "
                "where k.key = %s group by f.position, k.events").format(
                keys=t.idempotency_keys, events=t.events), (idempotency_key,)).fetchone()
        return _result(row) if row is not None else None

    # --- read ---------------------------------------------------------------
    def read_stream(self, stream_id: str, *, from_version: int = 1, limit: int | None = None,
                    decode: bool = True, hashes: bool = False, reveal: bool = True) -> list[RecordedEvent]:
        """Events of one stream from `from_version` (inclusive), in stream order. `reveal=False`
        leaves personal fields sealed as stored (see `kappaflow.ledger.personal`)."""
        check_identifier(stream_id, field="stream_id")
        _check_int(from_version, "from_version", minimum=1)
        if limit is not None:
            _check_int(limit, "limit", minimum=1)
        rows = self._fetch(self._reads["stream", hashes], (stream_id, from_version, limit), one=False)
        return self._records(rows, decode, hashes, reveal)

    def load_events(self, stream_id: str, *, from_version: int = 1) -> list[tuple[int, Any]]:
        """``(stream_version, event)`` pairs of one stream from `from_version`: the read a command
        handler makes to catch its aggregate up before deciding (then appends with the last
        version as expected version). Reads fewer columns than `read_stream` and builds no
        `RecordedEvent`s; events are typed through the registry (dicts without one)."""
        check_identifier(stream_id, field="stream_id")
        _check_int(from_version, "from_version", minimum=1)
        rows = self._fetch(self._load_sql, (stream_id, from_version), one=False)
        registry, loads = self.registry, orjson.loads
        pre = self._revealed([r[3] for r in rows])
        if registry is None:
            return [(r[0], pre[i] if i in pre else loads(r[3])) for i, r in enumerate(rows)]
        decode = registry.decode
        with _gc_paused(len(rows) >= 256):
            return [(r[0], decode(r[1], r[2], pre[i] if i in pre else loads(r[3]), position=r[4]))
                    for i, r in enumerate(rows)]

    def load(self, stream_id: str, fold: Fold[S]) -> Loaded[S]:
        """A stream's state through `fold`, from its latest snapshot plus the events after it; stores
        a new snapshot every ``snapshot_every[stream_type]`` events (see `kappaflow.ledger.snapshots`).
        Append with ``expected_version=loaded.version``."""
        return self.snapshots.load(stream_id, fold)

    def read_all(self, *, from_position: int = 1, limit: int = 1000, stream_types: Sequence[str] | None = None,
                 decode: bool = True, hashes: bool = False, reveal: bool = True) -> list[RecordedEvent]:
        """Events in global (commit) order from `from_position` (inclusive). `hashes=True` also
        reads each event's chain hash (`RecordedEvent.hash`; None otherwise)."""
        _check_int(from_position, "from_position", minimum=1)
        _check_int(limit, "limit", minimum=1)
        if stream_types:
            rows = self._fetch(self._reads["types", hashes], (from_position, list(stream_types), limit), one=False)
        else:
            rows = self._fetch(self._reads["all", hashes], (from_position, limit), one=False)
        return self._records(rows, decode, hashes, reveal)

    def iter_all(self, *, from_position: int = 1, batch: int = 5000, decode: bool = True,
                 hashes: bool = False, reveal: bool = True) -> Iterator[RecordedEvent]:
        """Every event from `from_position` up to the head at the time each batch is read."""
        pos = from_position
        while True:
            chunk = self.read_all(from_position=pos, limit=batch, decode=decode, hashes=hashes, reveal=reveal)
            yield from chunk
            if len(chunk) < batch:
                return
            pos = chunk[-1].position + 1

    def read_query(self, query: Query, *, after: int = 0, limit: int | None = None,
                   decode: bool = True) -> QueryResult:
        """The events matching `query` (in global order, after position `after`) and the ledger
        head they were read at, in one snapshot: ``result.condition`` is the `AppendCondition`
        that makes a decision based on them safe (see `kappaflow.ledger.query`).

        Items with tags are found through the tag index; an item with types only scans the
        events after `after`."""
        if not isinstance(query, Query):
            raise InvalidAppendError(f"expected a Query, got {type(query).__name__}", field="query")
        _check_int(after, "after", minimum=0)
        if limit is not None:
            _check_int(limit, "limit", minimum=1)
        params: list[Any] = []
        for item in query.items:
            if item.tags:
                params += [item.tags[0], after]
                if item.types:
                    params.append(list(item.types))
                params += item.tags[1:]
            elif item.types:
                params += [after, list(item.types)]
        shape = tuple((len(i.tags), bool(i.types)) for i in query.items)
        stmt = self._query_sql.get(shape)
        if stmt is None:
            stmt = self._query_sql[shape] = self._render_query(shape)
        if any(not i.tags and not i.types for i in query.items):
            params = []  # an item matching every event: the query is every event
        args = [*params, after, limit]
        rows = self._fetch(stmt, args, one=False, prepare=None)
        head = int(rows[0][0]) if rows else 0
        events = self._records([r[1:] for r in rows if r[1] is not None], decode, False, True)
        return QueryResult(query, events, head)

    def stream_version(self, stream_id: str) -> int:
        """The stream's current version (0 when it has no events)."""
        check_identifier(stream_id, field="stream_id")
        with self.connection() as conn:
            row = conn.execute(sql.SQL("select version from {} where stream_id = %s").format(
                self.tables.streams), (stream_id,)).fetchone()
        return int(row[0]) if row else 0

    def barrier(self) -> None:
        """Wait until everything committed so far is flushed to disk (see group commit above)."""
        with self.connection() as conn:
            conn.execute(self._barrier_sql, prepare=True)

    def head(self) -> Head:
        """The last event's position and hash (position 0 and the genesis hash when empty)."""
        with self.connection() as conn:
            row = conn.execute(sql.SQL(
                "select position, hash, recorded_at from {} order by position desc limit 1").format(
                self.tables.events)).fetchone()
        if row is None:
            from kappaflow.ledger.hashing import GENESIS_HASH

            return Head(0, GENESIS_HASH, None)
        return Head(int(row[0]), bytes(row[1]), row[2])

    def stats(self) -> LedgerStats:
        t = self.tables
        head = self.head()
        with self.connection() as conn:
            by_type = dict(conn.execute(sql.SQL(
                "select stream_type, sum(version)::bigint from {} group by stream_type order by 1").format(
                t.streams)).fetchall())
            n_streams = conn.execute(sql.SQL("select count(*) from {}").format(t.streams)).fetchone()
            n_keys = conn.execute(sql.SQL("select count(*) from {}").format(t.idempotency_keys)).fetchone()
            first = conn.execute(sql.SQL("select recorded_at from {} order by position limit 1").format(
                t.events)).fetchone()
            last = conn.execute(sql.SQL("select recorded_at from {} order by position desc limit 1").format(
                t.events)).fetchone()
            sizes = dict(conn.execute(
                "select c.relname, pg_total_relation_size(c.oid) from pg_class c "
                "join pg_namespace n on n.oid = c.relnamespace where n.nspname = %s and c.relkind = 'r'",
                (t.schema,)).fetchall())
        assert n_streams is not None and n_keys is not None
        return LedgerStats(
            head_position=head.position, head_hash=head.hash.hex(), streams=int(n_streams[0]),
            events_by_stream_type={k: int(v) for k, v in by_type.items()}, idempotency_keys=int(n_keys[0]),
            first_recorded_at=first[0].isoformat() if first else None,
            last_recorded_at=last[0].isoformat() if last else None,
            table_bytes={k: int(v) for k, v in sizes.items()},
        )

    def verify(self, **kwargs: Any) -> Any:
        """Check the hash chain and stream versions; see `kappaflow.ledger.hashing.verify`."""
        from kappaflow.ledger.hashing import verify

        with self.connection() as conn:
            return verify(conn, self.tables.schema, **kwargs)

    # --- helpers ------------------------------------------------------------
    def _fetch(self, query: bytes, params: Sequence[Any] | Mapping[str, Any], *, one: bool | None,
               prepare: bool | None = True) -> Any:
        """Run one prepared statement on a pooled connection: the hot path of appends and reads
        (no context managers, one cursor per connection, reused)."""
        pool = self._pool
        conn = pool.acquire()
        try:
            cur = self._cursors.get(conn)
            if cur is None or cur.closed:
                cur = self._cursors[conn] = conn.cursor(binary=True)  # binary results load faster
            cur.execute(query, params, prepare=prepare)
            if one is None:  # no result wanted
                return None
            return cur.fetchone() if one else cur.fetchall()
        except psycopg.Error as exc:
            raise _map_error(exc, self.tables.schema) from None
        finally:
            pool.release(conn)

    def _records(self, rows: list[tuple[Any, ...]], decode: bool, hashes: bool, reveal: bool) -> list[RecordedEvent]:
        """Rows of EVENT_COLUMNS (+ hash; payload and metadata as JSON text) -> RecordedEvents."""
        registry = self.registry if decode else None
        out: list[RecordedEvent] = []
        pre = self._revealed([r[6] for r in rows]) if reveal else {}
        with _gc_paused(len(rows) >= 256):
            self._build(rows, out, registry.decode if registry is not None else None, hashes, pre)
        return out

    def _render_query(self, shape: tuple[tuple[int, bool], ...]) -> bytes:
        """The read_query statement for a query shape ((tag count, has types) per item); rendered
        once per shape: composing it costs more than running it."""
        t = self.tables
        branches: list[sql.Composable] = []
        match_all = False
        for n_tags, typed in shape:
            if n_tags:
                q = sql.SQL("select t.position from {tags} t where t.tag = %s and t.position > %s").format(
                    tags=t.table("event_tags"))
                if typed:
                    q += sql.SQL(" and t.event_type = any(%s::text[])")
                for _ in range(n_tags - 1):
                    q += sql.SQL(" and exists (select 1 from {tags} t2 where t2.tag = %s and t2.position = t.position)"
                                 ).format(tags=t.table("event_tags"))
                branches.append(q)
            elif typed:
                branches.append(sql.SQL("select x.position from {events} x where x.position > %s "
                                        "and x.event_type = any(%s::text[])").format(events=t.events))
            else:
                match_all = True
        if match_all:  # the events after `after`, by primary key
            inner = sql.SQL("select * from {events} x where x.position > %s and x.position <= h.head "
                            "order by x.position limit %s").format(events=t.events)
        else:  # the matching positions drive: one primary-key probe per match (never a scan of events)
            inner = sql.SQL(
                "select x.* from ({branches}) m(position) cross join lateral "
                "(select * from {events} y where y.position = m.position) x "
                "where m.position > %s and m.position <= h.head order by m.position limit %s").format(
                branches=sql.SQL(" union ").join(branches), events=t.events)
        return sql.SQL(
            "select h.head, {cols} from (select coalesce(max(position), 0) as head from {events}) h "
            "left join lateral ({inner}) e on true").format(
            cols=self._cols(False), events=t.events, inner=inner).as_bytes(None)

    def _revealed(self, payloads: list[str]) -> dict[int, Any]:
        """{row index: data with personal fields decrypted (or the forgotten marker)} for the
        payloads that carry envelopes; one key lookup for the batch, none when there are none."""
        from kappaflow.ledger.personal import has_envelopes, reveal, subjects_of

        sealed = {i: orjson.loads(p) for i, p in enumerate(payloads) if has_envelopes(p)}
        if not sealed:
            return {}
        keys = self.keys.keys_for_read(set().union(*(subjects_of(d) for d in sealed.values())))
        return {i: reveal(d, keys) for i, d in sealed.items()}

    def forget(self, subject: str) -> Any:
        """Erase a data subject's personal fields everywhere by destroying its key (idempotent);
        see `kappaflow.ledger.personal`. Returns a `ForgetResult`."""
        return self.keys.forget(subject)

    @staticmethod
    def _build(rows: list[tuple[Any, ...]], out: list[RecordedEvent], decode: Any, hashes: bool,
               pre: dict[int, Any]) -> None:
        loads = orjson.loads
        append = out.append
        for i, r in enumerate(rows):
            data = pre[i] if pre and i in pre else loads(r[6])
            meta = r[7]
            tags = r[10]
            append(RecordedEvent(r[0], r[1], r[2], r[3], r[4], r[5], data,
                                 {} if meta == "{}" else loads(meta), r[8], r[9],  # most events: no metadata
                                 bytes(r[11]) if hashes else None,
                                 decode(r[4], r[5], data, position=r[0]) if decode is not None else None,
                                 () if tags is None else tuple(tags)))

    @contextmanager
    def _mapped_errors(self) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise _map_error(exc, self.tables.schema) from None


@contextmanager
def _gc_paused(pause: bool) -> Iterator[None]:
    """No cyclic garbage collection while a read builds a batch of events.

    Every decoded event allocates a few GC-tracked objects (the RecordedEvent, the typed model
    and its field set) that all survive (they are returned), so the collector runs every few
    hundred rows and promotes them through every generation for nothing: measured at half of a
    typed read-all's time. Allocation-driven collection resumes at the end of the batch (which
    is bounded by the read's `limit`); nothing here creates cycles.
    """
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Retryable(LedgerUnavailableError):
    """The transaction rolled back and retrying is safe: a deadlock, a serialisation failure, or a
    concurrent append with the same idempotency key that committed first (the retry returns its
    result)."""


def _text_array(items: list[str]) -> str:
    """A text[] literal: every element quoted, backslash and double quote escaped."""
    return "{" + ",".join(['"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"' for x in items]) + "}"


def _nullable_text_array(items: list[str | None]) -> str:
    return "{" + ",".join(['NULL' if x is None else '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
                           for x in items]) + "}"


def _int_array(items: list[int]) -> str:
    return "{" + ",".join(map(str, items)) + "}"


def _result(row: tuple[Any, ...] | None, condition: AppendCondition | None = None) -> AppendResult:
    assert row is not None
    if len(row) > 6 and row[6] is not None:
        raise _conflict(row[6], condition)
    return AppendResult(first_position=int(row[0]), position=int(row[1]),
                        versions=dict(zip(row[2], (int(v) for v in row[3]), strict=True)),
                        recorded_at=row[4], duplicate=bool(row[5]))


def _conflict(detail: Any, condition: AppendCondition | None) -> Exception:
    """The exception for a conflict the append function returned (it logs no server ERROR)."""
    if isinstance(detail, str | bytes):
        detail = orjson.loads(detail)
    kind = detail.get("kind")
    if kind == "version":
        return WrongExpectedVersionError(detail["stream_id"], _expected_from_sql(int(detail["expected"])),
                                         int(detail["actual"]))
    if kind == "condition" and condition is not None:
        return AppendConditionFailedError(condition, int(detail["item"]), int(detail["position"]),
                                          str(detail["event_type"]))
    if kind == "retry":
        return _Retryable("a concurrent append with the same idempotency key committed first")
    from kappaflow.ledger.errors import LedgerError

    return LedgerError(f"the append function returned an unknown conflict: {detail!r}")


def _expected_from_sql(value: int) -> int | ExpectedVersion:
    return ExpectedVersion(value) if value < 0 else value


def _map_error(exc: psycopg.Error, schema: str) -> Exception:
    state = getattr(exc, "sqlstate", None)
    detail: dict[str, Any] = {}
    diag = getattr(exc, "diag", None)
    if diag is not None and diag.message_detail and diag.message_detail.startswith("{"):
        try:
            detail = orjson.loads(diag.message_detail)
        except orjson.JSONDecodeError:
            detail = {}
    if state == "KL001":
        return WrongExpectedVersionError(detail.get("stream_id", "?"), _expected_from_sql(int(detail["expected"])),
                                         int(detail["actual"]))
    if state == "KL002":
        return IdempotencyKeyReusedError(str(detail.get("key", "?")))
    if state == "KL003":
        return StreamTypeMismatchError(str(detail.get("stream_id")), str(detail.get("expected")),
                                       str(detail.get("actual")))
    if state == "KL004":
        return InvalidAppendError(_first_line(exc), field="connection")
    if state == "KL006":
        return InvalidAppendError(f"expected a position <= the ledger head {detail.get('head')}, got "
                                  f"{detail.get('after')} (a position from the future: use the position a "
                                  "read returned)", field="condition.after")
    if state == "KL010":
        return ImmutableLedgerError(_first_line(exc))
    if state == "KL005" or isinstance(exc, pgerrors.DeadlockDetected | pgerrors.SerializationFailure):
        return _Retryable(_first_line(exc))
    if isinstance(exc, pgerrors.UndefinedFunction | pgerrors.UndefinedTable | pgerrors.InvalidSchemaName):
        return LedgerNotInstalledError(schema, _first_line(exc))
    if isinstance(exc, pgerrors.ProgramLimitExceeded | pgerrors.UntranslatableCharacter
                  | pgerrors.CharacterNotInRepertoire):
        return InvalidAppendError(_first_line(exc), field="events")
    if isinstance(exc, psycopg.OperationalError):
        return LedgerUnavailableError(
            f"ledger database unavailable ({_first_line(exc)}); an append in flight may or may not have "
            "committed: retry it with the same idempotency key")
    from kappaflow.ledger.errors import LedgerError

    return LedgerError(f"ledger database error [{state}]: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_int(value: Any, name: str, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidAppendError(f"expected an integer >= {minimum}, got {value!r}", field=name)


__all__ = ["AppendResult", "Head", "Ledger", "LedgerStats", "StreamAppend", "configure_connection"]
