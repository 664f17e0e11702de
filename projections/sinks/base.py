"""The sink contract: where a projection's view lives (PostgreSQL table, search index, Redis keys).

Every sink keeps the same guarantees:

1. **Versioned writes.** A batch is an Arrow table with the view's columns plus
   ``_kf_version`` (int64: the log position that produced the row) and ``_kf_deleted``
   (bool: the key must be removed). A row whose version is not greater than the stored
   version of that key has no effect, so retries, replays and duplicate delivery are
   exactly-once in effect. A delete leaves its version behind as the stored one (a
   tombstone: PostgreSQL keeps it 24 h or until a newer upsert, Redis ``tombstone_ttl_s``,
   search servers ``index.gc_deletes``), so an older upsert does not bring the row back.
2. **Positions.** ``write(..., positions=...)`` also stores the consumed log positions
   (next offset to read per topic/partition). Transactional sinks
   (``positions_with_rows``) store them atomically with the rows; the others are given
   them separately (``store_positions``) after the rows and the dead letters of the rows
   they refused (the version guard makes a replayed tail harmless).
3. **Zero-downtime rebuilds.** ``begin_shadow`` creates an empty target beside the live
   one; a replay fills it, ``swap`` makes it live atomically (rename / alias / pointer)
   and drops the old one. Readers see the old view until the switch, the new one after,
   never an empty or partial one.
4. **Schema from the projection.** ``ensure`` creates the live target from the
   projection's ``ViewSpec`` or checks that an existing one matches it, raising
   ``ViewSchemaMismatch`` (naming the columns) otherwise.
5. **Schema evolution in place.** ``evolve`` brings the live target to a view that differs
   from what the store holds only by added (nullable, non-key) columns and widened types
   (``widens``: smallint -> int -> bigint, float -> double, a decimal with more integer and
   fraction digits): PostgreSQL ``ALTER TABLE ... ADD COLUMN`` / ``ALTER COLUMN ... TYPE``,
   a mapping update of the live search index, the column list of the live Redis build. Rows
   and positions are untouched, so following goes on where it was (no replay); any other
   difference raises ``ViewSchemaMismatch`` (the view needs a rebuild).

Capabilities the engine asks for (never a sink's ``kind``): ``positions_with_rows``,
``load_batches`` (a bulk load that reports the rows it refused), ``grouped_state``
(the keyed state and group recompute a grouped fold needs, ``GroupedStateStore``),
``state_connection`` (a views-database connection whose transaction covers the sink's own
writes: state kept there commits with the rows) and ``build_of`` / ``builds`` (the physical
build a target lives in, for state kept beside a store without such a transaction; the
join stage, ``kappaflow.projections.joins``, uses these two).

Sinks are opened on the driver and, for replays and custom folds, inside Spark
executors: ``Sink.config()`` returns a small picklable `SinkConfig` (the kind, its registered
settings model and constructor arguments) whose ``open()`` makes an equivalent sink in another
process. ``kappaflow.projections.sinks.testing`` holds
the contract test suite every sink runs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import pyarrow as pa
from pydantic import BaseModel
from pyspark.sql.types import DataType

from kappaflow.errors import ConfigError, SinkError

VERSION = "_kf_version"
DELETED = "_kf_deleted"

TopicPartition = tuple[str, int]
Positions = Mapping[TopicPartition, int]


class ViewSchemaMismatch(SinkError):
    """An existing view does not have the shape the projection produces."""


@dataclass(frozen=True)
class ViewColumn:
    """One column of a view, typed with a Spark ``DataType`` (JVM-free to build and pickle)."""

    name: str
    type: DataType
    nullable: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type.jsonValue(), "nullable": self.nullable}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViewColumn:
        import json

        from pyspark.sql.types import _parse_datatype_json_string

        return cls(d["name"], _parse_datatype_json_string(json.dumps(d["type"])), bool(d.get("nullable", True)))


@dataclass(frozen=True)
class ViewSpec:
    """What a sink needs to know about a view: its public name, key and columns.

    ``columns`` holds every column in order, key columns included; ``_kf_version`` is
    added by the sink. ``namespace`` is sink-specific (PostgreSQL: the schema).
    """

    name: str
    projection: str
    key: tuple[str, ...]
    columns: tuple[ViewColumn, ...]
    namespace: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        if not self.key:
            raise ConfigError(f"view {self.name!r}: 'key': expected at least one key column")
        missing = [k for k in self.key if k not in names]
        if missing:
            raise ConfigError(f"view {self.name!r}: key column(s) {missing} are not among the columns {names}")
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"view {self.name!r}: duplicate column(s) {sorted(dup)}")
        reserved = [n for n in names if n in (VERSION, DELETED)]
        if reserved:
            raise ConfigError(f"view {self.name!r}: column names {reserved} are reserved by kappaflow")

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def value_columns(self) -> tuple[ViewColumn, ...]:
        return tuple(c for c in self.columns if c.name not in self.key)

    def column(self, name: str) -> ViewColumn:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def arrow_schema(self, *, with_meta: bool = True) -> pa.Schema:
        """The batch schema ``write`` takes: the columns, then version and deleted flag."""
        from pyspark.sql.pandas.types import to_arrow_type

        fields = [pa.field(c.name, to_arrow_type(c.type, timezone="UTC"), nullable=True) for c in self.columns]
        if with_meta:
            fields += [pa.field(VERSION, pa.int64(), nullable=False), pa.field(DELETED, pa.bool_(), nullable=False)]
        return pa.schema(fields)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "projection": self.projection,
            "key": list(self.key),
            "columns": [c.to_dict() for c in self.columns],
            "namespace": self.namespace,
            # per-sink view options (search index alias, Redis prefix...): status/query find the view by them
            "options": {k: v for k, v in self.options.items() if k in ("search", "redis")},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViewSpec:
        return cls(
            name=d["name"],
            projection=d["projection"],
            key=tuple(d["key"]),
            columns=tuple(ViewColumn.from_dict(c) for c in d["columns"]),
            namespace=d.get("namespace"),
            options=dict(d.get("options") or {}),
        )


def widens(old: DataType, new: DataType) -> bool:
    """Whether every value of Spark type `old` is a value of `new` too, with the same meaning (a view
    column of type `old` can be widened in place to `new`): equal types, integers to wider integers,
    float to double, a decimal to one with at least as many integer and fraction digits, arrays of
    such element types."""
    from pyspark.sql import types as T

    if old == new:
        return True
    ints: list[type[DataType]] = [T.ByteType, T.ShortType, T.IntegerType, T.LongType]
    ro = next((i for i, t in enumerate(ints) if isinstance(old, t)), None)
    rn = next((i for i, t in enumerate(ints) if isinstance(new, t)), None)
    if ro is not None and rn is not None:
        return ro <= rn
    if isinstance(old, T.FloatType) and isinstance(new, T.DoubleType):
        return True
    if isinstance(old, T.DecimalType) and isinstance(new, T.DecimalType):
        return new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale
    if isinstance(old, T.ArrayType) and isinstance(new, T.ArrayType):
        return widens(old.elementType, new.elementType)
    return False


@dataclass(frozen=True)
class ViewEvolution:
    """How a stored view differs from the view a projection makes now (``evolution``): columns to
    add, columns to widen ((stored, new)), and what cannot change in place (``problems``)."""

    added: tuple[ViewColumn, ...] = ()
    widened: tuple[tuple[ViewColumn, ViewColumn], ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.widened or self.problems)

    def describe(self) -> str:
        parts = [f"add column {c.name!r} {c.type.simpleString()}" for c in self.added]
        parts += [f"widen column {o.name!r} {o.type.simpleString()} -> {n.type.simpleString()}"
                  for o, n in self.widened]
        return ", ".join(parts + list(self.problems)) or "no change"


def evolution(stored: Sequence[ViewColumn], stored_key: Sequence[str] | None, view: ViewSpec) -> ViewEvolution:
    """What bringing a stored view (its columns and key, as the store recorded them) to `view` takes.

    In place: columns `view` has and the store lacks (never key columns), and stored columns whose
    type `view` widens. Anything else is a problem (a column the store has and `view` lacks, a
    narrowed or incompatible type, another key): those need a rebuild."""
    have = {c.name: c for c in stored}
    added: list[ViewColumn] = []
    widened: list[tuple[ViewColumn, ViewColumn]] = []
    problems: list[str] = []
    if stored_key is not None and list(stored_key) != list(view.key):
        problems.append(f"the key is {list(stored_key)} in the store, the projection's key is {list(view.key)}")
    for col in view.columns:
        old = have.get(col.name)
        if old is None:
            if col.name in view.key:
                problems.append(f"key column {col.name!r} is missing")
            else:
                added.append(col)
        elif old.type != col.type:
            if widens(old.type, col.type):
                widened.append((old, col))
            else:
                problems.append(f"column {col.name!r} is {old.type.simpleString()} in the store and cannot be "
                                f"changed in place to {col.type.simpleString()}")
    gone = [n for n in have if n not in view.column_names]
    if gone:
        problems.append(f"column(s) {gone} are in the store but no longer produced by the projection")
    return ViewEvolution(tuple(added), tuple(widened), tuple(problems))


def evolution_mismatch(where: str, view: ViewSpec, evo: ViewEvolution) -> ViewSchemaMismatch:
    """The error of an ``evolve`` that cannot be done in place (names every problem)."""
    return ViewSchemaMismatch(
        f"{where} cannot be evolved in place to projection {view.projection!r}: " + "; ".join(evo.problems)
        + ". Rebuild it with `kappaflow replay` (built beside the live view and swapped in).")


@dataclass(frozen=True)
class Target:
    """One physical copy of a view: the live one or a shadow being built.

    ``name`` is the sink's physical name (table / index / key prefix); ``label`` is how
    positions are filed (``"live"`` or the shadow's name).
    """

    view: ViewSpec
    name: str
    shadow: bool = False

    @property
    def label(self) -> str:
        return self.name if self.shadow else "live"


@dataclass
class WriteResult:
    """What a write did. ``rejected``: (key, reason) pairs a sink refused (go to dead letters)."""

    upserted: int = 0
    deleted: int = 0
    skipped: int = 0  # stale versions
    rejected: list[tuple[tuple[Any, ...], str]] = field(default_factory=list)


Rejected = tuple[tuple[Any, ...], int | None, str]
"""A row a sink refused while loading: (view key, the row's ``_kf_version``, reason)."""


@dataclass
class LoadResult:
    """What a bulk load did: rows loaded, and the rows the sink refused (they go to the dead letters)."""

    loaded: int = 0
    rejected: list[Rejected] = field(default_factory=list)


def located_rejections(
    view: ViewSpec, batch: pa.Table | pa.RecordBatch, rejected: Sequence[tuple[tuple[Any, ...], str]]
) -> list[Rejected]:
    """``WriteResult.rejected`` of a write of `batch`, with each refused row's version from the batch."""
    keys = [batch.column(k).to_pylist() for k in view.key]
    versions = batch.column(VERSION).to_pylist()
    by_key = {tuple(kc[i] for kc in keys): versions[i] for i in range(batch.num_rows)}
    return [(tuple(k), by_key.get(tuple(k)), reason) for k, reason in rejected]


@dataclass
class Drift:
    """One key where a view differs from what a fresh replay gives (``verify``).

    kind: ``changed`` (values differ), ``missing`` (the replay has a row the view lacks),
    ``unexpected`` (the view has a row the replay does not)."""

    key: tuple[Any, ...]
    kind: str
    live: dict[str, Any] | None
    expected: dict[str, Any] | None


class GroupedStateStore(Protocol):
    """A store that keeps a grouped view's per-source-key state and recomputes the groups a batch
    touches in the same transaction as the positions (PostgreSQL). A grouped fold folds the log
    into such a sink; its other sinks mirror that sink's view (``kappaflow.projections.mirror``)."""

    def load_state(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """Bulk-load keyed-state rows (``_kf_topic, _kf_key, _kf_version`` + state columns) into a fresh shadow."""
        ...

    def apply_grouped(
        self, target: Target, changes: pa.Table, version: int, positions: Positions | None
    ) -> WriteResult:
        """Apply keyed-state changes, recompute the touched groups at `version`, store `positions`: ONE transaction."""
        ...

    def read_for_mirror(
        self,
        target: Target,
        since: int | None,
        consume: Callable[[list[dict[str, Any]]], None],
        chunk: int = 5000,
    ) -> tuple[dict[TopicPartition, int], list[tuple[Any, ...]]]:
        """Rows (all, or of the groups recomputed above version `since`) and the positions, in one snapshot:
        (positions, keys of changed groups that no longer exist)."""
        ...


@dataclass(frozen=True)
class SinkConfig:
    """Picklable recipe for opening a sink in another process (Spark executors).

    One shape for every sink, so that a sink is configured by its registered settings model only
    (``[views.<kind>]``, see ``sinks/registry.py``): the kind, its settings (a pydantic model, hence
    picklable, holding what locates the store), the sink's constructor arguments beyond them (its
    per-sink options, client options, default schema) and the projections whose writes it fences.
    """

    kind: str
    settings: BaseModel
    args: Mapping[str, Any] = field(default_factory=dict)
    fences: Mapping[str, str] = field(default_factory=dict)  # projection -> the lock holder's token

    def open(self) -> Sink:
        """An equivalent sink, opened by the registry's opener for ``kind``."""
        from kappaflow.projections.sinks.registry import sink_kind

        sink = sink_kind(self.kind).open(self.settings, **self.args)
        for projection, token in self.fences.items():
            sink.fence(projection, token)
        return sink

    def for_worker(self) -> SinkConfig:
        """As a Spark worker opens it: with the kind's registered ``worker_args`` (e.g. PostgreSQL's
        ``migrate=False``: the driver ran the migrations, a worker never does)."""
        from kappaflow.projections.sinks.registry import sink_kind

        extra = sink_kind(self.kind).worker_args
        return replace(self, args={**self.args, **extra}) if extra else self


class Sink(abc.ABC):
    """One store of views. See the module docstring for the guarantees."""

    kind: ClassVar[str] = ""

    positions_with_rows: ClassVar[bool] = False
    """True: ``write(..., positions)`` stores the positions in the same transaction as the rows (and
    refuses no row). False: the engine stores them with ``store_positions`` after the rows and
    after the dead letters of the rows the sink refused, so a crash in between loses none."""

    def grouped_state(self) -> GroupedStateStore | None:
        """The keyed-state capability a grouped fold needs (``GroupedStateStore``), None when the store
        has none (its view of a grouped projection is then a mirror)."""
        return None

    def state_connection(self) -> Any | None:
        """A psycopg connection to the views database whose transaction also covers this sink's rows and
        positions (PostgreSQL: the sink's own), so state a fold keeps there commits with them; None for
        stores without one (their state lives beside them, per build: ``build_of``)."""
        return None

    def build_of(self, target: Target) -> str | None:
        """The build (one physical copy of a view: an index, a key namespace) `target` writes to now;
        it changes only when a swap replaces it or the store lost it. None: the store has no builds, or
        the target's build is gone. State kept outside the store is keyed by it, so a swap moves the
        state with the rows and positions, and a lost build loses its state too."""
        return None

    def builds(self, view: ViewSpec) -> set[str] | None:
        """Every build of `view` the store holds now (live, shadows, verify scratches); None when the
        store has no builds. State of a build not listed belongs to nothing and may be dropped."""
        return None

    # --- configuration ------------------------------------------------------------------
    @abc.abstractmethod
    def config(self) -> SinkConfig:
        """A picklable config that opens an equivalent sink elsewhere."""

    # --- targets ------------------------------------------------------------------------
    @abc.abstractmethod
    def live(self, view: ViewSpec) -> Target | None:
        """The live target if it exists (no schema check)."""

    @abc.abstractmethod
    def ensure(self, view: ViewSpec) -> Target:
        """Create the live target if missing; if present, check it matches (ViewSchemaMismatch)."""

    @abc.abstractmethod
    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        """A new, empty target beside the live one (a leftover one of the same label is dropped)."""

    @abc.abstractmethod
    def swap(self, shadow: Target) -> Target:
        """Make `shadow` (with its positions) the live target atomically; drop the old one."""

    @abc.abstractmethod
    def drop(self, target: Target) -> None:
        """Remove a target and its positions (no error if it does not exist)."""

    def evolve(self, view: ViewSpec) -> Target:
        """Bring the live target of `view` to `view`'s shape in place: add the columns the store lacks,
        widen the columns `view` widens (see ``evolution``), leaving rows and positions as they are;
        returns the live target for `view`. Nothing to do when it already matches. Raises
        ``ViewSchemaMismatch`` when the difference is not one of those (the view needs a rebuild).
        Idempotent, so a follower that crashed after it may run it again."""
        raise ViewSchemaMismatch(f"the {self.kind} sink cannot evolve view {view.name!r} in place; rebuild it "
                                 "with `kappaflow replay`")

    # --- data ---------------------------------------------------------------------------
    @abc.abstractmethod
    def write(self, target: Target, batch: pa.Table, positions: Positions | None = None) -> WriteResult:
        """Apply versioned upserts/deletes (see module docstring) and store `positions`."""

    def load(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """Bulk-load rows into a fresh shadow (unique keys, no deletes), e.g. one Spark
        partition of a replay. Sinks may skip the version guard here; the default writes
        batch by batch. Returns rows loaded."""
        n = 0
        for b in batches:
            t = b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
            n += self.write(target, t).upserted
        return n

    def load_batches(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> LoadResult:
        """``load``, reporting the rows the sink refused (search mapping conflicts, Redis key sizes) so
        they reach the dead letters with their key and version. Default: ``load`` (a bulk path that
        refuses no row, e.g. COPY); sinks that may refuse rows override it (``load_by_write``)."""
        return LoadResult(self.load(target, batches))

    def load_by_write(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> LoadResult:
        """``load_batches`` through ``write``, batch by batch, collecting the refused rows."""
        res = LoadResult()
        for b in batches:
            t = b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
            w = self.write(target, t)
            res.loaded += w.upserted
            if w.rejected:
                res.rejected += located_rejections(target.view, t, w.rejected)
        return res

    @abc.abstractmethod
    def fetch(self, target: Target, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
        """Current rows (columns + ``_kf_version``) for the given keys; absent keys are left out."""

    @abc.abstractmethod
    def scan(self, target: Target) -> Iterator[dict[str, Any]]:
        """Every row (columns + ``_kf_version``), in key order."""

    @abc.abstractmethod
    def count(self, target: Target) -> int:
        """Number of rows."""

    def diff(
        self, live: Target, expected: Target, limit: int = 100
    ) -> tuple[dict[TopicPartition, int], int, list[Drift]]:
        """Keys whose values (not versions) differ between `live` and `expected`:
        (live positions, number of differing keys, the first `limit`). Sinks that can read
        rows and positions in one snapshot override this; the default compares scans."""
        positions = self.read_positions(live)
        names = live.view.column_names
        key = live.view.key

        def rows(t: Target) -> dict[tuple[Any, ...], dict[str, Any]]:
            return {tuple(r[k] for k in key): {c: r.get(c) for c in names} for r in self.scan(t)}

        a, b = rows(live), rows(expected)
        out = []
        for k in sorted(set(a) | set(b), key=repr):
            la, eb = a.get(k), b.get(k)
            if la == eb:
                continue
            out.append(Drift(k, "missing" if la is None else "unexpected" if eb is None else "changed", la, eb))
        return positions, len(out), out[:limit]

    # --- positions ----------------------------------------------------------------------
    @abc.abstractmethod
    def read_positions(self, target: Target) -> dict[TopicPartition, int]:
        """Stored next offsets ({} when none)."""

    @abc.abstractmethod
    def store_positions(self, target: Target, positions: Positions) -> None:
        """Store next offsets (never moving one backwards)."""

    # --- the projection lock ------------------------------------------------------------
    @abc.abstractmethod
    def try_lock(self, projection: str) -> bool:
        """Take `projection`'s lock in this store (one replay or follow writes a view at a time);
        False when another holder has it. Held until ``unlock``/``close``, and released by the
        store when the holder dies (session lock, or a lease that expires)."""

    @abc.abstractmethod
    def unlock(self, projection: str) -> None:
        """Release the lock taken with ``try_lock`` (no error if not held)."""

    @abc.abstractmethod
    def holds_lock(self, projection: str) -> bool:
        """Whether THIS sink still holds `projection`'s lock (False once its session died or its lease
        was lost): a follower checks it before each batch, so it never writes without the lock."""

    @abc.abstractmethod
    def is_locked(self, projection: str) -> bool:
        """Whether anyone holds `projection`'s lock, read without taking it (``kappaflow status``
        reports a projection as following when its lock is held)."""

    def lock_fence(self, projection: str) -> str | None:
        """The fencing token of `projection`'s lock while THIS sink holds it (lease stores: the
        lease's ``"<generation>:<random>"``), None when not held or when the store's lock needs
        no fence (a PostgreSQL advisory lock dies with its session)."""
        return None

    def fence(self, projection: str, token: str | None) -> None:  # noqa: B027 - optional
        """Fence this sink's writes to `projection`'s views with `token` (the lock holder's
        ``lock_fence``): from now on they are refused (``LockLostError``) once the lock no longer
        holds that token, i.e. after the holder's lease expired or was taken over. A sink that
        takes the lock itself fences its own writes; ``config()`` carries the fences to the
        sinks executors open. ``None`` removes the fence."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def empty_batch(view: ViewSpec) -> pa.Table:
    return view.arrow_schema().empty_table()


def batch_from_rows(view: ViewSpec, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Build a write batch from dicts (tests and small writes): missing columns are NULL,
    ``_kf_deleted`` defaults to False."""
    schema = view.arrow_schema()
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for r in rows:
        if VERSION not in r:
            raise ConfigError(f"batch row for view {view.name!r}: '{VERSION}' is required, got {dict(r)!r}")
        for f in schema:
            v = r.get(f.name)
            if f.name == DELETED and v is None:
                v = False
            cols[f.name].append(v)
    return pa.Table.from_pydict(cols, schema=schema)


__all__ = [
    "DELETED",
    "VERSION",
    "Drift",
    "GroupedStateStore",
    "LoadResult",
    "Positions",
    "Rejected",
    "Sink",
    "SinkConfig",
    "Target",
    "TopicPartition",
    "ViewColumn",
    "ViewEvolution",
    "ViewSchemaMismatch",
    "ViewSpec",
    "WriteResult",
    "batch_from_rows",
    "empty_batch",
    "evolution",
    "evolution_mismatch",
    "located_rejections",
    "widens",
]
