"""The ledger: an append-only, hash-chained event store in PostgreSQL that feeds the log.

    from kappaflow.ledger import Ledger, NewEvent, StreamAppend, ExpectedVersion, install

    install(dsn)                                   # Alembic branch "ledger" (idempotent)
    with Ledger(dsn, registry=registry) as ledger:
        r = ledger.append("account-1", [Deposited(amount=100)], expected_version=3)
        ledger.append_many([StreamAppend("account-1", [...], 4), StreamAppend("account-2", [...])],
                           idempotency_key="transfer-77")
        ledger.read_stream("account-1"); ledger.read_all(from_position=r.position)
        ledger.verify()                            # hash chain, dense positions, stream versions
        seen = ledger.read_query(Query.where(tags=["course:7"]))     # events matching tags/types
        ledger.append("enrolment-9", [...], condition=seen.condition) # fails if a match came since
    wait_for_projection(positions, "balances", r.position, timeout=5)   # read-your-writes

Into the log: the ledger source (``kappaflow.connectors.ledger``, source kind ``ledger``)
captures ``<schema>.events`` from the WAL and maps rows with `kappaflow.ledger.logmap.to_log_record`
(topic ``<source>.<stream_type>``, key = stream id, value = the domain event); without logical
decoding, `LedgerRelay` follows the ledger instead and writes the same records.
Modules: `store` (Ledger, the gap-safe ordering argument), `events` (typing, upcasting),
`query` (tags, queries, append conditions across streams), `snapshots` (Fold, snapshot loads),
`personal` (crypto-shredding of personal fields), `errors`, `hashing` (chain encoding, verify),
`tail` (TailReader), `wait`, `logmap`, `relay`, `cut` (the log's end offsets as of a ledger
position, for replays to a commit point).
"""

from kappaflow.ledger.errors import (
    AppendConditionFailedError,
    AppendConflictError,
    CorruptLedgerError,
    EventTooLargeError,
    IdempotencyKeyReusedError,
    ImmutableLedgerError,
    InvalidAppendError,
    LedgerError,
    LedgerNotInstalledError,
    LedgerUnavailableError,
    ProjectionTimeoutError,
    StreamTypeMismatchError,
    UnknownEventTypeError,
    UpcastError,
    WrongExpectedVersionError,
)
from kappaflow.ledger.events import (
    DEFAULT_MAX_EVENT_BYTES,
    EventRegistry,
    ExpectedVersion,
    NewEvent,
    RecordedEvent,
    parse_expected_version,
    stream_category,
)
from kappaflow.ledger.hashing import VerifyReport, verify
from kappaflow.ledger.personal import FORGOTTEN, ForgetResult, SubjectForgottenError
from kappaflow.ledger.query import AppendCondition, Query, QueryItem, QueryResult, Tagged
from kappaflow.ledger.relay import LedgerRelay
from kappaflow.ledger.schema import DEFAULT_SCHEMA, install
from kappaflow.ledger.snapshots import Fold, Loaded
from kappaflow.ledger.store import AppendResult, Head, Ledger, LedgerStats, StreamAppend
from kappaflow.ledger.tail import TailReader
from kappaflow.ledger.wait import (
    LogProjectionPositions,
    PostgresProjectionPositions,
    ProjectionPositions,
    wait_for_projection,
)

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_SCHEMA",
    "FORGOTTEN",
    "AppendCondition",
    "AppendConditionFailedError",
    "AppendConflictError",
    "AppendResult",
    "CorruptLedgerError",
    "EventRegistry",
    "EventTooLargeError",
    "ExpectedVersion",
    "Fold",
    "ForgetResult",
    "Head",
    "IdempotencyKeyReusedError",
    "ImmutableLedgerError",
    "InvalidAppendError",
    "Ledger",
    "LedgerError",
    "LedgerNotInstalledError",
    "LedgerRelay",
    "LedgerStats",
    "LedgerUnavailableError",
    "Loaded",
    "LogProjectionPositions",
    "NewEvent",
    "PostgresProjectionPositions",
    "ProjectionPositions",
    "ProjectionTimeoutError",
    "Query",
    "QueryItem",
    "QueryResult",
    "RecordedEvent",
    "StreamAppend",
    "StreamTypeMismatchError",
    "SubjectForgottenError",
    "Tagged",
    "TailReader",
    "UnknownEventTypeError",
    "UpcastError",
    "VerifyReport",
    "WrongExpectedVersionError",
    "install",
    "parse_expected_version",
    "stream_category",
    "verify",
    "wait_for_projection",
]
