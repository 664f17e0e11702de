"""As-of enrichment in replay (Spark) and follow (PostgreSQL state): the rule, exactly.

**The clock.** Every record gets a clock value, a 5-tuple ordered like ``schemas.pos_order``:

- *the table and the event stream come from one source* (same ``<source>.`` topic prefix, so one
  commit order): the clock is the source position (``kf_pos``: PostgreSQL commit LSN and change
  index, MySQL binlog file/position/row). A table change counts for an event when its position
  is BEFORE the event's: committed earlier, or earlier in the same transaction. The rows of an
  initial snapshot share one clock (the snapshot's consistent point): they count for each other.
- *different sources* (no common commit order): the clock is time in microseconds. An event of
  a ledger topic: its ``recorded_at`` (the ledger's append time, non-decreasing in position
  order by construction); a change record (table change, or an event of a change topic): the
  source's commit time ``source.ts_ms``, made non-decreasing in the topic's position order by
  taking the running maximum (``eff = max(ts of this and every earlier record of the topic)``),
  so a commit timestamp that steps back by a few microseconds cannot reorder anything. A table
  change counts for an event when its clock is STRICTLY earlier than the event's (equal times:
  the event first); changes with equal clocks are ordered by their position.

The row "as of" an event is the newest counted change of the looked-up key: its ``after`` row,
or none (NULL columns) when that change is a delete, when there is none, or when the event's
foreign key is NULL. A record whose clock cannot be read (no ``recorded_at``) is enriched with
NULLs. Tombstones and truncate markers are no changes (the deletes before/after them are).

**Hold-back (follow and replay alike).** An event is *released* (folded) only when every table's
capture has passed it, ``clock(event) <= F`` with ``F`` the table's frontier -- time clock: the
clock of the newest table change read so far (its running maximum: every later change has a
clock >= F, so it ties or comes after the event and can never count for it); position clock: the
largest position read from the source so far, events included (reads end at transaction cuts of
the source, so nothing at or below it is still to come: a streamed event is released at once; a
snapshot's events, whose clock is shared, once a record past the snapshot is read: ``< F``).
Events not released wait in the state, are folded by a later batch (in position order per view
key, as always) and are NOT in the view until then: a follower and a replay that end at the same
offsets have released the same events with the same rows, so a replay a year later gives the
view the follow gave on the day. With the time clock, an idle table holds events back until its
next change: let the table's source change regularly (a heartbeat row, as Debezium's
``heartbeat.action.query``), or keep the table in the stream's source (position clock).

**Consumers.** Custom folds (``folds/custom.py``: events sorted by view key, then ``apply``) and
windowed views (``folds/windowed.py``: the change topic's records from ``stream_events``, the
released ones parsed again with ``Plan.asof_events``, whose rows gain ``enriched_columns``, then the
window rule per log partition in offset order -- a prefix of each partition is released, see above).

**State** (PostgreSQL views database, ``kappaflow`` schema, one set per view table, swapped with
it; written in the transaction of the view rows and positions): per looked-up table
``asof__<schema>__<view>__h<i>`` -- the history: ``k`` (canonical key text), the change's clock
and position, deleted, the ``after`` row as JSON text -- and ``...__m``: the frontiers and the
waiting events (one Arrow IPC blob). Bounded: with ``G`` the clock below which no event can come
any more (the oldest waiting event's, else the newest event's: event clocks are non-decreasing
in commit order), a key keeps its versions at or after ``G`` and the newest one before it; a
follow batch prunes the keys it changed, a replay every key. So the history is one row per key
plus the changes newer than the stream's position, not the table's whole past.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StringType, StructField, StructType

from kappaflow.errors import ConfigError, SinkError
from kappaflow.events import TableSchema
from kappaflow.projections.folds.base import BAD_REASON
from kappaflow.projections.joins.asof import AsOf
from kappaflow.projections.joins.plan import VALID_OPS, canonical, comparable
from kappaflow.projections.schemas import (
    converted_row,
    envelope_struct,
    key_struct,
    pos_order,
    record_frame,
    row_wire_struct,
    spark_type,
)
from kappaflow.projections.sinks.base import Target

KF_SCHEMA = "kappaflow"
CLOCK = ("a", "b", "c", "d", "e")
Clock = tuple[int, str, int, int, int]


# --- the plan -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AsOfTable:
    topic: str
    index: int
    schema: TableSchema
    by_position: bool  # same source as the event stream: the position clock; else time


@dataclass(frozen=True)
class AsOfItem:
    asof: AsOf
    table: int  # index into AsOfPlan.tables
    fk: tuple[str, ...]  # event fields / columns, in the table's key order
    key_types: tuple[DataType, ...]
    columns: tuple[str, ...]
    out_names: tuple[str, ...]


@dataclass(frozen=True)
class AsOfPlan:
    projection: str
    topic: str  # the event stream
    events: bool  # an event topic (domain events), not a change topic
    schema: TableSchema | None  # the change topic's schema
    tables: tuple[AsOfTable, ...]
    items: tuple[AsOfItem, ...]

    @property
    def any_time(self) -> bool:
        return any(not t.by_position for t in self.tables)

    def job_items(self) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]:
        """What the custom folder needs: (name, table topic, columns, output names) per item."""
        return tuple((it.asof.name, self.tables[it.table].topic, it.columns, it.out_names) for it in self.items)

    @classmethod
    def build(cls, spec: Any, schemas: dict[str, TableSchema]) -> AsOfPlan:
        """Bind ``spec.as_of`` to the tables' schemas; ConfigError naming the projection and the attribute."""
        from kappaflow.connectors.cuts import source_of

        where = f"projection {spec.name!r}"
        src = spec.sources[0]
        eschema = None if src.events else schemas[src.topic]
        topics = list(dict.fromkeys(a.topic for a in spec.as_of))
        tables = tuple(
            AsOfTable(t, i, schemas[t], source_of(t) == source_of(src.topic) and not src.events)
            for i, t in enumerate(topics)
        )
        items: list[AsOfItem] = []
        seen_out = {c: "the event table" for c in (eschema.column_names if eschema else ())}
        for a in spec.as_of:
            at = f"{where}: 'as_of'[{a.name!r}]"
            schema = schemas[a.topic]
            if not schema.key:
                raise ConfigError(f"{at}.topic: {a.topic!r} has no primary key; as-of finds a row by the table's key")
            if sorted(a.on.values()) != sorted(schema.key) or len(set(a.on.values())) != len(a.on):
                raise ConfigError(
                    f"{at}.on: must map event fields to the whole primary key {list(schema.key)} of {a.topic!r}, "
                    f"got {dict(a.on)}"
                )
            inverse = {v: k for k, v in a.on.items()}
            fk = tuple(inverse[k] for k in schema.key)
            key_types = tuple(spark_type(schema.column(k)) for k in schema.key)
            if eschema is not None:
                missing = [c for c in fk if c not in eschema.column_names]
                if missing:
                    raise ConfigError(
                        f"{at}.on: column(s) {missing} are not in {src.topic!r} (columns: {list(eschema.column_names)})"
                    )
                for f, k, kt in zip(fk, schema.key, key_types, strict=True):
                    ft = spark_type(eschema.column(f))
                    if not comparable(ft, kt):
                        raise ConfigError(
                            f"{at}.on: {src.topic}.{f} ({ft.simpleString()}) cannot be compared with {a.topic}.{k} "
                            f"({kt.simpleString()}): key types must be equal, both integers, or an integer/decimal "
                            "into a decimal of at least its scale"
                        )
            if a.columns is None:
                columns = tuple(c for c in schema.column_names if c not in schema.key)
            else:
                unknown = [c for c in a.columns if c not in schema.column_names]
                if unknown:
                    raise ConfigError(
                        f"{at}.columns: {unknown} not in the schema of {a.topic!r} "
                        f"(columns: {list(schema.column_names)})"
                    )
                columns = tuple(dict.fromkeys(a.columns))
            outs = tuple(a.column_prefix + c for c in columns)
            for c, o in zip(columns, outs, strict=True):
                if o in seen_out:
                    raise ConfigError(
                        f"{at}.prefix: column {o!r} (from {a.topic}.{c}) clashes with a column of {seen_out[o]}; "
                        "choose another prefix"
                    )
                seen_out[o] = f"as_of[{a.name!r}]"
            items.append(AsOfItem(a, topics.index(a.topic), fk, key_types, columns, outs))
        return cls(spec.name, src.topic, src.events, eschema, tables, tuple(items))


