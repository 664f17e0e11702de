"""Stream-stream joins within a time bound (``IntervalJoinFold``, ``Projection.interval_join``).

The rule (the README's "Event time" / "Joins within a time bound" is the user-facing copy;
``tests/projections/test_interval_join.py`` holds a plain-Python reference of it). Times are
microseconds since the Unix epoch (UTC); L = ``allowed_lateness``; [lo, hi] = ``within``.

- Every change event of both topics (the projection's one source: *left*; ``interval_join.topic``:
  *right*) is read in log order per input partition. The *partition watermark before an event* is the
  largest event time (``left_time`` / ``right_time``) of the earlier inserts and updates of that
  partition, minus ``delay`` (the windows' rule, ``folds/windowed.py``).
- A row *version* is (side, record key, event time) with its columns. An event of a key first
  *retracts* the key's current version, then *inserts* its new one (not for a delete, a row ``where``
  rejects, a malformed record or a NULL event time). A part is *late* when ``its event time + L <
  partition watermark before the event``; ``late="update"``: nothing is late. A late retraction leaves
  the old version (and its pairs) frozen in the view; a late insertion is not applied (counted;
  ``dead_letter``: also sent to the dead-letter topic with reason "late").
- The *live* versions are those inserted and not retracted. The view holds one row per pair of live
  versions (l, r) with equal, non-NULL join keys and ``l.t + lo <= r.t <= l.t + hi`` (inner), and with
  ``how="left"`` one row per live left version without such a pair once ``l.t + hi + L < W`` (right
  columns NULL, ``<name>_key`` ''), W being the projection watermark (min over the non-idle
  partitions of both topics of their largest event time - delay). The view is a function of the live
  versions and W, which are functions of the log: replay and follow give the same rows.
- State: the live versions that can still change, per side, in the view's keyed-state table (the
  grouped fold's ``kappaflow.state__<schema>__<view>``, swapped with the view), the partitions' largest
  event times and W, written in the transaction of the view rows and the positions. With
  ``drop``/``dead_letter``, a left version is dropped once ``max(t, t + hi) + L < W_all`` and a right
  one once ``max(t, t - lo) + L < W_all`` (W_all: min over ALL partitions): from then on every part
  that could retract it or pair with it is late, so dropping changes no result.

Replay folds the whole log [0, end) with the same code as a follow batch (on the driver, into the
empty target): replay == follow by construction, at the price of holding the log's events of both
topics in the driver's memory during a replay.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StringType, TimestampNTZType, TimestampType

from kappaflow.errors import ConfigError, SinkError
from kappaflow.events import TableSchema
from kappaflow.projections.api import (
    INTERVAL_HOWS,
    INTERVAL_LATE_POLICIES,
    NAME_RE,
    Declaration,
    IntervalJoin,
    IntervalJoinFold,
    ProjectionSpec,
)
from kappaflow.projections.folds.base import BAD_REASON, BuildJob, Built, FoldedBatch, FoldStrategy, register
from kappaflow.projections.folds.windowed import (
    LATE_REASON,
    MARK_TOPIC,
    W_KEY,
    duration_us,
    iso,
    mark_key,
    projection_watermarks,
)
from kappaflow.projections.plan import VALID_OPS, Plan
from kappaflow.projections.schemas import converted_row, envelope_struct
from kappaflow.projections.sinks.base import VERSION, Positions, Sink, Target, ViewColumn, ViewSpec, WriteResult
from kappaflow.projections.sinks.postgres import STATE_KEY, STATE_TOPIC, pg_type

if TYPE_CHECKING:
    from kappaflow.projections.runtime import Runtime

JK, T, CUR, LATE, OP = "_kf_jk", "_kf_t", "_kf_cur", "_kf_late", "_kf_op"
"""State columns beside the view's: join key (JSON text), event time (µs), current version (not a
frozen one), late count (mark rows), and the change's operation (batch tables only)."""
UNMATCHED = ""
"""``<name>_key`` of a left row's unmatched row (``how="left"``)."""
TP = tuple[str, int]


