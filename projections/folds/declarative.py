"""What the declarative fold kinds (latest row, grouped) share: they read only the latest record of
each log key (``latestPerKey``) and fold the CURRENT row of every source key (``Plan.latest`` then
``Plan.rows``: derive, where). A strategy built on this base says what it makes of those rows:
``view_of`` (compile), ``load`` (replay) and ``changes`` (follow)."""

from __future__ import annotations

import abc
import time
from typing import TYPE_CHECKING, Any, ClassVar, cast

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from kappaflow.events import TableSchema
from kappaflow.projections.api import ProjectionSpec
from kappaflow.projections.folds.base import BuildJob, Built, FoldedBatch, FoldStrategy, collect_bad, dead_rows
from kappaflow.projections.joins import stage as join_stage
from kappaflow.projections.joins.plan import JoinPlan
from kappaflow.projections.plan import Plan
from kappaflow.projections.sinks.base import Sink, Target, ViewSpec

if TYPE_CHECKING:
    from kappaflow.projections.runtime import Runtime

LATEST_SPLIT = 2_000_000  # offsets per Spark partition when reading latest-per-key (bounds worker memory)


class DeclarativeStrategy(FoldStrategy):
    """Base of the fold kinds compiled to native Spark expressions over current source rows."""

    reads_latest_per_key: ClassVar[bool] = True

    # --- what a kind makes of the current rows --------------------------------------------------
    def check_sources(self, plan: Plan) -> None:
        """Refuse sources this kind cannot fold (ConfigError naming the projection)."""

    @abc.abstractmethod
    def view_of(self, plan: Plan, rows: DataFrame) -> ViewSpec:
        """The view's shape, from the (empty) row frame; may set kind-specific fields of `plan`."""

    @abc.abstractmethod
    def load(self, job: BuildJob, rows: DataFrame) -> tuple[list[Any], DataFrame | None]:
        """Replay: load the current `rows` into ``job.target``: (the loader's output rows, the rows
        frame that locates refused rows in the log, if a row's version is its change's offset)."""

    @abc.abstractmethod
    def changes(self, plan: Plan, rows: DataFrame) -> FoldedBatch:
        """Follow: what a batch's current `rows` change (collected to the driver)."""

    # --- the protocol ---------------------------------------------------------------------------
    def compile(self, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        row_cols = schemas[spec.source_topics[0]].column_names
        join = None
        if spec.joined:  # the fold sees the joined row: driving columns + each lookup's prefixed ones
            join = JoinPlan.build(spec, schemas)
            row_cols = (*row_cols, *join.extra_columns)
        plan = Plan(spec, schemas, view=cast(ViewSpec, None), row_columns=row_cols, join=join)  # view: set below
        if spec.as_of:  # the fold sees each event's row with the as-of columns (windowed views)
            from kappaflow.projections.joins.asof_stage import AsOfPlan

            plan.asof = AsOfPlan.build(spec, schemas)
        plan.check_same_columns()
        self.check_sources(plan)
        plan.view = self.view_of(plan, plan.empty_rows(spark))  # derive + where validated here
        plan.check_declared_schema(spark)
        return plan

    def build(self, job: BuildJob) -> Built:
        plan, rt, spec = job.plan, job.rt, job.plan.spec
        deduped = max(job.spans, default=0) <= LATEST_SPLIT
        raws = {
            t: rt.raw(t, "earliest", job.end, None if deduped else LATEST_SPLIT, latest_per_key=True)
            for t in spec.topics
        }
        obs = Observation(f"kf_build_{spec.name}_{time.monotonic_ns()}")
        raws = {t: job.counted(df, t) for t, df in raws.items()}
        ev = plan.all_events(raws).observe(obs, F.count(F.when(F.col("_kf_bad"), 1)).alias("bad"))
        latest = plan.latest(ev, deduped=deduped)
        lookup_dead: list[dict[str, Any]] = []
        if plan.join is not None:  # joined rows as of the end; the target's join state is loaded too
            positions = {(t, p): o for t, parts in job.end.items() for p, o in parts.items()}
            latest = join_stage.build_stage(
                plan.join, rt, job.sink, job.target, latest, raws, deduped=deduped, version=job.version,
                positions=positions, dead=lookup_dead,
            )
        out, located_by = self.load(job, plan.rows(latest))
        if plan.join is not None:
            located_by = None  # a joined row's version is the build's watermark, not its change's offset
        built = Built(loaded=sum(r["_kf_loaded"] or 0 for r in out), dead=dead_rows(out) + lookup_dead,
                      rows=located_by)
        if obs.get.get("bad"):
            built.dead += collect_bad(plan, raws)
        return built

    def fold_batch(
        self, plan: Plan, rt: Runtime, sink: Sink, target: Target, raws: dict[str, DataFrame],
        deduped_input: bool | None,
    ) -> FoldedBatch:
        bad = Observation(f"kf_bad_{plan.spec.name}_{time.monotonic_ns()}")
        bad_metric = plan.cached("bad_metric", lambda: F.count(F.when(F.col("_kf_bad"), 1)).alias("bad"))
        ev = plan.all_events(raws).observe(bad, bad_metric)
        latest = plan.latest(ev, deduped=bool(deduped_input))
        lookup_dead: list[dict[str, Any]] = []
        if plan.join is not None:  # the batch goes into the join state; the affected joined rows come out
            latest = join_stage.follow_stage(plan.join, rt.spark, sink, target, latest, raws,
                                             deduped=bool(deduped_input), dead=lookup_dead)
        batch = self.changes(plan, plan.rows(latest))
        batch.dead += lookup_dead
        batch.bad = bad
        return batch


__all__ = ["LATEST_SPLIT", "DeclarativeStrategy"]
