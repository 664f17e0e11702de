"""Appends through librdkafka's idempotent producer, durable when they return.

Steps of one append (`Appender.append`):

1. every check that can refuse the append runs before anything is sent (`checked_append`:
   record types, keys, sizes, partition), so a refused append writes nothing;
2. each record is handed to the producer with its partition chosen by kappaflow
   (`partitions_of`: murmur2 like Java clients) and a delivery report callback;
3. `flush()` waits for every report: librdkafka bounds each record's delivery by
   `message.timeout.ms` (the log's request timeout), retrying on its own meanwhile, so every
   record ends acknowledged by all in-sync replicas or failed, never pending;
4. any failed record fails the append with the count acknowledged and the first failure's
   record index and key. Nothing of a failed append stays queued to be written later (the
   producer's queue is purged), so a caller that retries from its last durable position never
   meets a late copy of a record it was told had failed.

Delivery reports of one partition arrive in produce order (the idempotent producer keeps
order per partition), which is how a report is matched to its record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from kappaflow.errors import LogError, LogUnavailableError, RecordTooLargeError, UnknownTopicError, ValidationError
from kappaflow.log.base import Appended, Record, TopicConfig
from kappaflow.log.embedded.codec import build
from kappaflow.log.kafka.common import checked_append, describe_key, partitions_of
from kappaflow.log.kafka.confluent.clients import is_too_large, is_unknown_topic, map_error
from kappaflow.log.kafka.confluent.topics import TopicAdmin

__all__ = ["Appender"]

_timestamp_of = attrgetter("timestamp_ms")
# Typed views of Message's accessors (its stubs say Optional; a delivery report has them).
_partition_of: Callable[[Message], int] = Message.partition  # type: ignore[assignment]
_offset_of: Callable[[Message], int] = Message.offset  # type: ignore[assignment]
_error_of = Message.error


class Appender:
    """The append side of one log: one producer, one append at a time."""

    def __init__(self, producer: Callable[[], Producer], *, bootstrap: str, timeout_s: float,
                 topics: TopicAdmin, drop_producer: Callable[[], None]) -> None:
        self._producer = producer
        self._bootstrap = bootstrap
        self._timeout_s = timeout_s
        self._topics = topics
        self._drop_producer = drop_producer
        self._lock = threading.Lock()

    def append(self, topic: str, config: TopicConfig, records: Sequence[Record], partition: int | None,
               *, results: bool) -> list[Appended]:
        n = len(records)
        keys, values = checked_append(topic, config, records, partition)  # step 1
        parts = partitions_of(keys, config.partitions, partition)
        stamps = list(map(_timestamp_of, records))
        if 0 in stamps:
            i = stamps.index(0)
            raise ValidationError(
                f"topic {topic!r} record {i}: timestamp_ms 0 cannot be written by librdkafka (it reads 0 as "
                "'now'); use 1, or None for the append time, or the kafka-python client")
        with self._lock:
            producer = self._producer()
            reports: list[Message] = []
            add = reports.append

            def delivered(err: KafkaError | None, msg: Message) -> None:
                add(msg)

            self._produce(producer, topic, records, keys, values, parts, delivered)  # step 2
            left = producer.flush(self._timeout_s + 5.0)  # step 3: message.timeout.ms bounds every record
            if left:
                producer.purge(in_queue=True, in_flight=False)
                producer.flush(5.0)
            return self._outcome(topic, n, keys, parts, reports, results)  # step 4

    def _produce(self, producer: Producer, topic: str, records: Sequence[Record], keys: list[bytes | None],
                 values: list[bytes | None], parts: list[int], delivered: Any) -> None:
        produce = producer.produce
        deadline = time.monotonic() + self._timeout_s
        for i, rec in enumerate(records):
            headers = rec.headers
            ts = rec.timestamp_ms
            while True:
                try:
                    produce(topic, values[i], keys[i], parts[i], delivered, None, ts or 0,
                            list(headers) if headers else None)
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.05)
                    if time.monotonic() > deadline:
                        producer.purge(in_queue=True, in_flight=False)
                        producer.flush(self._timeout_s)
                        raise LogUnavailableError(
                            f"appending to topic {topic!r}: the producer queue stayed full for "
                            f"{self._timeout_s:.0f}s (broker at {self._bootstrap} too slow or down); "
                            f"record {i} was not sent") from None
                except (TypeError, ValueError) as exc:
                    producer.purge(in_queue=True, in_flight=False)
                    producer.flush(self._timeout_s)
                    raise ValidationError(f"topic {topic!r} record {i}: {exc}; nothing after it was sent") from None

    def _outcome(self, topic: str, n: int, keys: list[bytes | None], parts: list[int], reports: list[Message],
                 results: bool) -> list[Appended]:
        errors = list(map(_error_of, reports))
        failed = n - len(reports) + sum(e is not None for e in errors)
        if not failed:
            if not results:
                return []
            return self._positions(topic, n, parts, reports)
        ok = n - failed
        # The first failed record in input order: reports of one partition come in produce order.
        pending: dict[int, list[int]] = {}
        for i, p in enumerate(parts):
            pending.setdefault(p, []).append(i)
        where: dict[int, int] = {}
        first_bad: tuple[int, KafkaError | None] | None = None
        for msg, err in zip(reports, errors, strict=True):
            p = _partition_of(msg)
            k = where.get(p, 0)
            where[p] = k + 1
            idx = pending[p][k]
            if err is not None and (first_bad is None or idx < first_bad[0]):
                first_bad = (idx, err)
        if first_bad is None:  # some records got no report at all: timed out locally
            first_bad = (min(pending[p][where.get(p, 0)] for p in pending if where.get(p, 0) < len(pending[p])), None)
        i, err = first_bad
        if err is not None and err.fatal():
            self._drop_producer()  # a fatal idempotence error: the next append starts a new producer
        what = (f"appending to topic {topic!r} ({ok} of {n} records acknowledged; record {i}, "
                f"key {describe_key(keys[i])}, failed first)")
        if err is None:
            raise LogUnavailableError(f"{what}: no delivery report from the broker at {self._bootstrap} "
                                      f"within {self._timeout_s:.0f}s")
        if is_too_large(err):
            raise RecordTooLargeError(
                f"topic {topic!r} record {i} (key {describe_key(keys[i])}): the broker rejected it as too large "
                f"for max.message.bytes ({err.str()}); {ok} of {n} records of this append were acknowledged")
        mapped: LogError = map_error(err, bootstrap=self._bootstrap, what=what, topic=topic)
        # A topic deleted meanwhile makes its records time out like an unreachable broker.
        timed_out = err.code() in (KafkaError._MSG_TIMED_OUT, KafkaError._TIMED_OUT)
        if (timed_out or is_unknown_topic(err)) and self._topics.check_gone(topic):
            raise UnknownTopicError(topic)
        raise mapped

    @staticmethod
    def _positions(topic: str, n: int, parts: list[int], reports: list[Message]) -> list[Appended]:
        if len(set(parts)) == 1:
            return build(Appended, n, parts, list(map(_offset_of, reports)))
        by_partition: dict[int, list[int]] = {}
        for msg in reports:
            by_partition.setdefault(_partition_of(msg), []).append(_offset_of(msg))
        taken = {p: iter(offsets) for p, offsets in by_partition.items()}
        return build(Appended, n, parts, [next(taken[p]) for p in parts])