# --- declaring -------------------------------------------------------------------------------------
def declare_interval_join(where: str, raw: Any, decl: Declaration) -> IntervalJoinFold:
    """The validated fold of ``interval_join`` (ConfigError naming the class and the attribute)."""
    at = f"{where}: 'interval_join'"
    if not isinstance(raw, IntervalJoin):
        raise ConfigError(f"{at}: expected IntervalJoin(name, topic, on=..., left_time=..., right_time=..., "
                          f"within=(lower, upper)), got {raw!r}")
    if decl.has_apply:
        raise ConfigError(f"{at}: a join within a time bound cannot be combined with an apply() fold")
    if decl.aggregates:
        raise ConfigError(f"{at}: 'aggregates' cannot be combined with a join within a time bound (the view "
                          "holds one row per matched pair)")
    if len(decl.sources) != 1 or decl.sources[0].events:
        raise ConfigError(f"{at}: the projection needs exactly one source of change events (the left stream), "
                          f"got {[s.topic for s in decl.sources]}")
    if not isinstance(raw.name, str) or not NAME_RE.match(raw.name):
        raise ConfigError(f"{at}.name: expected an identifier (the right columns' prefix), got {raw.name!r}")
    if not isinstance(raw.topic, str) or not raw.topic:
        raise ConfigError(f"{at}.topic: expected a topic name, got {raw.topic!r}")
    if raw.topic == decl.sources[0].topic:
        raise ConfigError(f"{at}.topic: {raw.topic!r} is the projection's source; join two different topics")
    if not isinstance(raw.on, Mapping) or not raw.on or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw.on.items()):
        raise ConfigError(f"{at}.on: expected a non-empty dict of left column -> right column, got {raw.on!r}")
    for attr in ("left_time", "right_time"):
        v = getattr(raw, attr)
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{at}.{attr}: expected a column name, got {v!r}")
    if not isinstance(raw.within, (tuple, list)) or len(raw.within) != 2:
        raise ConfigError(f"{at}.within: expected (lower, upper) durations, e.g. ('0s', '1h'), got {raw.within!r}")
    lower = duration_us(raw.within[0], f"{at}.within[0]")
    upper = duration_us(raw.within[1], f"{at}.within[1]")
    if lower > upper:
        raise ConfigError(f"{at}.within: the lower bound {raw.within[0]!r} is above the upper bound "
                          f"{raw.within[1]!r}")
    if raw.how not in INTERVAL_HOWS:
        raise ConfigError(f"{at}.how: expected one of {list(INTERVAL_HOWS)}, got {raw.how!r}")
    if raw.late not in INTERVAL_LATE_POLICIES:
        raise ConfigError(f"{at}.late: expected one of {list(INTERVAL_LATE_POLICIES)}, got {raw.late!r}")
    delay = duration_us(raw.delay, f"{at}.delay")
    if delay < 0:
        raise ConfigError(f"{at}.delay: must be >= 0, got {raw.delay!r}")
    lateness = duration_us(raw.allowed_lateness, f"{at}.allowed_lateness")
    if lateness < 0:
        raise ConfigError(f"{at}.allowed_lateness: must be >= 0, got {raw.allowed_lateness!r}")
    idle = None if raw.idle_timeout is None else duration_us(raw.idle_timeout, f"{at}.idle_timeout")
    if idle is not None and idle <= 0:
        raise ConfigError(f"{at}.idle_timeout: must be > 0 (or None: never idle), got {raw.idle_timeout!r}")
    right_cols = _names(f"{at}.columns", raw.columns)
    left_cols = _names(f"{where}: 'columns'", decl.columns)
    return IntervalJoinFold(
        name=raw.name, topic=raw.topic, on=tuple(raw.on.items()), left_time=raw.left_time,
        right_time=raw.right_time, lower_us=lower, upper_us=upper, how=raw.how, columns=left_cols,
        right_columns=right_cols, delay_us=delay, lateness_us=lateness, late=raw.late, idle_us=idle,
    )


def _names(at: str, raw: Any) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, str) or not isinstance(raw, (list, tuple)) or not all(isinstance(c, str) for c in raw):
        raise ConfigError(f"{at}: expected a list of column names, got {raw!r}")
    return tuple(raw)


# --- the rule --------------------------------------------------------------------------------------
@dataclass
class Rule:
    """The join's late rule and watermarks in plain Python (module docstring)."""

    lower: int
    upper: int
    delay: int
    lateness: int
    update: bool
    idle: int | None
    dead_letter: bool = False

    @classmethod
    def of(cls, fold: IntervalJoinFold) -> Rule:
        return cls(fold.lower_us, fold.upper_us, fold.delay_us, fold.lateness_us, fold.late == "update",
                   fold.idle_us, fold.late == "dead_letter")

    def watermarks(self, pmax: Mapping[TP, int], partitions: Sequence[TP]) -> tuple[int | None, int | None]:
        """(W over the non-idle partitions, W_all over every partition); None: no watermark yet."""
        return projection_watermarks(pmax, partitions, self.delay, self.idle)

    def fold(
        self, events: Mapping[str, list[Any]], current: dict[tuple[str, bytes], int],
        pmax: dict[TP, int], late: dict[TP, int], changes: list[tuple[str, str, bytes, int, int | None, int]],
        dead: list[dict[str, Any]] | None = None,
    ) -> None:
        """Apply `events` (``_kf_topic, _kf_partition, _kf_offset, _kf_key, _kf_keep, _kf_present,
        _kf_et``; offset order within each partition) to `current` ((topic, key) -> event time of the
        key's current version), `pmax` and `late`. `changes` gets (op, topic, key, event time, event
        index or None, offset) with op "ins" (a version inserted), "del" (retracted) or "ghost" (its
        retraction was late: frozen, no longer current); `dead` the dead letters of late insertions
        (``late="dead_letter"``; a late retraction is not reported, as for windows)."""
        topics, parts, offsets = events["_kf_topic"], events["_kf_partition"], events["_kf_offset"]
        keys, keeps, present, ets = events["_kf_key"], events["_kf_keep"], events["_kf_present"], events["_kf_et"]
        for i in range(len(offsets)):
            topic, key, et = topics[i], keys[i], ets[i]
            tp = (topic, parts[i])
            pm = pmax.get(tp)
            pw = None if pm is None or self.update else pm - self.delay
            sk = (topic, key)
            old = current.pop(sk, None)
            if old is not None:
                op = "ghost" if pw is not None and old + self.lateness < pw else "del"
                changes.append((op, topic, key, old, None, offsets[i]))
            if keeps[i] and et is not None:
                if pw is not None and et + self.lateness < pw:
                    late[tp] = late.get(tp, 0) + 1
                    if dead is not None and self.dead_letter:
                        dead.append({
                            "topic": topic, "partition": parts[i], "offset": offsets[i], "key": key,
                            "reason": LATE_REASON,
                            "extra": {"event_time": iso(et), "watermark": iso(pw),
                                      "allowed_lateness_s": self.lateness / 1_000_000},
                        })
                else:
                    current[sk] = et
                    changes.append(("ins", topic, key, et, i, offsets[i]))
            if present[i] and et is not None and (pm is None or et > pm):
                pmax[tp] = et


