"""Follow: keep a view current with Spark Structured Streaming, exactly-once in effect.

Each micro-batch (``foreachBatch``):

1. reads the positions stored with the live view (the sink is the source of truth, not
   Spark's checkpoint);
2. drops records below them — a batch Spark re-runs after a crash (its checkpoint is
   behind the sink) therefore changes nothing;
3. folds the rest (``engine.apply_batch``) and writes the changes AND the new positions
   in ONE PostgreSQL transaction;
4. returns, and Spark then records the batch in its checkpoint.
A crash between 3 and 4 re-runs the batch after restart, filtered out by 2; a crash
before 3's commit re-runs it for real. The stream starts from the stored positions
when there is no checkpoint, and the checkpoint directory carries the view's generation,
so a checkpoint from before a rebuild is never resumed against the new view.

One follower per projection: the follower holds a PostgreSQL advisory lock for its
lifetime (released by the server when the process dies, kill -9 included).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from kappaflow.errors import ConfigError
from kappaflow.projections.api import CustomFold, Projection, ProjectionSpec
from kappaflow.projections.engine import BatchResult, ProjectionBusy, apply_batch, nest, prepare
from kappaflow.projections.replay import _record, as_spec

log = logging.getLogger("kappaflow.projections")


@dataclass
class FollowStats:
    batches: int = 0
    events: int = 0
    upserted: int = 0
    deleted: int = 0
    dead_letters: int = 0
    last_batch_at: float = 0.0
    positions: dict[tuple[str, int], int] = field(default_factory=dict)


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
    """A running follow of one projection. ``start()``, then ``stop()`` or ``run_until(...)``."""

    def __init__(
        self,
        projection: ProjectionSpec | type[Projection] | Projection,
        rt: Any,
        *,
        trigger: str = "0.5s",
        max_records_per_batch: int | None = 200_000,
        on_batch: Callable[[FollowStats, BatchResult], None] | None = None,
        checkpoint: str | None = None,
    ) -> None:
        self.spec = as_spec(projection)
        self.rt = rt
        self.trigger = parse_trigger(trigger)
        self.max_records = max_records_per_batch
        self.on_batch = on_batch
        self.stats = FollowStats()
        self.query: Any = None
        self._checkpoint = checkpoint
        self._lock_conn: Any = None
        self.plan: Any = None
        self.target: Any = None
        self.sink: Any = None
        self.error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> Follower:
        import psycopg

        rt = self.rt
        spec = self.spec
        self.plan = plan = prepare(spec, rt)
        # Own sink (connection): followers in one process run their batches concurrently.
        self.sink = sink = rt.sink.config().open()
        # The lock lives on its own connection so it is held for the follower's lifetime.
        self._lock_conn = psycopg.connect(rt.dsn, autocommit=True)
        got = self._lock_conn.execute(
            "SELECT pg_try_advisory_lock(hashtextextended(%s, 7270604))", ("kappaflow.projection:" + spec.name,)
        ).fetchone()
        if not got or not got[0]:
            self._lock_conn.close()
            self.sink.close()
            raise ProjectionBusy(f"projection {spec.name!r} is already followed or being replayed by another process")
        try:
            created = sink.live(plan.view) is None
            self.target = sink.ensure(plan.view)
            reg = None
            if rt.dsn:
                with rt.registry() as r:
                    reg = r.get(spec.name)
            if reg is not None and not created and reg.fingerprint != spec.fingerprint():
                raise ConfigError(
                    f"projection {spec.name!r} changed since its view was built (definition fingerprint differs); "
                    f"rebuild it with `kappaflow replay {spec.class_path or spec.name}` before following"
                )
            generation = _record(rt, plan, new_generation=created, replayed=False)
            positions = sink.read_positions(self.target)
            log_ = rt.reader()
            partitions = {t: log_.partitions(t) for t in spec.topics}
            start = nest(positions, spec.topics, partitions)
            ckpt = self._checkpoint or str(rt.checkpoint_dir / spec.name / f"g{generation}")
            declarative = not isinstance(spec.fold, CustomFold)
            stream = rt.stream(spec.topics, start, self.max_records, latest_per_key=declarative)
            self.query = (
                stream.writeStream.queryName(f"kappaflow_{spec.name}")
                .foreachBatch(self._batch)
                .option("checkpointLocation", ckpt)
                .trigger(processingTime=self.trigger)
                .start()
            )
        except BaseException:
            self._release()
            raise
        return self

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        try:
            spec = self.spec
            before = self.sink.read_positions(self.target)
            raws = (
                {t: df.where(F.col("topic") == t) for t in spec.topics}
                if len(spec.topics) > 1
                else {spec.topics[0]: df}
            )
            res = apply_batch(self.plan, self.rt, self.target, raws, before, sink=self.sink, deduped_input=True)
            s = self.stats
            s.batches += 1
            s.events += res.events
            s.upserted += res.upserted
            s.deleted += res.deleted
            s.dead_letters += res.dead_letters
            s.last_batch_at = time.time()
            s.positions = res.positions
            if self.on_batch is not None:
                self.on_batch(s, res)
        except BaseException as exc:
            self.error = exc
            raise

    def _release(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None
        if self._lock_conn is not None:
            try:
                self._lock_conn.close()
            except Exception:
                pass
            self._lock_conn = None

    def stop(self) -> None:
        try:
            if self.query is not None:
                self.query.stop()
        finally:
            self._release()

    def wait_for(self, condition: Callable[[FollowStats], bool], timeout: float) -> bool:
        """Block until `condition(stats)` holds (True) or `timeout` passes / the query dies (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self.stats):
                return True
            self.check()
            time.sleep(0.05)
        return condition(self.stats)

    def check(self) -> None:
        """Raise the query's failure, if any."""
        if self.query is not None and not self.query.isActive:
            exc = self.query.exception()
            if exc is not None:
                raise self.error or RuntimeError(str(exc))

    def caught_up(self) -> bool:
        """True when the stored positions reach the log's current end."""
        ends = self.rt.end_offsets(self.spec.topics)
        pos = self.rt.sink.read_positions(self.target)  # not the batch connection (may be mid-transaction)
        return all(pos.get((t, p), 0) >= e for t, parts in ends.items() for p, e in parts.items())

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Run until SIGINT/SIGTERM (or `stop` is set), then stop cleanly."""
        stop = stop or threading.Event()
        prev: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                prev[sig] = signal.signal(sig, lambda *_: stop.set())
        try:
            while not stop.is_set():
                if self.query is not None and not self.query.isActive:
                    self.check()
                    break
                stop.wait(0.5)
        finally:
            for sig, h in prev.items():
                signal.signal(sig, h)
            self.stop()


def follow(projection: ProjectionSpec | type[Projection] | Projection, rt: Any, **kwargs: Any) -> Follower:
    """Start following `projection` (returns the running Follower)."""
    return Follower(projection, rt, **kwargs).start()


__all__ = ["FollowStats", "Follower", "follow", "parse_trigger"]
