"""What both Kafka clients of the log share: option checks, security settings, topic configs and
the checks an append passes before anything is sent.

kappaflow talks to Kafka with either kafka-python (`kappaflow.log.kafka.KafkaLog`) or librdkafka
through confluent-kafka (`kappaflow.log.kafka.confluent.ConfluentKafkaLog`). The rules that make a
topic, a record or a partition mean the same on both live here once, so the two clients refuse
the same input with the same message and put every record in the same partition.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

from kafka.record.default_records import DefaultRecordBatchBuilder

from kappaflow.errors import (
    ConfigError,
    LogError,
    LogUnavailableError,
    RecordTooLargeError,
    UnknownTopicError,
    ValidationError,
)
from kappaflow.log.base import CleanupPolicy, Record, TopicConfig, check_partition, validate_topic_name
from kappaflow.log.partitioner import partitions_for

__all__ = [
    "BATCH_FRAMING",
    "KafkaOptions",
    "KafkaSecurity",
    "cached_topic",
    "check_new_topic",
    "check_number",
    "checked_append",
    "creation_configs",
    "describe_key",
    "existing_topic",
    "keep_topic",
    "parse_bootstrap",
    "partitions_of",
    "topic_config_from",
    "topic_rejected",
    "topic_undescribed",
    "wait_deleted",
]

# Upper bound of the v2 framing of a batch holding one record without headers: the 61-byte
# batch header, at most 21 bytes of record fields, and the key length, value length and
# header count varints (at most 5 bytes each). max.message.bytes = max_record_bytes + this.
BATCH_FRAMING = DefaultRecordBatchBuilder.HEADER_STRUCT.size + DefaultRecordBatchBuilder.MAX_RECORD_OVERHEAD + 15
_exact_batch_size = DefaultRecordBatchBuilder.estimate_size_in_bytes
_key_of = attrgetter("key")
_value_of = attrgetter("value")
_headers_of = attrgetter("headers")

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
COMPRESSIONS = (None, "gzip", "snappy", "lz4", "zstd")
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def check_number(name: str, value: object, *, minimum: float = 0, integer: bool = False) -> Any:
    """A Kafka log option that must be a number >= `minimum`; ConfigError naming it otherwise."""
    ok_type = (type(value) is int) if integer else isinstance(value, int | float) and not isinstance(value, bool)
    if not ok_type or value < minimum:  # type: ignore[operator]
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"kafka log {name!r}: expected {kind} >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """How a client authenticates and encrypts: one description, mapped by each client to its names.

    Why a type of its own: `[log.kafka]` (and a Debezium source's cluster) is configured once, and
    kafka-python (`security_protocol`, `sasl_plain_username`, `ssl_cafile`) and librdkafka
    (`security.protocol`, `sasl.username`, `ssl.ca.location`) spell the same settings differently.
    The password never shows in `repr`.
    """

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"kafka security 'security_protocol': expected one of {', '.join(PROTOCOLS)}, "
                              f"got {self.protocol!r}")
        if self.sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise ConfigError(f"kafka security 'sasl_mechanism': {self.protocol} needs one of "
                                  f"{', '.join(MECHANISMS)}, got {self.sasl_mechanism!r}")
            if not self.sasl_username or self.sasl_password is None:
                raise ConfigError(f"kafka security: {self.protocol} needs sasl_username and sasl_password")
        for name in ("sasl_username", "ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"kafka security {name!r}: expected a string, got {type(value).__name__}")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    @classmethod
    def of(cls, value: KafkaSecurity | Mapping[str, Any] | None) -> KafkaSecurity:
        """From a KafkaSecurity, a mapping of its fields (also `security_protocol` for `protocol`), or None."""
        if value is None:
            return cls()
        if isinstance(value, KafkaSecurity):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"kafka log 'security': expected a KafkaSecurity or a table, got {type(value).__name__}")
        fields = dict(value)
        if "security_protocol" in fields:
            fields["protocol"] = fields.pop("security_protocol")
        try:
            return cls(**fields)
        except TypeError:
            known = ", ".join(f for f in cls.__dataclass_fields__)
            unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
            raise ConfigError(f"kafka log 'security': unknown setting(s) {unknown} (known: {known})") from None

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from PLAINTEXT defaults (the password included: never log it)."""
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "protocol" and v == "PLAINTEXT")}


