"""Topics on the broker through librdkafka's admin client: describe, create, delete.

Topic configs are fixed at creation, so `TopicCache` keeps each one for the life of the log
object (like the kafka-python client); deleting drops it. Metadata requests never allow auto
topic creation (`allow.auto.create.topics=false` on every client): a topic deleted while a
client still tracks it must stay deleted.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from kappaflow.errors import LogError, LogUnavailableError
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
from kappaflow.log.kafka.confluent.clients import error_of, map_error

__all__ = ["TopicAdmin"]

_REJECTED_CONFIG = {KafkaError.INVALID_REPLICATION_FACTOR, KafkaError.INVALID_CONFIG, KafkaError.POLICY_VIOLATION,
                    KafkaError.INVALID_PARTITIONS, KafkaError.TOPIC_EXCEPTION}


class TopicAdmin:
    """Topic operations of one log on one admin client (`admin()` connects it on first use)."""

    def __init__(self, admin: Any, *, bootstrap: str, timeout_s: float, replication_factor: int) -> None:
        self._admin_factory = admin
        self._bootstrap = bootstrap
        self._timeout_s = timeout_s
        self._replication_factor = replication_factor
        self._lock = threading.Lock()
        self._cache: dict[str, TopicConfig] = {}

    def _client(self) -> AdminClient:
        client: AdminClient = self._admin_factory()
        return client

    def fail(self, exc: BaseException, what: str, topic: str | None = None) -> LogError:
        err = error_of(exc)
        if topic is not None and err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            self.forget(topic)
        return map_error(err, bootstrap=self._bootstrap, what=what, topic=topic)

    def forget(self, topic: str) -> None:
        with self._lock:
            self._cache.pop(topic, None)

    # --- describe ------------------------------------------------------------------------------
    def describe(self, names: list[str] | None) -> dict[str, TopicConfig]:
        """Configs of existing topics among `names` (all user topics for None), from the broker."""
        admin = self._client()
        try:
            # One name: ask for it alone (never auto-created: see the module docstring).
            one = names[0] if names is not None and len(names) == 1 else None
            metadata = admin.list_topics(topic=one, timeout=self._timeout_s)
            found = {
                name: len(t.partitions) for name, t in metadata.topics.items()
                if t.error is None and t.partitions
                and (name in names if names is not None else not name.startswith("__"))  # listed: internal hidden
            }
            described: dict[str, dict[str, Any]] = {}
            if found:
                futures = admin.describe_configs([ConfigResource("topic", name) for name in found],
                                                 request_timeout=self._timeout_s)
                for resource, future in futures.items():
                    try:
                        described[resource.name] = future.result()
                    except KafkaException as exc:
                        if error_of(exc).code() not in (KafkaError.UNKNOWN_TOPIC_OR_PART,):
                            raise
                        found.pop(resource.name, None)  # deleted meanwhile
        except KafkaException as exc:
            raise self.fail(exc, "describing topics") from None
        out = {}
        for name, parts in sorted(found.items()):
            entries = described.get(name, {})
            out[name] = topic_config_from(name, parts, lambda key, e=entries: _entry_value(e, key))  # type: ignore[misc]
        return out

    def config(self, name: str) -> TopicConfig:
        """The topic's config, cached for the life of this object (topic configs are fixed)."""
        return cached_topic(self._cache, self._lock, name, self.describe)

    def list(self) -> dict[str, TopicConfig]:
        topics = self.describe(None)
        with self._lock:
            self._cache.update(topics)
        return topics

    # --- create / delete -----------------------------------------------------------------------
    def create(self, name: str, config: TopicConfig | None, *, exist_ok: bool) -> TopicConfig:
        check_new_topic(name, config)
        existing = self.describe([name]).get(name)
        if existing is None:
            wanted = config or TopicConfig()
            topic = NewTopic(name, num_partitions=wanted.partitions, replication_factor=self._replication_factor,
                             config=creation_configs(wanted))
            try:
                future = self._client().create_topics([topic], operation_timeout=self._timeout_s,
                                                      request_timeout=self._timeout_s)[name]
                future.result()
            except KafkaException as exc:
                err = error_of(exc)
                if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    existing = self.describe([name]).get(name)  # created concurrently: compare below
                    if existing is None:
                        raise topic_undescribed(name) from None
                elif err.code() in _REJECTED_CONFIG:
                    raise topic_rejected(name, wanted, self._replication_factor, err.str()) from None
                else:
                    raise self.fail(exc, f"creating topic {name!r}") from None
            else:
                self._wait_listed(name)
                return keep_topic(self._cache, self._lock, name, wanted)
        return keep_topic(self._cache, self._lock, name, existing_topic(name, config, existing, exist_ok=exist_ok))

    def _wait_listed(self, name: str) -> None:
        """Creation is asynchronous on Kafka: wait (bounded) until metadata shows the topic's partitions."""
        deadline = time.monotonic() + self._timeout_s
        while name not in self.describe([name]):
            if time.monotonic() > deadline:
                raise LogUnavailableError(f"topic {name!r} not listed {self._timeout_s:.0f}s after its creation")
            time.sleep(0.02)

    def delete(self, name: str) -> None:
        validate_topic_name(name)
        try:
            self._client().delete_topics([name], operation_timeout=self._timeout_s,
                                         request_timeout=self._timeout_s)[name].result()
        except KafkaException as exc:
            raise self.fail(exc, f"deleting topic {name!r}", topic=name) from None
        self.forget(name)
        wait_deleted(name, self.describe, self._timeout_s)

    def check_gone(self, name: str) -> bool:
        """True when the broker no longer has `name` (a failure on a deleted topic looks like a timeout)."""
        try:
            if name not in self.describe([name]):
                self.forget(name)
                return True
        except LogError:
            pass
        return False

    def unavailable(self, what: str) -> LogUnavailableError:
        return LogUnavailableError(f"{what}: no answer from the Kafka broker at {self._bootstrap} "
                                   f"within {self._timeout_s:.0f}s")


def _entry_value(entries: dict[str, Any], key: str) -> str | None:
    entry = entries.get(key)
    return None if entry is None else entry.value
