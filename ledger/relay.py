"""A relay from the ledger into the log, for setups without logical decoding.

The primary path is the PostgreSQL connector capturing the events table (see `logmap`). Where
``wal_level`` is not ``logical`` (or for the embedded quick start), this relay follows the ledger
with a `TailReader` and appends each event to ``<source>.<stream_type>``, keyed by stream id.

Exactly-once effect without a second store for the resume position:

1. events are relayed strictly in ledger order, in runs of consecutive events that land in the
   same topic partition, one `Log.append` per run (a run is all-or-nothing per partition);
2. so the log always holds every ledger position up to some P, and nothing beyond P;
3. on start, P is found from the log itself: the highest ``kf.ledger.position`` among the last
   records of the relay's topics; relaying resumes at P + 1.

Personal fields go to the log sealed as stored (or as the forgotten marker once their subject is
forgotten), exactly as the ledger source writes them.

Ledger topics use the DELETE cleanup policy: they carry every event of a stream under one key,
so compaction (keep the latest per key) would destroy history.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kappaflow.ledger.events import RecordedEvent
from kappaflow.ledger.logmap import POSITION_HEADER, LogRedactor, to_log_record
from kappaflow.ledger.personal import ForgottenSubjects
from kappaflow.ledger.store import Ledger
from kappaflow.ledger.tail import TailReader
from kappaflow.log.base import CleanupPolicy, Log, LogRecord, Record, TopicConfig
from kappaflow.log.partitioner import partition_for


def record_position(rec: LogRecord) -> int | None:
    """The ledger position a log record carries (header written by `to_log_record`)."""
    for name, value in rec.headers:
        if name == POSITION_HEADER:
            return int(value)
    return None


class LedgerRelay:
    def __init__(self, ledger: Ledger, log: Log, source: str, *, partitions: int = 4,
                 batch: int = 1000) -> None:
        self.ledger = ledger
        self.log = log
        self.source = source
        self.partitions = partitions
        self.batch = batch
        self._topics: dict[str, int] = {}
        self._reader: TailReader | None = None
        self._forgotten = LogRedactor(ForgottenSubjects(ledger.keys))
        # counted per append (a run of records), for metrics: events relayed, per topic, last position
        self.relayed = 0
        self.per_topic: dict[str, int] = {}
        self.position = 0

    def resume_position(self) -> int:
        """The next ledger position to relay (1 + the highest position found in the log)."""
        last = 0
        for topic, cfg in self.log.list_topics().items():
            if not topic.startswith(self.source + "."):
                continue
            for p in range(cfg.partitions):
                offset = max(0, self.log.end_offset(topic, p) - 1)
                while True:  # read forward: robust against an end offset that is too low
                    recs = self.log.read(topic, p, offset, 10_000)
                    if not recs:
                        break
                    pos = record_position(recs[-1])
                    if pos is not None:
                        last = max(last, pos)
                    offset = recs[-1].offset + 1
        return last + 1

    def run_once(self, timeout: float = 0.0) -> int:
        """Relay what is available now (waiting up to `timeout` s for something); returns the count."""
        if self._reader is None:
            self._reader = TailReader(self.ledger, next_position=self.resume_position(), batch=self.batch,
                                      decode=False, hashes=True, reveal=False)
        events = self._reader.poll(timeout)
        self._publish(events)
        return len(events)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.run_once(timeout=0.5)

    def _partitions(self, topic: str) -> int:
        n = self._topics.get(topic)
        if n is None:
            # every event counts: delete policy with no retention limit (Kafka's default deletes after 7 days)
            cfg = self.log.create_topic(topic, TopicConfig(partitions=self.partitions,
                                                           cleanup_policy=CleanupPolicy.DELETE,
                                                           retention_ms=-1, retention_bytes=-1))
            n = self._topics[topic] = cfg.partitions
        return n

    def _publish(self, events: Iterable[RecordedEvent]) -> None:
        run: list[Record] = []
        run_at: tuple[str, int] | None = None
        last = self.position
        for e in events:
            topic, record = to_log_record(self.source, e)
            record = self._forgotten.redact(record)
            where = (topic, partition_for(record.key, self._partitions(topic)))
            if run and where != run_at:
                assert run_at is not None
                self._append(run_at, run)
                run = []
            run.append(record)
            run_at = where
            last = e.position
        if run and run_at is not None:
            self._append(run_at, run)
            self.position = last

    def _append(self, where: tuple[str, int], run: list[Record]) -> None:
        self.log.append(where[0], run, partition=where[1])
        self.relayed += len(run)
        self.per_topic[where[0]] = self.per_topic.get(where[0], 0) + len(run)
