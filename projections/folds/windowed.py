"""Windowed (``WindowFold``): aggregates per group and event-time window, with a watermark taken
from the log, allowed lateness and a late-data policy.

The rule (the README's "Event time" section is the user-facing copy; ``tests/projections/
test_windows.py`` holds a plain-Python reference of it):

- Every change event of the sources is read in log order, per input partition (topic, partition);
  not only the latest per key: the watermark is made of every event.
- An event's *event time* is the window column over its row (``after``; a ``derive`` name works).
  The *partition watermark before an event* is the largest event time of the earlier inserts and
  updates of its input partition (deletes, NULL event times and tombstones carry none; rows that
  ``where`` rejects do count) minus ``delay``. It depends on that partition's log alone, so a
  replay (one pass) and a follower (batches cut anywhere) compute the same one for every event.
- A source key contributes its current row to the windows of its event time (one for tumbling,
  ``size / slide`` for hopping), in the group of its ``key`` columns; an update retracts the key's
  previous contributions and adds the new ones, a delete (or a row leaving ``where``) retracts.
  A part (one retraction or insertion, one window) is *late* when ``window end + allowed_lateness
  <= partition watermark before the event``. ``update``: late parts are applied (the window is
  reopened); ``drop`` / ``dead_letter``: a late insertion is not applied (counted; dead_letter also
  sends the event to the dead-letter topic with reason "late"), a late retraction is not applied
  either (the old contribution stays in the window: its contents are frozen) and not reported.
- The *projection watermark* W = min over the non-idle input partitions of their largest event
  time, minus ``delay``. A partition is idle when it has no event yet, or when its largest event time
  is more than ``idle_timeout`` behind the most advanced partition's (``idle_timeout=None``: never
  idle; a partition without events then holds W back). A window is *final* when ``W >= end +
  allowed_lateness`` (the ``final`` column; ``emit="final_only"`` shows final windows only).
- State: the contributing rows per (source key, window) and, per input partition, its largest event
  time and late count, in the PostgreSQL state table of the view (the grouped fold's), written in
  the transaction of the view rows and the positions. With ``drop``/``dead_letter`` the rows of a
  window are dropped once every input partition has passed it (min over ALL partitions of their
  largest event time - delay >= end + lateness): from then on every part that touches it is late and
  not applied, so dropping changes no result. ``update`` keeps every window's state (it may still
  change).

Session windows (``Session``, shape ``"session"``, ``size_us`` = the gap): a contribution is one part
keyed by its own event time t (late when ``t + allowed_lateness <= partition watermark``), and the
sessions are formed from the contributions afterwards -- natively after the rule in replay, per
touched group in follow (``folds/sessions.py``); each state row carries its session's bounds as
``window_start``/``window_end``, so everything below applies to sessions unchanged.

As-of enrichment (``as_of``, ``joins/asof_stage.py``): the source's records go through the as-of
stage before the rule, which releases each event with the tables' rows as they were at it (the
columns feed ``key``/``derive``/``where``/aggregates) and holds back events the tables' capture has
not passed. Event clocks are non-decreasing within a log partition, so what it releases is a prefix
of each partition: the rule reads every partition in offset order, later, and takes the decisions
it takes without the enrichment (held-back events move no watermark until released). Replay regroups
the released events by log partition after the stage's shuffles; follow runs the stage in the
batch's transaction (``asof_stage.transaction``).

Replay runs the rule once per log partition inside Spark's workers (``mapInArrow`` over the
partition's records in offset order) and aggregates the contributions natively; follow runs the
same loop on the driver over a batch, starting from the stored state of the keys it touches, and
PostgreSQL recomputes the touched windows (``GroupedState.apply_grouped``), then the windows the
batch made final, in one transaction with the positions.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, Observation
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
    TimestampNTZType,
    TimestampType,
)

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.api import (
    EMIT_MODES,
    LATE_POLICIES,
    NAME_RE,
    Aggregate,
    Count,
    Declaration,
    ProjectionSpec,
    Window,
    WindowFold,
)
from kappaflow.projections.folds.base import BuildJob, Built, FoldedBatch, collect_bad, register
from kappaflow.projections.folds.declarative import DeclarativeStrategy
from kappaflow.projections.folds.grouped import _check_agg_type, _spark_agg
from kappaflow.projections.joins import asof_stage
from kappaflow.projections.joins.plan import VALID_OPS
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

if TYPE_CHECKING:
    from kappaflow.projections.runtime import Runtime

WINDOW_START, WINDOW_END, FINAL = "window_start", "window_end", "final"
SESSION = "session"
"""``WindowFold.shape`` of session windows (``Session``); their ``size_us`` is the gap."""
RESERVED = (WINDOW_START, WINDOW_END, FINAL)
MARK_TOPIC = "kf:watermark"
"""``_kf_topic`` of the per-partition watermark rows in the state table (no log topic has a ':')."""
WM_MAX, WM_LATE = "_kf_wm_max", "_kf_late"
W_KEY = b"W"
"""``_kf_key`` of the row holding the projection watermark W and the late events of all partitions."""
FINAL_GUC = "kappaflow.final_before"
"""Transaction-local setting the ``final`` aggregate reads: windows ending at or before it are final."""
LATE_REASON = "late"

_UNITS_US = {"us": 1, "ms": 1_000, "s": 1_000_000, "m": 60_000_000, "h": 3_600_000_000, "d": 86_400_000_000}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|d)\s*$")


# --- declaring -------------------------------------------------------------------------------------
def duration_us(value: Any, where: str) -> int:
    """A duration in microseconds: ``timedelta``, seconds, or ``"<number><us|ms|s|m|h|d>"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration (timedelta, seconds, or text like '15m'), got {value!r}")
    if isinstance(value, timedelta):
        return value // timedelta(microseconds=1)
    if isinstance(value, (int, float)):
        return round(value * 1_000_000)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return round(float(m.group(1)) * _UNITS_US[m.group(2)])
        if value.strip().startswith("-"):
            return -duration_us(value.strip()[1:], where)
    raise ConfigError(f"{where}: expected a duration (timedelta, seconds, or text like '15m', '1h'), got {value!r}")


