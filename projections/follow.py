"""Follow: keep a view current with Spark Structured Streaming, exactly-once in effect.

One ``Follower`` per (projection, sink): a projection that names several sinks
(``Projection.sinks``) runs one streaming query per sink (``FollowerGroup``), each from
that sink's OWN stored positions, so a failing sink neither blocks nor corrupts the others.

Each micro-batch (``foreachBatch``):

1. reads the positions stored with the live view (the sink is the source of truth, not
   Spark's checkpoint);
2. drops records below them — a batch Spark re-runs after a crash (its checkpoint is
   behind the sink) therefore changes nothing;
3. folds the rest (``engine.apply_batch``) and writes the changes AND the new positions
   (PostgreSQL: in ONE transaction; search/Redis: positions after the version-guarded rows);
   rows the sink refuses go to the dead-letter topic;
4. returns, and Spark then records the batch in its checkpoint.
A crash between 3 and 4 re-runs the batch after restart, filtered out by 2; a crash
before 3's commit re-runs it for real. The stream starts from the stored positions
when there is no checkpoint, and the checkpoint directory carries the view's generation,
so a checkpoint from before a rebuild is never resumed against the new view.

Failures: when a batch fails (store down, timeouts after the sink's own retries) the
query stops; the follower logs it and restarts it after a backoff (doubling up to
``max_backoff_s``; ``max_restarts`` failures in a row without a successful batch end the
follower, ``error`` says why), with a fresh checkpoint, i.e. from the sink's stored
positions. When the store lost the view (``SinkStateLostError``: Redis flushed or
restarted empty, index deleted) the follower rebuilds that sink's view from the log
(``replay.rebuild``: new build, swap) and carries on. Errors that no retry can fix (a
view schema mismatch, bad configuration) end the follower at once.

Mirrors: the search/Redis views of a grouped projection copy its PostgreSQL view instead
of folding the log (``mirror.py``): their follower polls the view's positions every
trigger interval and copies the groups that changed, never storing positions ahead of
PostgreSQL's; failures back off and restart the same way.

One follower per projection and sink: the follower holds the sink's projection lock
(``Sink.try_lock``: a PostgreSQL advisory lock, a Redis / search lease) for its lifetime;
it is released when the process dies, kill -9 included. A replay of a followed projection
therefore builds without that lock and offers its rebuilt view; the follower's supervisor
looks for an offer between batches and takes it (``handover.py``: catch-up and swap under the
follower's lock, then the same query follows the new view).

Definition changes: at start, a view built by another definition of the projection (registry
fingerprint) stops the follower (``on_definition_change = "fail"``, the default) or is rebuilt
by it, blue/green, before it follows (``"rebuild"``).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from kappaflow.errors import ConfigError, KappaflowError, Retry, SinkError
from kappaflow.logs import describe
from kappaflow.projections.api import Projection, ProjectionSpec
from kappaflow.projections.engine import (
    BatchResult,
    ProjectionBusy,
    apply_batch,
    apply_range,
    nest,
    prepare,
    swap_in,
)
from kappaflow.projections.folds import strategy_for
from kappaflow.projections.handover import DEFINITION_POLICIES, HANDOVER_POLL_S, Handovers
from kappaflow.projections.mirror import is_mirror, open_source, sync
from kappaflow.projections.replay import _record, as_spec
from kappaflow.projections.schema_watch import (
    NeedsRebuild,
    SchemaChange,
    SchemaChangeRefused,
    SchemaWatch,
    mark_needs_rebuild,
    needs_rebuild_message,
    refused_message,
)
from kappaflow.projections.sinks.base import Target, ViewSchemaMismatch
from kappaflow.projections.sinks.errors import SinkStateLostError

log = logging.getLogger("kappaflow.projections")


@dataclass
class FollowStats:
    batches: int = 0
    events: int = 0
    upserted: int = 0
    deleted: int = 0
    dead_letters: int = 0
    last_batch_at: float = 0.0
    last_batch_s: float = 0.0  # how long the last batch took (metrics: batch duration histogram)
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    read: dict[str, int] = field(default_factory=dict)  # offsets the batches moved past, per topic


def parse_trigger(text: str) -> str:
    """'0.5s', '2 seconds', '500ms' -> Spark's processingTime string."""
    t = text.strip().lower().replace(" ", "")
    try:
        if t.endswith("ms"):
            secs = float(t[:-2]) / 1000
        elif t.endswith("seconds"):
            secs = float(t[:-7])
        elif t.endswith("s"):
            secs = float(t[:-1])
        else:
            secs = float(t)
    except ValueError:
        raise ConfigError(f"--trigger: expected a duration like 0.5s or 500ms, got {text!r}") from None
    if secs < 0:
        raise ConfigError(f"--trigger: expected a duration >= 0, got {text!r}")
    return f"{round(secs * 1000)} milliseconds"


