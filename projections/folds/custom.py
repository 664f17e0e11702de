"""Custom fold (``CustomFold``): the projection's ``apply(row, event)`` runs in Python.

Events are ``repartition``ed by view key, ``sortWithinPartitions`` by (view key, source position,
offset) and folded by the custom folder (``custom_folder.py``) inside ``mapInArrow`` — one Python
call per Spark partition, never one per key group. A fold over one topic keyed by its primary key
needs no shuffle (``fold_in_place``): a replay's workers read and fold each log partition
themselves. Replay loads the folded rows with the loader; follow collects the batch's changed rows
(the folder reads the current rows from the live view) and writes them at the batch's watermark.
Rows ``apply`` cannot produce (exceptions, rows that do not fit ``schema``) become dead letters.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from kappaflow.errors import ConfigError
from kappaflow.events import TableSchema
from kappaflow.projections.api import CustomFold, Declaration, ProjectionSpec
from kappaflow.projections.datasource import plan_ranges
from kappaflow.projections.folds.base import BuildJob, Built, FoldedBatch, FoldStrategy, dead_rows, register
from kappaflow.projections.folds.custom_folder import FoldJob, fold_arrow_schema, make_folder
from kappaflow.projections.joins import asof_stage
from kappaflow.projections.loader import LOAD_RESULT_DDL, make_loader
from kappaflow.projections.plan import Plan
from kappaflow.projections.schemas import converted_row, declared_struct, envelope_struct, key_struct, record_frame
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

if TYPE_CHECKING:
    from kappaflow.projections.runtime import Runtime


class CustomStrategy(FoldStrategy):
    fold: ClassVar[type[CustomFold]] = CustomFold
    priority: ClassVar[int] = 100
    reads_event_topics: ClassVar[bool] = True
    folds_events: ClassVar[bool] = True
    evolves_in_place: ClassVar[bool] = True  # its view is the declared schema; state is the view row

    def claims(self, decl: Declaration) -> bool:
        return decl.has_apply

    def lookup_advice(self) -> str:
        return ("an apply() fold folds events, so enrich each event with the row as it was then: "
                "as_of = [AsOf(...)] with the same arguments (a lookup's current row would make a replay "
                "differ from the follow that folded the same events earlier)")

    def declare(self, decl: Declaration) -> CustomFold:
        import inspect

        where = decl.where
        if decl.aggregates:
            raise ConfigError(f"{where}: declare either 'aggregates' or an 'apply' method, not both")
        if decl.schema is None:
            raise ConfigError(
                f"{where}: 'schema': a custom fold (apply) must declare its output schema, "
                "e.g. schema = 'customer_id bigint, total decimal(18,2)'"
            )
        if decl.derive or decl.where_sql:
            raise ConfigError(f"{where}: 'derive'/'where' apply to declarative folds; filter inside apply()")
        params = list(inspect.signature(decl.klass.apply).parameters)
        if len(params) != 3:
            raise ConfigError(f"{where}: 'apply': expected apply(self, row, event), got apply({', '.join(params)})")
        return CustomFold()

    def code_fingerprint(self, spec: ProjectionSpec) -> list[str]:
        """apply()'s source code: changing the fold changes the view."""
        import inspect

        if spec.cls is None:
            return []
        try:
            return [inspect.getsource(spec.cls.apply)]
        except (OSError, TypeError):
            return [spec.cls.__qualname__]

    def compile(self, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        where = f"projection {spec.name!r}"
        assert spec.schema is not None
        struct = declared_struct(spark, spec.schema, f"{where}: 'schema'")
        names = [f.name for f in struct.fields]
        missing = [k for k in spec.key if k not in names]
        if missing:
            raise ConfigError(f"{where}: 'key' column(s) {missing} are not in 'schema' ({names})")
        cols = tuple(ViewColumn(f.name, f.dataType, f.name not in spec.key) for f in struct.fields)
        plan = Plan(spec, schemas, ViewSpec(spec.view, spec.name, spec.key, cols, spec.namespace, spec.view_options()),
                    whole_rows=True)
        plan.compiled = {k: struct[k].dataType for k in spec.key}  # the view key's types (_key_types)
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

    def build(self, job: BuildJob) -> Built:
        plan, rt, spec = job.plan, job.rt, job.plan.spec
        total = sum(job.spans)
        parallel = max(1, rt.spark.sparkContext.defaultParallelism)
        in_place = fold_in_place(plan) and plan.asof is None
        read_by_workers = None  # the direct fold reads the log itself: an accumulator counts its records
        asof_dead: list[dict[str, object]] = []
        if in_place:
            # One Spark task per log partition reads and folds it directly (see custom_folder._run_direct).
            ranges = [(r.topic, r.partition, r.start, r.end) for r in plan_ranges({}, job.end, None)]
            read_by_workers = rt.spark.sparkContext.accumulator(0)
            fj = replace(
                fold_job(plan, job.version, sorted_input=False),
                log_url=rt.log_url,
                log_options=dict(rt.log_options),
                key_columns=_key_columns(plan),
                records_read=read_by_workers,
            )
            src = rt.spark.createDataFrame(
                rt.spark.sparkContext.parallelize(ranges or [("", 0, 0, 0)], max(1, len(ranges))),
                "topic string, partition int, start bigint, end bigint",
            )
            folded = src.mapInArrow(make_folder(fj), fold_output_type(plan))
        else:
            split = max(20_000, -(-total // (parallel * 2))) if total else None
            raws = {t: job.counted(rt.raw(t, "earliest", job.end, split), t) for t in spec.topics}
            ev = custom_events(plan, raws)
            if plan.asof is not None:  # each event with the tables' rows as they were then (joins/asof_stage.py)
                ev = asof_stage.build_stage(plan.asof, job.sink, job.target, ev, raws, asof_dead)
            parts = int(rt.spark.conf.get("spark.sql.shuffle.partitions") or 4)
            folded = sorted_for_fold(plan, ev, parts).mapInArrow(
                make_folder(fold_job(plan, job.version)), fold_output_type(plan)
            )
        out = folded.mapInArrow(make_loader(job.sink.config(), job.target), LOAD_RESULT_DDL).collect()
        return Built(
            loaded=sum(r["_kf_loaded"] or 0 for r in out),
            dead=dead_rows(out) + asof_dead,
            records_read=int(read_by_workers.value) if read_by_workers is not None else None,
        )

    def fold_batch(
        self, plan: Plan, rt: Runtime, sink: Sink, target: Target, raws: dict[str, DataFrame],
        deduped_input: bool | None,
    ) -> FoldedBatch:
        """Any non-None `deduped_input` means offset order per log partition, which allows folding in place."""
        in_place = fold_in_place(plan) and deduped_input is not None and plan.asof is None
        ev = custom_events(plan, raws, in_place=in_place)
        asof_dead: list[dict[str, object]] = []
        if plan.asof is not None:
            ev = asof_stage.follow_stage(plan.asof, rt.spark, sink, target, ev, raws, asof_dead)
        if in_place:
            folded = ev.mapInArrow(
                make_folder(fold_job(plan, 0, sink, target, sorted_input=False)), fold_output_type(plan)
            )
        else:
            parts = int(rt.spark.conf.get("spark.sql.shuffle.partitions") or 4)
            folded = sorted_for_fold(plan, ev, parts).mapInArrow(
                make_folder(fold_job(plan, 0, sink, target)), fold_output_type(plan)
            )
        out = folded.toArrow()
        dead: list[dict[str, object]] = list(asof_dead)
        dl_mask = pc.is_valid(out.column("_kf_dl_reason"))
        if pc.any(dl_mask).as_py():
            d = out.filter(dl_mask)
            dead = [
                {
                    "topic": r["_kf_dl_topic"],
                    "partition": r["_kf_dl_partition"],
                    "offset": r["_kf_dl_offset"],
                    "key": r["_kf_dl_key"],
                    "reason": r["_kf_dl_reason"],
                }
                for r in d.to_pylist()
            ]
            out = out.filter(pc.invert(dl_mask))
        return FoldedBatch(out.select([*plan.view.column_names, VERSION, DELETED]), dead=dead)

    def write_batch(
        self, plan: Plan, sink: Sink, target: Target, batch: FoldedBatch, watermark: int, positions: Positions | None
    ) -> WriteResult:
        """A custom row comes from many changes: its version is the batch's watermark (stamped on
        ``batch.table``, so rows the sink refuses are dead-lettered with it)."""
        tbl = batch.table
        if tbl.num_rows:
            batch.table = tbl.set_column(
                tbl.schema.get_field_index(VERSION), VERSION, pa.array([watermark] * tbl.num_rows, pa.int64())
            )
        return sink.write(target, batch.table, positions)


def fold_job(
    plan: Plan, version: int, sink: Sink | None = None, target: Target | None = None, *, sorted_input: bool = True
) -> FoldJob:
    spec = plan.spec
    assert spec.cls is not None
    _pickle_by_value(spec.cls)
    return FoldJob(
        projection=spec.cls,
        key=spec.key,
        schemas={t: s.to_dict() for t, s in plan.schemas.items()},
        event_topics=frozenset(s.topic for s in spec.sources if s.events),
        out_schema=fold_arrow_schema(plan.view.arrow_schema()),
        view_columns=plan.view.column_names,
        version=version,
        sink=sink.config() if (sink is not None and target is not None) else None,
        target=target,
        sorted_input=sorted_input,
        as_of=plan.asof.job_items() if plan.asof is not None else (),
    )


def _pickle_by_value(cls: type) -> None:
    """Ship the projection's module by value when workers may not import it (tests, scripts)."""
    from pyspark import cloudpickle

    mod = sys.modules.get(cls.__module__)
    if mod is None or cls.__module__.startswith("kappaflow.") or cls.__module__ == "__main__":
        return
    try:
        cloudpickle.register_pickle_by_value(mod)
    except ValueError:
        pass


def _key_types(plan: Plan) -> dict[str, DataType]:
    """The view key's Spark types (the strategy's compiled state, set by ``compile``)."""
    types: dict[str, DataType] = plan.compiled
    return types


def _key_columns(plan: Plan) -> dict[str, tuple[str, ...]]:
    out = {}
    for src in plan.spec.sources:
        mapping = dict(src.key or {k: k for k in plan.spec.key})
        out[src.topic] = tuple(mapping[k] for k in plan.spec.key)
    return out


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


# --- the events a custom fold reads ----------------------------------------------------------------
def custom_events(plan: Plan, raws: dict[str, DataFrame], *, in_place: bool = False) -> DataFrame:
    """Events for custom folds: view key, order and the raw value (decoded in Python).

    ``in_place`` (see ``fold_in_place``): no order columns and no JVM parse of the
    value at all; the view key comes from the record key.
    """
    frames = []
    for src in plan.spec.sources:
        mapping = dict(src.key or {k: k for k in plan.spec.key})
        raw = raws[src.topic]
        if src.events:
            frames.append(_event_topic_events(plan, raw, mapping))
            continue
        schema = plan.schemas[src.topic]
        if in_place:
            kj = F.from_json(F.col("key").cast("string"), key_struct(schema))
            krow = F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key]))
            kconv = converted_row(krow, schema.key_schema())
            vk = [kconv[mapping[k]].cast(_key_types(plan)[k]).alias(k) for k in plan.spec.key]
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
            vk = [kconv[mapping[k]].cast(_key_types(plan)[k]).alias(k) for k in plan.spec.key]
        else:
            after = F.coalesce(env["payload"]["after"], env["after"])
            before = F.coalesce(env["payload"]["before"], env["before"])
            row = F.coalesce(after, before)
            conv = converted_row(row, schema, sorted(set(mapping.values())))
            vk = [conv[mapping[k]].cast(_key_types(plan)[k]).alias(k) for k in plan.spec.key]
        frames.append(record_frame(raw, op, pos, *vk))
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f)
    return out