def table_schemas(spec: Any, log: Any, have: dict[str, TableSchema]) -> dict[str, TableSchema]:
    """The looked-up tables' schemas; a missing one is a ConfigError naming the attribute."""
    from kappaflow.projections.schemas import load_table_schemas

    out: dict[str, TableSchema] = {}
    for a in spec.as_of:
        if a.topic in have or a.topic in out:
            continue
        try:
            out.update(load_table_schemas(log, [a.topic]))
        except ConfigError as exc:
            raise ConfigError(
                f"projection {spec.name!r}: 'as_of'[{a.name!r}].topic: source topic {a.topic!r} is missing or was "
                f"never captured ({exc})"
            ) from None
    return out


# --- Spark frames shared by replay and follow -----------------------------------------------------------
def _clock_struct(
    a: SparkColumn,
    b: SparkColumn | None = None,
    c: SparkColumn | None = None,
    d: SparkColumn | None = None,
    e: SparkColumn | None = None,
) -> SparkColumn:
    zero = F.lit(0).cast("bigint")
    return F.when(
        a.isNotNull(),
        F.struct(
            a.cast("bigint").alias("a"),
            (b if b is not None else F.lit("")).cast("string").alias("b"),
            (c if c is not None else zero).cast("bigint").alias("c"),
            (d if d is not None else F.lit(1)).cast("int").alias("d"),
            (e if e is not None else zero).cast("bigint").alias("e"),
        ),
    )


def _pos(value: SparkColumn, schema: TableSchema) -> SparkColumn:
    """The position clock: ``pos_order`` of ``kf_pos``, with every row of one initial snapshot at ONE
    clock (its consistent point: the row index within a snapshot is the order tables were read in,
    not an order of changes), so a snapshot's table rows count for the snapshot's events."""
    env = F.from_json(value.cast("string"), envelope_struct(schema))
    p = pos_order(F.coalesce(env["payload"]["source"]["kf_pos"], env["source"]["kf_pos"]))
    d = F.coalesce(p["d"], F.lit(1))
    return _clock_struct(
        p["a"],
        F.coalesce(p["b"], F.lit("")),
        F.coalesce(p["c"], F.lit(0)),
        d,
        F.when(d == 0, F.lit(0)).otherwise(F.coalesce(p["e"], F.lit(0))),
    )


