"""Latest row per key (``LatestFold``): the view holds each source row as of its latest change.

The view key is the source table's primary key; a row's version is the log offset of the change
that made it, so a row a sink refuses is dead-lettered with its position in the log. Replay loads
the current rows (after ``derive``/``where``); follow writes one upsert or delete per key a batch
touched (a row leaving ``where`` is a delete).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from kappaflow.errors import ConfigError
from kappaflow.projections.api import Declaration, LatestFold, ProjectionSpec
from kappaflow.projections.folds.base import BuildJob, FoldedBatch, Located, register
from kappaflow.projections.folds.declarative import DeclarativeStrategy
from kappaflow.projections.loader import LOAD_RESULT_DDL, make_loader
from kappaflow.projections.plan import Plan
from kappaflow.projections.schemas import converted_row, key_struct
from kappaflow.projections.sinks.base import DELETED, VERSION, ViewColumn, ViewSpec
from kappaflow.projections.sinks.keys import key_str


def _value_columns(plan: Plan, rows: DataFrame) -> list[str]:
    spec = plan.spec
    fold = spec.fold
    assert isinstance(fold, LatestFold)
    derived = [n for n, _ in spec.derive]
    if fold.columns is not None:
        names = list(fold.columns)
        unknown = [c for c in names if c not in rows.columns or c.startswith("_kf_")]
        if unknown:
            raise ConfigError(
                f"projection {spec.name!r}: 'columns' {unknown} are neither source columns nor 'derive' names"
            )
        return names + [d for d in derived if d not in names]
    return [c for c in plan.row_columns if c not in derived] + derived


def _output(plan: Plan, rows: DataFrame) -> DataFrame:
    return rows.select(*_value_columns(plan, rows), F.col("_kf_offset").alias(VERSION))


def view_rows(plan: Plan, rows: DataFrame) -> DataFrame:
    """Replay: the live rows of a latest-row view (version = offset)."""
    return _output(plan, rows.where("_kf_keep")).select(*plan.view.column_names, VERSION, F.lit(False).alias(DELETED))


def changes_at(plan: Plan, rows: DataFrame) -> DataFrame:
    """Follow: one upsert or delete per key touched by the batch, plus where each change is in the
    log (``_kf_topic``, ``_kf_partition``; the offset is the version), so a row a sink refuses is
    dead-lettered with its position. Deletes and tombstones have no row: their key comes from the
    record key (the view key of a latest-row view is the source primary key); records without a
    usable key (e.g. a truncate marker) change no row."""
    cols, cond = plan.cached("latest_changes", lambda: _change_columns(plan, rows))
    return rows.select(*cols, F.col("_kf_topic"), F.col("_kf_partition")).where(cond)


def _change_columns(plan: Plan, rows: DataFrame) -> tuple[list[SparkColumn], SparkColumn]:
    spec = plan.spec
    schema = plan.schemas[spec.topics[0]]
    kj = F.from_json(F.col("_kf_key").cast("string"), key_struct(schema))
    krow = converted_row(
        F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key])), schema.key_schema()
    )
    cols = [
        F.when(F.col("_kf_keep"), F.col(c)).alias(c) if c not in spec.key else F.coalesce(F.col(c), krow[c]).alias(c)
        for c in _value_columns(plan, rows)
    ]
    cols += [F.col("_kf_offset").alias(VERSION), (~F.col("_kf_keep")).alias(DELETED)]
    cond = F.lit(True)
    for k in spec.key:
        cond = cond & F.col(k).isNotNull()
    return cols, cond


class LatestStrategy(DeclarativeStrategy):
    fold: ClassVar[type[LatestFold]] = LatestFold
    priority: ClassVar[int] = 0
    evolves_in_place: ClassVar[bool] = True
    holds_nested: ClassVar[bool] = True

    def default_schema_policy(self, fold: Any) -> str:
        """A view of every column evolves with its table (a new column appears in it); a view with an
        explicit ``columns`` list keeps its shape and stops for a rebuild if a change would alter it."""
        return "evolve" if getattr(fold, "columns", None) is None else "rebuild"

    def claims(self, decl: Declaration) -> bool:
        return True  # what a class declares when it declares no other fold

    def declare(self, decl: Declaration) -> LatestFold:
        columns = decl.columns
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise ConfigError(f"{decl.where}: 'columns': expected a list of column names, got {columns!r}")
            missing = [k for k in decl.key if k not in columns and k not in decl.derive]
            if missing:
                raise ConfigError(f"{decl.where}: 'columns': must include the key column(s) {missing}")
            columns = tuple(columns)
        return LatestFold(columns)

    def fingerprint(self, spec: ProjectionSpec) -> list[str]:
        assert isinstance(spec.fold, LatestFold)
        return [repr(spec.fold.columns)]

    def check_sources(self, plan: Plan) -> None:
        spec, schemas = plan.spec, plan.schemas
        where = f"projection {spec.name!r}"
        keyless = [t for t in spec.topics if not schemas[t].key]
        if keyless:
            raise ConfigError(
                f"{where}: source topic(s) {keyless} have no key: their table has no primary key (the "
                "change events' key is null), so the log keeps every change of it, append-only, and "
                "nothing says which row a change belongs to. A latest-row view needs that: give the table a "
                "primary key (or a unique index as its replica identity), or name the columns that identify "
                "a row in the source's key_columns; or fold the topic with 'aggregates' or an apply() fold"
            )
        first = schemas[spec.topics[0]]
        if set(spec.key) != set(first.key) or not first.key:
            raise ConfigError(
                f"{where}: 'key': a latest-row view is keyed by the source table's primary key "
                f"{list(first.key)}, got {list(spec.key)}; to key by other columns declare 'aggregates' "
                "(group by) or an apply() fold"
            )

    def view_of(self, plan: Plan, rows: DataFrame) -> ViewSpec:
        spec = plan.spec
        out = _output(plan, rows)
        cols = [ViewColumn(f.name, f.dataType, f.name not in spec.key) for f in out.schema.fields if f.name != VERSION]
        return ViewSpec(spec.view, spec.name, spec.key, tuple(cols), spec.namespace, spec.view_options())

    def load(self, job: BuildJob, rows: DataFrame) -> tuple[list[Any], DataFrame | None]:
        loader = make_loader(job.sink.config(), job.target)
        return view_rows(job.plan, rows).mapInArrow(loader, LOAD_RESULT_DDL).collect(), rows

    def changes(self, plan: Plan, rows: DataFrame) -> FoldedBatch:
        tbl = changes_at(plan, rows).toArrow()
        return FoldedBatch(tbl.drop_columns(["_kf_topic", "_kf_partition"]),
                           where_in_log=tbl.select(["_kf_topic", "_kf_partition"]))

    def locate_refused(
        self, plan: Plan, rows: DataFrame | None, refused: list[tuple[str, int | None, str]]
    ) -> Located:
        """A row's version is the offset of the change that made it: find that change in `rows`."""
        located: Located = {}
        offsets = sorted({v for _, v, _ in refused if v is not None})[:10_000]
        if rows is None or not offsets:
            return located
        key = list(plan.spec.key)
        found = (
            rows.where(F.col("_kf_offset").isin(offsets))
            .select("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key", *key)
            .collect()
        )
        for r in found:
            located[(key_str(tuple(r[k] for k in key)), int(r["_kf_offset"]))] = (
                r["_kf_topic"], int(r["_kf_partition"]), r["_kf_key"])
        return located


STRATEGY = register(LatestStrategy())

__all__ = ["STRATEGY", "LatestStrategy", "changes_at", "view_rows"]
