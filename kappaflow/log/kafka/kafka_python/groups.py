"""Consumer group offsets of the kafka-python log, committed without joining the group."""

from __future__ import annotations

from collections.abc import Mapping

from kafka import TopicPartition
from kafka import errors as kerr
from kafka.structs import OffsetAndMetadata

from kappaflow.errors import LogError, UnknownTopicError
from kappaflow.log.base import TopicPartition as TP
from kappaflow.log.base import check_commit_offset, check_group, check_partition, split_commit_key
from kappaflow.log.kafka.kafka_python.clients import map_error
from kappaflow.log.kafka.kafka_python.topics import KafkaTopics

__all__ = ["KafkaGroups"]


class KafkaGroups(KafkaTopics):
    """Commit and read a group's offsets through the admin client and a group-less consumer."""

    def commit(self, group: str, offsets: Mapping[TP, int]) -> None:
        check_group(group)
        request: dict[TopicPartition, OffsetAndMetadata] = {}
        for tp, nxt in offsets.items():
            topic, partition = split_commit_key(tp)
            check_partition(topic, partition, self._topic(topic).partitions)
            check_commit_offset(topic, partition, nxt)
            request[TopicPartition(topic, partition)] = OffsetAndMetadata(nxt, "", -1)
        if not request:
            return
        try:
            result = self._admin_client().alter_group_offsets(group, request)
        except kerr.KafkaError as exc:
            raise self._fail(exc, f"committing offsets of group {group!r}") from None
        failed = {tp: err for tp, err in result.items() if err is not kerr.NoError}
        if failed:
            tp, err = next(iter(failed.items()))
            if issubclass(err, kerr.UnknownTopicOrPartitionError):
                raise UnknownTopicError(tp.topic)
            if issubclass(err, kerr.UnknownMemberIdError | kerr.RebalanceInProgressError | kerr.IllegalGenerationError):
                raise LogError(
                    f"committing offsets of group {group!r}: the group has active members ({err.__name__}); "
                    "Kafka accepts commits from outside only for an empty group"
                )
            raise map_error(err(), bootstrap=self._bootstrap,
                            what=f"committing offsets of group {group!r} ({len(failed)} partitions failed)")

    def committed(self, group: str, topic: str) -> dict[int, int]:
        check_group(group)
        config = self._topic(topic)
        tps = [TopicPartition(topic, p) for p in range(config.partitions)]
        try:
            result = self._admin_client().list_group_offsets({group: tps}).get(group, {})
        except kerr.KafkaError as exc:
            raise self._fail(exc, f"fetching committed offsets of group {group!r}", topic=topic) from None
        return {tp.partition: int(om.offset) for tp, om in sorted(result.items())
                if tp.topic == topic and om.offset is not None and om.offset >= 0}