def parse_bootstrap(bootstrap: object) -> str:
    """Validate `host:port[,host:port...]`; returns it normalised (no spaces)."""
    if not isinstance(bootstrap, str) or not bootstrap.strip():
        raise ConfigError(f"kafka log 'bootstrap': expected 'host:port[,host:port]', got {bootstrap!r}")
    parts = [p.strip() for p in bootstrap.split(",")]
    for p in parts:
        m = _HOST_PORT.match(p)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ConfigError(
                f"kafka log 'bootstrap': expected 'host:port[,host:port]' with a port in 1..65535, "
                f"got {p!r} in {bootstrap!r}"
            )
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class KafkaOptions:
    """The options both Kafka clients take, checked once (see `KafkaLog` for their meaning)."""

    bootstrap: str
    client_id: str
    linger_ms: int
    batch_bytes: int
    compression: str | None
    replication_factor: int
    timeout_s: float
    connect_attempts: int
    connect_backoff_s: float
    connect_timeout_s: float
    read_only: bool
    security: KafkaSecurity

    @classmethod
    def checked(cls, bootstrap: object, *, client_id: object, linger_ms: object, batch_bytes: object,
                compression: object, replication_factor: object, request_timeout_s: object,
                connect_attempts: object, connect_backoff_s: object, connect_timeout_s: object,
                read_only: object, security: object) -> KafkaOptions:
        if not isinstance(read_only, bool):
            raise ConfigError(f"kafka log 'read_only': expected true or false, got {read_only!r}")
        if not isinstance(client_id, str) or not client_id:
            raise ConfigError(f"kafka log 'client_id': expected a non-empty string, got {client_id!r}")
        if compression not in COMPRESSIONS:
            raise ConfigError(
                f"kafka log 'compression': expected None, 'gzip', 'snappy', 'lz4' or 'zstd', got {compression!r}"
            )
        if type(replication_factor) is not int or not (replication_factor == -1 or replication_factor >= 1):
            raise ConfigError(
                f"kafka log 'replication_factor': expected -1 (broker default) or an integer >= 1, "
                f"got {replication_factor!r}"
            )
        return cls(
            bootstrap=parse_bootstrap(bootstrap),
            client_id=client_id,
            linger_ms=check_number("linger_ms", linger_ms, integer=True),
            batch_bytes=check_number("batch_bytes", batch_bytes, minimum=1024, integer=True),
            compression=compression,
            replication_factor=replication_factor,
            timeout_s=float(check_number("request_timeout_s", request_timeout_s, minimum=0.1)),
            connect_attempts=check_number("connect_attempts", connect_attempts, minimum=1, integer=True),
            connect_backoff_s=float(check_number("connect_backoff_s", connect_backoff_s)),
            connect_timeout_s=float(check_number("connect_timeout_s", connect_timeout_s, minimum=0.1)),
            read_only=read_only,
            security=KafkaSecurity.of(security),  # type: ignore[arg-type]
        )


def topic_config_from(name: str, partitions: int, value: Callable[[str], str | None]) -> TopicConfig:
    """A TopicConfig from a broker's DescribeConfigs answer (`value(key)`: the entry's value or None)."""
    defaults = TopicConfig()
    policy_raw = value("cleanup.policy")
    # Kafka allows "compact,delete" (compaction plus retention): compaction is what matters here.
    policy = CleanupPolicy.COMPACT if policy_raw and "compact" in policy_raw else CleanupPolicy.DELETE
    numbers = {}
    for key, default in (("delete.retention.ms", defaults.delete_retention_ms),
                         ("max.message.bytes", defaults.max_record_bytes + BATCH_FRAMING)):
        raw = value(key)
        try:
            numbers[key] = default if raw is None else int(raw)
        except ValueError:
            raise ValidationError(
                f"topic {name!r} config {key!r}: the broker reported {raw!r}, expected an integer"
            ) from None
    retention: dict[str, int | None] = {}
    for key in ("retention.ms", "retention.bytes"):
        raw = value(key)
        try:
            retention[key] = None if raw is None else max(-1, int(raw))  # Kafka reads any negative as "no limit"
        except ValueError:
            raise ValidationError(
                f"topic {name!r} config {key!r}: the broker reported {raw!r}, expected an integer"
            ) from None
    return TopicConfig(partitions=partitions, cleanup_policy=policy,
                       delete_retention_ms=numbers["delete.retention.ms"],
                       max_record_bytes=max(1, numbers["max.message.bytes"] - BATCH_FRAMING),
                       retention_ms=retention["retention.ms"], retention_bytes=retention["retention.bytes"])


