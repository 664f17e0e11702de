"""Topics of the kafka-python log: describe (cached configs), create, delete, list."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kafka import errors as kerr
from kafka.admin import ConfigResource, ConfigResourceType

from kappaflow.log.base import TopicConfig, validate_topic_name
from kappaflow.log.kafka.common import (
    cached_topic,
    check_new_topic,
    creation_configs,
    existing_topic,
    keep_topic,
    topic_config_from,
    topic_rejected,
    topic_undescribed,
    wait_deleted,
)
from kappaflow.log.kafka.kafka_python.connection import KafkaConnection

__all__ = ["KafkaTopics"]


class KafkaTopics(KafkaConnection):
    """Create, delete and describe topics on the admin client (configs cached for the log's life)."""

    def _describe(self, names: list[str] | None) -> dict[str, TopicConfig]:
        """Configs of existing topics among `names` (all user topics for None), from the broker."""
        admin = self._admin_client()
        try:
            metadata = admin.describe_topics(names)
            found = {
                t["name"]: len(t["partitions"])
                for t in metadata
                if t.get("error_code", 0) == 0 and not t.get("is_internal")
                and (names is not None or not t["name"].startswith("__"))  # listed: internal ones hidden
                and t["partitions"]
            }
            described: dict[str, Any] = {}
            if found:
                # config_filter "all": brokers (tansu) may report explicitly set values as defaults.
                resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in found]
                described = admin.describe_configs(resources, config_filter="all").get("topic", {})
        except kerr.KafkaError as exc:
            raise self._fail(exc, "describing topics") from None
        return {name: topic_config_from(name, parts, _value_reader(described.get(name, {})))
                for name, parts in sorted(found.items())}

    def _topic(self, name: str) -> TopicConfig:
        """The topic's config, cached for the life of this object (topic configs are fixed)."""
        return cached_topic(self._topics, self._lock, name, self._describe)

    def create_topic(self, name: str, config: TopicConfig | None = None, *, exist_ok: bool = True) -> TopicConfig:
        self._require_writer(f"creating topic {name!r}")
        check_new_topic(name, config)
        existing = self._describe([name]).get(name)
        if existing is None:
            wanted = config or TopicConfig()
            spec = {
                "num_partitions": wanted.partitions,
                "replication_factor": self._replication_factor,
                "configs": creation_configs(wanted),
            }
            admin = self._admin_client()
            try:
                admin.create_topics({name: spec}, timeout_ms=int(self._timeout_s * 1000))
                admin.wait_for_topics([name], timeout_ms=int(self._timeout_s * 1000))
            except kerr.TopicAlreadyExistsError:
                existing = self._describe([name]).get(name)  # created concurrently: compare below
                if existing is None:
                    raise topic_undescribed(name) from None
            except (kerr.InvalidReplicationFactorError, kerr.InvalidConfigurationError,
                    kerr.PolicyViolationError, kerr.InvalidPartitionsError, kerr.InvalidTopicError) as exc:
                raise topic_rejected(name, wanted, self._replication_factor, exc) from None
            except kerr.KafkaError as exc:
                raise self._fail(exc, f"creating topic {name!r}") from None
            else:
                return keep_topic(self._topics, self._lock, name, wanted)
        return keep_topic(self._topics, self._lock, name, existing_topic(name, config, existing, exist_ok=exist_ok))

    def delete_topic(self, name: str) -> None:
        self._require_writer(f"deleting topic {name!r}")
        validate_topic_name(name)
        # Detach our consumers first: a consumer still assigned to the topic keeps asking the
        # broker about it, and tansu (like Kafka with auto.create.topics.enable) recreates it.
        with self._read_lock:
            if self._reader is not None and any(tp.topic == name for tp in self._reader.assignment()):
                self._reader.unsubscribe()
                self._reader_tp = None
                self._reader_next = -1
        with self._probe_lock:
            if self._probe is not None and any(tp.topic == name for tp in self._probe.assignment()):
                self._probe.unsubscribe()
        admin = self._admin_client()
        try:
            admin.delete_topics([name], timeout_ms=int(self._timeout_s * 1000))
        except kerr.KafkaError as exc:
            raise self._fail(exc, f"deleting topic {name!r}", topic=name) from None
        with self._lock:
            self._topics.pop(name, None)
            for tp in [tp for tp in self._highwater if tp.topic == name]:
                del self._highwater[tp]
        wait_deleted(name, self._describe, self._timeout_s)

    def list_topics(self) -> dict[str, TopicConfig]:
        topics = self._describe(None)
        with self._lock:
            self._topics.update(topics)
        return topics

    def topic_config(self, name: str) -> TopicConfig:
        return self._topic(name)

    def partitions(self, topic: str) -> int:
        return self._topic(topic).partitions


def _value_reader(entries: Mapping[str, Any]) -> Any:
    """`value(key)` over kafka-python's DescribeConfigs entries ({name: {"value": ...}})."""
    def value(key: str) -> str | None:
        entry = entries.get(key)
        return None if entry is None else entry.get("value")
    return value
