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

import abc
import contextlib
import contextvars
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType, StringType, StructField, StructType

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.folds.base import BAD_REASON
from kappaflow.projections.joins.plan import JoinPlan
from kappaflow.projections.joins.state import BuildCatalog, JoinState, base_for_target, behind
from kappaflow.projections.sinks.base import Positions, Target, ViewSpec
from kappaflow.projections.sinks.errors import SinkStateLostError


# --- where a target's join state lives -------------------------------------------------------------
class StateHome(abc.ABC):
    """Where the join state of a sink's targets lives, and how its commits line up with the sink's
    (two homes, picked by the sink's capabilities, never its kind):

    - ``InSinkTransaction``: the sink has a views-database transaction covering its own rows and
      positions (``Sink.state_connection``: PostgreSQL). State, rows and positions commit together.
    - ``BesideBuilds``: a store with builds (``Sink.build_of``: search indexes, Redis namespaces)
      and no transaction shared with PostgreSQL. The state lives in the views database, one per
      build (``state.BuildCatalog``), and commits BEFORE the store's rows and positions are
      written. A crash in between leaves the state ahead of the store: the batch is read again
      from the store's positions, its state changes are no-ops (each state row is guarded by the
      offset of its change), the same driving keys are affected (the batch's own and the fan-out
      of its looked-up changes, found under the state) and their joined rows come from that state,
      so the re-run writes what the first run would have, and the store converges (its writes are
      version-guarded). A swap moves the state with the build; a lost build loses its state."""

    def __init__(self, jp: JoinPlan, sink: Any) -> None:
        self.jp = jp
        self.sink = sink

    @abc.abstractmethod
    def begin_build(self, target: Target, positions: Positions) -> JoinState:
        """Fresh, empty state for a build of `target` folded up to `positions` (inside ``build``)."""
        raise NotImplementedError

    @abc.abstractmethod
    def build(self) -> contextlib.AbstractContextManager[Any]:
        """The transaction a replay's state load runs in."""
        raise NotImplementedError

    @abc.abstractmethod
    def follow_state(self, target: Target, before: Positions) -> JoinState:
        """The state a batch of `target` starting at `before` folds into (created for a new view;
        inside the batch's transaction)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        yield

    def before_write(self, target: Target, after: Positions) -> None:  # noqa: B027 - optional hook
        """The batch's state changes are final: called before the sink writes rows and positions."""

    @abc.abstractmethod
    def swap(self, shadow: Target) -> Target:
        raise NotImplementedError

    @abc.abstractmethod
    def drop(self, target: Target) -> None:
        raise NotImplementedError


class InSinkTransaction(StateHome):
    """The state in the sink's own transaction (``Sink.state_connection``), named per target table."""

    def __init__(self, jp: JoinPlan, sink: Any, conn: Any) -> None:
        super().__init__(jp, sink)
        self.conn = conn

    def state(self, target: Target) -> JoinState:
        schema = str(target.view.namespace or getattr(self.sink, "default_schema", "public"))
        return JoinState(self.conn, base_for_target(schema, target), self.jp)

    def build(self) -> contextlib.AbstractContextManager[Any]:
        return self.conn.transaction()

    def begin_build(self, target: Target, positions: Positions) -> JoinState:
        state = self.state(target)
        state.create()
        return state

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        with self.conn.transaction():  # the sink's write becomes a savepoint in it
            yield

    def follow_state(self, target: Target, before: Positions) -> JoinState:
        state = self.state(target)
        if not state.exists():
            if any(before.values()):
                raise SinkError(
                    f"view {target.view.name!r} has stored positions but no join state "
                    f"({state.table(0)} ... in schema kappaflow): rebuild it with `kappaflow replay`"
                )
            state.create()
        elif not any(before.values()):
            state.truncate()  # a new, empty view folds the log from its start: so does its state
        return state

    def swap(self, shadow: Target) -> Target:
        live = Target(shadow.view, shadow.view.name)
        with self.conn.transaction():
            out = self.sink.swap(shadow)
            self.state(live).replace(self.state(shadow))
        return out

    def drop(self, target: Target) -> None:
        with self.conn.transaction():
            self.state(target).drop()