def declare_window(where: str, window: Any, aggregates: tuple[tuple[str, Aggregate], ...]) -> WindowFold:
    """The checked ``WindowFold`` of a class's ``window`` (ConfigError naming the attribute)."""
    if not isinstance(window, Window) or type(window) is Window:
        raise ConfigError(
            f"{where}: 'window': expected Tumbling('col', size=...), Hopping('col', size=..., slide=...) or "
            f"Session('col', gap=...), got {window!r}"
        )
    here = f"{where}: 'window'"
    if not isinstance(window.column, str) or not window.column:
        raise ConfigError(f"{here}.column: expected the event-time column's name, got {window.column!r}")
    size_name = "gap" if window.shape == SESSION else "size"  # a session's gap is kept as its size
    size = duration_us(window.size, f"{here}.{size_name}")
    if size <= 0:
        raise ConfigError(f"{here}.{size_name}: must be > 0, got {window.size!r}")
    slide = duration_us(window.slide, f"{here}.slide")
    if slide <= 0:
        raise ConfigError(f"{here}.slide: must be > 0, got {window.slide!r}")
    if slide > size:
        raise ConfigError(f"{here}.slide: must be at most size ({window.size!r}), got {window.slide!r}")
    delay = duration_us(window.delay, f"{here}.delay")
    if delay < 0:
        raise ConfigError(f"{here}.delay: must be >= 0, got {window.delay!r}")
    lateness = duration_us(window.allowed_lateness, f"{here}.allowed_lateness")
    if lateness < 0:
        raise ConfigError(f"{here}.allowed_lateness: must be >= 0, got {window.allowed_lateness!r}")
    idle = None if window.idle_timeout is None else duration_us(window.idle_timeout, f"{here}.idle_timeout")
    if idle is not None and idle < 0:
        raise ConfigError(f"{here}.idle_timeout: must be >= 0 or None, got {window.idle_timeout!r}")
    if window.late not in LATE_POLICIES:
        raise ConfigError(
            f"{here}.late: unknown late-data policy {window.late!r}; expected one of {list(LATE_POLICIES)}"
        )
    if window.emit not in EMIT_MODES:
        raise ConfigError(f"{here}.emit: unknown emit mode {window.emit!r}; expected one of {list(EMIT_MODES)}")
    return WindowFold(
        aggregates=aggregates, column=window.column, shape=window.shape, size_us=size, slide_us=slide,
        delay_us=delay, lateness_us=lateness, late=window.late, emit=window.emit, idle_us=idle,
    )


# --- the rule ----------------------------------------------------------------------------------------
TP = tuple[str, int]


@dataclass
class Rule:
    """The windowing rule (module docstring) in plain Python, shared by replay's workers and follow's
    driver so both take the same decisions. Times are microseconds since the Unix epoch (UTC)."""

    size: int
    slide: int
    delay: int
    lateness: int
    update: bool
    dead_letter: bool
    idle: int | None
    session: bool = False
    """Session windows: a contribution is one part keyed by its own event time t (``size`` is the
    gap), late when ``t + lateness <= partition watermark``; sessions are formed from the
    contributions afterwards (``folds/sessions.py``)."""

    @classmethod
    def of(cls, fold: WindowFold) -> Rule:
        return cls(fold.size_us, fold.slide_us, fold.delay_us, fold.lateness_us, fold.late == "update",
                   fold.late == "dead_letter", fold.idle_us, fold.shape == SESSION)

    def windows(self, t: int) -> list[int]:
        """Starts of the windows holding event time `t` (aligned to the epoch), oldest first."""
        last = t - t % self.slide
        out = []
        s = last
        while s > t - self.size:
            out.append(s)
            s -= self.slide
        out.reverse()
        return out

    def watermarks(self, pmax: Mapping[TP, int], partitions: Sequence[TP]) -> tuple[int | None, int | None]:
        """(W, W_all): the projection watermark over the non-idle partitions, and the one over all
        partitions (when every window past it may drop its state); None = no watermark yet."""
        return projection_watermarks(pmax, partitions, self.delay, self.idle)

    def fold(
        self,
        events: Mapping[str, list[Any]],
        state: dict[tuple[str, bytes], dict[int, Any]],
        pmax: dict[TP, int],
        late: dict[TP, int],
        changes: list[tuple[str, str, bytes, int, Any, int]] | None,
        dead: list[dict[str, Any]] | None,
    ) -> None:
        """Apply `events` (columns ``_kf_topic, _kf_partition, _kf_offset, _kf_key, _kf_keep,
        _kf_present, _kf_et``; offset order within each partition) to `state` ((topic, key) ->
        {window start: source}, a source being the event's index or whatever the caller loaded),
        `pmax` and `late`. `changes` gets ("ins"|"del", topic, key, window start, source, offset);
        `dead` the dead letters of late events (dead_letter policy)."""
        size, slide, lateness, delay, session = self.size, self.slide, self.lateness, self.delay, self.session
        # a part is late when its end + lateness <= the partition watermark; a session part's "end" is its
        # own event time (the session it joins may end anywhere after it: see folds/sessions.py)
        reach = lateness if session else size + lateness
        apply_late = self.update
        topics, parts, offsets = events["_kf_topic"], events["_kf_partition"], events["_kf_offset"]
        keys, keeps, present, ets = events["_kf_key"], events["_kf_keep"], events["_kf_present"], events["_kf_et"]
        for i in range(len(offsets)):
            topic, key, et = topics[i], keys[i], ets[i]
            tp = (topic, parts[i])
            pm = pmax.get(tp)
            sk = (topic, key)
            old = state.get(sk)
            if old:
                for ws in list(old):
                    if pm is not None and ws + reach <= pm - delay and not apply_late:
                        continue  # a late retraction: the old contribution stays (frozen window)
                    src = old.pop(ws)
                    if changes is not None:
                        changes.append(("del", topic, key, ws, src, offsets[i]))
            if keeps[i] and et is not None:
                late_ws = None
                starts = [et] if session else [et - et % size] if slide == size else self.windows(et)
                for ws in starts:
                    if pm is not None and ws + reach <= pm - delay:
                        if late_ws is None:
                            late_ws = ws
                        if not apply_late:
                            continue
                    if old is None:
                        old = state[sk] = {}
                    old[ws] = i
                    if changes is not None:
                        changes.append(("ins", topic, key, ws, i, offsets[i]))
                if late_ws is not None:
                    late[tp] = late.get(tp, 0) + 1
                    if dead is not None and self.dead_letter:
                        dead.append({
                            "topic": topic, "partition": parts[i], "offset": offsets[i], "key": key,
                            "reason": LATE_REASON,
                            "extra": {
                                "event_time": iso(et), "watermark": iso(pm - delay) if pm is not None else None,
                                "window_start": iso(late_ws), "window_end": iso(late_ws + size),
                                "allowed_lateness_s": lateness / 1_000_000,
                            },
                        })
            if old is not None and not old:
                del state[sk]
            if present[i] and et is not None and (pm is None or et > pm):
                pmax[tp] = et



def projection_watermarks(pmax: Mapping[TP, int], partitions: Sequence[TP], delay: int,
                          idle: int | None) -> tuple[int | None, int | None]:
    """(W, W_all) from each input partition's largest event time (README "Event time", rule 4): W over
    the non-idle partitions (a partition is idle when it has no event or is more than `idle` behind the
    most advanced one; `idle=None`: none is), W_all over every partition (state older than it can be
    dropped); None = no watermark yet. One definition for windows and joins within a time bound."""
    vals = [pmax.get(tp) for tp in partitions]
    seen = [v for v in vals if v is not None]
    w_all = min(seen) - delay if seen and len(seen) == len(vals) else None
    if not seen:
        return None, w_all
    if idle is None:
        return w_all, w_all
    top = max(seen)
    return min(v for v in seen if v >= top - idle) - delay, w_all

def iso(us: int) -> str:
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


def state_key(key: bytes, ws: int) -> bytes:
    """A contribution's ``_kf_key`` in the state table: the record key, NUL, the window start."""
    return key + b"\x00" + struct.pack(">q", ws)


def split_state_key(sk: bytes) -> tuple[bytes, int]:
    return sk[:-9], struct.unpack(">q", sk[-8:])[0]


