"""Appends through the idempotent kafka-python producer, durable when they return."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kafka import errors as kerr

from kappaflow.errors import LogError, LogUnavailableError, RecordTooLargeError, UnknownTopicError, ValidationError
from kappaflow.log.base import Appended, Record
from kappaflow.log.kafka.common import checked_append, describe_key, partitions_of
from kappaflow.log.kafka.kafka_python.clients import is_too_large, is_unknown_topic
from kappaflow.log.kafka.kafka_python.topics import KafkaTopics

__all__ = ["KafkaAppend"]


class KafkaAppend(KafkaTopics):
    """Append records: every check before anything is sent, then flush and wait for every ack."""

    def append(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> list[Appended]:
        self._require_writer(f"appending to topic {topic!r}")
        config = self._topic(topic)
        n = len(records)
        if n == 0:
            return []
        keys, values = checked_append(topic, config, records, partition)
        parts = partitions_of(keys, config.partitions, partition)
        producer = self._producer_client()
        send = producer.send
        futures: list[Any] = []
        add = futures.append
        try:
            for i, rec in enumerate(records):
                headers = rec.headers
                add(send(topic, value=values[i], key=keys[i], headers=list(headers) if headers else None,
                         partition=parts[i], timestamp_ms=rec.timestamp_ms))
        except (TypeError, ValueError) as exc:
            producer.flush(self._timeout_s)
            raise ValidationError(
                f"topic {topic!r} record {len(futures)}: {exc}; {len(futures)} earlier records of this append "
                "were sent") from None
        except kerr.KafkaError as exc:
            raise self._append_failure(topic, exc, len(futures), n) from None
        try:
            producer.flush(self._timeout_s)
        except kerr.KafkaError as exc:
            raise self._append_failure(topic, exc, 0, n) from None
        out: list[Appended] = []
        push = out.append
        for i, f in enumerate(futures):
            if not f.succeeded():
                error = f.exception if f.is_done else kerr.KafkaTimeoutError("record not acknowledged in time")
                ok = sum(map(bool, (g.succeeded() for g in futures)))
                if is_too_large(error):
                    raise RecordTooLargeError(
                        f"topic {topic!r} record {i} (key {describe_key(keys[i])}): the broker rejected it as too "
                        f"large for max.message.bytes ({error}); {ok} of {n} records of this append were "
                        "acknowledged") from None
                raise self._append_failure(topic, error, ok, n) from None
            md = f.value
            push(Appended(md.partition, md.offset))
        return out

    def _append_failure(self, topic: str, exc: BaseException, acknowledged: int, total: int) -> LogError:
        err = self._fail(exc, f"appending to topic {topic!r} ({acknowledged} of {total} records acknowledged)",
                         topic=topic)
        if isinstance(err, LogUnavailableError) or not is_unknown_topic(exc):
            # A timeout on a topic deleted meanwhile looks like an unreachable broker: tell them apart.
            try:
                if topic not in self._describe([topic]):
                    with self._lock:
                        self._topics.pop(topic, None)
                    return UnknownTopicError(topic)
            except LogError:
                pass
        return err