def _ts_us(value: SparkColumn, schema: TableSchema) -> SparkColumn:
    env = F.from_json(value.cast("string"), envelope_struct(schema))
    return F.coalesce(env["payload"]["source"]["ts_ms"], env["source"]["ts_ms"]) * F.lit(1000)


def event_columns(ap: AsOfPlan, ev: DataFrame) -> DataFrame:
    """`ev` (``custom_events``) + ``_kf_fk<i>`` per item, ``_kf_rt`` (raw time, us) and ``_kf_pos``."""
    if ap.events:
        names = sorted({f for it in ap.items for f in it.fk} | {"recorded_at"})
        obj = F.from_json(F.col("_kf_value").cast("string"), StructType([StructField(n, StringType()) for n in names]))
        fks = [canonical([obj[f].try_cast(t) for f, t in zip(it.fk, it.key_types, strict=True)]) for it in ap.items]
        rt = F.unix_micros(F.try_to_timestamp(obj["recorded_at"]))
        pos = _clock_struct(F.col("_kf_order")["a"])
    else:
        assert ap.schema is not None
        env = F.from_json(F.col("_kf_value").cast("string"), envelope_struct(ap.schema, with_before=True))
        row = F.coalesce(
            F.coalesce(env["payload"]["after"], env["after"]), F.coalesce(env["payload"]["before"], env["before"])
        )
        needed = sorted({f for it in ap.items for f in it.fk})
        conv = converted_row(row, ap.schema, needed)
        fks = [canonical([conv[f].try_cast(t) for f, t in zip(it.fk, it.key_types, strict=True)]) for it in ap.items]
        rt = _ts_us(F.col("_kf_value"), ap.schema)
        pos = _pos(F.col("_kf_value"), ap.schema)
    return ev.select(
        "*", *[fk.alias(f"_kf_fk{i}") for i, fk in enumerate(fks)], rt.alias("_kf_rt"), pos.alias("_kf_pos")
    )


def stream_events(ap: AsOfPlan, raw: DataFrame) -> DataFrame:
    """A change topic's records in the stages' input shape (``custom_events``' columns, no view key):
    ``_kf_topic, _kf_partition, _kf_offset, _kf_key, _kf_value, _kf_op, _kf_order``; no tombstones or
    truncate markers (the deletes carry the change). What a windowed view feeds ``build_stage`` /
    ``follow_stage``: the stages release a log partition's events in offset order (event clocks are
    non-decreasing in it), so the rule after them reads each partition as it is in the log."""
    assert ap.schema is not None, "an event topic is folded by apply(), not by a windowed view"
    env = F.from_json(F.col("value").cast("string"), envelope_struct(ap.schema))
    op = F.coalesce(env["payload"]["op"], env["op"])
    pos = F.coalesce(env["payload"]["source"]["kf_pos"], env["source"]["kf_pos"])
    return record_frame(raw, op, pos)


def row_fields(ap: AsOfPlan) -> list[StructField]:
    """The enrichment's columns (``prefix + column``) with the looked-up tables' types."""
    return [
        StructField(o, spark_type(ap.tables[it.table].schema.column(c)), True)
        for it in ap.items
        for c, o in zip(it.columns, it.out_names, strict=True)
    ]


def enriched_columns(ap: AsOfPlan, asof: SparkColumn) -> list[SparkColumn]:
    """The enrichment's columns (typed as ``row_fields``) from a stage's ``_kf_asof`` text: each
    table's ``after`` row as it was, NULL columns where there was none."""
    struct = StructType(
        [StructField(it.asof.name, row_wire_struct(ap.tables[it.table].schema), True) for it in ap.items]
    )
    parsed = F.from_json(asof, struct)
    out: list[SparkColumn] = []
    for it in ap.items:
        row = converted_row(parsed[it.asof.name], ap.tables[it.table].schema, it.columns)
        out += [row[c].alias(o) for c, o in zip(it.columns, it.out_names, strict=True)]
    return out


def table_changes(ap: AsOfPlan, tb: AsOfTable, raw: DataFrame) -> DataFrame:
    """A table's changes: ``k, pos, rt, deleted, bad, after`` (+ where in the log); no tombstones or truncate
    markers."""
    schema = tb.schema
    j = F.from_json(F.col("value").cast("string"), envelope_struct(schema))
    op = F.coalesce(j["payload"]["op"], j["op"])
    after = F.coalesce(
        F.get_json_object(F.col("value").cast("string"), "$.payload.after"),
        F.get_json_object(F.col("value").cast("string"), "$.after"),
    )
    bad = op.isNull() | ~op.isin(*VALID_OPS)
    kj = F.from_json(F.col("key").cast("string"), key_struct(schema))
    krow = converted_row(
        F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key])), schema.key_schema()
    )
    out = raw.where(F.col("value").isNotNull()).select(
        canonical([krow[c] for c in schema.key]).alias("k"),
        _pos(F.col("value"), schema).alias("pos"),
        _ts_us(F.col("value"), schema).alias("rt"),
        (bad | (op == "d") | after.isNull()).alias("deleted"),
        bad.alias("bad"),
        F.when(~bad & (op != "d"), after).alias("after"),
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("key"),
        op.alias("op"),
    )
    return out.where(F.col("k").isNotNull() & (F.col("op").isNull() | (F.col("op") != "t"))).drop("op")