def creation_configs(config: TopicConfig) -> dict[str, str]:
    """The topic configs a new topic is created with (see `kafka_python.log` on max.message.bytes)."""
    configs = {
        "cleanup.policy": config.cleanup_policy.value,
        "delete.retention.ms": str(config.delete_retention_ms),
        "max.message.bytes": str(config.max_record_bytes + BATCH_FRAMING),
    }
    # set only when asked for: None leaves the broker's default (log.retention.hours, 7 days)
    if config.retention_ms is not None:
        configs["retention.ms"] = str(config.retention_ms)
    if config.retention_bytes is not None:
        configs["retention.bytes"] = str(config.retention_bytes)
    return configs


def describe_key(key: bytes | None, limit: int = 80) -> str:
    """A record key for an error message: text when it is printable UTF-8, else its bytes repr; cut."""
    if key is None:
        return "None"
    try:
        text = key.decode()
        shown = repr(text) if text.isprintable() else repr(key)
    except UnicodeDecodeError:
        shown = repr(key)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def checked_append(topic: str, config: TopicConfig, records: Sequence[Record],
                   partition: int | None) -> tuple[list[bytes | None], list[bytes | None]]:
    """Keys and values of an append after every check that must pass before anything is sent.

    Record types, keys on compacted topics, no empty records, the explicit partition, and every
    record's size (the payload rule of the embedded log, plus Kafka's exact batch size when it has
    headers): a rejected append writes nothing.
    """
    if not all(type(r) is Record for r in records):
        for i, r in enumerate(records):
            if not isinstance(r, Record):
                raise ValidationError(
                    f"topic {topic!r} record {i}: expected a kappaflow.log.Record, got {type(r).__name__}")
    keys = list(map(_key_of, records))
    values = list(map(_value_of, records))
    if config.compacted and None in keys:
        i = keys.index(None)
        raise ValidationError(
            f"topic {topic!r} record {i}: a compacted topic needs a key on every record, got key None")
    if None in keys:
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is None and v is None:
                raise ValidationError(
                    f"topic {topic!r} record {i}: a record needs a key or a value (Kafka has no empty record)")
    _check_sizes(topic, config, records, keys, values)
    if partition is not None:
        check_partition(topic, partition, config.partitions)
    return keys, values


def partitions_of(keys: list[bytes | None], partitions: int, partition: int | None) -> list[int]:
    """Each record's partition: the explicit one, else murmur2(key) mod partitions (keyless: 0)."""
    n = len(keys)
    if partition is not None:
        return [partition] * n
    return partitions_for(keys, partitions)  # keyless: 0; vectorised for large appends


# The most a record's own framing adds to key + value + header names and values (Kafka's record
# format v2: length, attributes, timestamp delta, offset delta, key length, value length, header
# count as varints; two varint lengths per header): an upper bound, so a batch under it needs no
# exact per-record size.
_RECORD_FRAMING_MAX = 5 + 1 + 10 + 5 + 5 + 5 + 5
_HEADER_FRAMING_MAX = 10


def _fits(records: Sequence[Record], keys: list[bytes | None], values: list[bytes | None], limit: int) -> bool:
    """Whether every record is certainly within `limit` (largest key + largest value + largest headers
    with their framing bounds): the common case, decided in C loops over the batch. Records carry few
    distinct header sets (capture repeats one ``kf.op`` tuple), so headers are sized once per set."""
    try:
        header_sets = set(map(_headers_of, records))
    except TypeError:  # unhashable headers (lists): size each record exactly
        return False
    most = 0
    for headers in header_sets:
        if headers:
            most = max(most, sum(len(hk.encode()) + (len(hv) if hv else 0) + _HEADER_FRAMING_MAX
                                  for hk, hv in headers))
    bound = max(map(len, keys)) + max(map(len, values)) + most + _RECORD_FRAMING_MAX  # type: ignore[arg-type]
    return bound <= limit


