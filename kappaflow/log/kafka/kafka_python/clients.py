"""kafka-python client plumbing for the Kafka log backend: options, bounded connects, error mapping.

Kept apart from `kafka.py` so the backend reads as the log contract and this file
holds what only matters to talking to brokers: which client accepts which option,
how a broker that is down is reported (bounded retries with backoff, the bootstrap
address in the message, never a credential), and how kafka-python's errors map onto
kappaflow's (`LogUnavailableError`, `UnknownTopicError`, `RecordTooLargeError`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kafka import errors as kerr

from kappaflow.errors import ConfigError, LogError, LogUnavailableError, RecordTooLargeError, Retry, UnknownTopicError
from kappaflow.log.kafka.common import KafkaSecurity, parse_bootstrap

__all__ = ["connect", "disable_auto_topic_creation", "is_too_large", "is_unknown_topic", "map_error",
           "parse_bootstrap", "security_options", "split_options"]

T = TypeVar("T")

# Options kappaflow sets itself: a user value would break a guarantee of the backend.
_RESERVED = {
    "bootstrap_servers": "pass the address as KafkaLog(bootstrap=...)",
    "enable_idempotence": "the producer is always idempotent (no duplicates on retry)",
    "acks": "appends are acknowledged by all in-sync replicas ('all')",
    "group_id": "commit()/committed() take the group as an argument",
    "enable_auto_commit": "offsets are committed explicitly with commit()",
    "auto_offset_reset": "read() positions explicitly",
    "key_serializer": "keys are bytes", "value_serializer": "values are bytes",
    "key_deserializer": "keys are bytes", "value_deserializer": "values are bytes",
    "partitioner": "kappaflow's murmur2 partition_for() picks the partition",
    "transactional_id": "the backend uses an idempotent, non-transactional producer",
}


def security_options(security: KafkaSecurity) -> dict[str, Any]:
    """kafka-python's names for a `KafkaSecurity` (every client takes all of them)."""
    opts: dict[str, Any] = {"security_protocol": security.protocol}
    if security.sasl:
        opts.update(sasl_mechanism=security.sasl_mechanism, sasl_plain_username=security.sasl_username,
                    sasl_plain_password=security.sasl_password)
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if getattr(security, name):
            opts[name] = getattr(security, name)
    return opts


def split_options(client_options: Mapping[str, Any] | None, clients: Mapping[str, type], *,
                  security: Mapping[str, Any] | None = None,
                  only: Mapping[str, Mapping[str, Any] | None] | None = None) -> dict[str, dict[str, Any]]:
    """Route each option to the kafka-python clients that know it.

    `security` goes to every client; `client_options` to each client that knows the option;
    `only[name]` to the client `name` alone (`[log.kafka.producer]` never reaches a consumer).
    An option no client knows, or one kappaflow must control, is a ConfigError naming it.
    """
    routed: dict[str, dict[str, Any]] = {name: dict(security or {}) for name in clients}
    for key, value in (client_options or {}).items():
        _check_settable(key)
        known = [name for name, cls in clients.items() if key in cls.DEFAULT_CONFIG]  # type: ignore[attr-defined]
        if not known:
            raise ConfigError(
                f"kafka log client option {key!r}: not a kafka-python producer, consumer or admin option"
            )
        for name in known:
            routed[name][key] = value
    for name, options in (only or {}).items():
        cls = clients[name]
        for key, value in (options or {}).items():
            _check_settable(key)
            if key not in cls.DEFAULT_CONFIG:  # type: ignore[attr-defined]
                raise ConfigError(f"kafka log {name} option {key!r}: not a kafka-python {cls.__name__} option "
                                  "(kafka-python spells options with underscores, e.g. linger_ms)")
            routed[name][key] = value
    return routed


def _check_settable(key: str) -> None:
    if key in _RESERVED:
        raise ConfigError(f"kafka log client option {key!r} cannot be set: {_RESERVED[key]}")


def connect(make: Callable[[], T], *, bootstrap: str, what: str, attempts: int, backoff_s: float) -> T:
    """Create a client, retrying with exponential backoff; LogUnavailableError when all attempts fail."""
    delay = backoff_s
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            return make()
        except (kerr.KafkaTimeoutError, kerr.KafkaConnectionError, kerr.NodeNotReadyError, OSError) as exc:
            last = exc
        if attempt < attempts:
            time.sleep(delay)
            delay *= 2
    raise LogUnavailableError(
        f"Kafka broker at {bootstrap} is unreachable: {what} failed after {attempts} attempts "
        f"with backoff ({_brief(last)}); check that the broker runs and the address is right"
    )


def disable_auto_topic_creation(client: Any) -> None:
    """Make the client's metadata requests say allow_auto_topic_creation=false.

    kafka-python 3.0 accepts `allow_auto_create_topics=False` on producer and consumer but
    builds their cluster metadata without it, so every Metadata request allows auto
    creation; brokers that honour it (tansu always, Kafka with auto.create.topics.enable)
    then recreate a topic that was just deleted while a client still tracks it.
    """
    clusters = [getattr(client, "_cluster", None), getattr(client, "_metadata", None),
                getattr(getattr(client, "_manager", None), "cluster", None)]
    for cluster in clusters:
        config = getattr(cluster, "config", None)
        if isinstance(config, dict) and "allow_auto_create_topics" in config:
            config["allow_auto_create_topics"] = False


def _brief(exc: BaseException | None) -> str:
    if exc is None:
        return "no error recorded"
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def is_too_large(exc: BaseException) -> bool:
    return isinstance(exc, kerr.MessageSizeTooLargeError | kerr.RecordListTooLargeError)


def is_unknown_topic(exc: BaseException) -> bool:
    return isinstance(exc, kerr.UnknownTopicOrPartitionError | kerr.UnknownTopicIdError)


def map_error(exc: BaseException, *, bootstrap: str, what: str, topic: str | None = None) -> LogError:
    """One kafka-python error as a kappaflow LogError with a retry verdict and the operation named."""
    if topic is not None and is_unknown_topic(exc):
        return UnknownTopicError(topic)
    if is_too_large(exc):
        return RecordTooLargeError(f"{what}: the broker rejected a record as too large ({_brief(exc)})")
    if isinstance(exc, kerr.KafkaTimeoutError | kerr.KafkaConnectionError | kerr.NodeNotReadyError
                       | kerr.RequestTimedOutError | OSError):
        return LogUnavailableError(f"{what}: Kafka broker at {bootstrap} did not answer ({_brief(exc)})")
    if isinstance(exc, kerr.AuthorizationError | kerr.SaslAuthenticationFailedError):
        return LogError(f"{what}: not authorised by the broker at {bootstrap} ({_brief(exc)})",
                        retry=Retry.TERMINAL)
    retriable = bool(getattr(exc, "retriable", False))
    return LogError(f"{what}: {_brief(exc)}", retry=Retry.TRANSIENT if retriable else Retry.TERMINAL)
