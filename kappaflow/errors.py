"""Error types shared by every part of kappaflow.

Every error carries a retry verdict so callers (capture loops, sinks, the CLI)
can decide between backing off and giving up without parsing messages.
"""

from __future__ import annotations

from enum import Enum


class Retry(str, Enum):
    """Whether repeating the failed operation can succeed."""

    TRANSIENT = "transient"  # e.g. a broker or server that is down or busy
    TERMINAL = "terminal"  # e.g. bad config, auth failure, corrupt data


class KappaflowError(Exception):
    """Base error. `retry` says whether trying again may help."""

    retry: Retry = Retry.TERMINAL

    def __init__(self, message: str, *, retry: Retry | None = None) -> None:
        super().__init__(message)
        if retry is not None:
            self.retry = retry

    @property
    def transient(self) -> bool:
        return self.retry is Retry.TRANSIENT


class ConfigError(KappaflowError):
    """Invalid configuration or CLI argument; names the field and what was expected."""


class ValidationError(KappaflowError):
    """An external record (change event, ledger event, server reply) is malformed."""


class LogError(KappaflowError):
    """Base for log failures; names topic/partition/offset where known."""


class UnknownTopicError(LogError):
    def __init__(self, topic: str) -> None:
        super().__init__(f"unknown topic {topic!r}: create it first (kappaflow log topics) or check the name")
        self.topic = topic


class LogUnavailableError(LogError):
    """The log backend cannot be reached (broker down, file locked)."""

    retry = Retry.TRANSIENT


class CorruptLogError(LogError):
    """Stored log data is damaged; records before `offset` remain readable."""

    def __init__(self, message: str, *, path: str, topic: str | None = None,
                 partition: int | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.topic = topic
        self.partition = partition
        self.offset = offset


class RecordTooLargeError(LogError):
    pass


class SourceError(KappaflowError):
    """A capture source failed (connection, permissions, server settings)."""


class SinkError(KappaflowError):
    """A view sink failed."""