def _check_history(ap: AsOfPlan, tb: AsOfTable, raw: DataFrame) -> None:
    """Refuse a replay over a table topic that lost versions: with records missing below a
    partition's last offset (compaction, or retention that deleted the start), old events would be
    enriched with later rows, so the rebuilt view would differ from the one the follower made --
    silently. One aggregate per table (count and last offset per partition)."""
    per = (
        raw.groupBy("partition").agg(F.count(F.lit(1)).alias("n"), F.max("offset").alias("last")).toArrow().to_pylist()
    )
    gaps = sorted((r["partition"], r["last"] + 1 - r["n"], r["last"] + 1) for r in per if r["n"] < r["last"] + 1)
    if gaps:
        lost = ", ".join(f"partition {p}: {n} of {total}" for p, n, total in gaps[:4])
        raise ConfigError(
            f"projection {ap.projection!r}: an as_of lookup needs every version of table topic {tb.topic!r}, "
            f"but records are missing from its history ({lost} records gone to compaction or retention); "
            f"a replay would enrich old events with later rows and differ from the view the follower made. "
            f"List the table in its source's keep_history (kappaflow.toml [sources.<name>] keep_history = "
            f'["schema.table"]) so capture creates the topic keeping every version, then delete the topic and '
            f"re-read the table (`kappaflow log delete`, `kappaflow snapshot`); or use a Lookup (current rows)"
        )


def _asof_json(ap: AsOfPlan, rows: list[SparkColumn]) -> SparkColumn:
    """``{"<name>": <after row JSON or null>, ...}``: the same text follow builds in Python."""
    parts: list[SparkColumn] = []
    for i, it in enumerate(ap.items):
        parts += [
            F.lit(("{" if i == 0 else ",") + orjson.dumps(it.asof.name).decode() + ":"),
            F.coalesce(rows[i], F.lit("null")),
        ]
    return F.concat(*parts, F.lit("}"))


def asof_text(ap: AsOfPlan, rows: list[str | None]) -> str:
    out = []
    for it, r in zip(ap.items, rows, strict=True):
        out.append(orjson.dumps(it.asof.name).decode() + ":" + (r if r is not None else "null"))
    return "{" + ",".join(out) + "}"


def _lit_clock(c: Clock) -> SparkColumn:
    return F.struct(*[F.lit(v).alias(n) for v, n in zip(c, CLOCK, strict=True)]).cast(
        "struct<a:bigint,b:string,c:bigint,d:int,e:bigint>"
    )


def _time_clock(us: SparkColumn) -> SparkColumn:
    return _clock_struct(us)


def _tuple(row: Any) -> Clock | None:
    if row is None:
        return None
    d = row.asDict() if hasattr(row, "asDict") else dict(row)
    if d.get("a") is None:
        return None
    return (int(d["a"]), str(d["b"]), int(d["c"]), int(d["d"]), int(d["e"]))


def _clock_of(v: Any) -> Clock | None:
    """A clock stored as a JSON list."""
    return (int(v[0]), str(v[1]), int(v[2]), int(v[3]), int(v[4])) if v else None


def _time_tuple(us: int | None) -> Clock | None:
    return (int(us), "", 0, 1, 0) if us is not None else None


def _max(a: Clock | None, b: Clock | None) -> Clock | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


# --- state --------------------------------------------------------------------------------------------------
def _q(name: str) -> Any:
    from psycopg import sql

    return sql.Identifier(name)


def _table_name(base: str, suffix: str) -> str:
    name = base + suffix
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    keep = 63 - len(suffix.encode()) - 9
    return base.encode()[:keep].decode(errors="ignore") + "_" + digest + suffix


_HIST_COLS = ["k", "a", "b", "c", "d", "e", "pa", "pb", "pc", "pd", "pe", "deleted", "row"]


