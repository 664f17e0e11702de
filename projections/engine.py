"""The two operations everything is made of: build a target from scratch, apply a batch.

- ``build``: a full fold of the log up to given end offsets into an empty target (a
  shadow), written by the Spark executors themselves (``mapInArrow`` + COPY).
- ``apply_batch``: fold a bounded slice of the log (a follow micro-batch, or a replay's
  catch-up) into a live target: the changes are collected to the driver and written with
  the consumed positions in ONE sink transaction. Records below the stored positions are
  filtered out first, so re-running a batch (Spark checkpoint behind the sink after a
  crash) changes nothing: exactly-once in effect.

Versions: a latest-row view's row carries the log offset of its event. Grouped and
custom views carry the *watermark* of the write: the sum of the next offsets of all
input partitions, which grows with every batch that consumed anything, so a version
guard (``excluded._kf_version > view._kf_version``) orders writes of any kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from kappaflow.errors import KappaflowError, SinkError
from kappaflow.projections.api import CustomFold, GroupFold, LatestFold, ProjectionSpec
from kappaflow.projections.datasource import plan_ranges
from kappaflow.projections.deadletter import write_dead_letters
from kappaflow.projections.executor import LOAD_RESULT_DDL, FoldJob, fold_arrow_schema, make_folder, make_loader
from kappaflow.projections.plan import Plan, fold_output_type
from kappaflow.projections.runtime import Offsets, Runtime
from kappaflow.projections.schemas import load_table_schemas
from kappaflow.projections.sinks.base import DELETED, VERSION, Positions, Sink, Target, TopicPartition
from kappaflow.projections.sinks.keys import key_str

log = logging.getLogger("kappaflow.projections")

BAD_REASON = "value is not a change event (unparseable JSON, or 'op' missing or unknown)"


def prepare(spec: ProjectionSpec, rt: Runtime) -> Plan:
    """Load the source schemas and compile the projection."""
    given = {s.topic: s.schema for s in spec.sources if s.schema is not None}
    schemas = load_table_schemas(rt.reader(), spec.change_topics, given)
    return Plan.build(rt.spark, spec, schemas)


def flatten(offsets: Mapping[str, Mapping[int, int]]) -> dict[TopicPartition, int]:
    return {(t, p): o for t, parts in offsets.items() for p, o in parts.items()}


def nest(positions: Positions, topics: list[str], partitions: Mapping[str, int]) -> Offsets:
    return {t: {p: positions.get((t, p), 0) for p in range(partitions[t])} for t in topics}


def watermark(positions: Positions) -> int:
    return int(sum(positions.values()))


def _with_retry(what: str, fn: Callable[[], Any], attempts: int = 5) -> Any:
    delay = 0.2
    for i in range(attempts):
        try:
            return fn()
        except KappaflowError as exc:
            if not exc.transient or i == attempts - 1:
                raise
            log.warning("%s failed: %s; retrying in %.1fs (attempt %d/%d)", what, exc, delay, i + 1, attempts)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


@dataclass
class BuildResult:
    events: int = 0
    rows: int = 0
    dead_letters: int = 0
    seconds: float = 0.0


@dataclass
class BatchResult:
    events: int = 0
    upserted: int = 0
    deleted: int = 0
    dead_letters: int = 0
    positions: dict[TopicPartition, int] = field(default_factory=dict)


def _partition_counts(rt: Runtime, topics: list[str]) -> dict[str, int]:
    log_ = rt.reader()
    return {t: log_.partitions(t) for t in topics}


def _dead_rows(rows: list[Any]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d = r.asDict() if hasattr(r, "asDict") else dict(r)
        if d.get("_kf_dl_reason") is not None:
            out.append(
                {
                    "topic": d["_kf_dl_topic"],
                    "partition": d["_kf_dl_partition"],
                    "offset": d["_kf_dl_offset"],
                    "key": d.get("_kf_dl_key"),
                    "reason": d["_kf_dl_reason"],
                }
            )
    return out


def _collect_bad(plan: Plan, raws: dict[str, DataFrame]) -> list[dict[str, Any]]:
    ev = plan.all_events(raws).where("_kf_bad").select("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key")
    return [{"topic": r[0], "partition": r[1], "offset": r[2], "key": r[3], "reason": BAD_REASON} for r in ev.collect()]


def _dead_letter(rt: Runtime, plan: Plan, rows: list[dict[str, Any]]) -> int:
    if not rows:
        return 0
    for r in rows[:5]:
        log.warning(
            "dead letter for %s: %s[%s]@%s: %s", plan.spec.name, r["topic"], r["partition"], r["offset"], r["reason"]
        )
    return write_dead_letters(rt.log_url, rt.log_options, plan.spec.name, rows)


def _fold_job(
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
    )


def _pickle_by_value(cls: type) -> None:
    """Ship the projection's module by value when workers may not import it (tests, scripts)."""
    import sys

    from pyspark import cloudpickle

    mod = sys.modules.get(cls.__module__)
    if mod is None or cls.__module__.startswith("kappaflow.") or cls.__module__ == "__main__":
        return
    try:
        cloudpickle.register_pickle_by_value(mod)
    except ValueError:
        pass


