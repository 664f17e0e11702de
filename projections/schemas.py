"""Source table schemas, and how their JSON values become Spark values (in the JVM).

Change events carry values in Debezium's JSON encodings (``kappaflow.events.values``): DATE as days,
TIMESTAMP as micros, TIMESTAMPTZ as ISO text, DECIMAL as text, BYTES as base64... A
projection parses the envelope with ``from_json`` and an explicit schema derived from the
topic's ``TableSchema`` (found on ``<source>.__schema``), then converts each column with
native expressions, so no per-row Python runs for declarative folds.

Type mapping (source -> Spark): INT8/INT16 -> smallint, INT32/YEAR -> int, INT64 -> bigint,
FLOAT32 -> float, FLOAT64 -> double, DECIMAL(p,s) -> decimal(p or 38, s), VARIABLE_DECIMAL
-> decimal(38,18), DATE -> date, TIMESTAMP -> timestamp_ntz, TIMESTAMPTZ -> timestamp,
TIME and INTERVAL -> bigint micros, BYTES/BITS -> binary, UUID/JSON/ENUM/SET/STRING ->
string (JSON as its text), ARRAY -> array of the element type. Conversions never depend on
the Spark session time zone.

A view column keeps its source column's type, whatever the fold: a source ``timestamp``
(naive) stays ``timestamp`` (PostgreSQL ``timestamp without time zone``), a ``timestamptz``
stays ``timestamptz``. So in a projection's declared ``schema`` (Spark DDL, required for
custom folds) ``timestamp`` means timestamp WITHOUT time zone, as in SQL and PostgreSQL
(Spark's ``timestamp_ntz``; ``declared_struct``), and ``timestamp_ltz`` means with time zone.
(Spark alone would read ``timestamp`` as ``timestamp_ltz``: a custom fold of a ``timestamp``
column became ``timestamptz`` while a grouped ``Max`` of the same column stayed ``timestamp``.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from kappaflow.errors import ConfigError, ValidationError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.events.sources import layouts
from kappaflow.events.values import time_unit

SCHEMA_TOPIC_SUFFIX = ".__schema"
VARIABLE_DECIMAL = DecimalType(38, 18)

_POS_SPARK_TYPES = {"string": StringType(), "int64": LongType(), "boolean": BooleanType()}


def _pos_type() -> StructType:
    """``source.kf_pos`` as Spark reads it: ``kind`` and the fields the kinds' orderings read (each
    connector's layout names them, ``SourceLayout.spark_fields``, typed by its ``kf_pos_fields``)."""
    fields = {"kind": StructField("kind", StringType())}
    for layout in layouts():
        if layout.spark_order is None:
            continue
        types = {f["field"]: f["type"] for f in layout.kf_pos_fields}
        for name in layout.spark_fields:
            fields.setdefault(name, StructField(name, _POS_SPARK_TYPES[types[name]]))
    return StructType(list(fields.values()))


POS_TYPE = _pos_type()


def spark_type(col: Column) -> DataType:
    t = col.type
    if t in (FieldType.INT8, FieldType.INT16):
        return ShortType()
    if t in (FieldType.INT32, FieldType.YEAR):
        return IntegerType()
    if t in (FieldType.INT64, FieldType.TIME, FieldType.INTERVAL):
        return LongType()
    if t is FieldType.FLOAT32:
        return FloatType()
    if t is FieldType.FLOAT64:
        return DoubleType()
    if t is FieldType.BOOLEAN:
        return BooleanType()
    if t is FieldType.DECIMAL:
        precision = col.precision if col.precision and col.precision <= 38 else 38
        scale = col.scale or 0
        if scale > precision:
            precision = 38
        return DecimalType(precision, scale)
    if t is FieldType.VARIABLE_DECIMAL:
        return VARIABLE_DECIMAL
    if t is FieldType.DATE:
        return DateType()
    if t is FieldType.TIMESTAMP:
        return TimestampNTZType()
    if t is FieldType.TIMESTAMPTZ:
        return TimestampType()
    if t in (FieldType.BYTES, FieldType.BITS):
        return BinaryType()
    if t is FieldType.ARRAY:
        assert col.items is not None
        return ArrayType(spark_type(col.items), True)
    return StringType()  # STRING, UUID, JSON, ENUM, SET


def wire_type(col: Column) -> DataType:
    """The type ``from_json`` reads the column's JSON value as."""
    t = col.type
    if t in (FieldType.DECIMAL, FieldType.VARIABLE_DECIMAL, FieldType.TIMESTAMPTZ, FieldType.BYTES, FieldType.BITS):
        return StringType()
    if t is FieldType.DATE:
        return IntegerType()
    if t is FieldType.TIMESTAMP:
        return LongType()
    if t is FieldType.ARRAY:
        assert col.items is not None
        return ArrayType(wire_type(col.items), True)
    return spark_type(col)