class AsOfState:
    """The state tables of one view target (see the module docstring) on the sink's connection."""

    def __init__(self, conn: Any, schema: str, target: Target, ap: AsOfPlan) -> None:
        self.conn = conn
        self.base = f"asof__{schema}__{target.name}"
        self.ap = ap

    def name(self, suffix: str) -> str:
        return _table_name(self.base, suffix)

    def rel(self, suffix: str) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(self.name(suffix)))

    def suffixes(self) -> list[str]:
        return ["__m", *[f"__h{t.index}" for t in self.ap.tables]]

    def exists(self) -> bool:
        names = [self.name(s) for s in self.suffixes()]
        row = self.conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = ANY(%s) AND c.relkind = 'r'",
            (KF_SCHEMA, names),
        ).fetchone()
        return bool(row and row[0] == len(names))

    def create(self) -> None:
        from psycopg import sql

        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(KF_SCHEMA)))
        self.drop()
        self.conn.execute(
            sql.SQL("CREATE TABLE {} (id integer PRIMARY KEY, frontiers jsonb NOT NULL, pending bytea)").format(
                self.rel("__m")
            )
        )
        self.conn.execute(sql.SQL("INSERT INTO {} VALUES (1, '{{}}', NULL)").format(self.rel("__m")))
        for t in self.ap.tables:
            self.conn.execute(
                sql.SQL(
                    'CREATE TABLE {} (k text NOT NULL, a bigint, b text COLLATE "C", c bigint, d integer, e bigint, '
                    'pa bigint, pb text COLLATE "C", pc bigint, pd integer, pe bigint, deleted boolean NOT NULL, '
                    "row text, "
                    "PRIMARY KEY (k, a, b, c, d, e, pa, pb, pc, pd, pe))"
                ).format(self.rel(f"__h{t.index}"))
            )

    def drop(self) -> None:
        from psycopg import sql

        for s in self.suffixes():
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self.rel(s)))

    def truncate(self) -> None:
        self.create()

    def replace(self, other: AsOfState) -> None:
        """Make `other`'s tables (a rebuilt shadow's) this target's (inside the swap's transaction)."""
        from psycopg import sql

        for s in self.suffixes():
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self.rel(s)))
            self.conn.execute(sql.SQL("ALTER TABLE IF EXISTS {} RENAME TO {}").format(other.rel(s), _q(self.name(s))))

    # frontiers: {"F": {table index: clock}, "G": clock or null, "GT": running max event time (us) or null}
    def load_meta(self) -> tuple[dict[str, Any], pa.Table | None]:
        from psycopg import sql

        row = self.conn.execute(
            sql.SQL("SELECT frontiers, pending FROM {} WHERE id = 1").format(self.rel("__m"))
        ).fetchone()
        if row is None:
            return {}, None
        pending = pa.ipc.open_stream(bytes(row[1])).read_all() if row[1] is not None else None
        return dict(row[0]), pending

    def save_meta(self, meta: dict[str, Any], pending: pa.Table | None) -> None:
        from psycopg import sql
        from psycopg.types.json import Jsonb

        blob = None
        if pending is not None and pending.num_rows:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, pending.schema) as w:
                w.write_table(pending)
            blob = sink.getvalue().to_pybytes()
        self.conn.execute(
            sql.SQL("UPDATE {} SET frontiers = %s, pending = %s WHERE id = 1").format(self.rel("__m")),
            (Jsonb(meta), blob),
        )

    def add_history(self, ti: int, rows: list[tuple[Any, ...]]) -> None:
        from psycopg import sql

        if not rows:
            return
        self.conn.execute(
            sql.SQL("CREATE TEMP TABLE IF NOT EXISTS kf_asof_stg (LIKE {}) ON COMMIT DROP").format(self.rel(f"__h{ti}"))
        )
        self.conn.execute("TRUNCATE pg_temp.kf_asof_stg")
        cols = sql.SQL(", ").join(_q(c) for c in _HIST_COLS)
        with (
            self.conn.cursor() as cur,
            cur.copy(sql.SQL("COPY pg_temp.kf_asof_stg ({}) FROM STDIN").format(cols)) as cp,
        ):
            for r in rows:
                cp.write_row(r)
        self.conn.execute(
            sql.SQL("INSERT INTO {} ({c}) SELECT {c} FROM pg_temp.kf_asof_stg ON CONFLICT DO NOTHING").format(
                self.rel(f"__h{ti}"), c=cols
            )
        )

    def history(self, ti: int, keys: list[str]) -> dict[str, list[tuple[Clock, Clock, bool, str | None]]]:
        from psycopg import sql

        out: dict[str, list[tuple[Clock, Clock, bool, str | None]]] = {}
        if not keys:
            return out
        rows = self.conn.execute(
            sql.SQL("SELECT k, a, b, c, d, e, pa, pb, pc, pd, pe, deleted, row FROM {} WHERE k = ANY(%s)").format(
                self.rel(f"__h{ti}")
            ),
            (keys,),
        ).fetchall()
        for r in rows:
            out.setdefault(r[0], []).append(
                ((r[1], r[2], r[3], r[4], r[5]), (r[6], r[7], r[8], r[9], r[10]), r[11], r[12])
            )
        for v in out.values():
            v.sort(key=lambda x: (x[0], x[1]))
        return out

    def prune(self, ti: int, bound: Clock, keys: list[str] | None) -> None:
        """Drop versions before `bound` except each key's newest one before it (`keys`: only those keys)."""
        from psycopg import sql

        rel = self.rel(f"__h{ti}")
        only = sql.SQL("AND x.k = ANY(%s)") if keys is not None else sql.SQL("")
        self.conn.execute(
            sql.SQL(
                "DELETE FROM {rel} x WHERE (x.a, x.b, x.c, x.d, x.e) < (%s, %s, %s, %s, %s) {only} AND EXISTS ("
                "SELECT 1 FROM {rel} y WHERE y.k = x.k AND (y.a, y.b, y.c, y.d, y.e) < (%s, %s, %s, %s, %s) AND "
                "(y.a, y.b, y.c, y.d, y.e, y.pa, y.pb, y.pc, y.pd, y.pe) > "
                "(x.a, x.b, x.c, x.d, x.e, x.pa, x.pb, x.pc, x.pd, x.pe))"
            ).format(rel=rel, only=only),
            [*bound, *([keys] if keys is not None else []), *bound],
        )


# --- transactions (follow) -------------------------------------------------------------------------------
@dataclass
class _Batch:
    conn: Any
    schema: str


_ACTIVE: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("kappaflow_asof_batch", default=None)