def mark_key(topic: str, partition: int) -> bytes:
    return orjson.dumps([topic, partition])


# --- compiled shape --------------------------------------------------------------------------------
def _fold(plan: Plan) -> WindowFold:
    fold = plan.spec.fold
    assert isinstance(fold, WindowFold)
    return fold


@dataclass
class Shape:
    """What a compiled windowed view carries beyond the Plan: the value columns each contribution
    keeps, the event-time type, and the Spark expressions of the event frame."""

    values: tuple[ViewColumn, ...]
    time_type: DataType
    event_columns: list[Any] = field(default_factory=list)

    @property
    def aware(self) -> bool:
        return isinstance(self.time_type, TimestampType)

    def arrow_time(self) -> pa.DataType:
        return pa.timestamp("us", tz="UTC") if self.aware else pa.timestamp("us")


def _shape(plan: Plan) -> Shape:
    shape = plan._memo.get("window_shape")
    assert isinstance(shape, Shape), "a windowed plan is compiled by WindowedStrategy.view_of"
    return shape


def _events(
    plan: Plan, raws: dict[str, DataFrame], bad: Observation, stage: Callable[[DataFrame], DataFrame] | None = None
) -> DataFrame:
    """The frame the rule reads: position, key, verdicts, event time (µs) and the value columns.
    `bad` counts the malformed records (dead-lettered by ``collect_bad``; they change nothing).

    With ``as_of`` (`stage`: ``asof_stage.build_stage`` or ``follow_stage`` bound to the target) the
    source's records go through the as-of stage first: only the events it releases come out, each
    row with the tables' columns as they were at the event, so ``key``, ``derive``, ``where`` and the
    aggregates can use them. The stage releases a log partition's events in offset order (a prefix
    of what was read; the rest waits in its state), so the rule reads every partition as the log
    has it, only later: the same watermarks and late decisions as without the enrichment."""
    shape = _shape(plan)
    if plan.asof is None:
        ev = plan.all_events(raws).observe(bad, F.count(F.when(F.col("_kf_bad"), 1)).alias("bad"))
    else:
        assert stage is not None, "a windowed view with as_of runs its events through the as-of stage"
        (topic,) = plan.spec.source_topics
        op = F.col("_kf_op")
        released = stage(asof_stage.stream_events(plan.asof, raws[topic]).observe(
            bad, F.count(F.when(op.isNull() | ~op.isin(*VALID_OPS), 1)).alias("bad")))
        ev = plan.asof_events(released, topic)
    ev = ev.where(
        F.col("_kf_key").isNotNull() & ~F.col("_kf_bad") & (F.col("_kf_op").isNull() | (F.col("_kf_op") != "t"))
    )
    return plan.rows(ev).select(*shape.event_columns)


def _event_columns(plan: Plan, values: Sequence[ViewColumn], time_type: DataType) -> list[Any]:
    fold, spec = _fold(plan), plan.spec
    t = F.col(fold.column)
    if isinstance(time_type, TimestampNTZType):
        t = t.cast("timestamp")  # the session time zone is UTC: wall time as UTC
    group_ok = F.lit(True)
    for k in spec.key:
        group_ok = group_ok & F.col(k).isNotNull()
    return [
        F.col("_kf_topic"), F.col("_kf_partition"), F.col("_kf_offset"), F.col("_kf_key"),
        (F.col("_kf_keep") & group_ok).alias("_kf_keep"),
        (~F.col("_kf_deleted") & F.col("_kf_row_present")).alias("_kf_present"),
        F.unix_micros(t).alias("_kf_et"),
        *[F.col(c.name) for c in values],
    ]


