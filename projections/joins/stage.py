"""The join stage of replay (Spark DataFrame joins) and follow (PostgreSQL join state).

Both turn the driving table's latest records (``Plan.latest``) into joined-row records of the
same shape, which the folds consume unchanged:

- ``build_stage`` (replay): latest row per key of every looked-up table as of the replay's end
  offsets, left-joined along the lookup chains in Spark; the state tables of the target are
  loaded from the same frames, so catch-up and follow continue from them.
- ``follow_stage`` (follow micro-batch, replay catch-up): the batch's latest change per key of
  every table goes into the join state (``state.JoinState.apply``) inside the sink transaction
  that also writes the view rows and the positions (``transaction``); the joined rows of the
  affected driving keys come back from SQL and are parsed in Spark with the same options.
Versions: a joined row carries no single offset, so it takes the batch's watermark (replay: the
watermark of the end offsets), as grouped and custom views do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.joins.plan import JoinPlan
from kappaflow.projections.joins.state import JoinState
from kappaflow.projections.sinks.base import Target


def _needs_postgres(jp: JoinPlan, sink: Any) -> None:
    if getattr(sink, "kind", None) != "postgres" or not hasattr(sink, "conn"):
        raise ConfigError(
            f"projection {jp.projection!r}: a projection with lookups keeps its join state in the PostgreSQL "
            f"views database, in the transaction of the view rows; it cannot be folded into the "
            f"{getattr(sink, 'kind', sink)!r} sink"
        )


def state_for(jp: JoinPlan, sink: Any, target: Target) -> JoinState:
    _needs_postgres(jp, sink)
    schema = target.view.namespace or sink.default_schema
    return JoinState(sink.conn, schema, target, jp)


@contextlib.contextmanager
def transaction(jp: JoinPlan | None, sink: Any) -> Iterator[None]:
    """One transaction around a batch's join-state update and the sink's write (whose own
    transaction becomes a savepoint in it), so state, view rows and positions commit together."""
    if jp is None:
        yield
        return
    _needs_postgres(jp, sink)
    with sink.conn.transaction():
        yield


def _head(version: Any) -> list[Any]:
    return [F.col("_kf_topic"), F.col("_kf_key"), F.col("_kf_partition"), version.alias("_kf_offset"), F.col("_kf_op")]


# --- replay --------------------------------------------------------------------------------------
def build_stage(
    jp: JoinPlan,
    sink: Any,
    target: Target,
    latest: DataFrame,
    raws: dict[str, DataFrame],
    *,
    deduped: bool,
    version: int,
) -> DataFrame:
    """Joined rows as of the replay's end; fills the target's join state from the same frames."""
    tables = {
        ts.index: jp.table_latest(ts, raws[ts.topic], deduped=deduped).where(~F.col("deleted"))
        for ts in jp.topics[1:]
    }
    state = state_for(jp, sink, target)
    try:
        with sink.conn.transaction():
            state.create()
            drv = jp.driving_latest(latest).where(~F.col("deleted"))
            for ts in jp.topics:
                frame = drv if ts.index == 0 else tables[ts.index]
                rows = frame.select(
                    "k", "kb", "p", F.col("off").alias("ver"), jp.row_text(F.col("row")).alias("row"),
                    *[f"fk{j}" for j in ts.children],
                ).toArrow()
                state.load(ts, rows)
    except Exception as exc:
        if isinstance(exc, (SinkError, ConfigError)):
            raise
        raise SinkError(f"loading the join state of view {target.view.name!r}: {exc}") from None
    df = latest.select(
        "*", *[jp.fk_column(lp, F.col("_kf_row")).alias(f"_kf_fk{lp.index}") for lp in jp.lookups if lp.parent is None]
    )
    for lp in jp.lookups:
        i = lp.index
        kids = [c for c in jp.lookups if c.parent == i]
        right = tables[lp.topic_index].select(
            F.col("k").alias(f"_kf_jk{i}"),
            F.col("row").alias(f"_kf_jr{i}"),
            *[F.col(f"fk{c.index}").alias(f"_kf_fk{c.index}") for c in kids],
        )
        df = df.join(right, df[f"_kf_fk{i}"] == right[f"_kf_jk{i}"], "left")
    return jp.assemble(
        df,
        F.col("_kf_row"),
        [F.col(f"_kf_jr{lp.index}") for lp in jp.lookups],
        [F.col(f"_kf_jk{lp.index}").isNotNull() for lp in jp.lookups],
        _head(F.lit(version).cast("bigint")),
        F.col("_kf_deleted"),
    )


def swap(jp: JoinPlan | None, sink: Any, shadow: Target) -> Target:
    """``sink.swap(shadow)`` and, for a join, the shadow's join state becomes the live one in the
    same transaction."""
    if jp is None:
        return sink.swap(shadow)
    live = Target(shadow.view, shadow.view.name)
    with sink.conn.transaction():
        out = sink.swap(shadow)
        state_for(jp, sink, live).replace(state_for(jp, sink, shadow))
    return out


def drop(jp: JoinPlan | None, sink: Any, target: Target) -> None:
    """Drop a target's join state (a shadow or verify scratch that is dropped itself)."""
    if jp is None or getattr(sink, "kind", None) != "postgres":
        return
    with sink.conn.transaction():
        state_for(jp, sink, target).drop()