def state_key(key: bytes, t: int) -> bytes:
    """A version's ``_kf_key`` in the state table: the record key, NUL, the event time (sorts by key)."""
    return key + b"\x00" + t.to_bytes(8, "big", signed=True)


def right_label(key: bytes, t: int) -> str:
    """``<name>_key`` of a right version: its record key (as text) @ its event time."""
    return key.decode("utf-8", "replace") + "@" + iso(t)


# --- compiled shape --------------------------------------------------------------------------------
@dataclass
class Shape:
    """What the strategy compiled: the left/right value columns (view names), the time types, and
    the Spark expressions of each side's event frame."""

    left: str
    right: str
    left_cols: tuple[ViewColumn, ...]
    right_cols: tuple[ViewColumn, ...]
    label: str
    left_time_view: str
    aware: bool
    left_exprs: list[Any] = field(default_factory=list)
    right_exprs: list[Any] = field(default_factory=list)

    @property
    def values(self) -> tuple[ViewColumn, ...]:
        return (*self.left_cols, *self.right_cols)


def _fold(plan: Plan) -> IntervalJoinFold:
    fold = plan.spec.fold
    assert isinstance(fold, IntervalJoinFold)
    return fold


def _shape(plan: Plan) -> Shape:
    shape = plan._memo.get("interval_shape")
    assert isinstance(shape, Shape), "an interval join's plan is compiled by IntervalJoinStrategy.compile"
    return shape


def _micros(col: Any, dt: DataType) -> Any:
    return F.unix_micros(col.cast("timestamp") if isinstance(dt, TimestampNTZType) else col)


def _join_key(cols: Sequence[Any]) -> Any:
    """The join key as JSON text of the values as strings (NULL when a part is NULL: never matches)."""
    ok = F.lit(True)
    for c in cols:
        ok = ok & c.isNotNull()
    return F.when(ok, F.to_json(F.array(*[c.cast("string") for c in cols])))