# --- the strategy ---------------------------------------------------------------------------------
class WindowedStrategy(DeclarativeStrategy):
    fold: ClassVar[type[WindowFold]] = WindowFold
    priority: ClassVar[int] = 110  # before custom: a class with a window and apply() is refused, not custom
    reads_latest_per_key: ClassVar[bool] = False  # every event makes the watermark
    folds_events: ClassVar[bool] = True  # ... and is folded into the windows of its time: as_of feeds it

    def lookup_advice(self) -> str:
        return ("a windowed view folds every event into the windows of its event time, so enrich each event "
                "with the row as it was when the event happened: as_of = [AsOf(...)] with the same arguments "
                "(a lookup's current row would rewrite windows already closed whenever the looked-up row "
                "changes later -- a product moved to another category would move last month's revenue -- and "
                "a replay would differ from the follow that folded the same events earlier)")

    def claims(self, decl: Declaration) -> bool:
        return getattr(decl.klass, "window", None) is not None

    def declare(self, decl: Declaration) -> WindowFold:
        where = decl.where
        if decl.has_apply:
            raise ConfigError(f"{where}: 'window' aggregates per window; it cannot be combined with an apply() fold")
        if not decl.aggregates:
            raise ConfigError(f"{where}: 'aggregates': a windowed view needs at least one, e.g. {{'n': Count()}}")
        if decl.columns is not None:
            raise ConfigError(f"{where}: 'columns' selects the columns of a latest-row view; a windowed view's "
                              "columns are its key, the window and the aggregates")
        aggs = []
        for out, agg in decl.aggregates.items():
            if not isinstance(out, str) or not NAME_RE.match(out):
                raise ConfigError(f"{where}: 'aggregates': column name {out!r} is not an identifier")
            if not isinstance(agg, Aggregate) or type(agg) is Aggregate:
                raise ConfigError(f"{where}: 'aggregates'[{out!r}]: expected Count(), Sum('col'), Min, Max, Avg, "
                                  f"CollectList or CollectSet, got {agg!r}")
            if agg.column is None and not isinstance(agg, Count):
                raise ConfigError(f"{where}: 'aggregates'[{out!r}]: {type(agg).__name__} needs a column")
            if out in decl.key or out in RESERVED:
                raise ConfigError(
                    f"{where}: 'aggregates'[{out!r}]: the name is a key column or one of {list(RESERVED)}"
                )
            aggs.append((out, agg))
        clash = [k for k in decl.key if k in RESERVED]
        if clash:
            raise ConfigError(f"{where}: 'key': {clash} are names of the window columns {list(RESERVED)}")
        return declare_window(where, getattr(decl.klass, "window", None), tuple(aggs))

    def fingerprint(self, spec: ProjectionSpec) -> list[str]:
        f = spec.fold
        assert isinstance(f, WindowFold)
        return [repr([(n, a.func, a.column) for n, a in f.aggregates]),
                repr((f.column, f.shape, f.size_us, f.slide_us, f.delay_us, f.lateness_us, f.late, f.emit, f.idle_us))]

    def check_sinks(self, where: str, sinks: Sequence[str]) -> None:
        other = [s for s in sinks if s != "postgres"]
        if other:
            raise ConfigError(
                f"{where}: 'sinks': a windowed projection ('window') is kept in PostgreSQL only: its per-key, "
                f"per-window state and watermark live there, and search/Redis mirrors of it are not supported "
                f"(they would miss the final flag flips). Use sinks = ('postgres',), not {list(sinks)}"
            )

    # --- compile --------------------------------------------------------------------------------
    def view_of(self, plan: Plan, rows: DataFrame) -> ViewSpec:
        spec, fold = plan.spec, _fold(plan)
        where = f"projection {spec.name!r}"
        names = [c for c in rows.columns if not c.startswith("_kf_")]
        missing = [k for k in spec.key if k not in rows.columns]
        if missing:
            raise ConfigError(f"{where}: 'key' (group by) column(s) {missing} are neither source columns nor "
                              f"'derive' names (have {names})")
        types = {f.name: f.dataType for f in rows.schema.fields}
        if fold.column not in names:
            raise ConfigError(f"{where}: 'window'.column: {fold.column!r} is neither a source column nor a "
                              f"'derive' name (have {names})")
        tt = types[fold.column]
        if not isinstance(tt, (TimestampType, TimestampNTZType)):
            raise ConfigError(f"{where}: 'window'.column: the event-time column {fold.column!r} is "
                              f"{tt.simpleString()}; expected timestamp or timestamptz (cast it in 'derive')")
        clash = [n for n in names if n in RESERVED]
        if clash:
            raise ConfigError(f"{where}: the source has column(s) {clash}, names a windowed view gives its window "
                              "columns; rename them in 'derive' and leave them out of the view")
        inputs: list[str] = []
        for out_name, agg in fold.aggregates:
            if agg.column is None:
                continue
            if agg.column not in rows.columns or agg.column.startswith("_kf_"):
                raise ConfigError(f"{where}: 'aggregates'[{out_name!r}]: column {agg.column!r} is neither a source "
                                  "column nor a 'derive' name")
            _check_agg_type(where, out_name, agg, types[agg.column])
            if agg.column not in inputs and agg.column not in spec.key:
                inputs.append(agg.column)
        values = tuple(ViewColumn(n, types[n]) for n in (*spec.key, *inputs))
        shape = Shape(values, tt, _event_columns(plan, values, tt))
        plan._memo["window_shape"] = shape
        group_by = (*spec.key, WINDOW_START, WINDOW_END)
        plan.compiled = (*values, ViewColumn(WINDOW_START, tt), ViewColumn(WINDOW_END, tt),
                              ViewColumn(WM_MAX, LongType()), ViewColumn(WM_LATE, LongType()))
        empty = rows.select(*[F.col(c.name) for c in values], F.col(fold.column).alias(WINDOW_START),
                            F.col(fold.column).alias(WINDOW_END))
        agg_df = empty.groupBy(*group_by).agg(*[_spark_agg(a).alias(n) for n, a in fold.aggregates])
        cols = [ViewColumn(f.name, f.dataType, f.name not in group_by) for f in agg_df.schema.fields]
        cols.append(ViewColumn(FINAL, BooleanType()))
        ts_sql = "timestamptz" if shape.aware else "timestamp"
        we = '"' + WINDOW_END + '"'
        group = {
            "group_by": list(group_by),
            "state_columns": [{"name": c.name, "pg_type": pg_type(c.type)} for c in plan.compiled],
            "aggregates": [
                *[{"name": n, "sql": aggregate_sql_of(a, types.get(a.column) if a.column else None),
                   "pg_type": pg_type(next(c.type for c in cols if c.name == n))} for n, a in fold.aggregates],
                {"name": FINAL, "pg_type": "boolean",
                 "sql": f"(max({we}) <= current_setting('{FINAL_GUC}')::{ts_sql})"},
            ],
        }
        return ViewSpec(spec.view, spec.name, group_by, tuple(cols), spec.namespace,
                        {**spec.view_options(), "group": group})

    # --- replay ---------------------------------------------------------------------------------
    def load(self, job: BuildJob, rows: DataFrame) -> tuple[list[Any], DataFrame | None]:
        raise NotImplementedError  # build() is overridden: the rule needs every event, not current rows

    def changes(self, plan: Plan, rows: DataFrame) -> FoldedBatch:
        raise NotImplementedError  # fold_batch() is overridden

    def build(self, job: BuildJob) -> Built:
        plan, rt, spec, fold = job.plan, job.rt, job.plan.spec, _fold(job.plan)
        shape = _shape(plan)
        # one Spark partition per log partition, records in offset order (the rule runs over each in order)
        raws = {t: job.counted(rt.raw(t, "earliest", job.end), t) for t in spec.topics}
        bad = Observation(f"kf_wbad_{spec.name}_{time.monotonic_ns()}")
        asof_dead: list[dict[str, Any]] = []
        if plan.asof is None:
            ev = _events(plan, raws, bad)
        else:  # the released events, enriched; the target's as-of state (history, waiting events) loaded
            ev = _events(plan, raws, bad, lambda e: asof_stage.build_stage(
                plan.asof, job.sink, job.target, e, raws, asof_dead))
            # the stage's joins scatter the events: whole log partitions back together for the rule
            parts = sum(len(job.end.get(t, {})) for t in spec.source_topics)
            ev = ev.repartition(max(1, parts), "_kf_topic", "_kf_partition")
        out = ev.mapInArrow(make_window_folder(Rule.of(fold), shape), _folded_type(shape))
        out = out.persist(StorageLevel.MEMORY_AND_DISK)
        sessioned: DataFrame | None = None
        try:
            marks = out.where(F.col("_kf_kind") == 2).select("_kf_mt", "_kf_mp", WM_MAX, WM_LATE).collect()
            dead = [
                {"topic": r["_kf_dl_topic"], "partition": r["_kf_dl_partition"], "offset": r["_kf_dl_offset"],
                 "key": r["_kf_dl_key"], "reason": LATE_REASON, "extra": orjson.loads(r["_kf_dl_reason"])}
                for r in out.where(F.col("_kf_kind") == 1).collect()
            ]
            pmax = {(r["_kf_mt"], r["_kf_mp"]): r[WM_MAX] for r in marks if r[WM_MAX] is not None}
            rule = Rule.of(fold)
            w, w_all = rule.watermarks(pmax, _partitions_of(job.end, spec))
            final_before = None if w is None else w - rule.lateness
            state = out.where(F.col("_kf_kind") == 0)
            if rule.session:  # the contributions' event times -> their sessions' bounds
                from kappaflow.projections.folds.sessions import sessionize

                state = sessionize(state, list(spec.key), rule.size, shape.time_type, WINDOW_START, WINDOW_END,
                                   (STATE_TOPIC, STATE_KEY))
                state = sessioned = state.persist(StorageLevel.MEMORY_AND_DISK)
            view = _view_rows(plan, state, final_before, job.version)
            cfg = job.sink.config()
            loaded = view.mapInArrow(make_loader(cfg, job.target), LOAD_RESULT_DDL).collect()
            if not rule.update and w_all is not None:
                state = state.where(F.unix_micros(F.col(WINDOW_END).cast("timestamp")) > w_all - rule.lateness)
            state_cols = [STATE_TOPIC, STATE_KEY, VERSION, *[c.name for c in plan.compiled]]
            state.select(*state_cols).mapInArrow(make_loader(cfg, job.target, state=True), LOAD_RESULT_DDL).collect()
            keeper = _keeper(plan, job.sink)
            end = {(t, p): o for t, parts in job.end.items() for p, o in parts.items()}
            by_tp = {(r["_kf_mt"], r["_kf_mp"]): (r[WM_MAX], r[WM_LATE]) for r in marks}
            total = sum(n or 0 for _, n in by_tp.values())
            keeper.load_state(job.target, [_mark_table(plan, by_tp, end, (w, total, job.version))])
        finally:
            out.unpersist()
            if sessioned is not None:
                sessioned.unpersist()
        built = Built(loaded=sum(r["_kf_loaded"] or 0 for r in loaded), dead=dead + asof_dead)
        if bad.get.get("bad"):
            built.dead += collect_bad(plan, raws)
        return built

    # --- follow ---------------------------------------------------------------------------------
    def fold_batch(
        self, plan: Plan, rt: Runtime, sink: Sink, target: Target, raws: dict[str, DataFrame],
        deduped_input: bool | None,
    ) -> FoldedBatch:
        fold, shape, spec = _fold(plan), _shape(plan), plan.spec
        rule = Rule.of(fold)
        bad = Observation(f"kf_wbad_{spec.name}_{time.monotonic_ns()}")
        asof_dead: list[dict[str, Any]] = []
        stage = None
        if plan.asof is not None:  # inside asof_stage.transaction (engine.apply_batch): commits with the view
            def stage(e: DataFrame) -> DataFrame:
                return asof_stage.follow_stage(plan.asof, rt.spark, sink, target, e, raws, asof_dead)
        tbl = _events(plan, raws, bad, stage).toArrow()
        tbl = tbl.take(pc.sort_indices(tbl, [("_kf_topic", "ascending"), ("_kf_partition", "ascending"),
                                             ("_kf_offset", "ascending")]))
        keeper = _keeper(plan, sink)
        marks = _read_marks(keeper, target)
        pmax = {tp: m for tp, (m, _) in marks.items() if m is not None}
        late = {tp: n or 0 for tp, (_, n) in marks.items()}
        reader = rt.reader()
        partitions = [(t, p) for t in spec.source_topics for p in range(reader.partitions(t))]
        w_before, _ = rule.watermarks(pmax, partitions)
        events = {c: tbl.column(c).to_pylist() for c in ("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key",
                                                         "_kf_keep", "_kf_present", "_kf_et")}
        touched = sorted({(t, k) for t, k in zip(events["_kf_topic"], events["_kf_key"], strict=True)})
        stored = _read_state(keeper, target, plan, touched)
        state: dict[tuple[str, bytes], dict[int, Any]] = {}
        for (t, k, ws), values in stored.items():
            state.setdefault((t, k), {})[ws] = ("stored", values)
        before_marks = {tp: (pmax.get(tp), late.get(tp, 0)) for tp in set(pmax) | set(late)}
        changes: list[tuple[str, str, bytes, int, Any, int]] = []
        dead: list[dict[str, Any]] = list(asof_dead)
        rule.fold(events, state, pmax, late, changes, dead)
        w_after, w_all = rule.watermarks(pmax, partitions)
        if rule.session:
            table = _session_changes(plan, shape, keeper, target, tbl, changes)
        else:
            table = _change_table(plan, shape, tbl, changes)
        ends: dict[TP, int] = {}
        for t, p, o in zip(events["_kf_topic"], events["_kf_partition"], events["_kf_offset"], strict=True):
            ends[(t, p)] = max(ends.get((t, p), 0), o + 1)
        moved = {tp: (pmax.get(tp), late.get(tp, 0)) for tp in set(pmax) | set(late)
                 if (pmax.get(tp), late.get(tp, 0)) != before_marks.get(tp)}
        marks_tbl = _mark_table(plan, moved, ends)
        flags = pa.array([False] * marks_tbl.num_rows, pa.bool_())  # typed: an empty list would be null-typed
        table = pa.concat_tables([table, marks_tbl.append_column(DELETED, flags)])
        return WindowBatch(table, dead=dead, bad=bad, w_before=w_before, w_after=w_after,
                           w_all=w_all, rule=rule, aware=shape.aware, late_total=sum(late.values()))

    def write_batch(
        self, plan: Plan, sink: Sink, target: Target, batch: FoldedBatch, watermark: int, positions: Positions | None
    ) -> WriteResult:
        """Steps, in ONE transaction: (1) the ``final`` cut for the recompute; (2) state changes, the
        touched windows recomputed and the positions (``apply_grouped``); (3) the windows whose final
        flag the batch's move of W flips recomputed (with ``final_only`` they appear; W moves down when a
        partition that was idle catches up: those windows are not final any more and with ``final_only``
        leave in step 4; their state is still there, as state is dropped only below the W of ALL
        partitions, which never moves down); (4) ``final_only``: the
        touched windows that are not final leave the view; (5) the state of windows every partition
        has passed is dropped (not with ``update``)."""
        assert isinstance(batch, WindowBatch) and batch.rule is not None
        from psycopg import sql

        keeper = _keeper(plan, sink)
        conn = keeper.conn
        rule, fold = batch.rule, _fold(plan)
        fb_old = None if batch.w_before is None else batch.w_before - rule.lateness
        fb_new = None if batch.w_after is None else batch.w_after - rule.lateness
        group = target.view.options["group"]
        g = list(group["group_by"])
        srel = sql.SQL("{}.{}").format(sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)))
        vrel = sql.SQL("{}.{}").format(sql.Identifier(target.view.namespace or keeper.default_schema),
                                       sql.Identifier(target.name))
        gid = sql.SQL(", ").join(sql.Identifier(c) for c in g)
        ts = "timestamptz" if batch.aware else "timestamp"
        try:
            with conn.transaction():
                conn.execute("SELECT set_config(%s, %s, true)", (FINAL_GUC, _ts_text(fb_new, batch.aware)))
                w_row = _mark_table(plan, {}, {}, (batch.w_after, batch.late_total, watermark))
                table = batch.table
                if rule.session:
                    # a session row is restaged when a neighbour moves its bounds, whatever partition that
                    # neighbour is in: its version is the batch's (newer than every stored one), not an offset
                    versions = pc.if_else(pc.equal(table.column(STATE_TOPIC), MARK_TOPIC), table.column(VERSION),
                                          pa.scalar(watermark, pa.int64()))
                    table = table.set_column(table.schema.get_field_index(VERSION), VERSION, versions)
                changes = pa.concat_tables([table, w_row.append_column(DELETED, pa.array([False], pa.bool_()))])
                res = keeper.apply_grouped(target, changes, watermark, positions)
                if fb_new != fb_old:
                    # W moved: up (windows become final), or down (a partition that was idle caught up: windows
                    # it no longer passes are not final any more), so the flags always follow the current W
                    lo, hi = ((fb_old, fb_new) if fb_old is None or (fb_new is not None and fb_new > fb_old)
                              else (fb_new, fb_old))
                    nf = "kf_wfinal"
                    conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(sql.Identifier(nf)))
                    conn.execute(
                        sql.SQL("CREATE TEMP TABLE {nf} ON COMMIT DROP AS SELECT DISTINCT {g} FROM {st} "
                                "WHERE {t} <> %s AND {we} <= %s::{ts} AND {we} > %s::{ts}").format(
                            nf=sql.Identifier(nf), g=gid, st=srel, t=sql.Identifier(STATE_TOPIC),
                            we=sql.Identifier(WINDOW_END), ts=sql.SQL(ts)),
                        (MARK_TOPIC, _ts_text(hi, batch.aware), _ts_text(lo, batch.aware)),
                    )
                    conn.execute(sql.SQL("DELETE FROM {vr} v WHERE ({vg}) IN (SELECT {ag} FROM pg_temp.{nf} a)").format(
                        vr=vrel, vg=sql.SQL(", ").join(sql.SQL("v.{}").format(sql.Identifier(c)) for c in g),
                        ag=sql.SQL(", ").join(sql.SQL("a.{}").format(sql.Identifier(c)) for c in g),
                        nf=sql.Identifier(nf)))
                    outcols = [*g, *[a["name"] for a in group["aggregates"]]]
                    n = conn.execute(
                        sql.SQL("INSERT INTO {vr} ({cols}, {v}) SELECT a.*, %s::bigint FROM ({agg}) a").format(
                            vr=vrel, cols=sql.SQL(", ").join(sql.Identifier(c) for c in outcols),
                            v=sql.Identifier(VERSION),
                            agg=keeper.aggregate_sql(target, sql.SQL("pg_temp.{}").format(sql.Identifier(nf)))),
                        (watermark,),
                    ).rowcount
                    res.upserted += max(n, 0)
                if fold.emit == "final_only":
                    gone = conn.execute(
                        sql.SQL("DELETE FROM {vr} WHERE NOT {f} AND {v} = %s").format(
                            vr=vrel, f=sql.Identifier(FINAL), v=sql.Identifier(VERSION)), (watermark,)
                    ).rowcount
                    res.upserted = max(res.upserted - max(gone, 0), 0)
                if not rule.update and batch.w_all is not None:
                    conn.execute(
                        sql.SQL("DELETE FROM {st} WHERE {t} <> %s AND {we} <= %s::{ts}").format(
                            st=srel, t=sql.Identifier(STATE_TOPIC), we=sql.Identifier(WINDOW_END), ts=sql.SQL(ts)),
                        (MARK_TOPIC, _ts_text(batch.w_all - rule.lateness, batch.aware)),
                    )
        except Exception as exc:
            if isinstance(exc, (SinkError, ConfigError)):
                raise
            raise SinkError(f"applying a windowed batch to view {target.view.name!r}: {exc}") from None
        return res

    def mirror_source(self, spec: ProjectionSpec, sink: str) -> str | None:
        return None

    def status_details(self, sink: Sink, target: Target) -> dict[str, Any]:
        return window_status(sink, target)