def _connection(ap: AsOfPlan, sink: Any) -> Any:
    conn = sink.state_connection()
    if conn is None:
        raise ConfigError(
            f"projection {ap.projection!r}: 'as_of': the {sink.kind} sink has no transaction shared "
            "with the views database; an as-of view lives in PostgreSQL"
        )
    return conn


def _schema(sink: Any, target: Target) -> str:
    return str(target.view.namespace or getattr(sink, "default_schema", "public"))


@contextlib.contextmanager
def transaction(ap: AsOfPlan | None, sink: Any, target: Target) -> Iterator[None]:
    """The as-of state's updates commit with the view rows and positions (``engine.apply_batch``)."""
    if ap is None:
        yield
        return
    conn = _connection(ap, sink)
    with conn.transaction():  # the sink's write becomes a savepoint in it
        token = _ACTIVE.set(_Batch(conn, _schema(sink, target)))
        try:
            yield
        finally:
            _ACTIVE.reset(token)


def swap(ap: AsOfPlan, sink: Any, shadow: Target) -> Target:
    """``sink.swap(shadow)`` and the shadow's as-of state becomes the live one, in one transaction."""
    conn = _connection(ap, sink)
    live = Target(shadow.view, shadow.view.name)
    with conn.transaction():
        out = sink.swap(shadow)
        AsOfState(conn, _schema(sink, live), live, ap).replace(AsOfState(conn, _schema(sink, shadow), shadow, ap))
    return out


def drop(ap: AsOfPlan, sink: Any, target: Target) -> None:
    conn = _connection(ap, sink)
    with conn.transaction():
        AsOfState(conn, _schema(sink, target), target, ap).drop()


