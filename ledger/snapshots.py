"""Aggregate snapshots: load a long stream's state without folding it from the first event.

    ACCOUNT = Fold("account", version=1, state_type=Account, initial=Account,
                   apply=lambda acc, version, event: acc.apply(event))
    ledger = Ledger(dsn, registry=registry, snapshot_every={"account": 500})
    loaded = ledger.load("account-7", ACCOUNT)     # state, version (the expected version to append at)

`load` reads the stream's latest snapshot for the fold and only the events after it, in one
round trip; when the stream has grown `snapshot_every[stream_type]` events past its snapshot
(or has none and is that long), it stores a new one. A snapshot records the stream version it
covers and the fold's `version`:

- a snapshot made by another fold version is ignored (bump `version` whenever `initial`,
  `apply` or the state's shape change: old states are never fed to new code);
- a damaged snapshot (checksum mismatch, unreadable JSON, a state the type refuses) is ignored
  with a warning and the stream is folded from its first event (then re-snapshotted);
- snapshots are a cache outside the hash chain: `verify` never reads them, and deleting them
  (``DELETE FROM <schema>.snapshots``) only costs the next loads a full fold.

Why client-side states: the fold is application code (Python), so only the client can compute
it; the server stores opaque JSON text with a checksum.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson
import pydantic
from psycopg import sql

from kappaflow.errors import ConfigError
from kappaflow.ledger.errors import InvalidAppendError

if TYPE_CHECKING:
    from kappaflow.ledger.store import Ledger

log = logging.getLogger("kappaflow.ledger.snapshots")

S = TypeVar("S")


@dataclass(frozen=True)
class Fold(Generic[S]):
    """How a stream's events fold into a state, and how that state is stored in a snapshot.

    `apply(state, stream_version, event)` returns the new state (it may mutate and return the
    same object). `state_type` is anything pydantic's TypeAdapter handles (a dataclass, a model,
    a dict type): the snapshot is its JSON form.
    """

    name: str
    version: int
    state_type: Any
    initial: Callable[[str], S]
    apply: Callable[[S, int, Any], S]
    _adapter: pydantic.TypeAdapter[Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from kappaflow.ledger.events import check_identifier

        check_identifier(self.name, field="fold.name")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise InvalidAppendError(f"expected an integer >= 1, got {self.version!r}", field="fold.version")
        object.__setattr__(self, "_adapter", pydantic.TypeAdapter(self.state_type))

    def dump(self, state: S) -> bytes:
        return orjson.dumps(self._adapter.dump_python(state, mode="json"), option=orjson.OPT_SORT_KEYS)

    def restore(self, text: str | bytes) -> S:
        return self._adapter.validate_python(orjson.loads(text))


@dataclass(frozen=True, slots=True)
class Loaded(Generic[S]):
    """A stream's state as of `version` (0: no events): append with ``expected_version=version``."""

    stream_id: str
    state: S
    version: int
    snapshot_version: int | None = None  # the snapshot the load started from, if any
    folded: int = 0  # events folded on top of it
    stored_snapshot: bool = False  # this load wrote a new snapshot