class IntervalJoinStrategy(FoldStrategy):
    fold: ClassVar[type[IntervalJoinFold]] = IntervalJoinFold
    priority: ClassVar[int] = 120  # before windows and custom folds: a class with interval_join is ours
    reads_latest_per_key: ClassVar[bool] = False  # every event makes the watermark

    def claims(self, decl: Declaration) -> bool:
        return getattr(decl.klass, "interval_join", None) is not None

    def declare(self, decl: Declaration) -> IntervalJoinFold:
        return declare_interval_join(decl.where, getattr(decl.klass, "interval_join", None), decl)

    def fingerprint(self, spec: ProjectionSpec) -> list[str]:
        f = _fold_of(spec)
        return [repr((f.name, f.topic, f.on, f.left_time, f.right_time, f.lower_us, f.upper_us, f.how, f.columns,
                      f.right_columns, f.delay_us, f.lateness_us, f.late, f.idle_us))]

    def check_sinks(self, where: str, sinks: Sequence[str]) -> None:
        other = [s for s in sinks if s != "postgres"]
        if other:
            raise ConfigError(
                f"{where}: 'sinks': a join within a time bound ('interval_join') is kept in PostgreSQL only: its "
                f"state and watermark live there and search/Redis mirrors of it are not supported. Use "
                f"sinks = ('postgres',), not {list(sinks)}"
            )

    # --- compile --------------------------------------------------------------------------------
    def compile(self, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        fold = _fold_of(spec)
        where = f"projection {spec.name!r}"
        at = f"{where}: 'interval_join'"
        left, right = spec.source_topics[0], fold.topic
        if right not in schemas:
            raise ConfigError(f"{at}.topic: no table schema for topic {right!r}")
        lschema, rschema = schemas[left], schemas[right]
        plan = Plan(spec, schemas, view=None, row_columns=lschema.column_names)  # type: ignore[arg-type]
        rows = plan.empty_rows(spark)  # derive and where validated here
        ltypes = {f.name: f.dataType for f in rows.schema.fields if not f.name.startswith("_kf_")}
        rtypes = {c.name: f.dataType for c, f in zip(rschema.columns, _right_struct(rschema).fields, strict=True)}
        for attr, col, types, side in (("left_time", fold.left_time, ltypes, left),
                                       ("right_time", fold.right_time, rtypes, right)):
            if col not in types:
                raise ConfigError(f"{at}.{attr}: {col!r} is not a column of {side!r} (have {sorted(types)})")
            if not isinstance(types[col], (TimestampType, TimestampNTZType)):
                raise ConfigError(f"{at}.{attr}: the event-time column {col!r} is {types[col].simpleString()}; "
                                  "expected timestamp or timestamptz (cast it in 'derive')")
        if isinstance(ltypes[fold.left_time], TimestampType) != isinstance(rtypes[fold.right_time], TimestampType):
            raise ConfigError(f"{at}: left_time {fold.left_time!r} and right_time {fold.right_time!r} must both be "
                              "timestamptz or both timestamp (without time zone)")
        for lc, rc in fold.on:
            if lc not in ltypes:
                raise ConfigError(f"{at}.on: {lc!r} is not a column of {left!r} (have {sorted(ltypes)})")
            if rc not in rtypes:
                raise ConfigError(f"{at}.on: {rc!r} is not a column of {right!r} (have {sorted(rtypes)})")
        missing = [k for k in spec.key if k not in ltypes]
        if missing:
            raise ConfigError(f"{where}: 'key': {missing} are not columns of {left!r} (the left table's primary key)")
        lnames = list(fold.columns) if fold.columns is not None else list(ltypes)
        bad = [c for c in lnames if c not in ltypes]
        if bad:
            raise ConfigError(f"{where}: 'columns': {bad} are not columns of {left!r} (have {sorted(ltypes)})")
        for must in (*spec.key, fold.left_time):
            if must not in lnames:
                lnames.insert(0, must)
        rnames = list(fold.right_columns) if fold.right_columns is not None else list(rtypes)
        bad = [c for c in rnames if c not in rtypes]
        if bad:
            raise ConfigError(f"{at}.columns: {bad} are not columns of {right!r} (have {sorted(rtypes)})")
        if fold.right_time not in rnames:
            rnames.append(fold.right_time)
        prefix = fold.name + "_"
        label = prefix + "key"
        lcols = tuple(ViewColumn(n, ltypes[n]) for n in dict.fromkeys(lnames))
        rcols = tuple(ViewColumn(prefix + n, rtypes[n]) for n in rnames)
        clash = sorted({c.name for c in lcols} & {*(c.name for c in rcols), label})
        if clash:
            raise ConfigError(f"{at}.name: the right columns' names {clash} (prefix {prefix!r}) clash with left "
                              "columns; choose another name")
        lt_type = ltypes[fold.left_time]
        shape = Shape(left, right, lcols, rcols, label, fold.left_time, isinstance(lt_type, TimestampType))
        nulls_r = [F.lit(None).cast(c.type).alias(c.name) for c in rcols]
        nulls_l = [F.lit(None).cast(c.type).alias(c.name) for c in lcols]
        shape.left_exprs = [
            F.col("_kf_topic"), F.col("_kf_partition"), F.col("_kf_offset"), F.col("_kf_key"), F.col("_kf_bad"),
            (F.col("_kf_keep") & ~F.col("_kf_bad")).alias("_kf_keep"),
            (~F.col("_kf_deleted") & F.col("_kf_row_present") & ~F.col("_kf_bad")).alias("_kf_present"),
            _micros(F.col(fold.left_time), lt_type).alias("_kf_et"),
            _join_key([F.col(lc) for lc, _ in fold.on]).alias(JK),
            *[F.col(c.name) for c in lcols], *nulls_r,
        ]
        row = F.col("_kf_r")
        shape.right_exprs = [
            F.col("_kf_topic"), F.col("_kf_partition"), F.col("_kf_offset"), F.col("_kf_key"), F.col("_kf_bad"),
            (~F.col("_kf_deleted") & ~F.col("_kf_bad")).alias("_kf_keep"),
            (~F.col("_kf_deleted") & ~F.col("_kf_bad")).alias("_kf_present"),
            _micros(row[fold.right_time], rtypes[fold.right_time]).alias("_kf_et"),
            _join_key([row[rc] for _, rc in fold.on]).alias(JK),
            *nulls_l, *[row[n].alias(prefix + n) for n in rnames],
        ]
        plan._memo["interval_shape"] = shape
        plan._memo["interval_right_names"] = tuple(dict.fromkeys([*rnames, *(rc for _, rc in fold.on)]))
        key = (*spec.key, fold.left_time, label)
        cols = (*lcols, *rcols, ViewColumn(label, StringType(), False))
        state_cols = [{"name": c.name, "pg_type": pg_type(c.type)} for c in cols]
        state_cols += [{"name": JK, "pg_type": "text"}, {"name": T, "pg_type": "bigint"},
                       {"name": CUR, "pg_type": "boolean"}, {"name": LATE, "pg_type": "bigint"}]
        group = {"group_by": [spec.key[0]], "state_columns": state_cols, "aggregates": []}
        plan.view = ViewSpec(spec.view, spec.name, key, cols, spec.namespace, {**spec.view_options(), "group": group})
        plan.compiled = shape
        return plan

    # --- replay ---------------------------------------------------------------------------------
    def build(self, job: BuildJob) -> Built:
        """The whole log [0, end) folded as one follow batch into the empty target (module docstring)."""
        raws = {t: job.counted(job.rt.raw(t, "earliest", job.end), t) for t in job.plan.spec.topics}
        batch = self.fold_batch(job.plan, job.rt, job.sink, job.target, raws, None)
        res = self.write_batch(job.plan, job.sink, job.target, batch, job.version, None)
        return Built(loaded=res.upserted, dead=batch.dead)

    # --- follow ---------------------------------------------------------------------------------
    def fold_batch(
        self, plan: Plan, rt: Runtime, sink: Sink, target: Target, raws: dict[str, DataFrame],
        deduped_input: bool | None,
    ) -> FoldedBatch:
        fold, spec = _fold(plan), plan.spec
        rule = Rule.of(fold)
        tbl = _events(plan, raws).toArrow()
        tbl = tbl.take(pc.sort_indices(tbl, [("_kf_topic", "ascending"), ("_kf_partition", "ascending"),
                                             ("_kf_offset", "ascending")]))
        keeper = _keeper(plan, sink)
        marks = _read_marks(keeper, target)
        pmax = {tp: m for tp, (m, _) in marks.items() if m is not None}
        late = {tp: n for tp, (_, n) in marks.items()}
        reader = rt.reader()
        partitions = [(t, p) for t in spec.topics for p in range(reader.partitions(t))]
        w_before, _ = rule.watermarks(pmax, partitions)
        events = {c: tbl.column(c).to_pylist() for c in ("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key",
                                                         "_kf_keep", "_kf_present", "_kf_et", "_kf_bad")}
        touched = sorted({(t, k) for t, k in zip(events["_kf_topic"], events["_kf_key"], strict=True)})
        current = _read_current(keeper, target, touched)
        before = {tp: (pmax.get(tp), late.get(tp, 0)) for tp in set(pmax) | set(late)}
        changes: list[tuple[str, str, bytes, int, int | None, int]] = []
        dead: list[dict[str, Any]] = []
        rule.fold(events, current, pmax, late, changes, dead)
        w_after, w_all = rule.watermarks(pmax, partitions)
        dead += [
            {"topic": t, "partition": p, "offset": o, "key": k, "reason": BAD_REASON}
            for t, p, o, k, b in zip(events["_kf_topic"], events["_kf_partition"], events["_kf_offset"],
                                     events["_kf_key"], events["_kf_bad"], strict=True) if b
        ]
        ends: dict[TP, int] = {}
        for t, p, o in zip(events["_kf_topic"], events["_kf_partition"], events["_kf_offset"], strict=True):
            ends[(t, p)] = max(ends.get((t, p), 0), o + 1)
        moved = {tp: (pmax.get(tp), late.get(tp, 0)) for tp in set(pmax) | set(late)
                 if (pmax.get(tp), late.get(tp, 0)) != before.get(tp)}
        table = _change_table(plan, tbl, changes)
        return IntervalBatch(table, dead=dead, w_before=w_before, w_after=w_after, w_all=w_all, rule=rule,
                             marks=moved, mark_versions=ends, late_total=sum(late.values()))

    def write_batch(
        self, plan: Plan, sink: Sink, target: Target, batch: FoldedBatch, watermark: int, positions: Positions | None
    ) -> WriteResult:
        """Steps, in ONE transaction: (1) the batch's version changes go to a temporary table; (2) the
        view rows of every retracted or (re)inserted version leave the view; (3) the state takes the
        changes (frozen versions stay, not current); (4) the pairs of every inserted version with the
        live versions of the other side enter the view; (5) ``how="left"``: the unmatched rows of the
        left versions whose pairs or whose side of W changed are recomputed; (6) the watermark rows;
        (7) ``drop``: the versions every partition has passed leave the state; (8) the positions."""
        assert isinstance(batch, IntervalBatch) and batch.rule is not None
        try:
            return _write(plan, _keeper(plan, sink), target, batch, watermark, positions)
        except Exception as exc:
            if isinstance(exc, (SinkError, ConfigError)):
                raise
            raise SinkError(f"applying an interval-join batch to view {target.view.name!r}: {exc}") from None

    def status_details(self, sink: Sink, target: Target) -> dict[str, Any]:
        return interval_status(sink, target)


def _fold_of(spec: ProjectionSpec) -> IntervalJoinFold:
    f = spec.fold
    assert isinstance(f, IntervalJoinFold)
    return f


STRATEGY = register(IntervalJoinStrategy())


@dataclass
class IntervalBatch(FoldedBatch):
    """A batch of an interval join: version changes, the watermarks before/after it and the moved
    partition marks (largest event time, late count)."""

    w_before: int | None = None
    w_after: int | None = None
    w_all: int | None = None
    rule: Rule | None = None
    marks: dict[TP, tuple[int | None, int]] = field(default_factory=dict)
    mark_versions: dict[TP, int] = field(default_factory=dict)
    late_total: int = 0


# --- helpers ---------------------------------------------------------------------------------------
def _keeper(plan: Plan, sink: Sink) -> Any:
    keeper = sink.grouped_state()
    if keeper is None:
        raise ConfigError(f"projection {plan.spec.name!r}: the {sink.kind} sink keeps no state for a join "
                          "within a time bound (it lives in PostgreSQL)")
    return keeper


def _right_struct(schema: TableSchema) -> Any:
    from kappaflow.projections.schemas import row_struct

    return row_struct(schema)


def _events(plan: Plan, raws: dict[str, DataFrame]) -> DataFrame:
    """Both topics' change events as one frame of the rule's columns and the view's value columns."""
    shape, fold = _shape(plan), _fold(plan)
    base = F.col("_kf_key").isNotNull() & (F.col("_kf_op").isNull() | (F.col("_kf_op") != "t"))
    left = plan.rows(plan.all_events({shape.left: raws[shape.left]}).where(base)).select(*shape.left_exprs)
    schema = plan.schemas[fold.topic]
    names = plan._memo["interval_right_names"]
    j = F.from_json(F.col("value").cast("string"), envelope_struct(schema))
    after = F.coalesce(j["payload"]["after"], j["after"])
    op = F.coalesce(j["payload"]["op"], j["op"])
    tomb = F.col("value").isNull()
    right = raws[shape.right].select(
        F.col("topic").alias("_kf_topic"), F.col("partition").alias("_kf_partition"),
        F.col("offset").alias("_kf_offset"), F.col("key").alias("_kf_key"),
        F.when(tomb, F.lit(None).cast("string")).otherwise(op).alias("_kf_op"),
        (tomb | (op == "d") | after.isNull()).alias("_kf_deleted"),
        (~tomb & (op.isNull() | ~op.isin(*VALID_OPS))).alias("_kf_bad"),
        converted_row(after, schema, names).alias("_kf_r"),
    ).where(base)
    right = right.withColumn("_kf_deleted", F.col("_kf_deleted") | F.col("_kf_r").isNull())
    return left.unionByName(right.select(*shape.right_exprs))


def _rel(keeper: Any, target: Target) -> Any:
    from psycopg import sql

    return sql.SQL("{}.{}").format(sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)))


