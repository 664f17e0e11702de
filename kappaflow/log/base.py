"""The log contract: partitioned, compacted topics shared by every backend.

Offsets are per partition, start at 0, are assigned in append order and never
change (compaction leaves gaps). Resume state is always "the next offset to read".
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Self

from kappaflow.errors import ConfigError, ValidationError

Headers = tuple[tuple[str, bytes], ...]

DEFAULT_MAX_RECORD_BYTES = 1_048_576  # Kafka's default max.message.bytes (1 MiB)


_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


# --- argument checks every backend applies, so both refuse the same input the same way ------
def validate_topic_name(name: object) -> str:
    """Kafka's rules (legal characters, length), so topics move between backends unchanged."""
    if not isinstance(name, str) or not _TOPIC_NAME.fullmatch(name) or name in {".", ".."}:
        raise ConfigError(
            f"topic name: expected 1-249 characters of [a-zA-Z0-9._-] (not '.' or '..'), got {name!r}"
        )
    return name


def check_partition(topic: str, partition: object, partitions: int) -> int:
    if type(partition) is not int or not 0 <= partition < partitions:
        raise ValidationError(f"topic {topic!r} partition: expected an integer in [0, {partitions}), got {partition!r}")
    return partition


def check_read_args(topic: str, partition: int, offset: object, max_records: object) -> None:
    if type(offset) is not int or offset < 0:
        raise ValidationError(f"topic {topic!r} partition {partition} offset: expected an int >= 0, got {offset!r}")
    if type(max_records) is not int or max_records < 1:
        raise ValidationError(f"read max_records: expected an int >= 1, got {max_records!r}")


def check_group(group: object) -> str:
    if not isinstance(group, str) or not group:
        raise ValidationError(f"consumer group: expected a non-empty string, got {group!r}")
    return group


def split_commit_key(tp: object) -> tuple[Any, Any]:
    """(topic, partition) of a `commit` offsets key (partition checked by the caller)."""
    pair: Any = tp
    try:
        topic, partition = pair
    except (TypeError, ValueError):
        raise ValidationError(f"commit offsets key: expected (topic, partition), got {tp!r}") from None
    return topic, partition


def check_commit_offset(topic: str, partition: int, offset: object) -> int:
    if type(offset) is not int or offset < 0:
        raise ValidationError(
            f"commit offset for topic {topic!r} partition {partition}: expected an int >= 0, got {offset!r}")
    return offset


class CleanupPolicy(str, Enum):
    DELETE = "delete"
    COMPACT = "compact"


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """Fixed at creation, like a Kafka topic's partition count and configs."""

    partitions: int = 1
    cleanup_policy: CleanupPolicy = CleanupPolicy.DELETE
    # How long a tombstone stays readable after compaction sees it (Kafka's delete.retention.ms).
    delete_retention_ms: int = 86_400_000
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    # Kafka's retention.ms / retention.bytes of a delete-policy topic: None leaves the broker's
    # default (7 days / unlimited on Apache Kafka), -1 keeps every record for ever. The embedded log
    # never deletes by age or size, so it keeps None. Not compared: a topic's retention is an
    # operator's setting (kafka-configs.sh changes it in place), not part of its identity, and a
    # broker reports its default as a number; callers that need a retention check it themselves.
    retention_ms: int | None = field(default=None, compare=False)
    retention_bytes: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.partitions, int) or self.partitions < 1:
            raise ConfigError(f"topic config 'partitions': expected an integer >= 1, got {self.partitions!r}")
        if not isinstance(self.cleanup_policy, CleanupPolicy):
            try:
                object.__setattr__(self, "cleanup_policy", CleanupPolicy(self.cleanup_policy))
            except ValueError:
                raise ConfigError(
                    f"topic config 'cleanup.policy': expected 'delete' or 'compact', got {self.cleanup_policy!r}"
                ) from None
        if not isinstance(self.delete_retention_ms, int) or self.delete_retention_ms < 0:
            raise ConfigError(
                f"topic config 'delete.retention.ms': expected an integer >= 0, got {self.delete_retention_ms!r}"
            )
        if not isinstance(self.max_record_bytes, int) or self.max_record_bytes < 1:
            raise ConfigError(
                f"topic config 'max.message.bytes': expected an integer >= 1, got {self.max_record_bytes!r}"
            )
        for key, value in (("retention.ms", self.retention_ms), ("retention.bytes", self.retention_bytes)):
            if value is not None and (type(value) is not int or value < -1):
                raise ConfigError(f"topic config {key!r}: expected None, -1 (no limit) or an integer >= 0, "
                                  f"got {value!r}")

    @property
    def compacted(self) -> bool:
        return self.cleanup_policy is CleanupPolicy.COMPACT

    @property
    def keeps_everything(self) -> bool:
        """Every record stays for ever: delete policy and no known age or size limit (-1, or None:
        the backend's default, which is "for ever" only on the embedded log -- a Kafka log reports
        its broker's numbers)."""
        return (not self.compacted and self.retention_ms in (None, -1)
                and self.retention_bytes in (None, -1))


@dataclass(frozen=True, slots=True)
class Record:
    """A record to append. `value=None` is a tombstone."""

    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    timestamp_ms: int | None = None  # None: the log stamps the append time

    def __post_init__(self) -> None:
        if self.key is not None and not isinstance(self.key, bytes):
            raise ValidationError(f"record key: expected bytes or None, got {type(self.key).__name__}")
        if self.value is not None and not isinstance(self.value, bytes):
            raise ValidationError(f"record value: expected bytes or None, got {type(self.value).__name__}")


