"""Compile a ProjectionSpec into Spark DataFrames (the engine behind replay, follow, verify).

Input: raw log DataFrames from the ``kappaflow`` data source (one per topic). Every
topic is parsed with ``from_json`` and an explicit schema from its ``TableSchema``
(``schemas.py``) into the canonical event frame::

    _kf_topic, _kf_partition, _kf_offset, _kf_key (record key bytes), _kf_op,
    _kf_deleted (tombstone, delete or no row), _kf_bad (value is not a change event),
    _kf_row (struct of converted column values of ``after``)

Strategies, one per fold kind (``LatestFold``, ``GroupFold``, ``CustomFold``):

- latest row: ``max_by(event, offset)`` per (topic, record key) — a native hash
  aggregate — then derive/where, version = offset. Every event of a key lives in one
  partition, so offsets order them.
- grouped: the same latest-row step gives the CURRENT row of every source key (the
  keyed state); aggregates run over current rows only, so moving a row between groups
  or deleting it retracts its old contribution without needing before-images.
  Replay aggregates natively in Spark; follow sends the batch's state changes to the
  sink, which keeps the keyed state and recomputes only the affected groups in the
  same transaction as the positions (``PostgresSink.apply_grouped``). Aggregates are
  restricted to ones both engines compute identically (count, sum, min, max, exact
  avg, sorted collect list/set; strings compare by code point).
- custom: events are ``repartition``ed by view key, ``sortWithinPartitions`` by (view
  key, source position, offset) and folded by ``fold.fold_partition`` inside
  ``mapInArrow`` — one Python call per partition, never one per key group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from kappaflow.errors import ConfigError
from kappaflow.events import TableSchema
from kappaflow.projections.api import (
    Aggregate,
    Avg,
    CollectList,
    CollectSet,
    Count,
    CustomFold,
    GroupFold,
    LatestFold,
    Max,
    Min,
    ProjectionSpec,
    Sum,
)
from kappaflow.projections.schemas import (
    converted_row,
    declared_struct,
    envelope_struct,
    key_struct,
    pos_order,
    row_struct,
    spark_type,
)
from kappaflow.projections.sinks.base import DELETED, VERSION, ViewColumn, ViewSpec
from kappaflow.projections.sinks.postgres import STATE_KEY, STATE_TOPIC, aggregate_sql_of, pg_type

META = ("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key")
VALID_OPS = ("c", "u", "d", "r", "t")


def _analysis_error(where: str, exc: Exception) -> ConfigError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"{where}: {text[:500]}")


@dataclass
class Plan:
    """A validated projection bound to its source schemas, with its view's shape."""

    spec: ProjectionSpec
    schemas: dict[str, TableSchema]
    view: ViewSpec
    row_columns: tuple[str, ...] = ()  # source columns of the (common) row struct
    state_columns: tuple[ViewColumn, ...] = ()  # grouped: columns kept per source key
    view_key_types: dict[str, DataType] = field(default_factory=dict)
    whole_rows: bool = False  # the fold receives whole source rows (apply()): any column change reaches it
    # Column expressions are built once and reused for every batch: each builder call is a
    # py4j round trip, and a follow micro-batch would otherwise pay hundreds of them.
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def _cached(self, key: Any, build: Any) -> Any:
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = build()
        return hit

    # --- building --------------------------------------------------------------------------
    @classmethod
    def build(cls, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        where = f"projection {spec.name!r}"
        for t in spec.change_topics:
            if t not in schemas:
                raise ConfigError(f"{where}: no table schema for source topic {t!r}")
            bad = [c.name for c in schemas[t].columns if c.name.startswith("_kf_")]
            if bad:
                raise ConfigError(f"{where}: source {t!r} has column(s) {bad}; names starting with '_kf_' are reserved")
        if isinstance(spec.fold, CustomFold):
            return cls._build_custom(spark, spec, schemas)
        first = schemas[spec.topics[0]]
        row_cols = first.column_names
        for t in spec.topics[1:]:
            other = schemas[t]
            diff = [
                c.name
                for c in first.columns
                if c.name not in other.column_names or spark_type(other.column(c.name)) != spark_type(c)
            ]
            if diff:
                raise ConfigError(
                    f"{where}: declarative projections over several topics need the same columns; "
                    f"{t!r} differs from {spec.topics[0]!r} in {diff}"
                )
        if isinstance(spec.fold, LatestFold):
            keyless = [t for t in spec.topics if not schemas[t].key]
            if keyless:
                raise ConfigError(
                    f"{where}: source topic(s) {keyless} have no key: their table has no primary key (the "
                    "change events' key is null), so the log keeps every change of it, append-only, and "
                    "nothing says which row a change belongs to. A latest-row view needs that: give the table a "
                    "primary key (or a unique index as its replica identity), or name the columns that identify "
                    "a row in the source's key_columns; or fold the topic with 'aggregates' or an apply() fold"
                )
            keys = set(first.key)
            if set(spec.key) != keys or not first.key:
                raise ConfigError(
                    f"{where}: 'key': a latest-row view is keyed by the source table's primary key "
                    f"{list(first.key)}, got {list(spec.key)}; to key by other columns declare 'aggregates' "
                    "(group by) or an apply() fold"
                )
        plan = cls(spec, schemas, view=None, row_columns=row_cols)
        empty = spark.createDataFrame([], plan._event_schema())
        rows = plan._rows(empty)  # derive + where validated here
        if isinstance(spec.fold, LatestFold):
            out = plan._latest_output(rows)
            cols = [
                ViewColumn(f.name, f.dataType, f.name not in spec.key) for f in out.schema.fields if f.name != VERSION
            ]
            plan.view = ViewSpec(spec.view, spec.name, spec.key, tuple(cols), spec.namespace, spec.view_options())
        else:
            assert isinstance(spec.fold, GroupFold)
            missing = [k for k in spec.key if k not in rows.columns]
            if missing:
                raise ConfigError(
                    f"{where}: 'key' (group by) column(s) {missing} are neither source columns "
                    f"nor 'derive' names (have {[c for c in rows.columns if not c.startswith('_kf_')]})"
                )
            inputs: list[str] = []
            for out_name, agg in spec.fold.aggregates:
                if agg.column is not None:
                    if agg.column not in rows.columns:
                        raise ConfigError(
                            f"{where}: 'aggregates'[{out_name!r}]: column {agg.column!r} is neither a "
                            "source column nor a 'derive' name"
                        )
                    if agg.column not in inputs and agg.column not in spec.key:
                        inputs.append(agg.column)
            state_names = list(spec.key) + inputs
            types = {f.name: f.dataType for f in rows.schema.fields}
            plan.state_columns = tuple(ViewColumn(n, types[n]) for n in state_names)
            for out_name, agg in spec.fold.aggregates:
                if agg.column is not None:
                    _check_agg_type(where, out_name, agg, types[agg.column])
            agg_df = plan._aggregate(plan._state_frame(rows), 0)
            cols = [
                ViewColumn(f.name, f.dataType, f.name not in spec.key)
                for f in agg_df.schema.fields
                if f.name != VERSION
            ]
            group = {
                "group_by": list(spec.key),
                "state_columns": [{"name": c.name, "pg_type": pg_type(c.type)} for c in plan.state_columns],
                "aggregates": [
                    {
                        "name": n,
                        "sql": aggregate_sql_of(a, types.get(a.column) if a.column else None),
                        "pg_type": pg_type(next(c.type for c in cols if c.name == n)),
                    }
                    for n, a in spec.fold.aggregates
                ],
            }
            plan.view = ViewSpec(
                spec.view, spec.name, spec.key, tuple(cols), spec.namespace, {**spec.view_options(), "group": group}
            )
        plan._check_declared_schema(spark)
        return plan

    @classmethod
    def _build_custom(cls, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        where = f"projection {spec.name!r}"
        assert spec.schema is not None
        struct = declared_struct(spark, spec.schema, f"{where}: 'schema'")
        names = [f.name for f in struct.fields]
        missing = [k for k in spec.key if k not in names]
        if missing:
            raise ConfigError(f"{where}: 'key' column(s) {missing} are not in 'schema' ({names})")
        cols = tuple(ViewColumn(f.name, f.dataType, f.name not in spec.key) for f in struct.fields)
        plan = cls(spec, schemas, ViewSpec(spec.view, spec.name, spec.key, cols, spec.namespace, spec.view_options()),
                   whole_rows=True)
        plan.view_key_types = {k: struct[k].dataType for k in spec.key}
        for src in spec.sources:
            mapping = dict(src.key or {k: k for k in spec.key})
            if sorted(mapping) != sorted(spec.key):
                raise ConfigError(
                    f"{where}: Source({src.topic!r}).key must map every view key column "
                    f"{list(spec.key)}, got {sorted(mapping)}"
                )
            if src.events:
                continue
            schema = schemas[src.topic]
            unknown = [c for c in mapping.values() if c not in schema.column_names]
            if unknown:
                raise ConfigError(
                    f"{where}: Source({src.topic!r}).key names column(s) {unknown} the topic does not "
                    f"have (columns: {list(schema.column_names)})"
                )
        return plan

    def _check_declared_schema(self, spark: SparkSession) -> None:
        """A declared ``schema`` on a declarative projection must match what it computes."""
        if not self.spec.schema:
            return
        declared = declared_struct(spark, self.spec.schema, f"projection {self.spec.name!r}: 'schema'")
        got = {c.name: c.type for c in self.view.columns}
        want = {f.name: f.dataType for f in declared.fields}
        problems = [
            f"{n}: declared {t.simpleString()}, computed {got[n].simpleString() if n in got else 'nothing'}"
            for n, t in want.items()
            if got.get(n) != t
        ]
        problems += [f"{n}: computed but not declared" for n in got if n not in want]
        if problems:
            raise ConfigError(
                f"projection {self.spec.name!r}: 'schema' does not match the computed columns: " + "; ".join(problems)
            )

    # --- parsing ---------------------------------------------------------------------------
    def _event_schema(self) -> StructType:
        row = row_struct(self.schemas[self.spec.topics[0]], self.row_columns)
        return StructType(
            [
                StructField("_kf_topic", StringType()),
                StructField("_kf_partition", IntegerType()),
                StructField("_kf_offset", LongType()),
                StructField("_kf_key", BinaryType()),
                StructField("_kf_op", StringType()),
                StructField("_kf_deleted", BooleanType()),
                StructField("_kf_bad", BooleanType()),
                StructField("_kf_row", row),
            ]
        )

    def events(self, raw: DataFrame, topic: str) -> DataFrame:
        """Canonical event frame of one topic's raw records (declarative folds)."""
        first, second = self._cached(("events", topic), lambda: self._event_columns(topic))
        return raw.select(*first).select(*second)

    def _event_columns(self, topic: str) -> tuple[list[SparkColumn], list[SparkColumn]]:
        schema = self.schemas[topic]
        j = F.from_json(F.col("value").cast("string"), envelope_struct(schema))
        first = [
            F.col("topic").alias("_kf_topic"),
            F.col("partition").alias("_kf_partition"),
            F.col("offset").alias("_kf_offset"),
            F.col("key").alias("_kf_key"),
            F.col("value").isNull().alias("_kf_tomb"),
            j.alias("_kf_j"),
        ]
        env = F.col("_kf_j")
        after = F.coalesce(env["payload"]["after"], env["after"])
        op = F.coalesce(env["payload"]["op"], env["op"])
        tomb = F.col("_kf_tomb")
        second = [
            *[F.col(m) for m in META],
            F.when(tomb, F.lit(None).cast("string")).otherwise(op).alias("_kf_op"),
            (tomb | (op == "d") | after.isNull()).alias("_kf_deleted"),
            (~tomb & (op.isNull() | ~op.isin(*VALID_OPS))).alias("_kf_bad"),
            converted_row(after, schema, self.row_columns).alias("_kf_row"),
        ]
        return first, second

    def all_events(self, raws: dict[str, DataFrame]) -> DataFrame:
        frames = [self.events(raws[t], t) for t in self.spec.topics]
        out = frames[0]
        for f in frames[1:]:
            out = out.unionByName(f)
        return out

    # --- declarative: latest row per source key ----------------------------------------------
    def latest(self, events: DataFrame, *, deduped: bool = False) -> DataFrame:
        """The latest event per (topic, record key): keyed state as of the input's end.

        ``deduped``: the input already holds one record per key (read with
        ``latestPerKey`` and one Spark partition per log partition), so no aggregation.
        A malformed latest event counts as a delete (and is dead-lettered by the caller):
        the same rule in replay and follow. The ``_kf_bad`` flag is not used as a filter
        before this point, so Spark never pushes the JSON parse into a second filter.
        """
        cond, cols = self._cached(
            "latest",
            lambda: (
                F.col("_kf_key").isNotNull(),
                [
                    F.col("_kf_topic"),
                    F.col("_kf_key"),
                    F.col("_kf_partition"),
                    F.col("_kf_offset"),
                    F.col("_kf_op"),
                    (F.col("_kf_deleted") | F.col("_kf_bad")).alias("_kf_deleted"),
                    F.col("_kf_row"),
                ],
            ),
        )
        ev = events.where(cond).select(*cols)
        if deduped:
            return ev
        cols = ["_kf_partition", "_kf_offset", "_kf_op", "_kf_deleted", "_kf_row"]
        agg = ev.groupBy("_kf_topic", "_kf_key").agg(F.max_by(F.struct(*cols), "_kf_offset").alias("_kf_l"))
        return agg.select("_kf_topic", "_kf_key", "_kf_l.*")

    def _rows(self, latest: DataFrame) -> DataFrame:
        """Expand the row struct, add derived columns and the ``where`` verdict (``_kf_keep``)."""
        meta = [c for c in latest.columns if c.startswith("_kf_") and c not in ("_kf_row", "_kf_row_present")]
        checked = ("rows", tuple(meta)) in self._memo
        head, derived, keep = self._cached(("rows", tuple(meta)), lambda: self._row_columns(meta))
        df = latest.select(*head)
        for name, expr in derived:
            try:
                df = df.withColumn(name, expr)
            except Exception as exc:
                raise _analysis_error(
                    f"projection {self.spec.name!r}: 'derive'[{name!r}] = {dict(self.spec.derive)[name]!r}", exc
                ) from None
        if self.spec.where and not checked:
            try:
                df.select(F.expr(self.spec.where))  # analysis check, once
            except Exception as exc:
                raise _analysis_error(f"projection {self.spec.name!r}: 'where' = {self.spec.where!r}", exc) from None
        return df.withColumn("_kf_keep", keep)

    def _row_columns(self, meta: list[str]) -> tuple[list[Any], list[tuple[str, SparkColumn]], SparkColumn]:
        head = [*[F.col(m) for m in meta], F.col("_kf_row").isNotNull().alias("_kf_row_present"), F.col("_kf_row.*")]
        derived = [(name, F.expr(expr)) for name, expr in self.spec.derive]
        keep: SparkColumn = ~F.col("_kf_deleted") & F.col("_kf_row_present")
        if self.spec.where:
            keep = keep & F.coalesce(F.expr(self.spec.where), F.lit(False))
        return head, derived, keep

    def rows(self, latest: DataFrame) -> DataFrame:
        return self._rows(latest)

    def _view_value_columns(self, rows: DataFrame) -> list[str]:
        fold = self.spec.fold
        assert isinstance(fold, LatestFold)
        derived = [n for n, _ in self.spec.derive]
        if fold.columns is not None:
            names = list(fold.columns)
            unknown = [c for c in names if c not in rows.columns or c.startswith("_kf_")]
            if unknown:
                raise ConfigError(
                    f"projection {self.spec.name!r}: 'columns' {unknown} are neither source columns nor 'derive' names"
                )
            return names + [d for d in derived if d not in names]
        return [c for c in self.row_columns if c not in derived] + derived

    def _latest_output(self, rows: DataFrame) -> DataFrame:
        return rows.select(*self._view_value_columns(rows), F.col("_kf_offset").alias(VERSION))

    def latest_view_rows(self, rows: DataFrame) -> DataFrame:
        """Replay: the live rows of a latest-row view (version = offset)."""
        return self._latest_output(rows.where("_kf_keep")).select(
            *self.view.column_names, VERSION, F.lit(False).alias(DELETED)
        )

    def latest_changes(self, rows: DataFrame) -> DataFrame:
        """Follow: one upsert or delete per key touched by the batch."""
        # Deletes and tombstones have no row: their key comes from the record key (the view
        # key of a latest-row view is the source primary key).
        cols, cond = self._cached("latest_changes", lambda: self._latest_change_columns(rows))
        # Records without a usable key (e.g. a truncate marker) change no row.
        return rows.select(*cols).where(cond)

    def latest_changes_at(self, rows: DataFrame) -> DataFrame:
        """``latest_changes`` plus where each change is in the log (``_kf_topic``, ``_kf_partition``;
        the offset is the version), so a row a sink refuses is dead-lettered with its position."""
        cols, cond = self._cached("latest_changes", lambda: self._latest_change_columns(rows))
        return rows.select(*cols, F.col("_kf_topic"), F.col("_kf_partition")).where(cond)

    def _latest_change_columns(self, rows: DataFrame) -> tuple[list[SparkColumn], SparkColumn]:
        schema = self.schemas[self.spec.topics[0]]
        kj = F.from_json(F.col("_kf_key").cast("string"), key_struct(schema))
        krow = converted_row(
            F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key])), schema.key_schema()
        )
        cols = [
            F.when(F.col("_kf_keep"), F.col(c)).alias(c)
            if c not in self.spec.key
            else F.coalesce(F.col(c), krow[c]).alias(c)
            for c in self._view_value_columns(rows)
        ]
        cols += [F.col("_kf_offset").alias(VERSION), (~F.col("_kf_keep")).alias(DELETED)]
        cond = F.lit(True)
        for k in self.spec.key:
            cond = cond & F.col(k).isNotNull()
        return cols, cond

    # --- declarative: grouped --------------------------------------------------------------
    def _state_frame(self, rows: DataFrame) -> DataFrame:
        return rows.select(
            F.col("_kf_topic").alias(STATE_TOPIC),
            F.col("_kf_key").alias(STATE_KEY),
            F.col("_kf_offset").alias(VERSION),
            *[c.name for c in self.state_columns],
            F.col("_kf_keep"),
        )

    def _group_present(self) -> SparkColumn:
        cond = F.lit(True)
        for k in self.spec.key:
            cond = cond & F.col(k).isNotNull()
        return cond

    def state_rows(self, rows: DataFrame) -> DataFrame:
        """Replay: current contributing row per source key (group columns not NULL)."""
        st = self._state_frame(rows)
        return st.where(F.col("_kf_keep") & self._group_present()).drop("_kf_keep")

    def state_changes(self, rows: DataFrame) -> DataFrame:
        """Follow: keyed-state upserts/deletes of the batch (a row leaving the filter or
        its groups becoming NULL is a delete)."""
        first, second = self._cached("state_changes", self._state_change_columns)
        return rows.select(*first).select(*second)

    def _state_change_columns(self) -> tuple[list[SparkColumn], list[SparkColumn]]:
        first = [
            F.col("_kf_topic").alias(STATE_TOPIC),
            F.col("_kf_key").alias(STATE_KEY),
            F.col("_kf_offset").alias(VERSION),
            *[F.col(c.name) for c in self.state_columns],
            F.col("_kf_keep"),
        ]
        keep = F.col("_kf_keep") & self._group_present()
        second = [
            F.col(STATE_TOPIC),
            F.col(STATE_KEY),
            F.col(VERSION),
            *[F.when(keep, F.col(c.name)).alias(c.name) for c in self.state_columns],
            (~keep).alias(DELETED),
        ]
        return first, second

    def _aggregate(self, state: DataFrame, version: int) -> DataFrame:
        fold = self.spec.fold
        assert isinstance(fold, GroupFold)
        aggs = [_spark_agg(a).alias(n) for n, a in fold.aggregates]
        return state.groupBy(*self.spec.key).agg(*aggs).withColumn(VERSION, F.lit(version).cast("bigint"))

    def group_view_rows(self, state: DataFrame, version: int) -> DataFrame:
        return self._aggregate(state, version).select(*self.view.column_names, VERSION, F.lit(False).alias(DELETED))

    # --- custom folds ------------------------------------------------------------------------
    def custom_events(self, raws: dict[str, DataFrame], *, in_place: bool = False) -> DataFrame:
        """Events for custom folds: view key, order and the raw value (decoded in Python).

        ``in_place`` (see ``fold_in_place``): no order columns and no JVM parse of the
        value at all; the view key comes from the record key.
        """
        frames = []
        for src in self.spec.sources:
            mapping = dict(src.key or {k: k for k in self.spec.key})
            raw = raws[src.topic]
            if src.events:
                frames.append(self._event_topic_events(raw, mapping))
                continue
            schema = self.schemas[src.topic]
            if in_place:
                kj = F.from_json(F.col("key").cast("string"), key_struct(schema))
                krow = F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key]))
                kconv = converted_row(krow, schema.key_schema())
                vk = [kconv[mapping[k]].cast(self.view_key_types[k]).alias(k) for k in self.spec.key]
                # not tombstones, nor truncate markers (op header; the deletes after them carry the rows)
                frames.append(
                    raw.where(F.col("value").isNotNull() & (F.col("op").isNull() | (F.col("op") != "t"))).select(
                        F.col("topic").alias("_kf_topic"),
                        F.col("partition").alias("_kf_partition"),
                        F.col("offset").alias("_kf_offset"),
                        F.col("key").alias("_kf_key"),
                        F.col("value").alias("_kf_value"),
                        *vk,
                    )
                )
                continue
            env = F.from_json(F.col("value").cast("string"), envelope_struct(schema, with_before=True))
            pos = F.coalesce(env["payload"]["source"]["kf_pos"], env["source"]["kf_pos"])
            op = F.coalesce(env["payload"]["op"], env["op"])
            if set(mapping.values()) <= set(schema.key):
                kj = F.from_json(F.col("key").cast("string"), key_struct(schema))
                krow = F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key]))
                kconv = converted_row(krow, schema.key_schema())
                vk = [kconv[mapping[k]].cast(self.view_key_types[k]).alias(k) for k in self.spec.key]
            else:
                after = F.coalesce(env["payload"]["after"], env["after"])
                before = F.coalesce(env["payload"]["before"], env["before"])
                row = F.coalesce(after, before)
                conv = converted_row(row, schema, sorted(set(mapping.values())))
                vk = [conv[mapping[k]].cast(self.view_key_types[k]).alias(k) for k in self.spec.key]
            frames.append(
                raw.where(F.col("value").isNotNull())
                .select(
                    F.col("topic").alias("_kf_topic"),
                    F.col("partition").alias("_kf_partition"),
                    F.col("offset").alias("_kf_offset"),
                    F.col("key").alias("_kf_key"),
                    F.col("value").alias("_kf_value"),
                    op.alias("_kf_op"),
                    pos_order(pos).alias("_kf_order"),
                    *vk,
                )
                .where(F.col("_kf_op").isNull() | (F.col("_kf_op") != "t"))
            )
        out = frames[0]
        for f in frames[1:]:
            out = out.unionByName(f)
        return out

    @property
    def fold_in_place(self) -> bool:
        """A custom fold over one topic keyed by its primary key needs no shuffle: every
        event of a key is in one log partition, in offset order."""
        if len(self.spec.sources) != 1 or self.spec.sources[0].events:
            return False
        src = self.spec.sources[0]
        mapping = dict(src.key or {k: k for k in self.spec.key})
        schema = self.schemas[src.topic]
        return bool(schema.key) and sorted(mapping.values()) == sorted(schema.key)

    def _event_topic_events(self, raw: DataFrame, mapping: dict[str, str]) -> DataFrame:
        """Event topics: the view key from the event's fields; order by its ``position``."""
        types: dict[str, DataType] = {"position": LongType()}
        for k in self.spec.key:
            types[mapping[k]] = self.view_key_types[k]
        struct = StructType([StructField(f, t) for f, t in sorted(types.items())])
        ev = F.from_json(F.col("value").cast("string"), struct)
        order = F.struct(
            ev["position"].cast("bigint").alias("a"),
            F.lit("").alias("b"),
            F.lit(0).cast("bigint").alias("c"),
            F.lit(1).alias("d"),
            F.lit(0).cast("bigint").alias("e"),
        )
        vk = [ev[mapping[k]].cast(self.view_key_types[k]).alias(k) for k in self.spec.key]
        return raw.where(F.col("value").isNotNull()).select(
            F.col("topic").alias("_kf_topic"),
            F.col("partition").alias("_kf_partition"),
            F.col("offset").alias("_kf_offset"),
            F.col("key").alias("_kf_key"),
            F.col("value").alias("_kf_value"),
            F.lit("c").alias("_kf_op"),
            order.alias("_kf_order"),
            *vk,
        )

    def sorted_for_fold(self, events: DataFrame, partitions: int) -> DataFrame:
        keys = list(self.spec.key)
        return events.repartition(partitions, *keys).sortWithinPartitions(
            *keys, "_kf_order", "_kf_topic", "_kf_partition", "_kf_offset"
        )