def _read_marks(keeper: Any, target: Target) -> dict[TP, tuple[int | None, int]]:
    from psycopg import sql

    rows = keeper.conn.execute(
        sql.SQL("SELECT {k}, {t}, {n} FROM {s} WHERE {tp} = %s").format(
            s=_rel(keeper, target), k=sql.Identifier(STATE_KEY), t=sql.Identifier(T), n=sql.Identifier(LATE),
            tp=sql.Identifier(STATE_TOPIC)), (MARK_TOPIC,),
    ).fetchall()
    out = {}
    for k, m, n in rows:
        if bytes(k) == W_KEY:
            continue
        t, p = orjson.loads(bytes(k))
        out[(t, int(p))] = (m, int(n or 0))
    return out


def _read_current(keeper: Any, target: Target, keys: list[tuple[str, bytes]]) -> dict[tuple[str, bytes], int]:
    """The current version's event time of each (topic, record key) the batch touches."""
    from psycopg import sql

    if not keys:
        return {}
    rows = keeper.conn.execute(
        sql.SQL("SELECT s.{tp}, s.{k}, s.{t} FROM {s} s JOIN unnest(%s::text[], %s::bytea[], %s::bytea[]) "
                "AS q(tp, lo, hi) ON s.{tp} = q.tp AND s.{k} >= q.lo AND s.{k} < q.hi WHERE s.{c}").format(
            s=_rel(keeper, target), tp=sql.Identifier(STATE_TOPIC), k=sql.Identifier(STATE_KEY),
            t=sql.Identifier(T), c=sql.Identifier(CUR)),
        ([t for t, _ in keys], [k + b"\x00" for _, k in keys], [k + b"\x01" for _, k in keys]),
    ).fetchall()
    return {(r[0], bytes(r[1])[:-9]): int(r[2]) for r in rows}


