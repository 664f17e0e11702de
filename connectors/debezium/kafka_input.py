"""The Debezium source's input: Debezium's topics read through a kappaflow `Log` on their cluster.

Why through the log contract rather than a Kafka consumer of its own: the source then reads with
the Kafka client the configuration chose (``[log.kafka] client``: librdkafka or kafka-python),
with the same security settings, bounded connects, error mapping and end offsets that are right
on brokers whose ListOffsets lags (the test broker), and read_committed with the librdkafka
client (records of aborted transactions -- Kafka Connect's exactly-once sources -- are never
decoded). No consumer group is joined: the positions live in kappaflow's offsets topic.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from kappaflow.errors import ConfigError, LogError, Retry, SourceError, UnknownTopicError
from kappaflow.log import Log, LogRecord, open_log

__all__ = ["SWITCH_AFTER", "DebeziumInput", "InputPartition", "check_switch_after"]

#: Records read from one input partition in a row, by default (``[sources.NAME] switch_after``).
SWITCH_AFTER = 50_000


def check_switch_after(name: str, value: Any) -> int:
    """``switch_after`` of source ``name``: an integer >= 1, else a ConfigError naming the setting."""
    if type(value) is not int or value < 1:
        raise ConfigError(f"sources.{name}.switch_after: expected an integer >= 1 (records read from one input "
                          f"partition in a row before the next partition's turn), got {value!r}")
    return value


class InputPartition(NamedTuple):
    topic: str
    partition: int


class DebeziumInput:
    """`poll()` returns the next records of the assigned partitions, in offset order per partition.

    Partitions are read one at a time: the reader keeps the partition it is on while it has
    records, for up to ``switch_after`` records (``[sources.NAME] switch_after``, default 50,000),
    then takes the next one (a partition that is read to its end hands over at once). Why: both
    Kafka clients read a partition through one consumer that is re-assigned when the partition
    changes, and a re-assignment throws away what the client had prefetched (librdkafka: up to
    64 MB) and waits for a new fetch; taking the partitions in turn on every poll did that
    several times per poll, fetching most records from the broker more than once.
    """

    def __init__(self, name: str, bootstrap: str, topics: list[str], kafka_options: Mapping[str, Any], *,
                 switch_after: int = SWITCH_AFTER) -> None:
        self.name = name
        self.bootstrap = bootstrap
        self.topics = topics
        self.switch_after = check_switch_after(name, switch_after)
        options = {k: v for k, v in kafka_options.items() if k != "replication_factor"}
        try:
            self.log: Log = open_log(f"kafka://{bootstrap}", read_only=True, **options)
        except LogError as exc:
            raise SourceError(f"debezium source {name!r}: cannot reach Kafka at {bootstrap}: {exc}",
                              retry=exc.retry) from None
        self.next: dict[InputPartition, int] = {}
        self._turn = 0  # index of the partition being read
        self._taken = 0  # records taken from it since it became the current one

    def assign(self, stored: Mapping[str, Any] | None) -> list[InputPartition]:
        """Every partition of the topics, from the stored next offsets (else from the beginning)."""
        saved = (stored or {}).get("topics", {})
        tps: list[InputPartition] = []
        for topic in self.topics:
            try:
                parts = self.log.partitions(topic)
            except UnknownTopicError:
                raise SourceError(f"debezium source {self.name!r}: topic {topic!r} does not exist on "
                                  f"{self.bootstrap} (check the connector's topic.prefix and table names)",
                                  retry=Retry.TRANSIENT) from None
            except LogError as exc:
                raise self._failure(exc) from None
            tps.extend(InputPartition(topic, p) for p in range(parts))
        for tp in tps:
            nxt = saved.get(tp.topic, {}).get(str(tp.partition))
            self.next[tp] = 0 if nxt is None else int(nxt)
        return tps

    def poll(self, timeout_ms: int, max_records: int) -> dict[InputPartition, list[LogRecord]]:
        """Up to `max_records` records, from the current partition first (see the class docstring);
        waits up to `timeout_ms` when there are none."""
        deadline = time.monotonic() + timeout_ms / 1000
        tps = list(self.next)
        if not tps:
            return {}
        while True:
            out: dict[InputPartition, list[LogRecord]] = {}
            room = max_records
            empty = 0  # partitions found without records in a row: all of them ends this round
            while room > 0 and empty < len(tps):
                tp = tps[self._turn % len(tps)]
                want = min(room, self.switch_after - self._taken)
                try:
                    recs = self.log.read(tp.topic, tp.partition, self.next[tp], want)
                except LogError as exc:
                    raise self._failure(exc) from None
                if recs:
                    out.setdefault(tp, []).extend(recs)
                    self.next[tp] = recs[-1].offset + 1
                    room -= len(recs)
                    self._taken += len(recs)
                    empty = 0
                else:
                    empty += 1
                if not recs or self._taken >= self.switch_after:
                    self._turn = (self._turn + 1) % len(tps)
                    self._taken = 0
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))  # a follower's polling interval

    def caught_up(self) -> bool:
        """Every partition read up to its end offset."""
        try:
            return all(self.next[tp] >= self.log.end_offset(tp.topic, tp.partition) for tp in self.next)
        except LogError as exc:
            raise self._failure(exc) from None

    def _failure(self, exc: LogError) -> SourceError:
        return SourceError(f"debezium source {self.name!r}: reading Kafka at {self.bootstrap}: {exc}",
                           retry=exc.retry)

    def close(self) -> None:
        self.log.close()