def fold_in_place(plan: Plan) -> bool:
    """A custom fold over one topic keyed by its primary key needs no shuffle: every
    event of a key is in one log partition, in offset order."""
    if len(plan.spec.sources) != 1 or plan.spec.sources[0].events:
        return False
    src = plan.spec.sources[0]
    mapping = dict(src.key or {k: k for k in plan.spec.key})
    schema = plan.schemas[src.topic]
    return bool(schema.key) and sorted(mapping.values()) == sorted(schema.key)

def _event_topic_events(plan: Plan, raw: DataFrame, mapping: dict[str, str]) -> DataFrame:
    """Event topics: the view key from the event's fields; order by its ``position``."""
    types: dict[str, DataType] = {"position": LongType()}
    for k in plan.spec.key:
        types[mapping[k]] = _key_types(plan)[k]
    struct = StructType([StructField(f, t) for f, t in sorted(types.items())])
    ev = F.from_json(F.col("value").cast("string"), struct)
    order = F.struct(
        ev["position"].cast("bigint").alias("a"),
        F.lit("").alias("b"),
        F.lit(0).cast("bigint").alias("c"),
        F.lit(1).alias("d"),
        F.lit(0).cast("bigint").alias("e"),
    )
    vk = [ev[mapping[k]].cast(_key_types(plan)[k]).alias(k) for k in plan.spec.key]
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

def sorted_for_fold(plan: Plan, events: DataFrame, partitions: int) -> DataFrame:
    """Events by view key, in source order within a key: what ``_run_sorted`` folds."""
    keys = list(plan.spec.key)
    return events.repartition(partitions, *keys).sortWithinPartitions(
        *keys, "_kf_order", "_kf_topic", "_kf_partition", "_kf_offset"
    )


STRATEGY = register(CustomStrategy())

__all__ = ["STRATEGY", "CustomStrategy", "custom_events", "fold_in_place", "fold_job", "fold_output_type"]
