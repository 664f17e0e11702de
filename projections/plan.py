"""Compile a ProjectionSpec into Spark DataFrames (the engine behind replay, follow, verify).

Input: raw log DataFrames from the ``kappaflow`` data source (one per topic). Every
topic is parsed with ``from_json`` and an explicit schema from its ``TableSchema``
(``schemas.py``) into the canonical event frame::

    _kf_topic, _kf_partition, _kf_offset, _kf_key (record key bytes), _kf_op,
    _kf_deleted (tombstone, delete or no row), _kf_bad (value is not a change event),
    _kf_row (struct of converted column values of ``after``)

Every declarative fold (latest row, grouped) starts with the same latest-row step:
``max_by(event, offset)`` per (topic, record key) — a native hash aggregate; every event of
a key lives in one partition, so offsets order them — then ``derive``/``where`` over the
row (``rows``: the ``_kf_keep`` verdict). What happens next depends on the fold kind and
lives in its strategy (``kappaflow.projections.folds``); ``Plan.build`` checks the source
schemas and hands over to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from kappaflow.errors import ConfigError
from kappaflow.events import TableSchema
from kappaflow.projections.api import ProjectionSpec
from kappaflow.projections.schemas import (
    converted_row,
    declared_struct,
    envelope_struct,
    row_struct,
    spark_type,
)
from kappaflow.projections.sinks.base import ViewSpec

META = ("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key")
VALID_OPS = ("c", "u", "d", "r", "t")


def analysis_error(where: str, exc: Exception) -> ConfigError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"{where}: {text[:500]}")


@dataclass
class Plan:
    """A validated projection bound to its source schemas, with its view's shape."""

    spec: ProjectionSpec
    schemas: dict[str, TableSchema]
    view: ViewSpec
    row_columns: tuple[str, ...] = ()  # source columns of the (common) row struct
    join: Any = None  # kappaflow.projections.joins.plan.JoinPlan of a joined projection (lookups, nested)
    asof: Any = None  # kappaflow.projections.joins.asof_stage.AsOfPlan of a projection with as_of
    # What the fold strategy compiled for itself (grouped: the columns kept per source key; custom:
    # the view key's types): only that strategy reads it, so a new fold kind adds no field here.
    compiled: Any = None
    whole_rows: bool = False  # the fold receives whole source rows (apply()): any column change reaches it
    # Column expressions are built once and reused for every batch: each builder call is a
    # py4j round trip, and a follow micro-batch would otherwise pay hundreds of them.
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def cached(self, key: Any, build: Any) -> Any:
        """`build()` once per `key` (Spark column expressions reused by every batch)."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = build()
        return hit

    # --- building --------------------------------------------------------------------------
    @classmethod
    def build(cls, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        """Check the sources' schemas, then compile with the fold's strategy (``kappaflow.projections.folds``)."""
        from kappaflow.projections.folds import strategy_for

        where = f"projection {spec.name!r}"
        for t in spec.change_topics:
            if t not in schemas:
                raise ConfigError(f"{where}: no table schema for source topic {t!r}")
            bad = [c.name for c in schemas[t].columns if c.name.startswith("_kf_")]
            if bad:
                raise ConfigError(f"{where}: source {t!r} has column(s) {bad}; names starting with '_kf_' are reserved")
        return strategy_for(spec).compile(spark, spec, schemas)

    def check_same_columns(self) -> None:
        """Declarative folds over several topics read one row struct: the topics need the same columns."""
        spec, schemas = self.spec, self.schemas
        first = schemas[spec.source_topics[0]]
        for t in spec.source_topics[1:]:
            other = schemas[t]
            diff = [
                c.name
                for c in first.columns
                if c.name not in other.column_names or spark_type(other.column(c.name)) != spark_type(c)
            ]
            if diff:
                raise ConfigError(
                    f"projection {spec.name!r}: declarative projections over several topics need the same columns; "
                    f"{t!r} differs from {spec.source_topics[0]!r} in {diff}"
                )

    def empty_rows(self, spark: SparkSession) -> DataFrame:
        """The row frame of no events: compiling against it validates ``derive`` and ``where``."""
        return self.rows(spark.createDataFrame([], self._event_schema()))

    def check_declared_schema(self, spark: SparkSession) -> None:
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
        row = (
            self.join.row_struct
            if self.join is not None
            else row_struct(self.schemas[self.spec.topics[0]], self.row_columns)
        )
        if self.asof is not None:  # each event's row with the tables' rows as they were then (windowed views)
            from kappaflow.projections.joins.asof_stage import row_fields

            row = StructType([*row.fields, *row_fields(self.asof)])
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

    def events(self, raw: DataFrame, topic: str, keep: tuple[str, ...] = ()) -> DataFrame:
        """Canonical event frame of one topic's raw records (declarative folds); `keep`: columns of
        `raw` carried along (an as-of stage's ``_kf_asof``)."""
        first, second = self.cached(("events", topic), lambda: self._event_columns(topic))
        return raw.select(*first, *keep).select(*second, *keep)

    def asof_events(self, staged: DataFrame, topic: str) -> DataFrame:
        """Canonical event frame of the records an as-of stage released (``joins.asof_stage``: the
        ``stream_events`` columns and ``_kf_asof``), the row extended with the enrichment's columns
        (``prefix + column``, NULL for a delete's absent row)."""
        from kappaflow.projections.joins.asof_stage import enriched_columns

        raw = staged.select(
            F.col("_kf_topic").alias("topic"),
            F.col("_kf_partition").alias("partition"),
            F.col("_kf_offset").alias("offset"),
            F.col("_kf_key").alias("key"),
            F.col("_kf_value").alias("value"),
            F.col("_kf_asof"),
        )
        ev = self.events(raw, topic, keep=("_kf_asof",))
        row = F.col("_kf_row")
        extended = F.struct(*[row[c].alias(c) for c in self._source_columns],
                            *enriched_columns(self.asof, F.col("_kf_asof")))
        return ev.withColumn("_kf_row", F.when(row.isNotNull(), extended)).drop("_kf_asof")

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
            converted_row(after, schema, self._source_columns).alias("_kf_row"),
        ]
        return first, second

    @property
    def _source_columns(self) -> tuple[str, ...]:
        """Columns parsed from the driving rows (with lookups, the row also gets the looked-up ones)."""
        return self.row_columns if self.join is None else self.join.driving.columns

    def all_events(self, raws: dict[str, DataFrame]) -> DataFrame:
        """Canonical events of the source topics (not of lookup tables: ``joins`` reads those)."""
        frames = [self.events(raws[t], t) for t in self.spec.source_topics]
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
        cond, cols = self.cached(
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

    def rows(self, latest: DataFrame) -> DataFrame:
        """Expand the row struct, add derived columns and the ``where`` verdict (``_kf_keep``)."""
        meta = [c for c in latest.columns if c.startswith("_kf_") and c not in ("_kf_row", "_kf_row_present")]
        checked = ("rows", tuple(meta)) in self._memo
        head, derived, keep = self.cached(("rows", tuple(meta)), lambda: self._row_columns(meta))
        df = latest.select(*head)
        for name, expr in derived:
            try:
                df = df.withColumn(name, expr)
            except Exception as exc:
                raise analysis_error(
                    f"projection {self.spec.name!r}: 'derive'[{name!r}] = {dict(self.spec.derive)[name]!r}", exc
                ) from None
        if self.spec.where and not checked:
            try:
                df.select(F.expr(self.spec.where))  # analysis check, once
            except Exception as exc:
                raise analysis_error(f"projection {self.spec.name!r}: 'where' = {self.spec.where!r}", exc) from None
        return df.withColumn("_kf_keep", keep)

    def _row_columns(self, meta: list[str]) -> tuple[list[Any], list[tuple[str, SparkColumn]], SparkColumn]:
        head = [*[F.col(m) for m in meta], F.col("_kf_row").isNotNull().alias("_kf_row_present"), F.col("_kf_row.*")]
        derived = [(name, F.expr(expr)) for name, expr in self.spec.derive]
        keep: SparkColumn = ~F.col("_kf_deleted") & F.col("_kf_row_present")
        if self.spec.where:
            keep = keep & F.coalesce(F.expr(self.spec.where), F.lit(False))
        return head, derived, keep



__all__ = ["META", "Plan", "analysis_error"]
