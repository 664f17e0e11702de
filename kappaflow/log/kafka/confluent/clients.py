"""librdkafka client plumbing for the confluent-kafka log client: configs, bounded connects, errors.

The counterpart of `kappaflow.log.kafka.kafka_python.clients` (kafka-python): which librdkafka properties
kappaflow sets itself (and refuses from users), how `KafkaSecurity` is spelled for librdkafka,
how a broker that is down is reported (bounded retries with backoff, the bootstrap address in
the message, never a credential), and how librdkafka's error codes map onto kappaflow's errors.

librdkafka logs through Python `logging` (logger ``kappaflow.log.confluent.librdkafka``), not on
stderr: a broker that goes away is reported once, as kappaflow's error, not as a stream of
librdkafka lines; configure that logger to see them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from kappaflow.errors import ConfigError, LogError, LogUnavailableError, RecordTooLargeError, Retry, UnknownTopicError
from kappaflow.log.kafka.common import KafkaOptions, KafkaSecurity

__all__ = [
    "LIBRDKAFKA_LOGGER",
    "ErrorLatch",
    "base_config",
    "connect",
    "error_of",
    "is_too_large",
    "is_unknown_topic",
    "map_error",
    "security_config",
    "user_config",
]

T = TypeVar("T")

LIBRDKAFKA_LOGGER = logging.getLogger("kappaflow.log.confluent.librdkafka")
LIBRDKAFKA_LOGGER.addHandler(logging.NullHandler())  # silent unless the application configures logging

# librdkafka properties kappaflow sets itself: a user value would break a guarantee of the backend.
_RESERVED = {
    "bootstrap.servers": "pass the address as the log URL / bootstrap",
    "enable.idempotence": "the producer is always idempotent (no duplicates on retry)",
    "acks": "appends are acknowledged by all in-sync replicas ('all')",
    "request.required.acks": "appends are acknowledged by all in-sync replicas ('all')",
    "group.id": "commit()/committed() take the group as an argument",
    "enable.auto.commit": "offsets are committed explicitly with commit()",
    "enable.auto.offset.store": "offsets are committed explicitly with commit()",
    "auto.offset.reset": "read() positions explicitly",
    "enable.partition.eof": "reads detect the end of a partition with it",
    "partitioner": "kappaflow's murmur2 partition_for() picks the partition",
    "transactional.id": "the backend uses an idempotent, non-transactional producer",
    "allow.auto.create.topics": "topics are created explicitly (a deleted topic must stay deleted)",
    "on_delivery": "appends collect their own delivery reports",
    "error_cb": "kappaflow reports broker errors itself",
}
_SECURITY_KEYS = ("security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username", "sasl.password",
                  "ssl.ca.location", "ssl.certificate.location", "ssl.key.location")

# Error codes, by meaning.
_UNKNOWN_TOPIC = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION}
_TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE}
_UNAVAILABLE = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
                KafkaError._MSG_TIMED_OUT, KafkaError.REQUEST_TIMED_OUT, KafkaError._RESOLVE,
                KafkaError.NETWORK_EXCEPTION, KafkaError.NOT_ENOUGH_REPLICAS,
                KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, KafkaError.LEADER_NOT_AVAILABLE,
                KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.BROKER_NOT_AVAILABLE,
                KafkaError._WAIT_COORD, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
                KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._NODE_UPDATE}
_DENIED = {KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION, KafkaError._SSL,
           KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
           KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED}


def security_config(security: KafkaSecurity) -> dict[str, Any]:
    """librdkafka's names for a `KafkaSecurity` (producer, consumers and admin take all of them)."""
    conf: dict[str, Any] = {"security.protocol": security.protocol.lower()}
    if security.sasl:
        conf.update({"sasl.mechanism": security.sasl_mechanism, "sasl.username": security.sasl_username,
                     "sasl.password": security.sasl_password})
    for name, prop in (("ssl_cafile", "ssl.ca.location"), ("ssl_certfile", "ssl.certificate.location"),
                       ("ssl_keyfile", "ssl.key.location")):
        value = getattr(security, name)
        if value:
            conf[prop] = value
    return conf


