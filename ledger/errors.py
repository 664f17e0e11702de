"""Typed ledger errors: each names the field, stream or position and what was expected.

They subclass the shared types in `kappaflow.errors`, so callers that only know
`ValidationError` / `KappaflowError` (and their retry verdict) keep working.
"""

from __future__ import annotations

from typing import Any

from kappaflow.errors import KappaflowError, Retry, ValidationError


class LedgerError(KappaflowError):
    """Base for ledger failures."""


class InvalidAppendError(ValidationError, LedgerError):
    """An append request is malformed; `field` names the offending part (e.g. ``events[2].data.amount``)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnknownEventTypeError(InvalidAppendError):
    """An event type (or Python class) is not registered in the `EventRegistry`."""

    def __init__(self, message: str, *, field: str, event_type: str, position: int | None = None) -> None:
        super().__init__(message, field=field)
        self.event_type = event_type
        self.position = position


class EventTooLargeError(InvalidAppendError):
    """An encoded event (payload + metadata) exceeds the ledger's `max_event_bytes`."""

    def __init__(self, *, field: str, size: int, limit: int) -> None:
        super().__init__(f"encoded event is {size} bytes, the limit is {limit} bytes (max_event_bytes)",
                         field=field)
        self.size = size
        self.limit = limit


class AppendConflictError(LedgerError):
    """An optimistic-concurrency conflict: what the decision was based on has changed.

    A normal outcome under contention, not a failure: the server reports it as a result (it logs
    no ERROR) and the append wrote nothing. Repeating the same append fails again (TERMINAL):
    re-read, re-decide, append again.
    """


class WrongExpectedVersionError(AppendConflictError):
    """Optimistic concurrency conflict: the stream was not at the expected version.

    Repeating the same append fails again (TERMINAL): re-read the stream, re-decide, append
    with the new version.
    """

    def __init__(self, stream_id: str, expected: Any, actual: int) -> None:
        super().__init__(
            f"wrong expected version for stream {stream_id!r}: expected {_describe(expected)}, "
            f"found version {actual}"
        )
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


class AppendConditionFailedError(AppendConflictError):
    """An event matching the append condition's query was appended after its position."""

    def __init__(self, condition: Any, item: int, position: int, event_type: str) -> None:
        query_item = condition.query.items[item] if 0 <= item < len(condition.query.items) else "?"
        super().__init__(
            f"append condition failed: the event at position {position} ({event_type}) matches query item "
            f"{query_item} and was appended after position {condition.after}; read with the query again "
            "and decide again"
        )
        self.condition = condition
        self.item = item
        self.position = position
        self.event_type = event_type


class StreamTypeMismatchError(InvalidAppendError):
    def __init__(self, stream_id: str, expected: str, actual: str) -> None:
        super().__init__(f"stream {stream_id!r} has type {actual!r}, the append says {expected!r}",
                         field="stream_type")
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


class IdempotencyKeyReusedError(InvalidAppendError):
    """The idempotency key was used before for a different append (other events or streams)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} was already used for a different append; "
                         "use a new key for a new request", field="idempotency_key")
        self.key = key


class ImmutableLedgerError(LedgerError):
    """The database refused an UPDATE/DELETE/TRUNCATE of ledger events (they are immutable)."""


class LedgerNotInstalledError(LedgerError):
    def __init__(self, schema: str, detail: str) -> None:
        super().__init__(
            f"the ledger schema {schema!r} is missing or incomplete ({detail}); install it with "
            f"`kappaflow ledger install` or kappaflow.ledger.install(dsn, schema={schema!r})"
        )
        self.schema = schema


class LedgerUnavailableError(LedgerError):
    """The database cannot be reached. For an append the outcome may be unknown: retry it with
    the same idempotency key to get exactly-once effect."""

    retry = Retry.TRANSIENT


class CorruptLedgerError(LedgerError):
    """Stored ledger data breaks an invariant (hash chain, dense positions, stream versions)."""

    def __init__(self, message: str, *, position: int | None) -> None:
        super().__init__(message)
        self.position = position


class ProjectionTimeoutError(LedgerError):
    """A projection did not reach a ledger position in time (read-your-writes wait)."""

    retry = Retry.TRANSIENT

    def __init__(self, projection: str, position: int, reached: int | None, timeout: float) -> None:
        got = "no recorded position" if reached is None else f"processed up to position {reached}"
        super().__init__(
            f"projection {projection!r} did not reach ledger position {position} within {timeout:g} s "
            f"({got}); is it running?"
        )
        self.projection = projection
        self.position = position
        self.reached = reached
        self.timeout = timeout


class UpcastError(LedgerError):
    def __init__(self, message: str, *, event_type: str, position: int | None) -> None:
        where = f" at position {position}" if position is not None else ""
        super().__init__(f"event {event_type!r}{where}: {message}")
        self.event_type = event_type
        self.position = position


def _describe(expected: Any) -> str:
    from kappaflow.ledger.events import ExpectedVersion

    if isinstance(expected, ExpectedVersion):
        return {ExpectedVersion.ANY: "any version", ExpectedVersion.NO_STREAM: "no stream",
                ExpectedVersion.STREAM_EXISTS: "an existing stream"}[expected]
    return f"version {expected}"