# --- follow --------------------------------------------------------------------------------------
_CHANGE_HEAD = ["ti", "k", "kb", "p", "off", "deleted", "row"]


def follow_stage(
    jp: JoinPlan,
    spark: Any,
    sink: Any,
    target: Target,
    latest: DataFrame,
    raws: dict[str, DataFrame],
    *,
    deduped: bool,
) -> DataFrame:
    """Apply the batch to the join state and return the joined rows of every affected driving key.
    Must run inside ``transaction``."""
    state = state_for(jp, sink, target)
    before = sink.read_positions(target)
    if not state.exists():
        if any(before.values()):
            raise SinkError(
                f"view {target.view.name!r} has stored positions but no join state "
                f"({state.table(0)} ... in schema kappaflow): rebuild it with `kappaflow replay`"
            )
        state.create()
    elif not any(before.values()):
        state.truncate()  # a new, empty view folds the log from its start: so does its state
    n = len(jp.lookups)
    frames = []
    for ts in jp.topics:
        raw = raws.get(ts.topic)
        if ts.index == 0:
            base = jp.driving_latest(latest)
        elif raw is None:
            continue
        else:
            base = jp.table_latest(ts, raw, deduped=deduped)
        frames.append(
            base.select(
                F.lit(ts.index).alias("ti"), "k", "kb", "p", "off", "deleted",
                jp.row_text(F.col("row")).alias("row"),
                *[
                    (F.col(f"fk{j}") if j in ts.children else F.lit(None).cast("string")).alias(f"fk{j}")
                    for j in range(n)
                ],
            )
        )
    changes = frames[0]
    for f in frames[1:]:
        changes = changes.unionByName(f)
    tbl = changes.toArrow()
    joined = state.apply(tbl)
    schema = StructType(
        [StructField("k", StringType()), StructField("kb", BinaryType()), StructField("p", IntegerType()),
         *[StructField(f"r{i}", StringType()) for i in range(n + 1)]]
    )
    df = spark.createDataFrame(joined if joined.num_rows else pa.Table.from_pylist([], schema=_arrow(schema)),
                               schema=schema)
    lookups_rows = [jp.parse_row(F.col(f"r{lp.index + 1}"), jp.topics[lp.topic_index]) for lp in jp.lookups]
    head = [
        F.lit(jp.driving.topic).alias("_kf_topic"),
        F.col("kb").alias("_kf_key"),
        F.coalesce(F.col("p"), F.lit(0)).alias("_kf_partition"),
        F.lit(0).cast("bigint").alias("_kf_offset"),  # the engine sets the batch's watermark
        F.lit("u").alias("_kf_op"),
    ]
    return jp.assemble(
        df,
        jp.parse_row(F.col("r0"), jp.driving),
        lookups_rows,
        [F.col(f"r{lp.index + 1}").isNotNull() for lp in jp.lookups],
        head,
        F.lit(False),
    )


def _arrow(schema: StructType) -> pa.Schema:
    kinds = {"string": pa.string(), "binary": pa.binary(), "int": pa.int32()}
    return pa.schema([pa.field(f.name, kinds[f.dataType.simpleString()]) for f in schema.fields])


__all__ = ["build_stage", "drop", "follow_stage", "state_for", "swap", "transaction"]