@dataclass(frozen=True, slots=True)
class LogRecord:
    """A record read back from the log, with its position."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    timestamp_ms: int = 0


@dataclass(frozen=True, slots=True)
class Appended:
    """Where one appended record landed."""

    partition: int
    offset: int


@dataclass(slots=True)
class CompactionStats:
    """What one compaction did; the byte sizes are set by backends that own the files (embedded)."""

    topic: str
    removed: int = 0
    kept: int = 0
    tombstones_removed: int = 0
    per_partition: dict[int, int] = field(default_factory=dict)
    bytes_before: int | None = None  # the topic's files on disk before compaction
    bytes_after: int | None = None  # ... and after it gave the freed space back
    full_vacuum: bool = False  # the file was rewritten whole (see kappaflow.log.embedded.space)

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "removed": self.removed, "kept": self.kept,
                "tombstones_removed": self.tombstones_removed,
                "per_partition": {str(p): n for p, n in self.per_partition.items()},
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "full_vacuum": self.full_vacuum}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CompactionStats:
        return cls(d["topic"], d["removed"], d["kept"], d["tombstones_removed"],
                   {int(p): n for p, n in d.get("per_partition", {}).items()}, d.get("bytes_before"),
                   d.get("bytes_after"), bool(d.get("full_vacuum")))


TopicPartition = tuple[str, int]


class Log(abc.ABC):
    """One contract for every log backend (embedded SQLite, Kafka).

    Implementations must be safe for one writer and many readers, possibly in
    other processes; a process killed mid-append leaves either all or none of
    that append visible per partition, and never a record twice.
    """

    # --- topics -------------------------------------------------------------
    @abc.abstractmethod
    def create_topic(self, name: str, config: TopicConfig | None = None, *, exist_ok: bool = True) -> TopicConfig:
        """Create a topic; with exist_ok, return the existing config (which must not conflict)."""

    @abc.abstractmethod
    def delete_topic(self, name: str) -> None:
        """Delete a topic and its data; UnknownTopicError if missing."""

    @abc.abstractmethod
    def list_topics(self) -> dict[str, TopicConfig]:
        """All topics with their configs."""

    def topic_config(self, name: str) -> TopicConfig:
        from kappaflow.errors import UnknownTopicError

        topics = self.list_topics()
        if name not in topics:
            raise UnknownTopicError(name)
        return topics[name]

    def partitions(self, topic: str) -> int:
        return self.topic_config(topic).partitions

    # --- write --------------------------------------------------------------
    @abc.abstractmethod
    def append(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> list[Appended]:
        """Append records durably; returns each record's partition and offset, in input order.

        Partition = murmur2(key) mod partitions (Kafka's default partitioner) unless
        `partition` is given; keyless records go to partition 0. When this returns, every
        record is durable (fsync'd / acknowledged by all in-sync replicas).
        """

    def append_quiet(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> None:
        """`append` for callers that need only "durable when this returns", not the offsets.

        Backends override it when skipping the per-record results saves work (the embedded
        log: building one result per record is a sizeable part of an append's CPU).
        """
        self.append(topic, records, partition=partition)

    def append_ends(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> dict[int, int]:
        """`append`, returning the end offset (next offset) of each partition it wrote to.

        The capture writer records these as the source's consistent cut (``connectors/cuts.py``);
        the caller must be the topic's only writer. Backends that keep their end offsets at hand
        override it (the embedded log returns every partition's end, no per-record results).
        """
        out: dict[int, int] = {}
        for a in self.append(topic, records, partition=partition):
            if a.offset >= out.get(a.partition, 0):
                out[a.partition] = a.offset + 1
        return out

    # --- read ---------------------------------------------------------------
    @abc.abstractmethod
    def read(self, topic: str, partition: int, offset: int, max_records: int = 10_000) -> list[LogRecord]:
        """Records with offset >= `offset`, in offset order, at most max_records; [] at the end."""

    def iter_partition(self, topic: str, partition: int, start: int = 0, end: int | None = None,
                       batch: int = 10_000) -> Iterator[LogRecord]:
        """Every record from `start` up to (excluding) `end` (default: the end offset now)."""
        stop = self.end_offset(topic, partition) if end is None else end
        offset = start
        while offset < stop:
            chunk = self.read(topic, partition, offset, min(batch, stop - offset))
            if not chunk:
                break
            for rec in chunk:
                if rec.offset >= stop:
                    return
                yield rec
            offset = chunk[-1].offset + 1

    @abc.abstractmethod
    def end_offset(self, topic: str, partition: int) -> int:
        """The offset the next appended record will get (one past the last record)."""

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self.end_offset(topic, p) for p in range(self.partitions(topic))}

    # --- consumer groups ----------------------------------------------------
    @abc.abstractmethod
    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        """Store the next offset to read per (topic, partition) for `group`, atomically."""

    @abc.abstractmethod
    def committed(self, group: str, topic: str) -> dict[int, int]:
        """Committed next-offsets per partition of `topic` for `group` ({} if none)."""

    # --- maintenance --------------------------------------------------------
    @abc.abstractmethod
    def compact(self, topic: str, *, now_ms: int | None = None) -> CompactionStats:
        """Keep the latest record per key; drop tombstones older than delete.retention.ms.

        Offsets of kept records never change. A no-op for delete-policy topics.
        """

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release connections and files."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