_CONNECTIONS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class BesideBuilds(StateHome):
    """The state in the views database beside a store with builds (see ``StateHome``)."""

    def __init__(self, jp: JoinPlan, sink: Any, dsn: str) -> None:
        super().__init__(jp, sink)
        self.conn = self._connection(sink, dsn)
        self.catalog = BuildCatalog(self.conn)
        self.catalog.ensure()
        self._tx: contextlib.ExitStack | None = None

    @staticmethod
    def _connection(sink: Any, dsn: str) -> Any:
        """One connection per sink object (a follower's batches run on their own sink), closed with it."""
        import psycopg

        conn = _CONNECTIONS.get(sink)
        if conn is None or conn.closed or conn.broken:
            try:
                conn = psycopg.connect(dsn, autocommit=True)
            except psycopg.Error as exc:
                raise SinkError(f"join state: connecting to the views database: {exc}".splitlines()[0]) from None
            _CONNECTIONS[sink] = conn
            weakref.finalize(sink, conn.close)
        return conn

    def _build(self, target: Target) -> str:
        build = self.sink.build_of(target)
        if build is None:
            raise SinkStateLostError(
                f"{self.sink.kind} sink: view {target.view.name!r} has no build (lost?); its join state goes with "
                "it: rebuilding from the log"
            )
        return str(build)

    def build(self) -> contextlib.AbstractContextManager[Any]:
        return self.conn.transaction()

    def begin_build(self, target: Target, positions: Positions) -> JoinState:
        self.cleanup(target.view)
        build = self._build(target)
        state = JoinState(self.conn, self.catalog.register(self.sink.kind, target.view.name, build), self.jp)
        state.create()
        self.catalog.set_positions(self.sink.kind, target.view.name, build, dict(positions))
        return state

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.conn.transaction())
            self._tx = stack
            try:
                yield
            finally:
                self._tx = None

    def follow_state(self, target: Target, before: Positions) -> JoinState:
        kind, view, build = self.sink.kind, target.view.name, self._build(target)
        entry = self.catalog.get(kind, view, build)
        if entry is None:
            if any(before.values()):
                raise SinkStateLostError(
                    f"{kind} sink: view {view!r} (build {build}) has stored positions but no join state in the "
                    "views database: rebuilding it from the log"
                )
            self.cleanup(target.view)
            state = JoinState(self.conn, self.catalog.register(kind, view, build), self.jp)
            state.create()
            return state
        base, folded = entry
        state = JoinState(self.conn, base, self.jp)
        if not state.exists():
            raise SinkStateLostError(
                f"{kind} sink: view {view!r} (build {build}): its join state tables are gone: rebuilding from the log"
            )
        if not any(before.values()):
            state.truncate()  # the build starts from the log's start: so does its state
            self.catalog.set_positions(kind, view, build, {})
            return state
        lag = behind(folded, dict(before))
        if lag:
            raise SinkStateLostError(
                f"{kind} sink: view {view!r} (build {build}): the join state is behind the view's positions "
                f"({'; '.join(lag[:3])}; restored from an older backup?): rebuilding from the log"
            )
        # the state ahead of the store: a batch whose state committed was not (all) written to the store;
        # the old parents of its moved and deleted child rows stay pending (``state.JoinState.apply``)
        state.carry_pending = bool(behind(dict(before), folded))
        return state

    def before_write(self, target: Target, after: Positions) -> None:
        """Record the state's positions and commit it: rows and positions of the store come after."""
        kind, view, build = self.sink.kind, target.view.name, self._build(target)
        entry = self.catalog.get(kind, view, build)
        folded = dict(entry[1]) if entry else {}
        for tp, o in after.items():
            folded[tp] = max(folded.get(tp, 0), o)
        self.catalog.set_positions(kind, view, build, folded)
        if self._tx is not None:
            tx, self._tx = self._tx, None
            tx.close()  # commits

    def swap(self, shadow: Target) -> Target:
        out = self.sink.swap(shadow)  # the state belongs to the build: it moves with it
        self.cleanup(shadow.view)
        return out

    def drop(self, target: Target) -> None:
        build = self.sink.build_of(target)
        if build is not None:
            self._forget(target.view.name, str(build))

    def _forget(self, view: str, build: str) -> None:
        entry = self.catalog.get(self.sink.kind, view, build)
        with self.conn.transaction():
            if entry is not None:
                JoinState(self.conn, entry[0], self.jp).drop()
            self.catalog.forget(self.sink.kind, view, build)

    def cleanup(self, view: ViewSpec) -> None:
        """Drop the state of builds the store no longer holds (swapped out, lost, a killed verify's).
        The catalog is read before the store's builds: a build registered meanwhile is not touched."""
        entries = self.catalog.entries(self.sink.kind, view.name)
        if not entries:
            return
        alive = self.sink.builds(view) or set()
        for build, _ in entries:
            if build not in alive:
                self._forget(view.name, build)