def check_policy(every: Mapping[str, int] | None) -> dict[str, int]:
    """``{stream_type: N}`` (``"*"`` for every other type), each N >= 1."""
    if every is None:
        return {}
    if not isinstance(every, Mapping):
        raise ConfigError(f"ledger snapshot_every: expected a mapping of stream type to event count, got {every!r}")
    out = {}
    for stype, n in every.items():
        if not isinstance(stype, str) or not stype:
            raise ConfigError(f"ledger snapshot_every: expected stream type names, got {stype!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"ledger snapshot_every[{stype!r}]: expected an integer >= 1, got {n!r}")
        out[stype] = n
    return out


def checksum(stream_id: str, fold: str, stream_version: int, fold_version: int, state: bytes) -> bytes:
    """What a snapshot row's checksum covers: its identity and its state, length-prefixed."""
    h = hashlib.sha256()
    for part in (stream_id.encode(), fold.encode()):
        h.update(struct.pack(">i", len(part)) + part)
    h.update(struct.pack(">qi", stream_version, fold_version))
    h.update(state)
    return h.digest()


class Snapshots:
    """The ledger's snapshot reads and writes (one instance per Ledger)."""

    def __init__(self, ledger: Ledger, every: Mapping[str, int] | None) -> None:
        self.ledger = ledger
        self.every = check_policy(every)
        t = ledger.tables
        # The snapshot and the events after it in one statement (one round trip, one snapshot).
        self._load_sql = sql.SQL(
            "select s.stream_version, s.fold_version, s.state, s.checksum, e.stream_version, e.event_type, "
            "e.schema_version, e.payload::text, e.position, e.stream_type "
            "from (select 1) one "
            "left join {snapshots} s on s.stream_id = %(id)s and s.fold = %(fold)s and s.fold_version = %(fv)s "
            "left join lateral (select * from {events} x where x.stream_id = %(id)s "
            "and x.stream_version > coalesce(s.stream_version, 0) order by x.stream_version) e on true"
        ).format(snapshots=t.table("snapshots"), events=t.events).as_bytes(None)
        self._full_sql = sql.SQL(
            "select null, null, null, null, stream_version, event_type, schema_version, payload::text, position, "
            "stream_type from {events} where stream_id = %(id)s order by stream_version"
        ).format(events=t.events).as_bytes(None)
        self._store_sql = sql.SQL(
            "insert into {snapshots} as s (stream_id, fold, stream_version, fold_version, state, checksum) "
            "values (%s, %s, %s, %s, %s, %s) on conflict (stream_id, fold) do update set "
            "stream_version = excluded.stream_version, fold_version = excluded.fold_version, "
            "state = excluded.state, checksum = excluded.checksum, created_at = now() "
            "where s.stream_version < excluded.stream_version or s.fold_version <> excluded.fold_version"
        ).format(snapshots=t.table("snapshots")).as_bytes(None)

    def interval(self, stream_type: str | None) -> int | None:
        if stream_type is None:
            return None
        return self.every.get(stream_type, self.every.get("*"))

    def load(self, stream_id: str, fold: Fold[S]) -> Loaded[S]:
        from kappaflow.ledger.events import check_identifier

        check_identifier(stream_id, field="stream_id")
        if not isinstance(fold, Fold):
            raise InvalidAppendError(f"expected a Fold, got {type(fold).__name__}", field="fold")
        params = {"id": stream_id, "fold": fold.name, "fv": fold.version}
        rows = self.ledger._fetch(self._load_sql, params, one=False)
        state: Any = None
        snap_version: int | None = None
        first = rows[0] if rows else None
        if first is not None and first[0] is not None:
            snap_version = int(first[0])
            state = self._restore(stream_id, fold, first)
            if state is None:  # damaged: fold everything
                snap_version = None
                rows = self.ledger._fetch(self._full_sql, params, one=False)
        if snap_version is None:
            state = fold.initial(stream_id)
        version = snap_version or 0
        registry, loads = self.ledger.registry, orjson.loads
        decode = registry.decode if registry is not None else None
        apply = fold.apply
        folded = 0
        stream_type = None
        from kappaflow.ledger.store import _gc_paused

        pre = self.ledger._revealed([r[7] if r[4] is not None else "" for r in rows])
        with _gc_paused(len(rows) >= 256):
            for i, r in enumerate(rows):
                if r[4] is None:
                    continue
                data = pre[i] if i in pre else loads(r[7])
                event = decode(r[5], r[6], data, position=r[8]) if decode is not None else data
                version = int(r[4])
                state = apply(state, version, event)
                stream_type = r[9]
                folded += 1
        stored = False
        every = self.interval(stream_type)
        if every is not None and version - (snap_version or 0) >= every:
            self.store(stream_id, fold, version, state)
            stored = True
        return Loaded(stream_id, state, version, snap_version, folded, stored)

    def store(self, stream_id: str, fold: Fold[S], version: int, state: S) -> None:
        """Store `state` as of `version` (kept only if newer than the stored one, or of another
        fold version)."""
        text = fold.dump(state)
        self.ledger._fetch(self._store_sql, (stream_id, fold.name, version, fold.version, text.decode(),
                                             checksum(stream_id, fold.name, version, fold.version, text)),
                           one=None)

    def _restore(self, stream_id: str, fold: Fold[S], row: tuple[Any, ...]) -> S | None:
        version, fold_version, text, stored_sum = int(row[0]), int(row[1]), row[2], bytes(row[3])
        raw = text.encode()
        if checksum(stream_id, fold.name, version, fold_version, raw) != stored_sum:
            reason = "its checksum does not match its content"
        else:
            try:
                return fold.restore(raw)
            except (orjson.JSONDecodeError, pydantic.ValidationError, TypeError, ValueError) as exc:
                reason = f"its state does not load ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        log.warning("ledger snapshot of stream %r (fold %r v%d, stream version %d) ignored: %s; folding the "
                    "stream from its first event", stream_id, fold.name, fold_version, version, reason)
        return None


__all__ = ["Fold", "Loaded", "Snapshots", "check_policy", "checksum"]