STRATEGY = register(WindowedStrategy())


@dataclass
class WindowBatch(FoldedBatch):
    """A follow batch of a windowed view: state changes, plus the watermarks before and after it."""

    w_before: int | None = None
    w_after: int | None = None
    w_all: int | None = None
    rule: Rule | None = None
    aware: bool = True
    late_total: int = 0


# --- helpers ---------------------------------------------------------------------------------------
def _keeper(plan: Plan, sink: Sink) -> Any:
    keeper = sink.grouped_state()
    if keeper is None:
        raise ConfigError(f"projection {plan.spec.name!r}: the {sink.kind} sink keeps no windowed state "
                          "(a windowed view lives in PostgreSQL)")
    return keeper


def _partitions_of(end: Mapping[str, Mapping[int, int]], spec: ProjectionSpec) -> list[TP]:
    return [(t, p) for t in spec.source_topics for p in sorted(end.get(t, {}))]


def _ts_text(us: int | None, aware: bool) -> str:
    if us is None:
        return "-infinity"
    text = (datetime(1970, 1, 1) + timedelta(microseconds=us)).isoformat(sep=" ")
    return text + "+00" if aware else text


def _read_marks(keeper: Any, target: Target) -> dict[TP, tuple[int | None, int]]:
    from psycopg import sql

    rows = keeper.conn.execute(
        sql.SQL("SELECT {k}, {m}, {n} FROM {}.{} WHERE {t} = %s").format(
            sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)), k=sql.Identifier(STATE_KEY),
            m=sql.Identifier(WM_MAX), n=sql.Identifier(WM_LATE), t=sql.Identifier(STATE_TOPIC)),
        (MARK_TOPIC,),
    ).fetchall()
    out = {}
    for k, m, n in rows:
        if bytes(k) == W_KEY:
            continue
        t, p = orjson.loads(bytes(k))
        out[(t, int(p))] = (m, int(n or 0))
    return out