def home_for(jp: JoinPlan, rt: Any, sink: Any, view: ViewSpec) -> StateHome:
    """The home of `sink`'s join state (by its capabilities)."""
    conn = sink.state_connection()
    if conn is not None:
        return InSinkTransaction(jp, sink, conn)
    if sink.builds(view) is None:
        raise ConfigError(
            f"projection {jp.projection!r}: the {sink.kind} sink has neither a transaction shared with the views "
            "database nor builds to key join state by; a projection with lookups or nested collections cannot be "
            "folded into it"
        )
    dsn = getattr(rt, "dsn", None)
    if not dsn:
        raise ConfigError(
            f"projection {jp.projection!r}: a projection with lookups or nested collections keeps its join state in "
            f"the PostgreSQL views database, also for its {sink.kind} view: set views.postgres.dsn "
            "(kappaflow.toml [views.postgres] or KAPPAFLOW_VIEWS__POSTGRES__DSN)"
        )
    return BesideBuilds(jp, sink, dsn)


@dataclass
class _Batch:
    home: StateHome
    target: Target
    extra: dict[str, Any] = field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("kappaflow_join_batch", default=None)


@contextlib.contextmanager
def transaction(jp: JoinPlan | None, rt: Any, sink: Any, target: Target) -> Iterator[None]:
    """The join state's transaction around a batch (``engine.apply_batch``): with the sink's own
    (PostgreSQL: state, view rows and positions commit together), or the state's, committed by
    ``before_write`` before the sink writes (search, Redis)."""
    if jp is None:
        yield
        return
    home = home_for(jp, rt, sink, target.view)
    with home.batch():
        token = _ACTIVE.set(_Batch(home, target))
        try:
            yield
        finally:
            _ACTIVE.reset(token)


def before_write(after: Positions) -> None:
    """The batch's positions are known and its rows are about to be written (``engine``)."""
    b = _ACTIVE.get()
    if b is not None:
        b.home.before_write(b.target, after)


def _observers(jp: JoinPlan, raws: dict[str, DataFrame]) -> dict[int, Observation]:
    return {ts.index: Observation(f"kf_jbad_{jp.projection}_{ts.index}_{time.monotonic_ns()}")
            for ts in jp.topics[1:] if ts.topic in raws}


def _dead_letters(jp: JoinPlan, raws: dict[str, DataFrame], observed: dict[int, Observation]) -> list[dict[str, Any]]:
    """Malformed records of the looked-up tables (the join counts them as deletes of their row, as the
    folds do for the driving table's): dead letters with the reason and their position."""
    out: list[dict[str, Any]] = []
    for ti, obs in observed.items():
        if not obs.get.get("bad"):
            continue
        ts = jp.topics[ti]
        names = [lp.name for lp in jp.lookups if lp.topic_index == ti]
        names += [np_.name for np_ in jp.nested if np_.topic_index == ti]
        reason = (f"{BAD_REASON}; a record of {ts.topic}, joined by {names}: the join counts it as a delete "
                  "of that row")
        for r in jp.bad_records(ts, raws[ts.topic]).collect():
            out.append({"topic": r["topic"], "partition": r["partition"], "offset": r["offset"], "key": r["key"],
                        "reason": reason})
    return out


def kb_text(kb: Any) -> Any:
    """A record key (binary) as PostgreSQL's bytea text (``\\x<hex>``): the state's COPY (CSV) takes it
    as it is, with no Python object per key on the driver."""
    return F.concat(F.lit("\\x"), F.lower(F.hex(kb)))


def _head(version: Any) -> list[Any]:
    return [F.col("_kf_topic"), F.col("_kf_key"), F.col("_kf_partition"), version.alias("_kf_offset"), F.col("_kf_op")]


# --- replay --------------------------------------------------------------------------------------
def build_stage(
    jp: JoinPlan,
    rt: Any,
    sink: Any,
    target: Target,
    latest: DataFrame,
    raws: dict[str, DataFrame],
    *,
    deduped: bool,
    version: int,
    positions: Positions,
    dead: list[dict[str, Any]],
) -> DataFrame:
    """Joined rows as of the replay's end (`positions`); fills the target's join state from the same
    frames, committed before the rows are loaded. Malformed looked-up records go to `dead`."""
    observed = _observers(jp, raws)
    tables = {
        ts.index: jp.table_latest(ts, raws[ts.topic], deduped=deduped, observe=observed[ts.index])
        .where(~F.col("deleted"))
        for ts in jp.topics[1:]
    }
    home = home_for(jp, rt, sink, target.view)
    try:
        with home.build():
            state = home.begin_build(target, positions)
            drv = jp.driving_latest(latest).where(~F.col("deleted"))
            for ts in jp.topics:
                frame = drv if ts.index == 0 else tables[ts.index]
                rows = frame.select(
                    "k", kb_text(F.col("kb")).alias("kb"), "p", F.col("off").alias("ver"),
                    jp.row_text(F.col("row")).alias("row"),
                    *[f"fk{j}" for j in ts.children], *[f"nfk{j}" for j in ts.nested],
                ).toArrow()
                state.load(ts, rows)
    except Exception as exc:
        if isinstance(exc, (SinkError, ConfigError)):
            raise
        raise SinkError(f"loading the join state of view {target.view.name!r}: {exc}") from None
    dead += _dead_letters(jp, raws, observed)
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
    if jp.nested:  # each parent's current children, gathered by their parent key (sorted in assemble)
        df = df.select("*", jp.key_text(jp.driving, F.col("_kf_key")).alias("_kf_dk"))
    for np_ in jp.nested:
        j = np_.index
        by_parent = (
            tables[np_.topic_index].where(F.col(f"nfk{j}").isNotNull())
            .groupBy(F.col(f"nfk{j}").alias(f"_kf_nk{j}")).agg(F.collect_list("row").alias(f"_kf_nr{j}"))
        )
        df = df.join(by_parent, df["_kf_dk"] == by_parent[f"_kf_nk{j}"], "left")
    return jp.assemble(
        df,
        F.col("_kf_row"),
        [F.col(f"_kf_jr{lp.index}") for lp in jp.lookups],
        [F.col(f"_kf_jk{lp.index}").isNotNull() for lp in jp.lookups],
        _head(F.lit(version).cast("bigint")),
        F.col("_kf_deleted"),
        [F.col(f"_kf_nr{np_.index}") for np_ in jp.nested],
    )


