"""Grouped (``GroupFold``): group by any column(s), with aggregates that retract.

The latest-row step gives the CURRENT row of every source key (the keyed state); aggregates run
over current rows only, so moving a row between groups or deleting it retracts its old
contribution without needing before-images. Replay aggregates natively in Spark and loads the
keyed state beside the view; follow sends a batch's keyed-state changes to the sink that keeps
the state (``GroupedState.apply_grouped``: PostgreSQL), which recomputes only the affected groups
in the same transaction as the positions. Aggregates are restricted to ones both engines compute
identically (count, sum, min, max, exact avg, sorted collect list/set; strings compare by code
point).

Its state: the keyed state lives in the sink with ``GroupedState``; the projection's other sinks
(search, Redis) MIRROR that sink's view instead of folding the log (``mirror_source``,
``kappaflow.projections.mirror``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pyspark import StorageLevel
from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StructType,
)

from kappaflow.errors import ConfigError
from kappaflow.projections.api import (
    NAME_RE,
    Aggregate,
    Avg,
    CollectList,
    CollectSet,
    Count,
    Declaration,
    GroupFold,
    Max,
    Min,
    ProjectionSpec,
    Sum,
)
from kappaflow.projections.folds.base import BuildJob, FoldedBatch, register
from kappaflow.projections.folds.declarative import DeclarativeStrategy
from kappaflow.projections.loader import LOAD_RESULT_DDL, make_loader
from kappaflow.projections.plan import Plan
from kappaflow.projections.sinks.base import (
    DELETED,
    VERSION,
    Positions,
    Sink,
    Target,
    ViewColumn,
    ViewSpec,
    WriteResult,
)
from kappaflow.projections.sinks.postgres import STATE_KEY, STATE_TOPIC, aggregate_sql_of, pg_type
from kappaflow.projections.sinks.registry import SINKS


def _state_sinks() -> list[str]:
    """Sink kinds whose stores keep a grouped view's keyed state (the registry's ``grouped_state``
    capability, ``Sink.grouped_state``): a grouped projection names one of them; its other sinks
    mirror it."""
    return [name for name, kind in SINKS.items() if kind.grouped_state]


def _state_columns(plan: Plan) -> tuple[ViewColumn, ...]:
    """The columns kept per source key (the strategy's compiled state, set by ``compile``)."""
    columns: tuple[ViewColumn, ...] = plan.compiled
    return columns


def _fold(plan: Plan) -> GroupFold:
    fold = plan.spec.fold
    assert isinstance(fold, GroupFold)
    return fold


def _state_frame(plan: Plan, rows: DataFrame) -> DataFrame:
    return rows.select(
        F.col("_kf_topic").alias(STATE_TOPIC),
        F.col("_kf_key").alias(STATE_KEY),
        F.col("_kf_offset").alias(VERSION),
        *[c.name for c in _state_columns(plan)],
        F.col("_kf_keep"),
    )


def _group_present(plan: Plan) -> SparkColumn:
    cond = F.lit(True)
    for k in plan.spec.key:
        cond = cond & F.col(k).isNotNull()
    return cond


def state_rows(plan: Plan, rows: DataFrame) -> DataFrame:
    """Replay: current contributing row per source key (group columns not NULL)."""
    st = _state_frame(plan, rows)
    return st.where(F.col("_kf_keep") & _group_present(plan)).drop("_kf_keep")


def state_changes(plan: Plan, rows: DataFrame) -> DataFrame:
    """Follow: keyed-state upserts/deletes of the batch (a row leaving the filter or its groups
    becoming NULL is a delete)."""
    first, second = plan.cached("state_changes", lambda: _state_change_columns(plan))
    return rows.select(*first).select(*second)


def _state_change_columns(plan: Plan) -> tuple[list[SparkColumn], list[SparkColumn]]:
    first = [
        F.col("_kf_topic").alias(STATE_TOPIC),
        F.col("_kf_key").alias(STATE_KEY),
        F.col("_kf_offset").alias(VERSION),
        *[F.col(c.name) for c in _state_columns(plan)],
        F.col("_kf_keep"),
    ]
    keep = F.col("_kf_keep") & _group_present(plan)
    second = [
        F.col(STATE_TOPIC),
        F.col(STATE_KEY),
        F.col(VERSION),
        *[F.when(keep, F.col(c.name)).alias(c.name) for c in _state_columns(plan)],
        (~keep).alias(DELETED),
    ]
    return first, second


def _aggregate(plan: Plan, state: DataFrame, version: int) -> DataFrame:
    aggs = [_spark_agg(a).alias(n) for n, a in _fold(plan).aggregates]
    return state.groupBy(*plan.spec.key).agg(*aggs).withColumn(VERSION, F.lit(version).cast("bigint"))


def group_view_rows(plan: Plan, state: DataFrame, version: int) -> DataFrame:
    return _aggregate(plan, state, version).select(*plan.view.column_names, VERSION, F.lit(False).alias(DELETED))


class GroupedStrategy(DeclarativeStrategy):
    fold: ClassVar[type[GroupFold]] = GroupFold
    priority: ClassVar[int] = 50

    def claims(self, decl: Declaration) -> bool:
        return bool(decl.aggregates)

    def declare(self, decl: Declaration) -> GroupFold:
        where = decl.where
        aggs = []
        for out, agg in decl.aggregates.items():
            if not isinstance(out, str) or not NAME_RE.match(out):
                raise ConfigError(f"{where}: 'aggregates': column name {out!r} is not an identifier")
            if not isinstance(agg, Aggregate) or type(agg) is Aggregate:
                raise ConfigError(
                    f"{where}: 'aggregates'[{out!r}]: expected Count(), Sum('col'), Min, Max, Avg, CollectList "
                    f"or CollectSet, got {agg!r}"
                )
            if agg.column is None and not isinstance(agg, Count):
                raise ConfigError(f"{where}: 'aggregates'[{out!r}]: {type(agg).__name__} needs a column")
            if out in decl.key:
                raise ConfigError(f"{where}: 'aggregates'[{out!r}]: the name is also a key column")
            aggs.append((out, agg))
        if decl.columns is not None:
            raise ConfigError(
                f"{where}: 'columns' selects the columns of a latest-row view; "
                "a grouped view's columns are its key and aggregates"
            )
        return GroupFold(tuple(aggs))

    def fingerprint(self, spec: ProjectionSpec) -> list[str]:
        assert isinstance(spec.fold, GroupFold)
        return [repr([(n, a.func, a.column) for n, a in spec.fold.aggregates])]

    def check_sinks(self, where: str, sinks: Sequence[str]) -> None:
        keepers = _state_sinks()
        other = [s for s in sinks if s not in keepers]
        if other and not any(s in keepers for s in sinks):
            titles = " or ".join(SINKS[k].title for k in keepers)
            raise ConfigError(
                f"{where}: 'sinks': a grouped projection ('aggregates') may write to {other} only together with "
                f"{' or '.join(map(repr, keepers))}: the per-source-key state that retracts a changed or deleted "
                f"row's old contribution, and the recompute of the touched groups, live in {titles} "
                f"(apply_grouped); the other sinks' views of it are mirrors of the {titles} view. Use sinks = "
                f"({keepers[0]!r}, {', '.join(map(repr, other))})"
            )

    def view_of(self, plan: Plan, rows: DataFrame) -> ViewSpec:
        spec, fold = plan.spec, _fold(plan)
        where = f"projection {spec.name!r}"
        missing = [k for k in spec.key if k not in rows.columns]
        if missing:
            raise ConfigError(
                f"{where}: 'key' (group by) column(s) {missing} are neither source columns "
                f"nor 'derive' names (have {[c for c in rows.columns if not c.startswith('_kf_')]})"
            )
        inputs: list[str] = []
        for out_name, agg in fold.aggregates:
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
        plan.compiled = tuple(ViewColumn(n, types[n]) for n in state_names)  # the state columns
        for out_name, agg in fold.aggregates:
            if agg.column is not None:
                _check_agg_type(where, out_name, agg, types[agg.column])
        agg_df = _aggregate(plan, _state_frame(plan, rows), 0)
        cols = [
            ViewColumn(f.name, f.dataType, f.name not in spec.key) for f in agg_df.schema.fields if f.name != VERSION
        ]
        group = {
            "group_by": list(spec.key),
            "state_columns": [{"name": c.name, "pg_type": pg_type(c.type)} for c in _state_columns(plan)],
            "aggregates": [
                {
                    "name": n,
                    "sql": aggregate_sql_of(a, types.get(a.column) if a.column else None),
                    "pg_type": pg_type(next(c.type for c in cols if c.name == n)),
                }
                for n, a in fold.aggregates
            ],
        }
        return ViewSpec(
            spec.view, spec.name, spec.key, tuple(cols), spec.namespace, {**spec.view_options(), "group": group}
        )

    def load(self, job: BuildJob, rows: DataFrame) -> tuple[list[Any], DataFrame | None]:
        cfg = job.sink.config()
        state = state_rows(job.plan, rows).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            state.mapInArrow(make_loader(cfg, job.target, state=True), LOAD_RESULT_DDL).collect()
            view = group_view_rows(job.plan, state, job.version)
            return view.mapInArrow(make_loader(cfg, job.target), LOAD_RESULT_DDL).collect(), None
        finally:
            state.unpersist()

    def changes(self, plan: Plan, rows: DataFrame) -> FoldedBatch:
        return FoldedBatch(state_changes(plan, rows).toArrow())

    def write_batch(
        self, plan: Plan, sink: Sink, target: Target, batch: FoldedBatch, watermark: int, positions: Positions | None
    ) -> WriteResult:
        """The keyed-state changes go to the sink that keeps the state, which recomputes the touched
        groups at version `watermark` (with `positions`, in the same transaction)."""
        return _state_keeper(plan, sink).apply_grouped(target, batch.table, watermark, positions)

    def mirror_source(self, spec: ProjectionSpec, sink: str) -> str | None:
        """A sink that keeps no keyed state mirrors the projection's one that does."""
        keepers = _state_sinks()
        if sink in keepers:
            return None
        return next((s for s in spec.sinks if s in keepers), None)


def _state_keeper(plan: Plan, sink: Sink) -> Any:
    keeper = sink.grouped_state()
    if keeper is None:
        raise ConfigError(
            f"projection {plan.spec.name!r}: the {sink.kind} sink keeps no grouped state; its view of a grouped "
            "projection mirrors the view of one that does"
        )
    return keeper


STRATEGY = register(GroupedStrategy())


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


__all__ = ["STRATEGY", "GroupedStrategy", "group_view_rows", "state_changes", "state_rows"]
