"""The two operations everything is made of: build a target from scratch, apply a batch.

- ``build``: a full fold of the log up to given end offsets into an empty target (a
  shadow), written by the Spark executors themselves (``mapInArrow`` + COPY).
- ``apply_batch``: fold a bounded slice of the log (a follow micro-batch, or a replay's
  catch-up) into a live target: the changes are collected to the driver and written with
  the consumed positions in ONE sink transaction. Records below the stored positions are
  filtered out first, so re-running a batch (Spark checkpoint behind the sink after a
  crash) changes nothing: exactly-once in effect.

What is folded, and how, is the fold kind's (``kappaflow.projections.folds``: its strategy's
``build``, ``fold_batch`` and ``write_batch``); this module is the same for every kind and asks
sinks only for capabilities (``positions_with_rows``, ``load_batches``, ``grouped_state``).

Versions: a latest-row view's row carries the log offset of its event. Grouped and
custom views carry the *watermark* of the write: the sum of the next offsets of all
input partitions, which grows with every batch that consumed anything, so a version
guard (``excluded._kf_version > view._kf_version``) orders writes of any kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from kappaflow.errors import KappaflowError, SinkError
from kappaflow.projections.api import ProjectionSpec
from kappaflow.projections.deadletter import write_dead_letters
from kappaflow.projections.folds import BuildJob, ReadCounter, strategy_for
from kappaflow.projections.folds.base import collect_bad, read_metrics
from kappaflow.projections.joins import asof_stage
from kappaflow.projections.joins import plan as join_plan
from kappaflow.projections.joins import stage as join_stage
from kappaflow.projections.plan import Plan
from kappaflow.projections.runtime import Offsets, Runtime
from kappaflow.projections.schemas import load_table_schemas
from kappaflow.projections.sinks.base import VERSION, Positions, Sink, Target, TopicPartition
from kappaflow.projections.sinks.keys import key_str

log = logging.getLogger("kappaflow.projections")


def prepare(spec: ProjectionSpec, rt: Runtime) -> Plan:
    """Load the source schemas and compile the projection."""
    given = {s.topic: s.schema for s in spec.sources if s.schema is not None}
    schemas = load_table_schemas(rt.reader(), [t for t in spec.change_topics if t in spec.source_topics], given)
    if spec.joined:
        schemas.update(join_plan.lookup_schemas(spec, rt.reader(), schemas))
    if spec.as_of:
        schemas.update(asof_stage.table_schemas(spec, rt.reader(), schemas))
    others = [t for t in spec.change_topics if t not in schemas]  # a fold's own joined topics (interval joins)
    if others:
        schemas.update(load_table_schemas(rt.reader(), others, {}))
    plan = Plan.build(rt.spark, spec, schemas)
    if spec.as_of and plan.asof is None:  # a windowed view's compile binds it already (its rows have the columns)
        plan.asof = asof_stage.AsOfPlan.build(spec, schemas)
    return plan


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


def _dead_letter(rt: Runtime, plan: Plan, rows: list[dict[str, Any]]) -> int:
    if not rows:
        return 0
    for r in rows[:5]:
        log.warning(
            "dead letter for %s: %s[%s]@%s: %s", plan.spec.name, r["topic"], r["partition"], r["offset"], r["reason"]
        )
    return write_dead_letters(rt.log_url, rt.log_options, plan.spec.name, rows)


# --- build (replay into an empty shadow) -------------------------------------------------------------
def _spans(end: Offsets, start: Offsets | None = None) -> list[int]:
    return [o - (start or {}).get(t, {}).get(p, 0) for t, parts in end.items() for p, o in parts.items()]


def build(
    plan: Plan, rt: Runtime, target: Target, end: Offsets, *, dead_letters: bool = True, sink: Sink | None = None
) -> BuildResult:
    """Fold [0, end) into the empty `target` of `sink` (default ``rt.sink``) with the fold's strategy.
    ``dead_letters=False`` (verify) only counts them. Rows the sink refuses go to the dead letters too."""
    t0 = time.monotonic()
    sink = sink or rt.sink
    counted = ReadCounter(plan.spec.name)
    strategy = strategy_for(plan.spec)
    built = strategy.build(BuildJob(plan, rt, sink, target, end, _spans(end), watermark(flatten(end)), counted))
    res = BuildResult(rows=built.loaded)
    dead = built.dead
    refused = [d for d in dead if d["topic"] is None]
    if refused:
        dead = [d for d in dead if d["topic"] is not None] + sink_rejections(
            plan, sink.kind, [(bytes(d["key"]).decode(), d["offset"], d["reason"]) for d in refused], built.rows
        )
    res.dead_letters = _dead_letter(rt, plan, dead) if dead_letters else len(dead)
    res.events = built.records_read if built.records_read is not None else counted.records
    res.seconds = time.monotonic() - t0
    return res


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
    partition, which allows folding in place); None: arbitrary partitioning.

    A projection with lookups updates its join state in the batch (``joins.stage``): in the
    PostgreSQL sink's transaction (join state, view rows and positions commit together), or beside
    a search/Redis view, committed before its rows and positions are written."""
    sink = sink or rt.sink
    with join_stage.transaction(plan.join, rt, sink, target), asof_stage.transaction(plan.asof, sink, target):
        return _apply_batch(plan, rt, target, raws, before, known_end, sink, deduped_input)