def _read_state(
    keeper: Any, target: Target, plan: Plan, keys: list[tuple[str, bytes]]
) -> dict[tuple[str, bytes, int], dict[str, Any]]:
    """The stored contributions of the source keys a batch touches: (topic, key, window start) -> values."""
    from psycopg import sql

    if not keys:
        return {}
    names = [c.name for c in plan.compiled if c.name not in (WM_MAX, WM_LATE)]
    rows = keeper.conn.execute(
        sql.SQL("SELECT s.{t}, s.{k}, {cols} FROM {}.{} s JOIN unnest(%s::text[], %s::bytea[], %s::bytea[]) "
                "AS q(t, lo, hi) ON s.{t} = q.t AND s.{k} >= q.lo AND s.{k} < q.hi").format(
            sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)), t=sql.Identifier(STATE_TOPIC),
            k=sql.Identifier(STATE_KEY), cols=sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(n))
                                                                  for n in names)),
        ([t for t, _ in keys], [k + b"\x00" for _, k in keys], [k + b"\x01" for _, k in keys]),
    ).fetchall()
    out = {}
    for r in rows:
        key, ws = split_state_key(bytes(r[1]))
        out[(r[0], key, ws)] = dict(zip(names, r[2:], strict=True))
    return out


def _arrow_types(plan: Plan, shape: Shape) -> dict[str, pa.DataType]:
    from pyspark.sql.pandas.types import to_arrow_type

    out = {c.name: to_arrow_type(c.type) for c in shape.values}
    out[WINDOW_START] = out[WINDOW_END] = shape.arrow_time()
    return out


def _change_table(plan: Plan, shape: Shape, tbl: pa.Table, changes: list[Any]) -> pa.Table:
    """Keyed-state changes for ``apply_grouped``: the last change per (topic, key, window) of the batch."""
    last: dict[tuple[str, bytes, int], tuple[str, Any, int]] = {}
    for op, t, k, ws, src, off in changes:
        last[(t, k, ws)] = (op, src, off)
    names = [c.name for c in shape.values]
    cols = _state_columns(names)
    values = {n: tbl.column(n).to_pylist() for n in names} if last else {}
    size = _fold(plan).size_us
    for (t, k, ws), (op, src, off) in last.items():
        cols[STATE_TOPIC].append(t)
        cols[STATE_KEY].append(state_key(k, ws))
        cols[VERSION].append(off)
        cols[DELETED].append(op == "del")
        if isinstance(src, tuple):  # a stored contribution (only ever deleted)
            for n in names:
                cols[n].append(src[1][n])
        else:
            for n in names:
                cols[n].append(values[n][src])
        cols[WINDOW_START].append(ws)
        cols[WINDOW_END].append(ws + size)
        cols[WM_MAX].append(None)
        cols[WM_LATE].append(None)
    return _state_arrow(plan, shape, cols)