def _change_table(plan: Plan, tbl: pa.Table, changes: list[tuple[str, str, bytes, int, int | None, int]]) -> pa.Table:
    """The batch's net change per version: ("put", current?, event index) or ("del") or ("ghost")."""
    from pyspark.sql.pandas.types import to_arrow_type

    shape = _shape(plan)
    last: dict[tuple[str, bytes, int], list[Any]] = {}
    for op, topic, key, t, src, off in changes:
        sk = (topic, key, t)
        if op == "ins":
            last[sk] = ["put", True, src, off]
        elif op == "ghost" and sk in last and last[sk][0] == "put":
            last[sk] = ["put", False, last[sk][2], off]  # inserted and frozen in this batch
        else:
            last[sk] = [op, None, None, off]
    names = [c.name for c in shape.values]
    values = {n: tbl.column(n).to_pylist() for n in names} if last else {}
    jks = tbl.column(JK).to_pylist() if last else []
    cols: dict[str, list[Any]] = {n: [] for n in [STATE_TOPIC, STATE_KEY, VERSION, OP, *names, shape.label, JK, T,
                                                  CUR, LATE]}
    for (topic, key, t), (op, cur, src, off) in last.items():
        cols[STATE_TOPIC].append(topic)
        cols[STATE_KEY].append(state_key(key, t))
        cols[VERSION].append(off)
        cols[OP].append(op)
        for n in names:
            cols[n].append(values[n][src] if src is not None else None)
        cols[shape.label].append(right_label(key, t) if topic == shape.right else None)
        cols[JK].append(jks[src] if src is not None else None)
        cols[T].append(t)
        cols[CUR].append(cur)
        cols[LATE].append(None)
    types = {c.name: to_arrow_type(c.type, timezone="UTC") for c in shape.values}
    arrays = {}
    for n, v in cols.items():
        if n in types:
            arrays[n] = pa.array(v, types[n])
        elif n == STATE_KEY:
            arrays[n] = pa.array(v, pa.binary())
        elif n in (VERSION, T, LATE):
            arrays[n] = pa.array(v, pa.int64())
        elif n == CUR:
            arrays[n] = pa.array(v, pa.bool_())
        else:
            arrays[n] = pa.array(v, pa.string())
    return pa.table(arrays)


def _ensure_indexes(keeper: Any, target: Target, shape: Shape) -> None:
    """The state's join-key and time indexes (created with the table's first batch; a swap renames the
    table with them), and the view's right-label index. One catalogue read per batch."""
    from psycopg import sql

    state = keeper.state_table(target)
    have = keeper.conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'kappaflow' AND tablename = %s", (state,)
    ).fetchall()
    if any(JK in r[0] for r in have):
        return
    tag = hashlib.sha1(f"ij{state}{time.time_ns()}".encode()).hexdigest()[:16]  # index names are per schema
    for prefix, rel, names in (("kf_ij_", _rel(keeper, target), (JK, T)),
                               ("kf_it_", _rel(keeper, target), (STATE_TOPIC, T)),
                               ("kf_il_", _view_rel(keeper, target), (shape.label,))):
        keeper.conn.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(
            sql.Identifier(prefix + tag), rel, sql.SQL(", ").join(sql.Identifier(n) for n in names)))