def swap(jp: JoinPlan | None, rt: Any, sink: Any, shadow: Target) -> Target:
    """``sink.swap(shadow)`` and, for a join, the shadow's join state becomes the live one (in the
    same transaction, or by belonging to the build the swap makes live)."""
    if jp is None:
        return sink.swap(shadow)
    return home_for(jp, rt, sink, shadow.view).swap(shadow)


def drop(jp: JoinPlan | None, rt: Any, sink: Any, target: Target) -> None:
    """Drop a target's join state (a shadow or verify scratch that is dropped itself)."""
    if jp is None:
        return
    home_for(jp, rt, sink, target.view).drop(target)


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
    dead: list[dict[str, Any]],
) -> DataFrame:
    """Apply the batch to the join state and return the joined rows of every affected driving key.
    Must run inside ``transaction``. Malformed looked-up records go to `dead`."""
    b = _ACTIVE.get()
    if b is None:
        raise SinkError(f"projection {jp.projection!r}: a join batch runs inside joins.stage.transaction()")
    state = b.home.follow_state(target, sink.read_positions(target))
    n, m = len(jp.lookups), len(jp.nested)
    observed = _observers(jp, raws)
    frames = []
    for ts in jp.topics:
        raw = raws.get(ts.topic)
        if ts.index == 0:
            base = jp.driving_latest(latest)
        elif raw is None:
            continue
        else:
            base = jp.table_latest(ts, raw, deduped=deduped, observe=observed[ts.index])
        frames.append(
            base.select(
                F.lit(ts.index).alias("ti"), "k", kb_text(F.col("kb")).alias("kb"), "p", "off", "deleted",
                jp.row_text(F.col("row")).alias("row"),
                *[
                    (F.col(f"fk{j}") if j in ts.children else F.lit(None).cast("string")).alias(f"fk{j}")
                    for j in range(n)
                ],
                *[
                    (F.col(f"nfk{j}") if j in ts.nested else F.lit(None).cast("string")).alias(f"nfk{j}")
                    for j in range(m)
                ],
            )
        )
    changes = frames[0]
    for f in frames[1:]:
        changes = changes.unionByName(f)
    tbl = changes.toArrow()
    dead += _dead_letters(jp, raws, observed)
    joined = state.apply(tbl)
    schema = StructType(
        [StructField("k", StringType()), StructField("kb", StringType()), StructField("p", IntegerType()),
         *[StructField(f"r{i}", StringType()) for i in range(n + 1)],
         *[StructField(f"n{j}", StringType()) for j in range(m)]]
    )
    df = spark.createDataFrame(joined if joined.num_rows else pa.Table.from_pylist([], schema=_arrow(schema)),
                               schema=schema)
    lookups_rows = [jp.parse_row(F.col(f"r{lp.index + 1}"), jp.topics[lp.topic_index]) for lp in jp.lookups]
    head = [
        F.lit(jp.driving.topic).alias("_kf_topic"),
        F.unhex(F.col("kb")).alias("_kf_key"),
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
        [jp.parse_rows(F.col(f"n{np_.index}"), jp.topics[np_.topic_index]) for np_ in jp.nested],
    )


def _arrow(schema: StructType) -> pa.Schema:
    kinds = {"string": pa.string(), "int": pa.int32()}
    return pa.schema([pa.field(f.name, kinds[f.dataType.simpleString()]) for f in schema.fields])


__all__ = [
    "BesideBuilds", "InSinkTransaction", "StateHome", "before_write", "build_stage", "drop", "follow_stage",
    "home_for", "swap", "transaction",
]