def _state_columns(names: Sequence[str]) -> dict[str, list[Any]]:
    return {n: [] for n in [STATE_TOPIC, STATE_KEY, VERSION, *names, WINDOW_START, WINDOW_END, WM_MAX, WM_LATE,
                            DELETED]}


def _session_changes(
    plan: Plan, shape: Shape, keeper: Any, target: Target, tbl: pa.Table, changes: list[Any]
) -> pa.Table:
    """Keyed-state changes of a session view's batch: the contributions the batch changed, and every
    contribution of the groups it touched whose session moved (``folds/sessions.py``). Versions are
    set to the batch's in ``write_batch``."""
    from kappaflow.projections.folds.sessions import regroup

    last: dict[tuple[str, bytes, int], tuple[str, Any]] = {}
    for op, t, k, et, src, _off in changes:
        last[(t, k, et)] = (op, src)
    names = [c.name for c in shape.values]
    gnames = list(plan.spec.key)
    cols = _state_columns(names)
    new_values = {n: tbl.column(n).to_pylist() for n in names} if last else {}

    def values_of(src: Any) -> dict[str, Any]:
        return {n: src[1][n] for n in names} if isinstance(src, tuple) else {n: new_values[n][src] for n in names}

    # every group a change left or entered, not only the last change's: an order moved to another customer
    # at the same time is one state key, but its old customer's sessions may split
    touched = {tuple(values_of(src)[g] for g in gnames) for _op, _t, _k, _et, src, _off in changes}
    stored = _read_groups(keeper, target, gnames, names, touched)
    rows = {cid: v for cid, (v, _) in stored.items()}
    inserted = set()
    for cid, (op, src) in last.items():
        if op == "del":
            rows.pop(cid, None)
        else:
            rows[cid] = values_of(src)
            inserted.add(cid)
    upsert, gone = regroup(
        _fold(plan).size_us, {cid: tuple(v[g] for g in gnames) for cid, v in rows.items()},
        {cid: b for cid, (_, b) in stored.items()}, [(cid, cid[2]) for cid in rows], inserted,
    )
    staged = [(cid, rows[cid], b, False) for cid, b in upsert.items()]
    staged += [(cid, stored[cid][0], stored[cid][1], True) for cid in gone]
    for (t, k, et), vals, (ws, we), deleted in staged:
        cols[STATE_TOPIC].append(t)
        cols[STATE_KEY].append(state_key(k, et))
        cols[VERSION].append(0)
        cols[DELETED].append(deleted)
        for n in names:
            cols[n].append(vals[n])
        cols[WINDOW_START].append(ws)
        cols[WINDOW_END].append(we)
        cols[WM_MAX].append(None)
        cols[WM_LATE].append(None)
    return _state_arrow(plan, shape, cols)


def _read_groups(
    keeper: Any, target: Target, gnames: Sequence[str], names: Sequence[str], groups: set[tuple[Any, ...]]
) -> dict[tuple[str, bytes, int], tuple[dict[str, Any], tuple[int, int]]]:
    """Every stored contribution of `groups` (a session view): (topic, key, event time) -> (values,
    (session start, end) in µs)."""
    from psycopg import sql

    if not groups:
        return {}
    pg_types = {c["name"]: c["pg_type"] for c in target.view.options["group"]["state_columns"]}
    ordered = sorted(groups, key=repr)
    rows = keeper.conn.execute(
        sql.SQL("SELECT s.{t}, s.{k}, {cols}, s.{ws}, s.{we} FROM {}.{} s WHERE s.{t} <> %s AND ({g}) IN "
                "(SELECT * FROM unnest({arrays}))").format(
            sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)), t=sql.Identifier(STATE_TOPIC),
            k=sql.Identifier(STATE_KEY), ws=sql.Identifier(WINDOW_START), we=sql.Identifier(WINDOW_END),
            cols=sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(n)) for n in names),
            g=sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(n)) for n in gnames),
            arrays=sql.SQL(", ").join(sql.SQL("%s::{}[]").format(sql.SQL(pg_types[n])) for n in gnames)),
        (MARK_TOPIC, *[[g[i] for g in ordered] for i in range(len(gnames))]),
    ).fetchall()
    out = {}
    for r in rows:
        key, et = split_state_key(bytes(r[1]))
        out[(r[0], key, et)] = (dict(zip(names, r[2:-2], strict=True)), (_us(r[-2]), _us(r[-1])))
    return out


def _us(value: datetime) -> int:
    """A stored window bound in µs since the epoch (a naive timestamp is UTC wall time)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC) if value.tzinfo is not None else datetime(1970, 1, 1)
    return (value - epoch) // timedelta(microseconds=1)


def _state_arrow(plan: Plan, shape: Shape, cols: dict[str, list[Any]]) -> pa.Table:
    types = _arrow_types(plan, shape)
    arrays = {}
    for n, v in cols.items():
        if n in (WINDOW_START, WINDOW_END):
            arrays[n] = pa.array(v, pa.int64()).cast(types[n])
        elif n in types:
            arrays[n] = pa.array(v, types[n])
        elif n == STATE_TOPIC:
            arrays[n] = pa.array(v, pa.string())
        elif n == STATE_KEY:
            arrays[n] = pa.array(v, pa.binary())
        elif n == DELETED:
            arrays[n] = pa.array(v, pa.bool_())
        else:
            arrays[n] = pa.array(v, pa.int64())
    return pa.table(arrays)


def _mark_table(
    plan: Plan, marks: Mapping[TP, tuple[int | None, int]], versions: Mapping[TP, int],
    w_row: tuple[int | None, int, int] | None = None,
) -> pa.Table:
    """The per-partition watermark rows (largest event time, late count) as state rows, and `w_row`
    (W, late events of all partitions, version) as the projection's row (key ``W_KEY``)."""
    shape = _shape(plan)
    types = _arrow_types(plan, shape)
    items: list[tuple[Any, tuple[int | None, int]]] = sorted(marks.items())
    keys = [mark_key(t, p) for (t, p), _ in items]
    vers = [versions.get(tp, 0) for tp, _ in items]
    if w_row is not None:
        items.append(("W", (w_row[0], w_row[1])))
        keys.append(W_KEY)
        vers.append(w_row[2])
    n = len(items)
    out: dict[str, pa.Array] = {
        STATE_TOPIC: pa.array([MARK_TOPIC] * n, pa.string()),
        STATE_KEY: pa.array(keys, pa.binary()),
        VERSION: pa.array(vers, pa.int64()),
    }
    for c in shape.values:
        out[c.name] = pa.nulls(n, types[c.name])
    out[WINDOW_START] = pa.nulls(n, types[WINDOW_START])
    out[WINDOW_END] = pa.nulls(n, types[WINDOW_END])
    out[WM_MAX] = pa.array([m for _, (m, _) in items], pa.int64())
    out[WM_LATE] = pa.array([late for _, (_, late) in items], pa.int64())
    return pa.table(out)