def _needs_conversion(col: Column) -> bool:
    if col.type is FieldType.ARRAY:
        assert col.items is not None
        return _needs_conversion(col.items)
    if col.type is FieldType.TIME and time_unit(col) != "us":
        return True
    return wire_type(col) != spark_type(col)


def _micros(expr: SparkColumn, unit: str) -> SparkColumn:
    """Integer time values in ``unit`` (a column's ``time_unit``) as microseconds, exactly."""
    if unit == "ms":
        return expr * F.lit(1000)
    if unit == "ns":  # floor division through an exact decimal (a double would round at 2**53)
        return F.floor(expr.cast("decimal(20,0)") / F.lit(1000)).cast("long")
    return expr


def convert(expr: SparkColumn, col: Column) -> SparkColumn:
    """Native expression turning the wire value into the Spark value (NULL stays NULL)."""
    t = col.type
    if t in (FieldType.DECIMAL, FieldType.VARIABLE_DECIMAL):
        return expr.try_cast(spark_type(col))
    if t is FieldType.DATE:
        return F.date_from_unix_date(expr)
    if t is FieldType.TIME:
        return _micros(expr, time_unit(col))
    if t is FieldType.TIMESTAMP:
        # timestamp_ntz epoch + micros: exact and independent of the session time zone. The unit is
        # the column's (io.debezium.time.Timestamp: ms, NanoTimestamp: ns, kappaflow's own: us).
        micros = _micros(expr, time_unit(col))
        return F.try_add(F.expr("timestamp_ntz'1970-01-01 00:00:00'"), micros * F.expr("interval '0.000001' second"))
    if t is FieldType.TIMESTAMPTZ:
        return F.try_to_timestamp(expr)
    if t in (FieldType.BYTES, FieldType.BITS):
        return F.try_to_binary(expr, F.lit("base64"))
    if t is FieldType.ARRAY and col.items is not None and _needs_conversion(col.items):
        items = col.items
        return F.transform(expr, lambda x: convert(x, items))
    return expr


def row_wire_struct(schema: TableSchema) -> StructType:
    return StructType([StructField(c.name, wire_type(c), True) for c in schema.columns])


def row_struct(schema: TableSchema, names: Iterable[str] | None = None) -> StructType:
    cols = schema.columns if names is None else [schema.column(n) for n in names]
    return StructType([StructField(c.name, spark_type(c), True) for c in cols])


def envelope_struct(schema: TableSchema, *, with_before: bool = False) -> StructType:
    """Debezium envelope (also inside ``payload`` for messages that carry their schema)."""
    row = row_wire_struct(schema)
    fields = [
        StructField("after", row, True),
        StructField("op", StringType(), True),
        StructField("ts_ms", LongType(), True),
        StructField("source", StructType([StructField("ts_ms", LongType()), StructField("kf_pos", POS_TYPE)]), True),
    ]
    if with_before:
        fields.insert(0, StructField("before", row, True))
    env = StructType(fields)
    return StructType([*env.fields, StructField("payload", env, True)])


def key_struct(schema: TableSchema) -> StructType:
    ks = schema.key_schema()
    row = row_wire_struct(ks)
    return StructType([*row.fields, StructField("payload", row, True)])


def converted_row(parsed_row: SparkColumn, schema: TableSchema, names: Iterable[str] | None = None) -> SparkColumn:
    """A struct of converted column values from a parsed wire row (NULL row stays NULL)."""
    cols = schema.columns if names is None else [schema.column(n) for n in names]
    fields = [convert(parsed_row[c.name], c).alias(c.name) for c in cols]
    return F.when(parsed_row.isNotNull(), F.struct(*fields))


def record_frame(raw: DataFrame, op: SparkColumn, pos: SparkColumn, *extra: SparkColumn) -> DataFrame:
    """The change records of a topic read from the log, as the folds that order records themselves take
    them (custom folds, the as-of stage): coordinates (``_kf_topic``, ``_kf_partition``, ``_kf_offset``),
    the record's bytes (``_kf_key``, ``_kf_value``), its op and the order of its source position
    (``_kf_order``), then `extra`. Tombstones and truncate markers are left out: the deletes written
    after a truncate carry its rows."""
    return (
        raw.where(F.col("value").isNotNull())
        .select(
            F.col("topic").alias("_kf_topic"),
            F.col("partition").alias("_kf_partition"),
            F.col("offset").alias("_kf_offset"),
            F.col("key").alias("_kf_key"),
            F.col("value").alias("_kf_value"),
            op.alias("_kf_op"),
            pos_order(pos).alias("_kf_order"),
            *extra,
        )
        .where(F.col("_kf_op").isNull() | (F.col("_kf_op") != "t"))
    )