def _check_sizes(topic: str, config: TopicConfig, records: Sequence[Record],
                 keys: list[bytes | None], values: list[bytes | None]) -> None:
    """Reject the whole append up front if one record is over the topic's size limit."""
    limit = config.max_record_bytes
    if None not in keys and None not in values and _fits(records, keys, values, limit):
        return
    for i, rec in enumerate(records):
        k, v, headers = keys[i], values[i], rec.headers
        payload = (len(k) if k else 0) + (len(v) if v else 0)
        if headers:
            payload += sum(len(hk.encode()) + len(hv) for hk, hv in headers)
        if payload > limit:
            raise RecordTooLargeError(
                f"topic {topic!r} record {i}: {payload} bytes (key + value + headers) is over the topic's limit of "
                f"{limit} bytes (record key {describe_key(k)}); nothing of this append was written"
            )
        if headers:
            size = _exact_batch_size(k, v, list(headers))
            if size > limit + BATCH_FRAMING:
                raise RecordTooLargeError(
                    f"topic {topic!r} record {i}: with the framing of its {len(headers)} headers a batch holding it "
                    f"is {size} bytes, over the topic's max.message.bytes of {limit + BATCH_FRAMING} (record key "
                    f"{describe_key(k)}); nothing of this append was written"
                )


# --- topic administration: the rules both clients' describe / create / delete follow ----------------
Describe = Callable[[list[str] | None], dict[str, TopicConfig]]


def cached_topic(cache: dict[str, TopicConfig], lock: threading.Lock, name: str, describe: Describe) -> TopicConfig:
    """The topic's config from `cache`, else described (and kept: topic configs are fixed at creation);
    UnknownTopicError when the broker does not have it."""
    config = cache.get(name)
    if config is None:
        validate_topic_name(name)
        config = describe([name]).get(name)
        if config is None:
            raise UnknownTopicError(name)
        keep_topic(cache, lock, name, config)
    return config


def keep_topic(cache: dict[str, TopicConfig], lock: threading.Lock, name: str, config: TopicConfig) -> TopicConfig:
    """`config` kept in `cache` as `name`'s (returned): a topic's config is fixed once it exists."""
    with lock:
        cache[name] = config
    return config


def check_new_topic(name: str, config: object) -> None:
    """A create request's name and config, checked before the broker is asked."""
    validate_topic_name(name)
    if config is not None and not isinstance(config, TopicConfig):
        raise ConfigError(f"topic {name!r} config: expected a TopicConfig, got {type(config).__name__}")


def existing_topic(name: str, config: TopicConfig | None, existing: TopicConfig, *, exist_ok: bool) -> TopicConfig:
    """`existing` when a create request for it may find it there: refused when `exist_ok` is false
    or the request asked for another config (Kafka cannot change partitions or policy in place)."""
    if not exist_ok:
        raise ConfigError(f"topic {name!r} already exists")
    if config is not None and config != existing:
        raise ConfigError(
            f"topic {name!r} already exists with a different config: existing {existing}, requested {config}"
        )
    return existing


def topic_undescribed(name: str) -> LogError:
    """A create found the topic existing, but a describe right after does not show it."""
    return LogError(f"topic {name!r}: the broker says it exists but does not describe it (being deleted?); retry",
                    retry=None)


def topic_rejected(name: str, wanted: TopicConfig, replication_factor: int, detail: object) -> ConfigError:
    """The broker refused the topic's config (replication factor, partitions, a config value)."""
    return ConfigError(f"topic {name!r}: the broker rejected the topic config {wanted} "
                       f"(replication_factor={replication_factor}): {detail}")


def wait_deleted(name: str, describe: Describe, timeout_s: float) -> None:
    """Deletion is asynchronous on Kafka: wait (bounded) until metadata no longer shows the topic."""
    deadline = time.monotonic() + timeout_s
    while name in describe([name]):
        if time.monotonic() > deadline:
            raise LogUnavailableError(
                f"topic {name!r} still listed {timeout_s:.0f}s after deletion (a client still "
                "using it may have recreated it through auto topic creation)")
        time.sleep(0.05)
