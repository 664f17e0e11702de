"""The change event: one row-level change, shaped like Debezium's envelope.

Every part of kappaflow (connectors, the ledger, projections) speaks this one
model. Validation here is deliberately cheap (connectors build ~100k events/s):
only the op/before/after consistency is checked; values are checked by the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.position import Position

__all__ = ["ChangeEvent", "Op", "Snapshot", "SourceInfo", "TransactionInfo"]


class Op(str, Enum):
    """Debezium's ``op`` codes."""

    CREATE = "c"
    UPDATE = "u"
    DELETE = "d"
    READ = "r"  # a row read by a snapshot
    TRUNCATE = "t"


class Snapshot(str, Enum):
    """Debezium's ``source.snapshot`` values."""

    TRUE = "true"
    FIRST = "first"
    FIRST_IN_DATA_COLLECTION = "first_in_data_collection"
    LAST_IN_DATA_COLLECTION = "last_in_data_collection"
    LAST = "last"
    FALSE = "false"
    INCREMENTAL = "incremental"


_OPS = {o.value: o for o in Op}
_SNAPSHOTS = {s.value: s for s in Snapshot}


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class SourceInfo:
    """Where and when the change happened at the source."""

    connector: str  # "postgresql" | "mysql" | "ledger" | "debezium" | "sqlserver" | ...
    name: str  # logical source name = topic prefix
    db: str
    schema: str | None  # PostgreSQL schema; None for MySQL
    table: str
    position: Position
    ts_ms: int  # commit time at the source
    tx_id: int | str | None = None
    snapshot: Snapshot = Snapshot.FALSE
    # Debezium 2.6+: the same instant in micro- and nanoseconds (None: ts_ms * 1000 / * 10**6)
    ts_us: int | None = None
    ts_ns: int | None = None
    # connector-specific source fields the position does not hold, as Debezium names them
    # (PostgreSQL ``sequence``/``xmin``, MySQL ``thread``/``query``, SQL Server ``change_lsn`` ...)
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.snapshot.__class__ is not Snapshot:
            s = _SNAPSHOTS.get(self.snapshot)
            if s is None:
                raise ValidationError(
                    f"source.snapshot: expected one of {list(_SNAPSHOTS)}, got {self.snapshot!r}"
                )
            object.__setattr__(self, "snapshot", s)
        if not isinstance(self.position, Position):
            raise ValidationError(f"source.position: expected a Position, got {type(self.position).__name__}")


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class TransactionInfo:
    """Debezium's ``transaction`` block: the event's place within its transaction."""

    id: str
    total_order: int
    data_collection_order: int


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """One change. ``key`` holds the primary-key columns; rows map column -> value.

    A column missing from a row dict is *absent* (unknown, e.g. not in the replica
    identity), which differs from a column present with None (SQL NULL).
    """

    op: Op
    key: dict[str, Any] | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    source: SourceInfo
    ts_ms: int  # when kappaflow processed it
    transaction: TransactionInfo | None = None
    unavailable: tuple[str, ...] = ()  # columns whose value is unknown (e.g. unchanged TOAST)
    ts_us: int | None = None  # the processing time in micro-/nanoseconds (None: from ts_ms)
    ts_ns: int | None = None

    def __post_init__(self) -> None:
        op = self.op
        if op.__class__ is not Op:
            o = _OPS.get(op)
            if o is None:
                raise ValidationError(f"op: expected one of {list(_OPS)}, got {op!r}")
            object.__setattr__(self, "op", o)
            op = o
        if op is Op.CREATE or op is Op.READ or op is Op.UPDATE:
            if self.after is None:
                raise ValidationError(f"after: an op {op.value!r} event needs the row after the change, got null")
        elif op is Op.DELETE:
            if self.before is None and self.key is None:
                raise ValidationError("before: a delete event needs the row before (or at least the key), got null")
            if self.after is not None:
                raise ValidationError("after: a delete event has no row after the change")
        elif self.before is not None or self.after is not None:  # TRUNCATE
            raise ValidationError("before/after: a truncate event carries no rows")
        if self.unavailable.__class__ is not tuple:
            object.__setattr__(self, "unavailable", tuple(self.unavailable))

    @property
    def row(self) -> dict[str, Any] | None:
        """The row as it is now: ``after``, or ``before`` for deletes."""
        return self.after if self.after is not None else self.before
