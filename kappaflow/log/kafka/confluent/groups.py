"""Consumer group offsets through librdkafka's admin client, without joining the group.

OffsetCommit / OffsetFetch go to the group coordinator like Java's
`AdminClient.alterConsumerGroupOffsets` / `listConsumerGroupOffsets`: kappaflow stores positions
for a group without being one of its members. Kafka accepts commits from outside only while the
group has no active members; otherwise the error says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kappaflow.errors import LogError, UnknownTopicError
from kappaflow.log.kafka.confluent.clients import error_of
from kappaflow.log.kafka.confluent.topics import TopicAdmin

__all__ = ["GroupOffsets"]

_ACTIVE = {KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION}


class GroupOffsets:
    def __init__(self, admin: Callable[[], AdminClient], *, timeout_s: float, topics: TopicAdmin) -> None:
        self._admin = admin
        self._timeout_s = timeout_s
        self._topics = topics

    def commit(self, group: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Store the next offset to read per (topic, partition) (all in one OffsetCommit request)."""
        tps = [TopicPartition(topic, partition, nxt) for (topic, partition), nxt in offsets.items()]
        what = f"committing offsets of group {group!r}"
        try:
            future = self._admin().alter_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group, tps)], request_timeout=self._timeout_s)[group]
            result = future.result()
        except KafkaException as exc:
            raise self._failure(exc, what, tps) from None
        failed = [tp for tp in result.topic_partitions if tp.error is not None]
        if failed:
            tp = failed[0]
            raise self._failure(KafkaException(tp.error), f"{what} ({len(failed)} partitions failed)", [tp])

    def _failure(self, exc: BaseException, what: str, tps: list[TopicPartition]) -> LogError:
        err = error_of(exc)
        if err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC) and tps:
            return UnknownTopicError(tps[0].topic)
        if err.code() in _ACTIVE:
            return LogError(f"{what}: the group has active members ({err.name()}); "
                            "Kafka accepts commits from outside only for an empty group")
        return self._topics.fail(exc, what)

    def committed(self, group: str, topic: str, partitions: int) -> dict[int, int]:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        what = f"fetching committed offsets of group {group!r}"
        try:
            future = self._admin().list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group, tps)], request_timeout=self._timeout_s)[group]
            result = future.result()
        except KafkaException as exc:
            raise self._failure(exc, what, tps) from None
        out = {}
        for tp in result.topic_partitions:
            if tp.error is not None:
                raise self._failure(KafkaException(tp.error), what, [tp])
            if tp.topic == topic and tp.offset is not None and tp.offset >= 0:
                out[tp.partition] = int(tp.offset)
        return dict(sorted(out.items()))