# --- aggregates in both engines ------------------------------------------------------------------
_NUMERIC = (ShortType, IntegerType, LongType, FloatType, DoubleType, DecimalType)


def _check_agg_type(where: str, name: str, agg: Aggregate, dt: DataType) -> None:
    if isinstance(agg, (Sum, Avg)) and not isinstance(dt, _NUMERIC):
        raise ConfigError(
            f"{where}: 'aggregates'[{name!r}]: {type(agg).__name__} needs a numeric column, "
            f"{agg.column!r} is {dt.simpleString()}"
        )
    if isinstance(agg, (Min, Max, CollectList, CollectSet)) and isinstance(dt, (ArrayType, StructType, BinaryType)):
        raise ConfigError(
            f"{where}: 'aggregates'[{name!r}]: {type(agg).__name__} over {dt.simpleString()} is not supported"
        )


def _spark_agg(agg: Aggregate) -> SparkColumn:
    c = F.col(agg.column) if agg.column else None
    if isinstance(agg, Count):
        return F.count(F.lit(1)) if c is None else F.count(c)
    assert c is not None
    if isinstance(agg, Sum):
        return F.sum(c)
    if isinstance(agg, Min):
        return F.min(c)
    if isinstance(agg, Max):
        return F.max(c)
    if isinstance(agg, Avg):
        return F.try_divide(F.sum(c).cast("double"), F.count(c))
    if isinstance(agg, CollectList):
        return F.array_sort(F.collect_list(c))
    if isinstance(agg, CollectSet):
        return F.array_sort(F.collect_set(c))
    raise ConfigError(f"unsupported aggregate {agg!r}")


def fold_output_type(plan: Plan) -> StructType:
    """mapInArrow output of a custom fold: view columns, version, deleted, dead-letter info."""
    fields = [StructField(c.name, c.type, True) for c in plan.view.columns]
    fields += [
        StructField(VERSION, LongType(), True),
        StructField(DELETED, BooleanType(), True),
        StructField("_kf_dl_topic", StringType(), True),
        StructField("_kf_dl_partition", IntegerType(), True),
        StructField("_kf_dl_offset", LongType(), True),
        StructField("_kf_dl_key", BinaryType(), True),
        StructField("_kf_dl_reason", StringType(), True),
    ]
    return StructType(fields)


__all__ = ["Plan", "fold_output_type"]
