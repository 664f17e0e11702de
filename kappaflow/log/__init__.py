"""The partitioned, compacted log: one contract, an embedded and a Kafka backend."""

from typing import Any

from kappaflow.log.base import (
    Appended,
    CleanupPolicy,
    CompactionStats,
    Headers,
    Log,
    LogRecord,
    Record,
    TopicConfig,
    TopicPartition,
)
from kappaflow.log.partitioner import murmur2, partition_for

__all__ = [
    "Appended",
    "CleanupPolicy",
    "CompactionStats",
    "Headers",
    "Log",
    "LogRecord",
    "Record",
    "TopicConfig",
    "TopicPartition",
    "murmur2",
    "open_log",
    "partition_for",
]


def open_log(url: str, **options: Any) -> Log:
    """Open a log by URL: a path or `file:PATH` (embedded) or `kafka://host:port[,host:port]`."""
    from kappaflow.errors import ConfigError

    if url.startswith("kafka://"):
        from kappaflow.log.kafka import KafkaLog

        return KafkaLog(url.removeprefix("kafka://"), **options)
    if "://" in url:
        raise ConfigError(f"log url: expected a directory path or kafka://HOST:PORT, got scheme in {url!r}")
    from kappaflow.log.embedded import EmbeddedLog

    return EmbeddedLog(url.removeprefix("file:"), **options)