def _view_rows(plan: Plan, state: DataFrame, final_before: int | None, version: int) -> DataFrame:
    fold = _fold(plan)
    group_by = list(plan.view.key)
    aggs = [_spark_agg(a).alias(n) for n, a in fold.aggregates]
    end = F.unix_micros(F.col(WINDOW_END).cast("timestamp"))
    final = F.lit(False) if final_before is None else (end <= F.lit(final_before))
    out = state.groupBy(*group_by).agg(*aggs).withColumn(FINAL, final)
    if fold.emit == "final_only":
        out = out.where(F.col(FINAL))
    return out.select(*plan.view.column_names, F.lit(version).cast("bigint").alias(VERSION),
                      F.lit(False).alias(DELETED))


# --- replay: the rule inside Spark's workers ---------------------------------------------------------
_DL = [("_kf_dl_topic", StringType(), pa.string()), ("_kf_dl_partition", IntegerType(), pa.int32()),
       ("_kf_dl_offset", LongType(), pa.int64()), ("_kf_dl_key", BinaryType(), pa.binary()),
       ("_kf_dl_reason", StringType(), pa.string())]


def _folded_type(shape: Shape) -> StructType:
    fields = [StructField("_kf_kind", IntegerType()), StructField(STATE_TOPIC, StringType()),
              StructField(STATE_KEY, BinaryType()), StructField(VERSION, LongType())]
    fields += [StructField(c.name, c.type) for c in shape.values]
    fields += [StructField(WINDOW_START, shape.time_type), StructField(WINDOW_END, shape.time_type),
               StructField(WM_MAX, LongType()), StructField(WM_LATE, LongType()),
               StructField("_kf_mt", StringType()), StructField("_kf_mp", IntegerType())]
    fields += [StructField(n, t) for n, t, _ in _DL]
    return StructType(fields)


def make_window_folder(rule: Rule, shape: Shape) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """mapInArrow function: the rule over one Spark partition's events (whole log partitions, in offset
    order); outputs the contributions left at the end (kind 0), the dead letters (1) and each input
    partition's largest event time and late count (2)."""
    from pyspark.sql.pandas.types import to_arrow_type

    value_types = {c.name: to_arrow_type(c.type) for c in shape.values}
    names = list(value_types)
    time_type = shape.arrow_time()
    schema = pa.schema(
        [("_kf_kind", pa.int32()), (STATE_TOPIC, pa.string()), (STATE_KEY, pa.binary()), (VERSION, pa.int64())]
        + [(n, t) for n, t in value_types.items()]
        + [(WINDOW_START, time_type), (WINDOW_END, time_type), (WM_MAX, pa.int64()), (WM_LATE, pa.int64()),
           ("_kf_mt", pa.string()), ("_kf_mp", pa.int32())]
        + [(n, a) for n, _, a in _DL]
    )

    def batch_of(n: int, kind: int, given: dict[str, pa.Array]) -> pa.RecordBatch:
        arrays = [given.get(f.name, pa.nulls(n, f.type)) if f.name != "_kf_kind" else pa.array([kind] * n, pa.int32())
                  for f in schema]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        got = [b for b in batches if b.num_rows]
        if not got:
            return
        tbl = pa.Table.from_batches(got)
        tbl = tbl.take(pc.sort_indices(tbl, [("_kf_topic", "ascending"), ("_kf_partition", "ascending"),
                                             ("_kf_offset", "ascending")]))
        events = {c: tbl.column(c).to_pylist() for c in ("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key",
                                                         "_kf_keep", "_kf_present", "_kf_et")}
        state: dict[tuple[str, bytes], dict[int, Any]] = {}
        pmax: dict[TP, int] = {}
        late: dict[TP, int] = {}
        dead: list[dict[str, Any]] = []
        rule.fold(events, state, pmax, late, None, dead)
        idx, topics, skeys, starts, versions = [], [], [], [], []
        offsets = events["_kf_offset"]
        for (t, k), wins in state.items():
            for ws, i in wins.items():
                idx.append(i)
                topics.append(t)
                skeys.append(state_key(k, ws))
                starts.append(ws)
                versions.append(offsets[i])
        n = len(idx)
        for lo in range(0, n, 65_536):
            hi = min(n, lo + 65_536)
            taken = tbl.take(pa.array(idx[lo:hi], pa.int64()))
            ws_arr = pa.array(starts[lo:hi], pa.int64())
            yield batch_of(hi - lo, 0, {
                STATE_TOPIC: pa.array(topics[lo:hi], pa.string()),
                STATE_KEY: pa.array(skeys[lo:hi], pa.binary()),
                VERSION: pa.array(versions[lo:hi], pa.int64()),
                **{c: taken.column(c).combine_chunks().cast(value_types[c]) for c in names},
                WINDOW_START: ws_arr.cast(time_type),
                WINDOW_END: pc.add(ws_arr, rule.size).cast(time_type),
            })
        if dead:
            yield batch_of(len(dead), 1, {
                "_kf_dl_topic": pa.array([d["topic"] for d in dead], pa.string()),
                "_kf_dl_partition": pa.array([d["partition"] for d in dead], pa.int32()),
                "_kf_dl_offset": pa.array([d["offset"] for d in dead], pa.int64()),
                "_kf_dl_key": pa.array([d["key"] for d in dead], pa.binary()),
                "_kf_dl_reason": pa.array([orjson.dumps(d["extra"]).decode() for d in dead], pa.string()),
            })
        tps = sorted(set(pmax) | set(late))
        if tps:
            yield batch_of(len(tps), 2, {
                "_kf_mt": pa.array([t for t, _ in tps], pa.string()),
                "_kf_mp": pa.array([p for _, p in tps], pa.int32()),
                WM_MAX: pa.array([pmax.get(tp) for tp in tps], pa.int64()),
                WM_LATE: pa.array([late.get(tp, 0) for tp in tps], pa.int64()),
            })

    return run


# --- status ----------------------------------------------------------------------------------------
def window_status(sink: Sink, target: Target) -> dict[str, Any]:
    """The watermark W, late events and state rows of a windowed view, from what the view stored
    (``kappaflow status``; no projection class needed)."""
    from psycopg import sql

    keeper: Any = sink.grouped_state()
    if keeper is None:
        return {}
    rows = keeper.conn.execute(
        sql.SQL("SELECT {m}, {n} FROM {}.{} WHERE {t} = %s AND {k} = %s").format(
            sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)), m=sql.Identifier(WM_MAX),
            n=sql.Identifier(WM_LATE), t=sql.Identifier(STATE_TOPIC), k=sql.Identifier(STATE_KEY)),
        (MARK_TOPIC, W_KEY),
    ).fetchall()
    count = keeper.conn.execute(
        sql.SQL("SELECT count(*) FROM {}.{} WHERE {} <> %s").format(
            sql.Identifier("kappaflow"), sql.Identifier(keeper.state_table(target)), sql.Identifier(STATE_TOPIC)),
        (MARK_TOPIC,),
    ).fetchone()
    w, late = (rows[0][0], int(rows[0][1] or 0)) if rows else (None, 0)
    return {
        "watermark": iso(w) if w is not None else None,
        "late_events": late,
        "state_rows": int(count[0]) if count else 0,
    }


__all__ = [
    "FINAL",
    "MARK_TOPIC",
    "STRATEGY",
    "WINDOW_END",
    "WINDOW_START",
    "Rule",
    "WindowBatch",
    "WindowedStrategy",
    "declare_window",
    "duration_us",
    "window_status",
]
