"""Ordered, batched appends to the log on a writer thread, offset last.

A connector decodes the next batch while the previous one is being appended
(SQLite and the Kafka client release the GIL while they wait), and learns which
batch is durable through :attr:`CaptureWriter.durable_token`.

Per batch, the writer performs these steps, in this order:

1. create the topics the batch needs (idempotent);
2. append each ``(topic, partition, records)`` group, in batch order — the log
   makes each append durable before returning;
3. append the batch's offset dict to the offsets topic (durable), with the source's
   consistent cut (``connectors/cuts.py``): the end offset of every partition of the
   source's topics when the batch ends at a transaction boundary (``Batch.cut``), else the
   previous cut again;
4. publish the batch's token as durable; only then may the connector
   acknowledge the source up to it.

A failure stops the writer; the error is re-raised in the connector's thread by
the next :meth:`submit`, :meth:`check` or :meth:`drain`, and no later batch is
written (so the offset never runs ahead of the data).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kappaflow.connectors.cuts import CutTracker
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.log.base import Log, Record, TopicConfig

__all__ = ["Batch", "CaptureWriter"]

# Test hook, called with the step just reached: "before_records" / "after_records" (batches
# with records only) and "after_offset" (batches with an offset).
FaultHook = Callable[[str], None]


@dataclass
class Batch:
    appends: list[tuple[str, int | None, list[Record]]] = field(default_factory=list)
    offset: dict[str, Any] | None = None
    token: Any = None
    creates: list[tuple[str, TopicConfig]] = field(default_factory=list)
    records: int = 0
    transactions: int = 0  # source transactions completed by this batch (metrics)
    commit_ts_ms: int | None = None  # source commit time of the batch's last transaction (source lag)
    # the batch ends at a source transaction boundary: its offset record carries a new cut
    # (False for a part of a huge transaction, or the records before a TRUNCATE inside one)
    cut: bool = True

    def add(self, topic: str, records: list[Record], partition: int | None = None) -> None:
        if records:
            self.appends.append((topic, partition, records))
            self.records += len(records)


_STOP = object()


class CaptureWriter:
    """Serialises batches onto the log; see the module docstring for the step order."""

    def __init__(self, log: Log, offsets: OffsetStore, source: str, *, threaded: bool = True, depth: int = 2,
                 fault: FaultHook | None = None) -> None:
        self.log = log
        self.offsets = offsets
        self.source = source
        self._fault = fault
        self._error: BaseException | None = None
        self._durable: Any = None
        self._submitted = 0
        self._done = 0
        self._cond = threading.Condition()
        self.records_written = 0
        self.batches_written = 0
        self.append_seconds = 0.0
        self.per_topic: dict[str, int] = {}
        # The run's summary: step 4 counts the batch's transactions there and measures the source lag
        # (commit at the source -> durable in the log), per batch, off the per-row path.
        self.summary: Any = None
        self.cuts = CutTracker(log, source)
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
            self._thread = threading.Thread(target=self._run, name=f"kappaflow-writer-{source}", daemon=True)
            self._thread.start()

    # -- connector side ------------------------------------------------------------------
    @property
    def durable_token(self) -> Any:
        return self._durable

    @property
    def pending(self) -> int:
        return self._submitted - self._done

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, batch: Batch) -> None:
        self.check()
        self._submitted += 1
        if self._thread is None:
            self._write(batch)
            return
        while True:
            try:
                self._queue.put(batch, timeout=0.5)
                return
            except queue.Full:
                self.check()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted batch is durable (or raise the writer's error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._done < self._submitted and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"log writer still has {self._submitted - self._done} batch(es) pending")
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
        self.check()

    def close(self) -> None:
        """Stop the thread after the batches already submitted (errors are kept, not raised)."""
        if self._thread is not None and self._thread.is_alive():
            while True:
                try:
                    self._queue.put(_STOP, timeout=0.5)
                    break
                except queue.Full:
                    if self._error is not None or not self._thread.is_alive():
                        break
            self._thread.join()

    # -- writer side ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            if self._error is not None:
                continue  # drain the queue without writing anything after a failure
            try:
                self._write(batch)
            except BaseException as exc:  # re-raised in the connector's thread
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()

    def _write(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        cuts = self.cuts
        for name, cfg in batch.creates:  # step 1
            self.log.create_topic(name, cfg, exist_ok=True)
            cuts.know(name)
        if self._fault is not None and batch.records:
            self._fault("before_records")
        append = self.log.append_ends  # durable, and the end offsets of the partitions written
        for topic, partition, records in batch.appends:  # step 2
            cuts.know(topic)
            cuts.appended(topic, append(topic, records, partition=partition))
            self.per_topic[topic] = self.per_topic.get(topic, 0) + len(records)
        if self._fault is not None and batch.records:
            self._fault("after_records")
        if batch.offset is not None:  # step 3
            self.offsets.save(self.source, batch.offset, cut=cuts.cut() if batch.cut else cuts.last)
            if self._fault is not None:
                self._fault("after_offset")
        self.append_seconds += time.perf_counter() - t0
        self.records_written += batch.records
        self.batches_written += 1
        summary = self.summary
        if summary is not None:
            summary.transactions += batch.transactions
            if batch.commit_ts_ms is not None:
                summary.source_lag_ms = max(0.0, time.time() * 1000 - batch.commit_ts_ms)
        with self._cond:  # step 4
            if batch.token is not None:
                self._durable = batch.token
            self._done += 1
            self._cond.notify_all()