def _apply_batch(
    plan: Plan,
    rt: Runtime,
    target: Target,
    raws: dict[str, DataFrame],
    before: Positions,
    known_end: Offsets | None,
    sink: Sink,
    deduped_input: bool | None,
) -> BatchResult:
    spec = plan.spec
    partitions = _partition_counts(rt, spec.topics)
    cond = _offset_filter(before)
    observations: list[Observation] = []
    observed: dict[str, DataFrame] = {}
    for t, df in raws.items():
        if cond is not None:
            df = df.where(cond)
        obs = Observation(f"kf_batch_{spec.name}_{t}_{time.monotonic_ns()}")
        metrics = plan.cached(
            ("metrics", t, partitions[t]),
            lambda t=t: (
                read_metrics()
                + [F.max(F.when(F.col("partition") == p, F.col("offset"))).alias(f"p{p}") for p in range(partitions[t])]
            ),
        )
        observed[t] = df.observe(obs, *metrics)
        observations.append(obs)
    res = BatchResult()
    strategy = strategy_for(spec)
    batch = strategy.fold_batch(plan, rt, sink, target, observed, deduped_input)
    dead = list(batch.dead)
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
    if batch.bad is not None and batch.bad.get.get("bad"):
        dead += collect_bad(plan, {t: (df.where(cond) if cond is not None else df) for t, df in raws.items()})
    res.dead_letters = _dead_letter(rt, plan, dead)
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    # log records consumed (read), not offsets passed: compaction leaves gaps in the offsets
    res.events = sum(int(o.get.get("rows") or 0) + int(o.get.get("superseded") or 0) for o in observations)
    wm = watermark(after)
    if plan.join is not None:  # a joined row's version is the batch's watermark, not a change's offset
        t = batch.table
        batch.table = t.set_column(t.schema.get_field_index(VERSION), VERSION, pa.array([wm] * t.num_rows, pa.int64()))
        batch.where_in_log = None
        join_stage.before_write(after)  # state kept beside a search/Redis view commits before its rows
    # Sinks without transactions (search, Redis) may refuse single rows: the positions are stored
    # only after the refused rows are in the dead-letter topic, so a crash between the two
    # re-runs the batch (the version guard skips what was written) and loses no dead letter.
    if not changed and not batch.table.num_rows and not res.dead_letters:
        # Nothing moved (every record was below the stored positions): no sink transaction.
        res.positions = after
        return res
    with_rows = changed if sink.positions_with_rows else None
    w = _with_retry(
        "applying the batch", lambda: strategy.write_batch(plan, sink, target, batch, wm, with_rows)
    )
    if w.rejected:
        # The rest of the batch is written: the refused rows go to the dead letters with the
        # reason and, when a row's version is its change's offset, the log position of that change.
        versions, located = _where_by_key(plan, batch.table, batch.where_in_log, {key_str(k) for k, _ in w.rejected})
        refused = [(key_str(k), versions.get(key_str(k)), reason) for k, reason in w.rejected]
        res.dead_letters += _dead_letter(rt, plan, sink_rejections(plan, sink.kind, refused, None, located))
    if with_rows is None and changed:
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
    located = {**(located or {}), **strategy_for(plan.spec).locate_refused(plan, rows, refused)}
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


def swap_in(plan: Plan, rt: Runtime, sink: Sink, shadow: Target) -> Target:
    """Make `shadow` the live view together with the state its input stage keeps beside it (a join's
    state, an as-of history): replay, a follower taking a handover and a replay finishing one alone
    all swap through here, so none of them can swap a view without its state."""
    if plan.asof is not None:  # the view and its as-of state swap in one transaction
        return asof_stage.swap(plan.asof, sink, shadow)
    return join_stage.swap(plan.join, rt, sink, shadow)  # plain sink.swap without lookups


def drop_state(plan: Plan, rt: Runtime, sink: Sink, target: Target) -> None:
    """Drop the input-stage state kept beside `target` (a failed shadow's, a verify scratch's); the
    caller drops the view itself."""
    join_stage.drop(plan.join, rt, sink, target)
    if plan.asof is not None:
        asof_stage.drop(plan.asof, sink, target)


def apply_range(
    plan: Plan, rt: Runtime, target: Target, start: Offsets, end: Offsets, sink: Sink | None = None
) -> BatchResult:
    latest_only = strategy_for(plan.spec).reads_latest_per_key
    raws = {t: rt.raw(t, start, end, latest_per_key=latest_only) for t in plan.spec.topics}
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
    "drop_state",
    "flatten",
    "prepare",
    "sink_rejections",
    "swap_in",
    "watermark",
]