def user_config(role: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """librdkafka properties a user set for `role` ("client", "producer", "consumer"), checked.

    Names must be librdkafka's (dotted, e.g. ``linger.ms``): a kafka-python name (``linger_ms``)
    is refused here with the spelling to use, rather than by librdkafka later. Security settings
    belong in `security` (mapped once for both clients), not here.
    """
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"kafka log {role} option {key!r}: expected a librdkafka property name")
        if key in _RESERVED:
            raise ConfigError(f"kafka log {role} option {key!r} cannot be set: {_RESERVED[key]}")
        if key in _SECURITY_KEYS:
            raise ConfigError(f"kafka log {role} option {key!r}: set security with [log.kafka] security_protocol, "
                              "sasl_* and ssl_* (the same settings for both Kafka clients)")
        if "_" in key and "." not in key:
            raise ConfigError(
                f"kafka log {role} option {key!r}: the confluent client takes librdkafka property names "
                f"(e.g. {key.replace('_', '.')!r}); set [log.kafka] client = \"kafka-python\" to use "
                "kafka-python's names")
        out[key] = value
    return out


class ErrorLatch:
    """librdkafka's `error_cb`: keeps the last client-level error (e.g. all brokers down) for messages."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last: KafkaError | None = None

    def __call__(self, err: KafkaError) -> None:
        with self._lock:
            self.last = err

    def brief(self) -> str:
        err = self.last
        return "" if err is None else f"; last broker error: {err.str()}"


def base_config(opts: KafkaOptions, role: str, latch: ErrorLatch, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The properties every client of one log shares: address, identity, timeouts, security, logging."""
    timeout_ms = int(opts.timeout_s * 1000)
    return {
        "bootstrap.servers": opts.bootstrap,
        "client.id": f"{opts.client_id}-{role}",
        "socket.timeout.ms": max(10, timeout_ms),
        "socket.connection.setup.timeout.ms": max(1000, int(opts.connect_timeout_s * 1000)),
        "reconnect.backoff.max.ms": 1000,
        "logger": LIBRDKAFKA_LOGGER,
        "error_cb": latch,
        **security_config(opts.security),
        **extra,
    }


def connect(make: Callable[[], T], probe: Callable[[T, float], object], *, bootstrap: str, what: str,
            attempts: int, backoff_s: float, timeout_s: float, latch: ErrorLatch) -> T:
    """Create a client and wait until it answered one metadata request, retrying with backoff.

    librdkafka connects in the background, so a client object says nothing about the broker; the
    metadata request does. LogUnavailableError after `attempts` tries of `timeout_s` each; a
    refused configuration (unknown property, bad value) is a ConfigError at once.
    """
    try:
        client = make()
    except KafkaException as exc:
        raise ConfigError(f"kafka log: librdkafka refused the configuration of {what.removeprefix('connecting ')}: "
                          f"{error_of(exc).str()}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kafka log: {what}: {exc}") from None
    delay = backoff_s
    last: str = "no error recorded"
    for attempt in range(1, attempts + 1):
        try:
            probe(client, timeout_s)
            return client
        except KafkaException as exc:
            err = error_of(exc)
            if err.code() in _DENIED:
                raise map_error(err, bootstrap=bootstrap, what=what) from None
            last = err.str()
        if attempt < attempts:
            time.sleep(delay)
            delay *= 2
    raise LogUnavailableError(
        f"Kafka broker at {bootstrap} is unreachable: {what} failed after {attempts} attempts "
        f"with backoff ({last}{latch.brief()}); check that the broker runs and the address is right"
    )


def error_of(exc: BaseException) -> KafkaError:
    """The KafkaError inside a KafkaException (or a generic one for anything else)."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    if isinstance(exc, KafkaError):
        return exc
    return KafkaError(KafkaError._FAIL, f"{type(exc).__name__}: {exc}")


def is_unknown_topic(err: KafkaError) -> bool:
    return err.code() in _UNKNOWN_TOPIC


def is_too_large(err: KafkaError) -> bool:
    return err.code() in _TOO_LARGE


def map_error(err: KafkaError | BaseException, *, bootstrap: str, what: str, topic: str | None = None) -> LogError:
    """One librdkafka error as a kappaflow LogError with a retry verdict and the operation named."""
    if not isinstance(err, KafkaError):
        err = error_of(err)
    code = err.code()
    text = err.str()[:300]
    if topic is not None and code in _UNKNOWN_TOPIC:
        return UnknownTopicError(topic)
    if code in _TOO_LARGE:
        return RecordTooLargeError(f"{what}: the broker rejected a record as too large ({text})")
    if code in _UNAVAILABLE:
        return LogUnavailableError(f"{what}: Kafka broker at {bootstrap} did not answer ({text})")
    if code in _DENIED:
        return LogError(f"{what}: not authorised by the broker at {bootstrap} ({text})", retry=Retry.TERMINAL)
    transient = err.retriable() and not err.fatal()
    return LogError(f"{what}: {text}", retry=Retry.TRANSIENT if transient else Retry.TERMINAL)