def pos_order(pos: SparkColumn) -> SparkColumn:
    """A struct that orders source positions like ``Position.sort_key`` within one kind.

    Each kind's five ordering columns come from its connector (``SourceLayout.spark_order``); a
    kind without one orders by ``position`` (null for kinds that have none)."""
    kind = pos["kind"]
    zero = F.lit(0).cast("bigint")
    slots: list[Any] = [pos["position"], F.lit(""), zero, F.lit(1), zero]
    branches: list[Any] = [None] * 5
    for layout in layouts():
        if layout.spark_order is None:
            continue
        for i, col in enumerate(layout.spark_order(pos)):
            cond = kind == layout.kind
            branches[i] = F.when(cond, col) if branches[i] is None else branches[i].when(cond, col)
    return F.struct(*[(b.otherwise(d) if b is not None else d).alias(name)
                      for b, d, name in zip(branches, slots, "abcde", strict=True)])


def declared_struct(spark: Any, ddl: str, where: str) -> StructType:
    """A projection's declared ``schema`` (Spark DDL) as a StructType, ``timestamp`` read as
    timestamp without time zone (see the module docstring); ConfigError naming `where` otherwise.

    Parsed in a session of its own (same SparkContext) whose ``spark.sql.timestampType`` is
    TIMESTAMP_NTZ, so the shared session's settings are untouched."""
    session = getattr(spark, "_kf_ddl_session", None)
    if session is None:
        session = spark.newSession()
        session.conf.set("spark.sql.timestampType", "TIMESTAMP_NTZ")
        spark._kf_ddl_session = session
    try:
        return session.createDataFrame([], ddl).schema
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if "TIMESTAMPTZ" in text.upper():
            hint = " (write timestamp_ltz for a timestamp with time zone, timestamp for one without)"
        raise ConfigError(f"{where}: {text[:500]}{hint}") from None


# --- schema topics --------------------------------------------------------------------------------
def schema_topic(topic: str) -> str:
    """``<source>.__schema`` for a topic named ``<source>.<schema>.<table>``."""
    return topic.split(".", 1)[0] + SCHEMA_TOPIC_SUFFIX


def load_table_schemas(
    log: Any, topics: Iterable[str], given: dict[str, TableSchema] | None = None
) -> dict[str, TableSchema]:
    """The latest ``TableSchema`` of each topic from its source's schema topic."""
    from kappaflow.errors import UnknownTopicError

    out: dict[str, TableSchema] = dict(given or {})
    wanted = [t for t in topics if t not in out]
    by_schema_topic: dict[str, list[str]] = {}
    for t in wanted:
        by_schema_topic.setdefault(schema_topic(t), []).append(t)
    for st, ts in by_schema_topic.items():
        try:
            partitions = log.partitions(st)
        except UnknownTopicError:
            partitions = 0
        found: dict[str, tuple[int, TableSchema]] = {}
        for p in range(partitions):
            for rec in log.iter_partition(st, p):
                if rec.value is None:
                    continue
                try:
                    data = orjson.loads(rec.value)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(data, dict) and isinstance(data.get("schema"), dict) and "columns" in data["schema"]:
                    data = data["schema"]
                if not isinstance(data, dict) or data.get("name") not in ts:
                    continue
                try:
                    schema = TableSchema.from_dict(data)
                except ValidationError as exc:
                    raise ValidationError(f"{st}[{p}] offset {rec.offset}: bad table schema: {exc}") from None
                prev = found.get(schema.name)
                if prev is None or rec.timestamp_ms >= prev[0]:
                    found[schema.name] = (rec.timestamp_ms, schema)
        for t in ts:
            if t not in found:
                raise ConfigError(
                    f"no schema for topic {t!r}: expected a table schema on {st!r} (written by `kappaflow capture`), "
                    "or give it explicitly: Source(topic, schema=TableSchema(...))"
                )
            out[t] = found[t][1]
    return out


__all__ = [
    "POS_TYPE",
    "convert",
    "converted_row",
    "declared_struct",
    "envelope_struct",
    "key_struct",
    "load_table_schemas",
    "pos_order",
    "row_struct",
    "row_wire_struct",
    "schema_topic",
    "spark_type",
    "wire_type",
]
