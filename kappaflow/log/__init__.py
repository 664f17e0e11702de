"""The partitioned, compacted log: one contract, an embedded and a Kafka backend (two Kafka clients)."""

import importlib
import importlib.util
from dataclasses import dataclass
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
    "KAFKA_CLIENTS",
    "Appended",
    "CleanupPolicy",
    "CompactionStats",
    "Headers",
    "KafkaClient",
    "Log",
    "LogRecord",
    "Record",
    "TopicConfig",
    "TopicPartition",
    "kafka_client",
    "murmur2",
    "open_log",
    "partition_for",
]


@dataclass(frozen=True)
class KafkaClient:
    """One Kafka client implementation of the log contract, imported only when chosen."""

    name: str
    module: str
    cls: str
    requirement: str  # what to install when it is missing
    import_name: str  # the driver's top-level module

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.import_name) is not None

    def load(self) -> Any:
        """The client's log class (a `Log` subclass taking the bootstrap and the Kafka log options)."""
        if not self.installed:
            from kappaflow.errors import ConfigError

            raise ConfigError(f"log.kafka.client = {self.name!r} needs {self.requirement}; install it "
                              f"(pip install {self.requirement!r}) or choose another client")
        return getattr(importlib.import_module(self.module), self.cls)


#: The registry of Kafka clients, in order of preference: the first installed one is the default.
KAFKA_CLIENTS: dict[str, KafkaClient] = {
    c.name: c for c in (
        KafkaClient("confluent", "kappaflow.log.kafka.confluent", "ConfluentKafkaLog", "kappaflow[kafka]",
                    "confluent_kafka"),
        KafkaClient("kafka-python", "kappaflow.log.kafka.kafka_python", "KafkaLog", "kafka-python", "kafka"),
    )
}


def kafka_client(name: str | None = None) -> KafkaClient:
    """The Kafka client called `name`; None or "auto": the first installed one (confluent, then kafka-python)."""
    from kappaflow.errors import ConfigError

    if name is None or name == "auto":
        for client in KAFKA_CLIENTS.values():
            if client.installed:
                return client
        raise ConfigError("no Kafka client is installed: pip install 'kappaflow[kafka]' (or kafka-python)")
    client = KAFKA_CLIENTS.get(name)  # type: ignore[assignment]
    if client is None:
        raise ConfigError(f"log.kafka.client: expected one of {', '.join(KAFKA_CLIENTS)} or 'auto', got {name!r}")
    return client


def open_log(url: str, *, client: str | None = None, **options: Any) -> Log:
    """Open a log by URL: a path or `file:PATH` (embedded) or `kafka://host:port[,host:port]`.

    For Kafka, `client` picks the implementation ("confluent", "kafka-python"; default: the first
    installed, see `kafka_client`); the other options go to its constructor.
    """
    from kappaflow.errors import ConfigError

    if url.startswith("kafka://"):
        log: Log = kafka_client(client).load()(url.removeprefix("kafka://"), **options)
        return log
    if client is not None:
        raise ConfigError(f"log url {url!r}: 'client' applies to kafka:// logs only")
    if "://" in url:
        raise ConfigError(f"log url: expected a directory path or kafka://HOST:PORT, got scheme in {url!r}")
    from kappaflow.log.embedded import EmbeddedLog

    return EmbeddedLog(url.removeprefix("file:"), **options)