class Follower:
    """A running follow of one projection into one sink. ``start()``, then ``stop()`` or ``run_until(...)``.

    `sink` names the sink (default: the projection's only sink, else its first).
    `on_definition_change` ("fail" / "rebuild"): what to do at start when the view was built by
    another definition of the projection; the projection's own ``on_definition_change`` wins."""

    def __init__(
        self,
        projection: ProjectionSpec | type[Projection] | Projection,
        rt: Any,
        *,
        trigger: str = "0.5s",
        max_records_per_batch: int | None = 200_000,
        on_batch: Callable[[FollowStats, BatchResult], None] | None = None,
        checkpoint: str | None = None,
        sink: str | None = None,
        max_restarts: int = 20,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        on_definition_change: str = "fail",
        _shared: dict[str, Any] | None = None,
    ) -> None:
        self.spec = as_spec(projection)
        if on_definition_change not in DEFINITION_POLICIES:
            raise ConfigError(f"on_definition_change: expected one of {list(DEFINITION_POLICIES)}, "
                              f"got {on_definition_change!r}")
        # the projection's own setting wins over the runtime's ([follow] on_definition_change)
        self.on_definition_change = self.spec.on_definition_change or on_definition_change
        # shared by the followers of one projection (FollowerGroup): the registry's fingerprint as the
        # first of them read it, so every sink is rebuilt after a definition change, not only the first
        self._shared: dict[str, Any] = _shared if _shared is not None else {}
        self.rt = rt
        self.sink_name = sink or self.spec.sinks[0]
        rt.sinks_for(self.spec, [self.sink_name])  # a clear error now if it is not configured
        self.trigger = parse_trigger(trigger)
        self.max_records = max_records_per_batch
        self.on_batch = on_batch
        self.stats = FollowStats()
        self.query: Any = None
        self._checkpoint = checkpoint
        self.plan: Any = None
        self.target: Any = None
        self.sink: Any = None
        self._lock_sink: Any = None
        self.error: BaseException | None = None
        self.failed: BaseException | None = None  # set when the follower gave up
        self.restarts = 0
        self.rebuilds = 0
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._failures = 0  # in a row, reset by a successful batch
        self._pg: Any = None  # mirrors: their own connection to the PostgreSQL view
        self._ckpt: str | None = None  # the running query's checkpoint directory
        self.schema_changes: list[str] = []  # source schema changes taken (followed or evolved), in order
        self._rebuild_pending = False  # auto_rebuild: the next restart rebuilds the view first
        self.handovers = 0  # rebuilt views taken from a replay and swapped in (handover.py)
        # a batch and a handover never run at once: the handover swaps the view the batch writes
        self._batch_mutex = threading.RLock()
        self._handover_db: Handovers | None = None
        self._next_poll = 0.0
        self._definition_rebuilt = False  # on_definition_change = "rebuild" rebuilt this sink's view

    @property
    def name(self) -> str:
        return f"{self.spec.name}/{self.sink_name}"

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, *, retry_start: bool = False) -> Follower:
        """Take the lock and start the streaming query; raises if that fails.

        ``retry_start=True`` (a runtime hosting many projections): a failure a retry can fix (the
        store is down or unreachable) does not raise; the follower retries its start in the
        background with the same backoff as a restart, so the other projections start and run."""
        try:
            self._open_and_start()
        except BaseException as exc:
            if not (retry_start and retryable_start(exc)):
                raise
            self.error = exc
            self._supervisor = threading.Thread(target=self._start_later, args=(exc,),
                                                name=f"kappaflow-follow-{self.name}", daemon=True)
            self._supervisor.start()
            return self
        self._supervisor = threading.Thread(target=self._supervise, name=f"kappaflow-follow-{self.name}", daemon=True)
        self._supervisor.start()
        return self

    def _open_and_start(self) -> None:
        rt = self.rt
        spec = self.spec
        if self.plan is None:
            self.plan = prepare(spec, rt)
            self._schemas = SchemaWatch(self.plan, rt)
        base = rt.sink_for(spec.name, self.sink_name)
        try:
            # Own sink (connection): followers in one process run their batches concurrently.
            self.sink = base.config().open()
            if is_mirror(spec, self.sink_name):
                # A mirror follows the projection's PostgreSQL view, not the log (see mirror.py).
                self._pg = open_source(spec, rt, self.sink_name)
            # The lock on its own connection/client, so it is held for the follower's lifetime.
            self._lock_sink = base.config().open()
            if not self._lock_sink.try_lock(spec.name):
                raise ProjectionBusy(
                    f"projection {spec.name!r} is already followed or being replayed in the {self.sink_name} sink "
                    "by another process"
                )
            self._start_query(first=True)
        except BaseException:
            self._release()
            raise

    def _start_later(self, exc: BaseException) -> None:
        """Supervisor of a follower whose first start failed: retry it with backoff, then supervise."""
        if self._recover(exc, what="start failed"):
            self._supervise()

    def _checkpoint_path(self, generation: int) -> str:
        spec = self.spec
        if self._checkpoint:
            return self._checkpoint if len(spec.sinks) == 1 else str(Path(self._checkpoint) / self.sink_name)
        root = self.rt.checkpoint_dir / spec.name
        # PostgreSQL keeps the path it always had; other sinks get their own folder.
        if self.sink_name == "postgres":
            return str(root / f"g{generation}")
        return str(root / self.sink_name / f"g{generation}")

    def _fence(self) -> None:
        """The batch connection's writes carry the lock holder's fencing token (lease stores): once the
        lease is lost or taken over, the store refuses them (see ``Sink.fence``)."""
        self.sink.fence(self.spec.name, self._lock_sink.lock_fence(self.spec.name))

    def _start_query(self, *, first: bool = False, fresh: bool = False) -> None:
        rt, spec, plan, sink = self.rt, self.spec, self.plan, self.sink
        self._fence()
        created = sink.live(plan.view) is None
        try:
            self.target = sink.ensure(plan.view)
        except ViewSchemaMismatch as exc:  # e.g. a source table changed while nothing followed it
            self.target = self._meet_mismatch(exc)
            plan = self.plan
        if first:
            reg = None
            if rt.dsn:
                with rt.registry() as r:
                    reg = r.get(spec.name)
            if reg is not None and not created and reg.needs_rebuild:
                if not spec.auto_rebuild:
                    raise NeedsRebuild(
                        f"projection {spec.name!r} needs a rebuild before it can be followed ({reg.needs_rebuild}); "
                        f"run `kappaflow replay {spec.class_path or spec.name}`"
                    )
                log.warning("follower %s: the view needs a rebuild (%s); auto_rebuild: rebuilding it now",
                            self.name, reg.needs_rebuild)
                self._auto_rebuild()
                plan = self.plan
            built_by = self._shared.setdefault("fingerprint", reg.fingerprint if reg is not None else None)
            if reg is not None and not created and built_by != spec.fingerprint() and not self._definition_rebuilt:
                if self.on_definition_change != "rebuild":
                    raise ConfigError(
                        f"projection {spec.name!r} changed since its view was built (definition fingerprint "
                        f"differs); rebuild it with `kappaflow replay {spec.class_path or spec.name}` before "
                        "following, or set on_definition_change = \"rebuild\" (projection or [follow])"
                    )
                log.warning("follower %s: the projection's definition changed since its view was built; "
                            "on_definition_change = 'rebuild': rebuilding it now (new build beside the live view, "
                            "then swap)", self.name)
                self._auto_rebuild()
                self._definition_rebuilt = True  # a retried start does not rebuild it again
                plan = self.plan
        generation = _record(rt, plan, new_generation=created, replayed=False)
        positions = sink.read_positions(self.target)
        log_ = rt.reader()
        partitions = {t: log_.partitions(t) for t in spec.topics}
        start = nest(positions, spec.topics, partitions)
        ckpt = self._checkpoint_path(generation)
        self._ckpt = ckpt
        if fresh:
            # After a failure the sink's stored positions are the truth: start the stream from them.
            shutil.rmtree(ckpt, ignore_errors=True)
        if self._pg is not None:
            self.error = None
            self.query = _MirrorLoop(self, max(int(self.trigger.split()[0]) / 1000, 0.05))
            return
        latest_only = strategy_for(spec).reads_latest_per_key
        stream = rt.stream(spec.topics, start, self.max_records, latest_per_key=latest_only,
                           consistency=spec.consistency)
        qname = f"kappaflow_{spec.name}" if self.sink_name == "postgres" else f"kappaflow_{spec.name}_{self.sink_name}"
        self.error = None
        self.query = (
            stream.writeStream.queryName(qname)
            .foreachBatch(self._batch)
            .option("checkpointLocation", ckpt)
            .trigger(processingTime=self.trigger)
            .start()
        )

    def _same_definition(self) -> bool:
        """Whether the live view was built by this definition (registry fingerprint), so a mismatch of
        its shape comes from the sources' schemas, not from an edited projection class."""
        if not self.rt.dsn:
            return True
        with self.rt.registry() as r:
            reg = r.get(self.spec.name)
        return reg is None or reg.fingerprint == self.spec.fingerprint()

    def _meet_mismatch(self, exc: ViewSchemaMismatch) -> Any:
        """The live view does not have the shape the plan makes at start (a source schema changed while
        nothing followed, or the follower died between evolving a sink and its next batch): evolve it in
        place, or rebuild it (auto_rebuild), when the projection's policy says so; else mark it as
        needing a rebuild and raise."""
        spec, rt = self.spec, self.rt
        same = self._same_definition()
        if same and spec.on_schema_change == "evolve" and strategy_for(spec).evolves_in_place and not spec.joined:
            try:
                target = self.sink.evolve(self.plan.view)
                _record(rt, self.plan, new_generation=False, replayed=False)
                log.info("follower %s: the view was evolved in place to the sources' current schemas", self.name)
                return target
            except ViewSchemaMismatch as again:
                exc = again
        if same and spec.auto_rebuild:
            log.warning("follower %s: %s; auto_rebuild: rebuilding the view now", self.name, exc)
            self._auto_rebuild()
            return self.sink.ensure(self.plan.view)
        mark_needs_rebuild(rt, spec.name, str(exc))
        raise exc

    def _auto_rebuild(self) -> None:
        """Rebuild the view from the log with the sources' current schemas (new build, catch-up, swap),
        record the new generation (clears "needs rebuild"), and follow with the new plan."""
        self._rebuild_pending = True
        self._rebuild()

    def _take_schema_change(self, change: SchemaChange) -> None:
        """Act on a source schema change before the batch (see ``schema_watch``): follow on with the
        recompiled plan, evolve the sink's view in place first, or stop (rebuild / fail)."""
        spec, rt = self.spec, self.rt
        if change.action == "fail":
            raise SchemaChangeRefused(refused_message(spec, change.reason))
        reason = change.reason
        if change.action == "evolve":
            assert change.plan is not None
            try:
                self.target = self.sink.evolve(change.plan.view)
            except ViewSchemaMismatch as exc:  # e.g. a search field whose mapping cannot widen in place
                reason = f"{reason}; the {self.sink_name} sink cannot apply it in place: {exc}"
            else:
                reason = ""
        if reason and change.action != "follow":
            if spec.auto_rebuild and change.plan is not None:
                raise NeedsRebuild(needs_rebuild_message(spec, reason, self.sink_name), auto=True)
            mark_needs_rebuild(rt, spec.name, reason)
            raise NeedsRebuild(needs_rebuild_message(spec, reason, self.sink_name))
        assert change.plan is not None
        self.plan = change.plan
        self._schemas.accept(change)
        if change.action == "evolve":
            _record(rt, self.plan, new_generation=False, replayed=False)
        self.schema_changes.append(change.reason)
        log.info("follower %s: source schema change %s: %s", self.name,
                 "applied to the view in place" if change.action == "evolve" else "taken (the view keeps its shape)",
                 change.reason)

    def _check_lock(self) -> None:
        """Refuse to write without the projection's lock (its session died with a PostgreSQL restart,
        or its lease was lost): the batch fails, and recovery re-takes the lock or gives up."""
        if not self._lock_sink.holds_lock(self.spec.name):
            raise SinkError(f"the projection lock in the {self.sink_name} sink was lost (the store restarted, the "
                            "connection broke or the lease expired)", retry=Retry.TRANSIENT)

    def _relock(self) -> None:
        """Take the lock again on a fresh connection/client if it was lost; ProjectionBusy (the
        follower gives up) when another process took it meanwhile."""
        spec = self.spec
        if self._lock_sink.holds_lock(spec.name):
            return
        fresh = self.rt.sink_for(spec.name, self.sink_name).config().open()
        if not fresh.try_lock(spec.name):
            fresh.close()
            raise ProjectionBusy(
                f"projection {spec.name!r}: the {self.sink_name} sink lost the follower's lock (store restarted or "
                "lease expired) and another process holds it now"
            )
        old, self._lock_sink = self._lock_sink, fresh
        try:
            old.close()
        except Exception:
            pass
        log.info("follower %s: took the projection lock again", self.name)

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        with self._batch_mutex:
            self._run_batch(df, batch_id)

    def _run_batch(self, df: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        cached: DataFrame | None = None
        try:
            spec = self.spec
            before = self.sink.read_positions(self.target)
            if self._already_applied(batch_id, before):
                # Spark re-runs the batch it had not recorded before a crash or restart, and the
                # sink has it already: step 2 would filter out every record, so skip the Spark
                # jobs and the sink transaction altogether (no lock or schema check needed either).
                log.debug("follower %s: batch %d is already in the view, skipped", self.name, batch_id)
                return
            self._check_lock()
            change = self._schemas.check()  # a source schema change: follow on, evolve the view, or stop
            if change is not None:
                self._take_schema_change(change)
            if len(spec.topics) > 1:
                # Each topic's frame would read the whole micro-batch again (a Python data source
                # has no filter push-down): read it once (a join reads every table of the batch).
                df = df.persist(StorageLevel.MEMORY_AND_DISK)
                cached = df
                raws = {t: df.where(F.col("topic") == t) for t in spec.topics}
            else:
                raws = {spec.topics[0]: df}
            res = apply_batch(self.plan, self.rt, self.target, raws, before, sink=self.sink, deduped_input=True)
            self._count(res, started, before)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            if cached is not None:
                cached.unpersist()

    def _already_applied(self, batch_id: int, before: dict[tuple[str, int], int]) -> bool:
        """Whether every record of micro-batch `batch_id` is below the sink's stored positions.

        The batch's end offsets are in Spark's offset log (``<checkpoint>/offsets/<batch_id>``,
        written before the batch runs: a version line, a metadata line, then one JSON line per
        source). Read from the local file system only; anywhere else (a cluster's HDFS/S3
        checkpoint) or in any unexpected shape the batch simply runs, and step 2 filters it."""
        ckpt = self._ckpt
        if not ckpt or "://" in ckpt:
            return False
        try:
            lines = (Path(ckpt) / "offsets" / str(batch_id)).read_text().splitlines()
            end = json.loads(lines[2])
            ends = [(t, int(p), int(o)) for t, parts in end.items() for p, o in parts.items()]
        except (OSError, IndexError, ValueError, AttributeError, TypeError):
            return False
        return bool(ends) and all(before.get((t, p), 0) >= o for t, p, o in ends)

    def _count(self, res: BatchResult, started: float | None = None,
               before: dict[tuple[str, int], int] | None = None) -> None:
        s = self.stats
        if started is not None:
            s.last_batch_s = time.monotonic() - started
        if before is not None:  # a mirror copies the PostgreSQL view: it reads no log
            for (t, p), at in res.positions.items():
                moved = at - before.get((t, p), 0)
                if moved > 0:
                    s.read[t] = s.read.get(t, 0) + moved
        s.batches += 1
        s.events += res.events
        s.upserted += res.upserted
        s.deleted += res.deleted
        s.dead_letters += res.dead_letters
        s.last_batch_at = time.time()
        s.positions = res.positions
        self._failures = 0
        if self.on_batch is not None:
            self.on_batch(s, res)

    # --- supervision: restart after failures, rebuild after state loss -----------------------
    def _supervise(self) -> None:
        while not self._stopping.wait(0.1):
            q = self.query
            if q is None or q.isActive:
                if q is not None:
                    self._poll_handover()
                continue
            exc = self.error or (q.exception() and RuntimeError(str(q.exception())))
            if exc is None:  # stopped without an error (by someone else): nothing to do
                return
            if not self._recover(exc):
                return

    def _recover(self, exc: BaseException, what: str = "batch failed") -> bool:
        """Restart (or rebuild, then restart) after `exc`; False when the follower gives up.

        Each failure is ONE log line: what failed, the cause (``kappaflow.logs.describe``: no
        Spark/py4j wrappers, no traceback) and what happens next; the traceback is logged at
        debug level only."""
        while not self._stopping.is_set():
            lost = isinstance(exc, SinkStateLostError)
            if isinstance(exc, NeedsRebuild) and exc.auto:
                self._rebuild_pending = True
            elif isinstance(exc, KappaflowError) and not exc.transient and not lost:
                return self._give_up(exc, "an error no retry can fix")
            self._failures += 1
            if self._failures > self.max_restarts:
                return self._give_up(exc, f"{self.max_restarts} restarts in a row failed")
            # Jittered (0.75-1.25x): queries of one runtime that failed together (a store they share
            # went down, Python workers that could not start on a busy machine) restart apart.
            delay = min(self.backoff_s * 2 ** (self._failures - 1), self.max_backoff_s) * random.uniform(0.75, 1.25)
            log.warning(
                "follower %s: %s: %s; %s in %.1fs (attempt %d/%d)",
                self.name, "the sink lost the view" if lost else what, describe(exc),
                "rebuilding it from the log (auto_rebuild)" if self._rebuild_pending
                else "rebuilding it from the log" if lost else "restarting from the sink's positions", delay,
                self._failures, self.max_restarts,
            )
            log.debug("follower %s: traceback of the failure", self.name, exc_info=exc)
            if self._stopping.wait(delay):
                return False
            try:
                if self._lock_sink is None:  # its first start failed: start it now
                    self._open_and_start()
                    log.info("follower %s: started (attempt %d)", self.name, self._failures)
                    return True
                self._reopen()
                self._relock()
                if lost or self._rebuild_pending or self._view_lost():
                    self._rebuild()
                self._start_query(fresh=True)
                self.restarts += 1
                log.info("follower %s: restarted (attempt %d)", self.name, self._failures)
                return True
            except BaseException as again:  # still down: back off further
                exc, what = again, "restart failed"
        return False

    # --- handover: a replay's rebuilt view, caught up and swapped in between two batches ----------
    def _poll_handover(self) -> None:
        """Every ``HANDOVER_POLL_S``: take a rebuilt view a replay offers (``handover.py``)."""
        if self._pg is not None or not self.rt.dsn or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + HANDOVER_POLL_S
        try:
            if self._handover_db is None:
                self._handover_db = Handovers(self.rt.dsn)
            if self._handover_db.ready(self.spec.name, self.sink_name):
                with self._batch_mutex:
                    self._take_handover(self._handover_db)
        except Exception as exc:
            # The views database is down: the batches fail, say so once per restart and recover on their
            # own; a poll every 0.5 s saying it again would bury those lines (a replay waiting for this
            # follower gives up after its --handover-timeout with its own message).
            log.debug("follower %s: looking for a rebuilt view to take failed: %s", self.name, describe(exc))
            db, self._handover_db = self._handover_db, None
            if db is not None:
                try:
                    db.close()
                except Exception:
                    pass

    def _take_handover(self, db: Handovers) -> None:
        """Steps 4-5 of ``handover.py``: claim the offered shadow, fold the log from its positions up to
        the live view's (per partition, the larger) into it, swap it in under this follower's lock and
        record the new generation. A shadow of another definition is refused, with the reason."""
        spec, rt, name = self.spec, self.rt, self.sink_name
        offer = db.claim(spec.name, name)
        if offer is None:  # withdrawn by the replay meanwhile
            return
        plan = self.plan
        refusal = None
        if offer.fingerprint != spec.fingerprint():
            refusal = ("it runs another definition of the projection (fingerprint differs): restart it with the "
                       "new one (with on_definition_change = 'rebuild' it rebuilds the view itself), or stop it "
                       "and replay")
        elif offer.view != plan.view.to_dict():
            refusal = ("the rebuilt view's columns differ from the follower's (a source schema changed between "
                       "them?): run the replay again")
        if refusal is not None:
            log.warning("follower %s: refused the rebuilt view offered by a replay: %s", self.name, refusal)
            db.finish(spec.name, name, "refused", refusal)
            return
        shadow = Target(plan.view, offer.shadow, shadow=True)
        try:
            self._check_lock()
            live = self.sink.read_positions(self.target)
            built = self.sink.read_positions(shadow)
            if not built:
                raise SinkError(f"the rebuilt view {offer.shadow!r} has no stored positions (dropped?)")
            end = {tp: max(live.get(tp, 0), built.get(tp, 0)) for tp in {*live, *built}}
            moved = sum(end.values()) - sum(built.values())
            if moved:
                log_ = rt.reader()
                partitions = {t: log_.partitions(t) for t in spec.topics}
                apply_range(plan, rt, shadow, nest(built, spec.topics, partitions),
                            nest(end, spec.topics, partitions), sink=self.sink)
            self._check_lock()
            swap_in(plan, rt, self.sink, shadow)
        except Exception as exc:
            reason = f"taking it failed: {describe(exc)}"
            log.warning("follower %s: the rebuilt view offered by a replay: %s; following the live view on",
                        self.name, reason)
            db.finish(spec.name, name, "refused", reason)
            return
        self.target = self.sink.live(plan.view) or self.target
        generation = _record(rt, plan, new_generation=True, replayed=True)
        db.finish(spec.name, name, "swapped", generation=generation)
        self.handovers += 1
        log.info("follower %s: took the rebuilt view from the replay (caught it up by %d offsets) and swapped it in "
                 "(generation %d); following on", self.name, moved, generation)

    def _reopen(self) -> None:
        """Fresh store connections for the batches (and a mirror's PostgreSQL reads): the old one
        may be what failed (server restarted, connection killed) and a sink does not reconnect
        by itself, so restarting on it would fail until the follower gives up."""
        rt, spec = self.rt, self.spec
        sink = rt.sink_for(spec.name, self.sink_name).config().open()
        try:
            pg = open_source(spec, rt, self.sink_name) if self._pg is not None else None
        except BaseException:
            sink.close()
            raise
        olds = [self.sink, self._pg]
        self.sink, self._pg = sink, pg
        for s in olds:
            try:
                if s is not None:
                    s.close()
            except Exception:
                pass

    def _view_lost(self) -> bool:
        return bool(self.sink.live(self.plan.view) is None)

    def _rebuild(self) -> None:
        """The store lost the view: take the lock again if its lease went with it, rebuild the view
        from the log into a new build and swap it in."""
        from kappaflow.projections.replay import rebuild

        spec = self.spec
        self._lock_sink.unlock(spec.name)
        if not self._lock_sink.try_lock(spec.name):
            raise ProjectionBusy(
                f"projection {spec.name!r}: the {self.sink_name} sink lost the lock while the store was down, "
                "and another process holds it now"
            )
        self._fence()
        if self._rebuild_pending:
            # auto_rebuild after a schema change: compile with the sources' schemas as they are now
            self.plan = prepare(spec, self.rt)
            self._schemas = SchemaWatch(self.plan, self.rt)
        log.warning("follower %s: rebuilding the view from the log", self.name)
        rebuild(self.plan, self.rt, {self.sink_name: self.sink})
        if self._rebuild_pending:
            _record(self.rt, self.plan, new_generation=True, replayed=True)  # clears "needs rebuild"
            self._rebuild_pending = False
        self.rebuilds += 1

    def _give_up(self, exc: BaseException, why: str) -> bool:
        log.error("follower %s stopped (%s): %s", self.name, why, describe(exc))
        log.debug("follower %s: traceback of the failure", self.name, exc_info=exc)
        self.failed = exc
        return False

    def _release(self) -> None:
        for attr in ("sink", "_lock_sink", "_pg", "_handover_db"):
            s = getattr(self, attr)
            if s is not None:
                try:
                    s.close()
                except Exception:
                    pass
                setattr(self, attr, None)

    def stop(self) -> None:
        self._stopping.set()
        try:
            if self._supervisor is not None and self._supervisor is not threading.current_thread():
                self._supervisor.join(timeout=30)
            if self.query is not None:
                self.query.stop()
        finally:
            self._release()

    def wait_for(self, condition: Callable[[FollowStats], bool], timeout: float) -> bool:
        """Block until `condition(stats)` holds (True) or `timeout` passes / the follower gives up (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self.stats):
                return True
            self.check()
            time.sleep(0.05)
        return condition(self.stats)

    def check(self) -> None:
        """Raise the failure that made the follower give up, if any."""
        if self.failed is not None:
            raise self.failed

    @property
    def healthy(self) -> bool:
        """Running (not between a failure and its restart, not given up)."""
        return self.failed is None and self.query is not None and bool(self.query.isActive)

    @property
    def running(self) -> bool:
        """Healthy and into its first trigger: processing a batch, or it looked at the log and is
        waiting for more. (``start()`` returns as soon as Spark accepted the query; the first
        trigger can take many seconds more under load.)"""
        if not self.healthy:
            return False
        if self.stats.batches:
            return True
        try:
            message = str((self.query.status or {}).get("message", ""))
        except Exception:  # the query is stopping
            return False
        return message.startswith(("Waiting for", "Processing new data"))

    def partition_lag(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(stored position, log end) per topic partition of the projection."""
        ends = self.rt.end_offsets(self.spec.topics)
        pos = self._lock_sink.read_positions(self.target)  # not the batch connection (may be mid-transaction)
        return {(t, p): (min(pos.get((t, p), 0), e), e) for t, parts in ends.items() for p, e in parts.items()}

    def lag(self) -> tuple[int, int]:
        """(stored position, log end), each summed over the projection's topic partitions;
        their difference is the number of records the view has not consumed yet."""
        parts = self.partition_lag()
        return sum(at for at, _ in parts.values()), sum(e for _, e in parts.values())

    def caught_up(self) -> bool:
        """True when the stored positions reach the log's current end (False while not started).

        False while a batch is running: its transaction may have committed the positions before
        ``stats`` count it, and a caller that sees "caught up" reads ``stats`` next."""
        if self.target is None or self._lock_sink is None:
            return False
        if not self._batch_mutex.acquire(blocking=False):
            return False
        try:
            ends = self.rt.end_offsets(self.spec.topics)
            pos = self._lock_sink.read_positions(self.target)  # not the batch connection (may be mid-transaction)
        finally:
            self._batch_mutex.release()
        return all(pos.get((t, p), 0) >= e for t, parts in ends.items() for p, e in parts.items())

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Run until SIGINT/SIGTERM (or `stop` is set), then stop cleanly."""
        _run_forever([self], stop)


def retryable_start(exc: BaseException) -> bool:
    """Whether a follower's failed start is worth retrying: the store or the log is down or
    unreachable. Not when another process holds the projection (``ProjectionBusy``) nor for
    errors no retry can fix (configuration, a view that needs a rebuild)."""
    if isinstance(exc, ProjectionBusy):
        return False
    if isinstance(exc, KappaflowError):
        return exc.transient
    return isinstance(exc, OSError | ConnectionError | TimeoutError)


class _MirrorLoop:
    """What a mirror follower runs instead of a streaming query: every `interval` seconds,
    ``mirror.sync`` copies what changed in the PostgreSQL view. Quacks like the parts of a
    ``StreamingQuery`` the supervisor uses (``isActive``, ``exception``, ``stop``)."""

    def __init__(self, follower: Follower, interval: float) -> None:
        self.follower = follower
        self.interval = interval
        self._stop = threading.Event()
        self._exc: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kappaflow-mirror-{follower.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        f = self.follower
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                f._check_lock()
                res = sync(f.plan, f.rt, f._pg, f.sink, f.target)
            except BaseException as exc:
                f.error = self._exc = exc
                return
            if res is not None:
                f._count(res, started)
            f._failures = 0
            self._synced = True
            self._stop.wait(self.interval)

    _synced = False

    @property
    def isActive(self) -> bool:
        return self._thread.is_alive()

    @property
    def status(self) -> dict[str, Any]:
        return {"message": "Waiting for next trigger" if self._synced else "Initializing"}

    def exception(self) -> BaseException | None:
        return self._exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


class FollowerGroup:
    """One follower per sink of a projection (or per selected sink), started and stopped together.

    A follower that gives up does not stop the others; ``run_forever`` returns when all gave up."""

    def __init__(
        self,
        projection: ProjectionSpec | type[Projection] | Projection,
        rt: Any,
        *,
        sinks: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.spec = as_spec(projection)
        selected = rt.sinks_for(self.spec, sinks)
        shared: dict[str, Any] = {}
        self.followers = {name: Follower(self.spec, rt, sink=name, _shared=shared, **kwargs) for name in selected}

    def __getitem__(self, sink: str) -> Follower:
        return self.followers[sink]

    def start(self) -> FollowerGroup:
        started: list[Follower] = []
        try:
            for f in self.followers.values():
                started.append(f.start())
        except BaseException:
            for f in started:
                f.stop()
            raise
        return self

    def stop(self) -> None:
        errors = []
        for f in self.followers.values():
            try:
                f.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def caught_up(self) -> bool:
        return all(f.caught_up() for f in self.followers.values())

    def check(self) -> None:
        """Raise when every follower gave up (one failing sink alone does not stop the rest)."""
        failed = [f.failed for f in self.followers.values() if f.failed is not None]
        if failed and len(failed) == len(self.followers):
            raise failed[0]

    def wait_for(self, condition: Callable[[FollowerGroup], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self):
                return True
            self.check()
            time.sleep(0.05)
        return condition(self)

    def run_forever(self, stop: threading.Event | None = None) -> None:
        _run_forever(list(self.followers.values()), stop)


def _run_forever(followers: list[Follower], stop: threading.Event | None) -> None:
    stop = stop or threading.Event()
    prev: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.is_set():
            if all(f.failed is not None for f in followers):
                break
            stop.wait(0.5)
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)
        for f in followers:
            f.stop()
    failed = [f.failed for f in followers if f.failed is not None]
    if failed and len(failed) == len(followers):
        raise failed[0]


def follow(
    projection: ProjectionSpec | type[Projection] | Projection,
    rt: Any,
    *,
    sinks: Sequence[str] | None = None,
    **kwargs: Any,
) -> FollowerGroup:
    """Start following `projection` in its sinks (or the `sinks` named): one follower per sink."""
    return FollowerGroup(projection, rt, sinks=sinks, **kwargs).start()


__all__ = ["FollowStats", "Follower", "FollowerGroup", "follow", "parse_trigger"]