# --- build (replay into an empty shadow) -------------------------------------------------------------
LATEST_SPLIT = 2_000_000  # offsets per Spark partition when reading latest-per-key (bounds worker memory)


def _spans(end: Offsets, start: Offsets | None = None) -> list[int]:
    return [o - (start or {}).get(t, {}).get(p, 0) for t, parts in end.items() for p, o in parts.items()]


def _read_metrics() -> list[Any]:
    """Records read through a raw log frame: rows, plus the records ``latestPerKey`` folded into them."""
    return [F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum("superseded"), F.lit(0)).alias("superseded")]


class _ReadCounter:
    """Counts the records a build actually reads: after compaction the offset span of a partition
    counts records that are gone, which inflated replay's events and events/s."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.observations: list[Observation] = []

    def __call__(self, df: DataFrame, topic: str) -> DataFrame:
        obs = Observation(f"kf_read_{self.name}_{topic}_{time.monotonic_ns()}")
        self.observations.append(obs)
        return df.observe(obs, *_read_metrics())

    @property
    def records(self) -> int:
        return sum(int(o.get.get("rows") or 0) + int(o.get.get("superseded") or 0) for o in self.observations)


def build(
    plan: Plan, rt: Runtime, target: Target, end: Offsets, *, dead_letters: bool = True, sink: Sink | None = None
) -> BuildResult:
    """Fold [0, end) into the empty `target` of `sink` (default ``rt.sink``). ``dead_letters=False``
    (verify) only counts them. Rows the sink refuses go to the dead letters too."""
    t0 = time.monotonic()
    spec = plan.spec
    spans = _spans(end)
    total = sum(spans)
    parallel = max(1, rt.spark.sparkContext.defaultParallelism)
    version = watermark(flatten(end))
    sink = sink or rt.sink
    cfg = sink.config()
    rows_df: DataFrame | None = None
    res = BuildResult()
    obs = Observation(f"kf_build_{spec.name}_{time.monotonic_ns()}")
    counted = _ReadCounter(spec.name)
    read_by_workers: Any = None  # the direct fold reads the log itself: an accumulator counts its records
    dead: list[dict[str, Any]] = []
    if isinstance(spec.fold, CustomFold):
        in_place = plan.fold_in_place
        split = None if in_place else (max(20_000, -(-total // (parallel * 2))) if total else None)
        if in_place:
            # One Spark task per log partition reads and folds it directly (see executor._run_direct).
            ranges = [(r.topic, r.partition, r.start, r.end) for r in plan_ranges({}, end, None)]
            read_by_workers = rt.spark.sparkContext.accumulator(0)
            job = replace(
                _fold_job(plan, version, sorted_input=False),
                log_url=rt.log_url,
                log_options=dict(rt.log_options),
                key_columns=_key_columns(plan),
                records_read=read_by_workers,
            )
            src = rt.spark.createDataFrame(
                rt.spark.sparkContext.parallelize(ranges or [("", 0, 0, 0)], max(1, len(ranges))),
                "topic string, partition int, start bigint, end bigint",
            )
            folded = src.mapInArrow(make_folder(job), fold_output_type(plan))
        else:
            raws = {t: counted(rt.raw(t, "earliest", end, split), t) for t in spec.topics}
            ev = plan.custom_events(raws)
            parts = int(rt.spark.conf.get("spark.sql.shuffle.partitions") or 4)
            folded = plan.sorted_for_fold(ev, parts).mapInArrow(
                make_folder(_fold_job(plan, version)), fold_output_type(plan)
            )
        out = folded.mapInArrow(make_loader(cfg, target), LOAD_RESULT_DDL).collect()
        res.rows = sum(r["_kf_loaded"] or 0 for r in out)
        dead = _dead_rows(out)
    else:
        deduped = max(spans, default=0) <= LATEST_SPLIT
        raws = {
            t: rt.raw(t, "earliest", end, None if deduped else LATEST_SPLIT, latest_per_key=True) for t in spec.topics
        }
        ev = plan.all_events({t: counted(df, t) for t, df in raws.items()}).observe(
            obs, F.count(F.when(F.col("_kf_bad"), 1)).alias("bad")
        )
        rows = plan.rows(plan.latest(ev, deduped=deduped))
        if isinstance(spec.fold, LatestFold):
            rows_df = rows
            out = plan.latest_view_rows(rows).mapInArrow(make_loader(cfg, target), LOAD_RESULT_DDL).collect()
            res.rows = sum(r["_kf_loaded"] or 0 for r in out)
        else:
            assert isinstance(spec.fold, GroupFold)
            state = plan.state_rows(rows).persist(StorageLevel.MEMORY_AND_DISK)
            try:
                state.mapInArrow(make_loader(cfg, target, state=True), LOAD_RESULT_DDL).collect()
                out = (
                    plan.group_view_rows(state, version).mapInArrow(make_loader(cfg, target), LOAD_RESULT_DDL).collect()
                )
                res.rows = sum(r["_kf_loaded"] or 0 for r in out)
            finally:
                state.unpersist()
        dead = _dead_rows(out)
        if obs.get.get("bad"):
            dead += _collect_bad(plan, raws)
    refused = [d for d in dead if d["topic"] is None]
    if refused:
        dead = [d for d in dead if d["topic"] is not None] + sink_rejections(
            plan, sink.kind, [(bytes(d["key"]).decode(), d["offset"], d["reason"]) for d in refused], rows_df
        )
    res.dead_letters = _dead_letter(rt, plan, dead) if dead_letters else len(dead)
    res.events = int(read_by_workers.value) if read_by_workers is not None else counted.records
    res.seconds = time.monotonic() - t0
    return res


def _key_columns(plan: Plan) -> dict[str, tuple[str, ...]]:
    out = {}
    for src in plan.spec.sources:
        mapping = dict(src.key or {k: k for k in plan.spec.key})
        out[src.topic] = tuple(mapping[k] for k in plan.spec.key)
    return out


# --- apply a bounded slice (follow micro-batch, replay catch-up) --------------------------------------------
def _offset_filter(before: Positions) -> Any:
    if not before:
        return None
    pairs: list[Any] = []
    for (t, p), o in before.items():
        pairs += [F.lit(f"{t}\x00{p}"), F.lit(int(o))]
    m = F.create_map(*pairs)
    start = F.coalesce(
        F.element_at(m, F.concat_ws("\x00", F.col("topic"), F.col("partition").cast("string"))), F.lit(0).cast("bigint")
    )
    return F.col("offset") >= start


def apply_batch(
    plan: Plan,
    rt: Runtime,
    target: Target,
    raws: dict[str, DataFrame],
    before: Positions,
    known_end: Offsets | None = None,
    sink: Sink | None = None,
    deduped_input: bool | None = None,
) -> BatchResult:
    """Fold `raws` (already bounded) into `target` in one sink transaction with the positions.

    `sink` defaults to ``rt.sink``; a follower passes its own (a sink's connection is not
    shared between concurrently running micro-batches). `deduped_input`: the raw frames
    come one Spark partition per log partition (True: read with ``latestPerKey`` for
    declarative folds; for custom folds any non-None value means offset order per
    partition, which allows folding in place); None: arbitrary partitioning."""
    spec = plan.spec
    sink = sink or rt.sink
    partitions = _partition_counts(rt, spec.topics)
    cond = _offset_filter(before)
    observations: list[Observation] = []
    observed: dict[str, DataFrame] = {}
    for t, df in raws.items():
        if cond is not None:
            df = df.where(cond)
        obs = Observation(f"kf_batch_{spec.name}_{t}_{time.monotonic_ns()}")
        metrics = plan._cached(
            ("metrics", t, partitions[t]),
            lambda t=t: (
                _read_metrics()
                + [F.max(F.when(F.col("partition") == p, F.col("offset"))).alias(f"p{p}") for p in range(partitions[t])]
            ),
        )
        observed[t] = df.observe(obs, *metrics)
        observations.append(obs)
    res = BatchResult()
    dead: list[dict[str, Any]] = []
    where_in_log: pa.Table | None = None
    bad_obs: Observation | None = None
    tbl: pa.Table
    if isinstance(spec.fold, CustomFold):
        in_place = plan.fold_in_place and deduped_input is not None
        ev = plan.custom_events(observed, in_place=in_place)
        if in_place:
            folded = ev.mapInArrow(
                make_folder(_fold_job(plan, 0, sink, target, sorted_input=False)), fold_output_type(plan)
            )
        else:
            parts = int(rt.spark.conf.get("spark.sql.shuffle.partitions") or 4)
            folded = plan.sorted_for_fold(ev, parts).mapInArrow(
                make_folder(_fold_job(plan, 0, sink, target)), fold_output_type(plan)
            )
        out = folded.toArrow()
        reasons = out.column("_kf_dl_reason")
        dl_mask = pc.is_valid(reasons)
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
        tbl = out.select([*plan.view.column_names, VERSION, DELETED])
    else:
        bad_obs = Observation(f"kf_bad_{spec.name}_{time.monotonic_ns()}")
        bad_metric = plan._cached("bad_metric", lambda: F.count(F.when(F.col("_kf_bad"), 1)).alias("bad"))
        ev = plan.all_events(observed).observe(bad_obs, bad_metric)
        rows = plan.rows(plan.latest(ev, deduped=bool(deduped_input)))
        if isinstance(spec.fold, LatestFold):
            tbl = plan.latest_changes_at(rows).toArrow()
            where_in_log = tbl.select(["_kf_topic", "_kf_partition"])
            tbl = tbl.drop_columns(["_kf_topic", "_kf_partition"])
        else:
            tbl = plan.state_changes(rows).toArrow()
    # positions after the batch: max offset seen + 1 per partition, at least the known end
    after: dict[TopicPartition, int] = dict(before)
    for t, obs in zip(raws, observations, strict=True):
        m = obs.get
        for p in range(partitions[t]):
            v = m.get(f"p{p}")
            if v is not None:
                after[(t, p)] = max(after.get((t, p), 0), int(v) + 1)
    if known_end:
        for (t, p), o in flatten(known_end).items():
            after[(t, p)] = max(after.get((t, p), 0), o)
    for t in spec.topics:
        for p in range(partitions[t]):
            after.setdefault((t, p), 0)
    if bad_obs is not None and bad_obs.get.get("bad"):
        dead += _collect_bad(plan, {t: (df.where(cond) if cond is not None else df) for t, df in raws.items()})
    res.dead_letters = _dead_letter(rt, plan, dead)
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    # log records consumed (read), not offsets passed: compaction leaves gaps in the offsets
    res.events = sum(int(o.get.get("rows") or 0) + int(o.get.get("superseded") or 0) for o in observations)
    wm = watermark(after)
    if isinstance(spec.fold, GroupFold):
        w = _with_retry("applying the batch", lambda: sink.apply_grouped(target, tbl, wm, changed))
    else:
        if isinstance(spec.fold, CustomFold) and tbl.num_rows:
            tbl = tbl.set_column(
                tbl.schema.get_field_index(VERSION), VERSION, pa.array([wm] * tbl.num_rows, pa.int64())
            )
        # Sinks without transactions (search, Redis) may refuse single rows: the positions are stored
        # only after the refused rows are in the dead-letter topic, so a crash between the two
        # re-runs the batch (the version guard skips what was written) and loses no dead letter.
        transactional = sink.kind == "postgres"
        w = _with_retry("applying the batch", lambda: sink.write(target, tbl, changed if transactional else None))
        if w.rejected:
            # The rest of the batch is written: the refused rows go to the dead letters with the
            # reason and, for latest-row views, the log position of their change.
            versions, located = _where_by_key(plan, tbl, where_in_log, {key_str(k) for k, _ in w.rejected})
            refused = [(key_str(k), versions.get(key_str(k)), reason) for k, reason in w.rejected]
            res.dead_letters += _dead_letter(rt, plan, sink_rejections(plan, sink.kind, refused, None, located))
        if not transactional and changed:
            _with_retry("storing positions", lambda: sink.store_positions(target, changed))
    res.upserted, res.deleted = w.upserted, w.deleted
    res.positions = after
    return res


def _where_by_key(
    plan: Plan, tbl: pa.Table, where_in_log: pa.Table | None, wanted: set[str]
) -> tuple[dict[str, int], dict[tuple[str, int], tuple[str, int, bytes | None]]]:
    """Versions of the `wanted` rows, and (for latest-row views) their log positions."""
    keys = [tbl.column(k).to_pylist() for k in plan.view.key]
    versions = tbl.column(VERSION).to_pylist()
    topics = where_in_log.column("_kf_topic").to_pylist() if where_in_log is not None else None
    parts = where_in_log.column("_kf_partition").to_pylist() if where_in_log is not None else None
    out: dict[str, int] = {}
    located: dict[tuple[str, int], tuple[str, int, bytes | None]] = {}
    for i in range(tbl.num_rows):
        k = key_str(tuple(kc[i] for kc in keys))
        if k in wanted:
            out[k] = versions[i]
            if topics is not None and parts is not None:
                located[(k, versions[i])] = (topics[i], int(parts[i]), None)
    return out, located


def sink_rejections(
    plan: Plan,
    sink: str,
    refused: list[tuple[str, int | None, str]],
    rows: DataFrame | None,
    located: dict[tuple[str, int], tuple[str, int, bytes | None]] | None = None,
) -> list[dict[str, Any]]:
    """Dead letters for view rows a sink refused: (row key text, version, reason) each.

    A latest-row view's version is the offset of the change that made the row, so its log
    position is found in `rows` (the batch's folded rows); a grouped/custom row comes from
    many changes and is dead-lettered with its key and version (the batch's watermark).
    `located` gives positions already known: (row key, version) -> (topic, partition, record key)."""
    located = dict(located or {})
    if rows is not None and isinstance(plan.spec.fold, LatestFold):
        offsets = sorted({v for _, v, _ in refused if v is not None})[:10_000]
        if offsets:
            key = list(plan.spec.key)
            found = (
                rows.where(F.col("_kf_offset").isin(offsets))
                .select("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key", *key)
                .collect()
            )
            for r in found:
                located[(key_str(tuple(r[k] for k in key)), int(r["_kf_offset"]))] = (
                    r["_kf_topic"], int(r["_kf_partition"]), r["_kf_key"])
    out = []
    for rk, version, reason in refused:
        pos = located.get((rk, version)) if version is not None else None
        out.append(
            {
                "topic": pos[0] if pos else None,
                "partition": pos[1] if pos else None,
                "offset": version if pos else None,
                "key": bytes(pos[2]) if pos and pos[2] is not None else None,
                "reason": f"the {sink} sink refused the row of view {plan.view.name!r} with key {rk}: {reason}",
                "sink": sink,
                "row_key": rk,
                "version": version,
            }
        )
    return out


def apply_range(
    plan: Plan, rt: Runtime, target: Target, start: Offsets, end: Offsets, sink: Sink | None = None
) -> BatchResult:
    declarative = not isinstance(plan.spec.fold, CustomFold)
    raws = {t: rt.raw(t, start, end, latest_per_key=declarative) for t in plan.spec.topics}
    return apply_batch(plan, rt, target, raws, flatten(start), known_end=end, sink=sink, deduped_input=True)


class ProjectionBusy(SinkError):
    """Another replay or follow holds the projection's lock."""


__all__ = [
    "BatchResult",
    "BuildResult",
    "ProjectionBusy",
    "apply_batch",
    "apply_range",
    "build",
    "flatten",
    "prepare",
    "sink_rejections",
    "watermark",
]