def _dead(tb: AsOfTable, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    reason = f"{BAD_REASON}; a record of {tb.topic}, read for as-of enrichment: it counts as a delete of that row"
    return [
        {"topic": r["topic"], "partition": r["partition"], "offset": r["offset"], "key": r["key"], "reason": reason}
        for r in rows
    ]


# --- replay -------------------------------------------------------------------------------------------------
def build_stage(
    ap: AsOfPlan, sink: Any, target: Target, ev: DataFrame, raws: dict[str, DataFrame], dead: list[dict[str, Any]]
) -> DataFrame:
    """The released events of [0, end) with ``_kf_asof``; the target's state (history, frontiers and the
    waiting events) is loaded from the same frames before the rows are folded."""
    ev = event_columns(ap, ev)
    if not ap.events and ap.any_time:  # change records: running max of the commit time in position order
        w = Window.orderBy("_kf_pos", "_kf_topic", "_kf_partition", "_kf_offset").rowsBetween(
            Window.unboundedPreceding, Window.currentRow
        )
        ev = ev.withColumn("_kf_et", F.max("_kf_rt").over(w))
    else:
        ev = ev.withColumn("_kf_et", F.col("_kf_rt"))
    tabs: dict[int, DataFrame] = {}
    frontiers: dict[int, Clock | None] = {}
    g_row = ev.agg(F.max("_kf_pos").alias("p"), F.max("_kf_et").alias("t")).collect()[0]
    g_pos, g_time = _tuple(g_row["p"]), (int(g_row["t"]) if g_row["t"] is not None else None)
    for tb in ap.tables:
        _check_history(ap, tb, raws[tb.topic])
        tc = table_changes(ap, tb, raws[tb.topic])
        bad = tc.where(F.col("bad")).select("topic", "partition", "offset", "key").collect()
        dead += _dead(tb, [r.asDict() for r in bad])
        if tb.by_position:
            tc = tc.withColumn("eff", F.col("pos"))
            f = _max(_tuple(tc.agg(F.max("pos").alias("m")).collect()[0]["m"]), g_pos)
        else:
            w = Window.orderBy("pos", "topic", "partition", "offset").rowsBetween(
                Window.unboundedPreceding, Window.currentRow
            )
            tc = tc.withColumn("eff", _time_clock(F.max("rt").over(w)))
            f = _tuple(tc.agg(F.max("eff").alias("m")).collect()[0]["m"])
        tabs[tb.index] = tc.select("k", "eff", "pos", "deleted", "after")
        frontiers[tb.index] = f
    for tb in ap.tables:
        ev = ev.withColumn(f"_kf_c{tb.index}", F.col("_kf_pos") if tb.by_position else _time_clock(F.col("_kf_et")))
    released = F.lit(True)
    for tb in ap.tables:
        f = frontiers[tb.index]
        c = F.col(f"_kf_c{tb.index}")
        if f is None:
            ok = F.lit(False)
        elif tb.by_position:  # a snapshot's clock is shared: released once the reads are past it
            ok = (c < _lit_clock(f)) | ((c == _lit_clock(f)) & (c["d"] != 0))
        else:
            ok = c <= _lit_clock(f)
        released = released & (c.isNull() | ok)
    ev = ev.withColumn("_kf_rel", released)
    pending = ev.where(~F.col("_kf_rel")).drop("_kf_rel").toArrow()
    meta = {"F": {str(k): v for k, v in frontiers.items()}, "GP": g_pos, "GT": g_time}
    bounds = _bounds(ap, pending, g_pos, g_time)
    conn = _connection(ap, sink)
    try:
        with conn.transaction():
            state = AsOfState(conn, _schema(sink, target), target, ap)
            state.create()
            for tb in ap.tables:
                h = tabs[tb.index]
                b = bounds[tb.index]
                if b is not None:
                    below = F.col("eff") < _lit_clock(b)
                    rk = F.row_number().over(Window.partitionBy("k").orderBy(F.desc("eff"), F.desc("pos")))
                    h = h.where(~below).unionByName(
                        h.where(below).withColumn("_r", rk).where(F.col("_r") == 1).drop("_r")
                    )
                tbl = h.select(
                    "k",
                    *[F.col("eff")[n].alias(n) for n in CLOCK],
                    *[F.col("pos")[n].alias("p" + n) for n in CLOCK],
                    "deleted",
                    F.col("after").alias("row"),
                ).toArrow()
                state.add_history(tb.index, list(zip(*[tbl.column(c).to_pylist() for c in _HIST_COLS], strict=True)))
            state.save_meta(meta, pending if pending.num_rows else None)
    except Exception as exc:
        if isinstance(exc, (SinkError, ConfigError)):
            raise
        raise SinkError(f"loading the as-of state of view {target.view.name!r}: {exc}") from None
    out = ev.where(F.col("_kf_rel"))
    rows: list[SparkColumn] = []
    for i, it in enumerate(ap.items):
        tc = tabs[it.table]
        e = out.select(
            "*", F.col(f"_kf_fk{i}").alias("_j_k"), F.col(f"_kf_c{it.table}").alias("_j_t"), F.lit(0).alias("_j_tier")
        )
        # equal clocks: time -- the event first (a change at the same instant does not count); position --
        # the change first (only rows of one snapshot share a position: they count for each other)
        first = 0 if ap.tables[it.table].by_position else 1
        e = e.withColumn("_j_tier", F.lit(1 - first))
        t = tc.select(
            F.col("k").alias("_j_k"),
            F.col("eff").alias("_j_t"),
            F.lit(first).alias("_j_tier"),
            F.col("pos").alias("_j_pos"),
            F.struct(F.col("deleted"), F.col("after")).alias("_j_v"),
        )
        u = e.unionByName(t, allowMissingColumns=True)
        w = (
            Window.partitionBy("_j_k")
            .orderBy("_j_t", "_j_tier", "_j_pos")
            .rowsBetween(Window.unboundedPreceding, Window.currentRow)
        )
        v = F.last("_j_v", ignorenulls=True).over(w)
        out = (
            u.withColumn(
                f"_kf_r{i}", F.when(F.col("_j_k").isNotNull() & F.col("_j_t").isNotNull() & ~v["deleted"], v["after"])
            )
            .where(F.col("_j_v").isNull())
            .drop("_j_k", "_j_t", "_j_tier", "_j_pos", "_j_v")
        )
        rows.append(F.col(f"_kf_r{i}"))
    return out.withColumn("_kf_asof", _asof_json(ap, rows)).select(
        *[c for c in ev.columns if not c.startswith("_kf_") or c in _EV_KEEP], "_kf_asof"
    )


_EV_KEEP = ("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key", "_kf_value", "_kf_op", "_kf_order")


def _bounds(ap: AsOfPlan, pending: pa.Table | None, g_pos: Clock | None, g_time: int | None) -> dict[int, Clock | None]:
    """Per table: the clock below which no event can come any more (None: keep every version)."""
    out: dict[int, Clock | None] = {}
    for tb in ap.tables:
        col = f"_kf_c{tb.index}"
        raw = pending.column(col).to_pylist() if pending is not None and pending.num_rows else []
        cl = [c for c in (_tuple(x) for x in raw) if c is not None]
        if cl:
            out[tb.index] = min(cl)
        elif tb.by_position:
            out[tb.index] = g_pos
        else:
            out[tb.index] = (g_time, "", 0, 1, 0) if g_time is not None else None
    return out


# --- follow ---------------------------------------------------------------------------------------------------
def follow_stage(
    ap: AsOfPlan,
    spark: Any,
    sink: Any,
    target: Target,
    ev: DataFrame,
    raws: dict[str, DataFrame],
    dead: list[dict[str, Any]],
) -> DataFrame:
    """Apply one batch: table changes into the history, frontiers moved, events released (the waiting ones
    first) with ``_kf_asof``, the rest kept waiting. Runs inside ``transaction``."""
    b = _ACTIVE.get()
    if b is None:
        raise SinkError(f"projection {ap.projection!r}: an as-of batch runs inside asof_stage.transaction()")
    state = AsOfState(b.conn, b.schema, target, ap)
    before = sink.read_positions(target)
    if not state.exists():
        if any(before.values()):
            raise SinkError(
                f"view {target.view.name!r} has stored positions but no as-of state "
                f"({state.name('__m')} in schema kappaflow): rebuild it with `kappaflow replay`"
            )
        state.create()
    elif not any(before.values()):
        state.truncate()
    meta, pending = state.load_meta()
    frontiers: dict[int, Clock | None] = {int(k): _clock_of(v) for k, v in (meta.get("F") or {}).items()}
    g_pos: Clock | None = _clock_of(meta.get("GP"))
    g_time: int | None = meta.get("GT")
    evx = event_columns(ap, ev).withColumn("_kf_et", F.col("_kf_rt"))
    for tb in ap.tables:
        evx = evx.withColumn(f"_kf_c{tb.index}", F.lit(None).cast("struct<a:bigint,b:string,c:bigint,d:int,e:bigint>"))
    cols = evx.columns
    batch = evx.toArrow()
    # event clocks: running max of the commit time for change records, in position order, from the stored one
    recs = batch.to_pylist()
    recs.sort(
        key=lambda r: (_tuple(r["_kf_pos"]) or (-1, "", 0, 0, 0), r["_kf_topic"], r["_kf_partition"], r["_kf_offset"])
    )
    for r in recs:
        if not ap.events and r["_kf_rt"] is not None:
            g_time = r["_kf_rt"] if g_time is None else max(g_time, r["_kf_rt"])
            r["_kf_et"] = g_time
        elif ap.events and r["_kf_rt"] is not None:
            g_time = r["_kf_rt"] if g_time is None else max(g_time, r["_kf_rt"])
        g_pos = _max(g_pos, _tuple(r["_kf_pos"]))
    changed_keys: dict[int, set[str]] = {}
    for tb in ap.tables:
        raw = raws.get(tb.topic)
        ch = table_changes(ap, tb, raw).toArrow().to_pylist() if raw is not None else []
        dead += _dead(tb, [r for r in ch if r["bad"]])
        ch.sort(key=lambda r: (_tuple(r["pos"]) or (-1, "", 0, 0, 0), r["topic"], r["partition"], r["offset"]))
        f = frontiers.get(tb.index)
        rows = []
        for r in ch:
            pos = _tuple(r["pos"]) or (-1, "", 0, 0, 0)
            if tb.by_position:
                eff: Clock | None = pos
            else:
                if r["rt"] is None:
                    continue  # no commit time: cannot be placed (the connector always writes one)
                eff = _max(f, (int(r["rt"]), "", 0, 1, 0))
            f = _max(f, eff)
            assert eff is not None
            rows.append((r["k"], *eff, *pos, bool(r["deleted"]), r["after"]))
        if tb.by_position:
            f = _max(f, g_pos)
        frontiers[tb.index] = f
        state.add_history(tb.index, rows)
        changed_keys[tb.index] = {r[0] for r in rows}
    for r in recs:
        for tb in ap.tables:
            c = _tuple(r["_kf_pos"]) if tb.by_position else _time_tuple(r["_kf_et"])
            r[f"_kf_c{tb.index}"] = dict(zip(CLOCK, c, strict=True)) if c is not None else None
    schema = batch.schema
    allrecs = (pending.to_pylist() if pending is not None else []) + recs

    def released(r: dict[str, Any]) -> bool:
        for tb in ap.tables:
            c = _tuple(r[f"_kf_c{tb.index}"])
            if c is None:
                continue
            f = frontiers.get(tb.index)
            if f is None or c > f or (tb.by_position and c == f and c[3] == 0):
                return False
        return True

    out = [r for r in allrecs if released(r)]
    waiting = [r for r in allrecs if not released(r)]
    texts: list[list[str | None]] = [[] for _ in out]
    for i, it in enumerate(ap.items):
        keys = sorted({r[f"_kf_fk{i}"] for r in out if r[f"_kf_fk{i}"] is not None})
        hist = state.history(it.table, keys)
        effs = {k: [h[0] for h in v] for k, v in hist.items()}
        for n, r in enumerate(out):
            k, c = r[f"_kf_fk{i}"], _tuple(r[f"_kf_c{it.table}"])
            row = None
            if k is not None and c is not None and k in hist:
                by_pos = ap.tables[it.table].by_position  # equal clocks: see build_stage
                j = (bisect.bisect_right(effs[k], c) if by_pos else bisect.bisect_left(effs[k], c)) - 1
                if j >= 0 and not hist[k][j][2]:
                    row = hist[k][j][3]
            texts[n].append(row)
    pend = pa.Table.from_pylist(waiting, schema=schema) if waiting else None
    gp_list = list(g_pos) if g_pos is not None else None
    state.save_meta(
        {
            "F": {str(k): (list(v) if v is not None else None) for k, v in frontiers.items()},
            "GP": gp_list,
            "GT": g_time,
        },
        pend,
    )
    bounds = _bounds(ap, pend, g_pos, g_time)
    for tb in ap.tables:
        bd = bounds[tb.index]
        if bd is not None and changed_keys[tb.index]:
            state.prune(tb.index, bd, sorted(changed_keys[tb.index]))
    result = [
        {
            **{c: r[c] for c in _EV_KEEP + tuple(k for k in cols if not k.startswith("_kf_"))},
            "_kf_asof": asof_text(ap, texts[n]),
        }
        for n, r in enumerate(out)
    ]
    keep = [c for c in cols if not c.startswith("_kf_") or c in _EV_KEEP]
    fields = [schema.field(c) for c in keep] + [pa.field("_kf_asof", pa.string())]
    tbl = pa.Table.from_pylist(result, schema=pa.schema(fields))
    spark_schema = StructType([*[ev.schema[c] for c in keep], StructField("_kf_asof", StringType())])
    return spark.createDataFrame(
        tbl if tbl.num_rows else pa.Table.from_pylist([], schema=pa.schema(fields)), schema=spark_schema
    )


__all__ = [
    "AsOfPlan",
    "AsOfState",
    "build_stage",
    "drop",
    "enriched_columns",
    "follow_stage",
    "row_fields",
    "stream_events",
    "swap",
    "table_schemas",
    "transaction",
]