def _view_rel(keeper: Any, target: Target) -> Any:
    from psycopg import sql

    return sql.SQL("{}.{}").format(sql.Identifier(target.view.namespace or keeper.default_schema),
                                   sql.Identifier(target.name))


def _write(plan: Plan, keeper: Any, target: Target, batch: IntervalBatch, watermark: int,
           positions: Positions | None) -> WriteResult:
    from psycopg import sql

    assert batch.rule is not None
    shape, spec, fold, rule = _shape(plan), plan.spec, _fold(plan), batch.rule
    conn = keeper.conn
    ident = sql.Identifier
    srel, vrel = _rel(keeper, target), _view_rel(keeper, target)
    chg = sql.SQL("pg_temp.{}").format(ident("kf_ij_chg"))
    lkey = [*spec.key, shape.left_time_view]
    lnames = [c.name for c in shape.left_cols]
    rnames = [c.name for c in shape.right_cols]
    state_cols = [STATE_TOPIC, STATE_KEY, VERSION, *lnames, *rnames, shape.label, JK, T, CUR, LATE]
    res = WriteResult()

    def cols(alias: str, names: Sequence[str]) -> Any:
        return sql.SQL(", ").join(sql.SQL("{}.{}").format(ident(alias), ident(n)) for n in names)

    def same(a: str, b: str, names: Sequence[str]) -> Any:
        return sql.SQL(" AND ").join(
            sql.SQL("{}.{} = {}.{}").format(ident(a), ident(n), ident(b), ident(n)) for n in names)

    view_cols = sql.SQL(", ").join(ident(n) for n in [*lnames, *rnames, shape.label, VERSION])
    with conn.transaction():
        _ensure_indexes(keeper, target, shape)
        # (1) the version changes
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(chg))
        conn.execute(sql.SQL("CREATE TEMP TABLE {} (LIKE {}) ON COMMIT DROP").format(ident("kf_ij_chg"), srel))
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} text").format(chg, ident(OP)))
        keeper._copy(chg, [*state_cols[:-1], OP], batch.table)
        conn.execute(sql.SQL("ANALYZE {}").format(chg))
        # the join keys the batch touches, old (stored) and new: whose left versions may gain or lose pairs
        jks = sql.SQL("pg_temp.{}").format(ident("kf_ij_jk"))
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(jks))
        conn.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {jk} FROM {c} WHERE {jk} IS NOT NULL "
                             "UNION SELECT s.{jk} FROM {s} s JOIN {c} c ON s.{tp} = c.{tp} AND s.{k} = c.{k} "
                             "WHERE s.{jk} IS NOT NULL").format(
            ident("kf_ij_jk"), c=chg, s=srel, jk=ident(JK), tp=ident(STATE_TOPIC), k=ident(STATE_KEY)))
        # (2) the view rows of retracted and re-inserted versions (found through their stored rows)
        gone = sql.SQL("DELETE FROM {v} v USING {s} s, {c} c WHERE c.{tp} = %s AND c.{op} IN ('del', 'put') "
                       "AND s.{tp} = c.{tp} AND s.{k} = c.{k} AND {same}")
        for side, names in ((shape.left, lkey), (shape.right, [shape.label])):
            res.deleted += max(conn.execute(gone.format(
                v=vrel, s=srel, c=chg, tp=ident(STATE_TOPIC), op=ident(OP), k=ident(STATE_KEY),
                same=same("v", "s", names)),
                (side,)).rowcount, 0)
        # (3) the state
        conn.execute(sql.SQL("DELETE FROM {s} s USING {c} c WHERE s.{tp} = c.{tp} AND s.{k} = c.{k} "
                             "AND c.{op} IN ('del', 'put')").format(
            s=srel, c=chg, tp=ident(STATE_TOPIC), k=ident(STATE_KEY), op=ident(OP)))
        conn.execute(sql.SQL("UPDATE {s} s SET {cur} = false FROM {c} c WHERE s.{tp} = c.{tp} AND s.{k} = c.{k} "
                             "AND c.{op} = 'ghost'").format(
            s=srel, c=chg, tp=ident(STATE_TOPIC), k=ident(STATE_KEY), op=ident(OP), cur=ident(CUR)))
        sc = sql.SQL(", ").join(ident(n) for n in state_cols)
        conn.execute(sql.SQL("INSERT INTO {s} ({sc}) SELECT {sc} FROM {c} WHERE {op} = 'put'").format(
            s=srel, sc=sc, c=chg, op=ident(OP)))
        # (4) the pairs of the inserted versions
        lo, hi = rule.lower, rule.upper
        pair = sql.SQL(
            "INSERT INTO {v} ({vc}) SELECT {lc}, {rc}, r.{lab}, %s::bigint FROM {s} l JOIN {s} r "
            "ON l.{jk} = r.{jk} AND r.{t} BETWEEN l.{t} + %s AND l.{t} + %s "
            "JOIN {c} c ON c.{tp} = {side}.{tp} AND c.{k} = {side}.{k} AND c.{op} = 'put' "
            "WHERE l.{tp} = %s AND r.{tp} = %s ON CONFLICT DO NOTHING")
        for side in ("l", "r"):
            res.upserted += max(conn.execute(pair.format(
                v=vrel, vc=view_cols, lc=cols("l", lnames), rc=cols("r", rnames), lab=ident(shape.label), s=srel,
                jk=ident(JK), t=ident(T), c=chg, tp=ident(STATE_TOPIC), side=ident(side), k=ident(STATE_KEY),
                op=ident(OP)),
                (watermark, lo, hi, shape.left, shape.right)).rowcount, 0)
        # (5) unmatched left versions
        if fold.how == "left":
            reach = hi + rule.lateness
            w_new, w_old = batch.w_after, batch.w_before
            never = -(2**62)  # no watermark: below every event time
            a, b = (never if w_old is None else w_old), (never if w_new is None else w_new)
            band_lo, band_hi = min(a, b), max(a, b)  # left versions whose side of W changed
            cand = sql.SQL(
                "SELECT l.* FROM {s} l WHERE l.{tp} = %s AND (l.{jk} IN (SELECT {jk} FROM {j}) "
                "OR EXISTS (SELECT 1 FROM {c} c WHERE c.{tp} = l.{tp} AND c.{k} = l.{k}) "
                "OR (l.{t} + %s >= %s AND l.{t} + %s < %s))").format(
                s=srel, tp=ident(STATE_TOPIC), jk=ident(JK), j=jks, c=chg, k=ident(STATE_KEY), t=ident(T))
            cargs = (shape.left, reach, band_lo, reach, band_hi)
            conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(ident("kf_ij_cand")))
            conn.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS {}").format(ident("kf_ij_cand"), cand), cargs)
            cnd = sql.SQL("pg_temp.{}").format(ident("kf_ij_cand"))
            res.deleted += max(conn.execute(
                sql.SQL("DELETE FROM {v} v USING {d} d WHERE v.{lab} = %s AND {same}").format(
                    v=vrel, d=cnd, lab=ident(shape.label), same=same("v", "d", lkey)), (UNMATCHED,)).rowcount, 0)
            if w_new is not None:
                nulls = sql.SQL(", ").join(sql.SQL("NULL") for _ in rnames)
                res.upserted += max(conn.execute(
                    sql.SQL("INSERT INTO {v} ({vc}) SELECT {lc}, {nulls}, %s, %s::bigint FROM {d} d "
                            "WHERE d.{t} + %s < %s AND NOT EXISTS (SELECT 1 FROM {v} v WHERE {same})").format(
                        v=vrel, vc=view_cols, lc=cols("d", lnames), nulls=nulls, d=cnd, t=ident(T),
                        same=same("v", "d", lkey)),
                    (UNMATCHED, watermark, reach, w_new)).rowcount, 0)
        # (6) watermark rows
        marks = [(MARK_TOPIC, mark_key(t, p), batch.mark_versions.get((t, p), 0), m, n)
                 for (t, p), (m, n) in sorted(batch.marks.items())]
        marks.append((MARK_TOPIC, W_KEY, watermark, batch.w_after, batch.late_total))
        conn.execute(sql.SQL("DELETE FROM {s} WHERE {tp} = %s AND {k} = ANY(%s::bytea[])").format(
            s=srel, tp=ident(STATE_TOPIC), k=ident(STATE_KEY)), (MARK_TOPIC, [m[1] for m in marks]))
        with conn.cursor() as cur:
            cur.executemany(sql.SQL("INSERT INTO {s} ({tp}, {k}, {v}, {t}, {n}) VALUES (%s, %s, %s, %s, %s)").format(
                s=srel, tp=ident(STATE_TOPIC), k=ident(STATE_KEY), v=ident(VERSION), t=ident(T), n=ident(LATE)), marks)
        # (7) versions every partition has passed
        if not rule.update and batch.w_all is not None:
            conn.execute(sql.SQL("DELETE FROM {s} WHERE ({tp} = %s AND greatest({t}, {t} + %s) + %s < %s) "
                                 "OR ({tp} = %s AND greatest({t}, {t} - %s) + %s < %s)").format(
                s=srel, tp=ident(STATE_TOPIC), t=ident(T)),
                (shape.left, hi, rule.lateness, batch.w_all, shape.right, lo, rule.lateness, batch.w_all))
        # (8) positions
        if positions:
            keeper._store_positions(target, positions)
    return res


def interval_status(sink: Sink, target: Target) -> dict[str, Any]:
    """W, late events and the versions kept, from what the view stored (``kappaflow status``)."""
    from psycopg import sql

    keeper: Any = sink.grouped_state()
    if keeper is None:
        return {}
    rows = keeper.conn.execute(
        sql.SQL("SELECT {t}, {n} FROM {s} WHERE {tp} = %s AND {k} = %s").format(
            s=_rel(keeper, target), t=sql.Identifier(T), n=sql.Identifier(LATE), tp=sql.Identifier(STATE_TOPIC),
            k=sql.Identifier(STATE_KEY)), (MARK_TOPIC, W_KEY),
    ).fetchall()
    count = keeper.conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE {} <> %s").format(_rel(keeper, target), sql.Identifier(STATE_TOPIC)),
        (MARK_TOPIC,),
    ).fetchone()
    w, late = (rows[0][0], int(rows[0][1] or 0)) if rows else (None, 0)
    return {"watermark": iso(w) if w is not None else None, "late_events": late,
            "state_rows": int(count[0]) if count else 0}


__all__ = ["STRATEGY", "IntervalBatch", "IntervalJoinStrategy", "Rule", "declare_interval_join", "interval_status"]
