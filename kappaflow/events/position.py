"""Source positions: a total order within one source, and a JSON-safe dict form.

A position is what a consumer compares to drop duplicates: it keeps the last
position per source and ignores records whose position is <= it. Records
re-captured after a crash carry the same position as before, so the order must
be total and the dict form must round-trip exactly (it travels in every event
as ``source.kf_pos``).

Equality and hashing follow the order key, so ``a == b`` exactly when neither
``a < b`` nor ``a > b``. Comparing positions of different kinds raises
``TypeError``: they come from different sources and have no common order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init

__all__ = [
    "BinlogPosition",
    "KafkaPosition",
    "LedgerPosition",
    "PgPosition",
    "Position",
    "binlog_file_sequence",
    "lsn_from_str",
    "lsn_to_str",
]

_MAX_LSN = (1 << 64) - 1
_LSN_RE = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_BINLOG_SUFFIX_RE = re.compile(r"^(.*?)\.?(\d+)$")


def lsn_to_str(lsn: int) -> str:
    """PostgreSQL's text form of an LSN: high and low 32 bits in hex, e.g. ``0/16B3748``."""
    if not isinstance(lsn, int) or isinstance(lsn, bool) or not 0 <= lsn <= _MAX_LSN:
        raise ValidationError(f"lsn: expected an integer in 0..2^64-1, got {lsn!r}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_from_str(text: str) -> int:
    """Parse PostgreSQL's ``X/Y`` LSN text (as shown by ``pg_current_wal_lsn()``)."""
    m = _LSN_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValidationError(f"lsn: expected PostgreSQL LSN text like '0/16B3748', got {text!r}")
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


def binlog_file_sequence(file: str) -> tuple[int, str]:
    """(sequence number, base name) of a binlog file name like ``mysql-bin.000003``."""
    m = _BINLOG_SUFFIX_RE.match(file) if isinstance(file, str) else None
    if m is None:
        raise ValidationError(
            f"binlog file: expected a name ending in a sequence number like 'mysql-bin.000003', got {file!r}"
        )
    return int(m.group(2)), m.group(1)


def _int(d: Mapping[str, Any], kind: str, name: str, *, minimum: int = 0, optional: bool = False) -> Any:
    v = d.get(name)
    if v is None and optional:
        return None
    if type(v) is not int or v < minimum:
        what = "missing" if name not in d else f"got {v!r}"
        raise ValidationError(f"position ({kind}).{name}: expected an integer >= {minimum}, {what}")
    return v


def _bool(d: Mapping[str, Any], kind: str, name: str) -> bool:
    v = d.get(name, False)
    if type(v) is not bool:
        raise ValidationError(f"position ({kind}).{name}: expected true or false, got {v!r}")
    return v


class Position:
    """Base of all source positions (abstract). Subclasses are frozen dataclasses."""

    __slots__ = ()
    kind: ClassVar[str] = ""
    _kinds: ClassVar[dict[str, type[Position]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            Position._kinds[cls.kind] = cls

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Position:
        """Rebuild a position from ``to_dict()`` output; dispatches on ``d["kind"]``."""
        if not isinstance(d, Mapping):
            raise ValidationError(f"position: expected an object with a 'kind', got {type(d).__name__}")
        kind = d.get("kind")
        sub = Position._kinds.get(kind) if isinstance(kind, str) else None
        if sub is None:
            raise ValidationError(
                f"position.kind: expected one of {sorted(Position._kinds)}, got {kind!r}"
            )
        if cls is not Position and sub is not cls:
            raise ValidationError(f"position.kind: expected {cls.kind!r}, got {kind!r}")
        return sub._from_dict(d)

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> Position:
        raise NotImplementedError

    # -- order ---------------------------------------------------------------------
    def sort_key(self) -> tuple[Any, ...]:
        """The tuple positions of one kind are ordered by."""
        raise NotImplementedError

    def successor(self) -> Position:
        """The smallest position of the same kind ordered after this one and before every other
        position greater than it that a source could assign (used for records that carry no
        position of their own, see ``kappaflow.connectors.debezium.ordering``)."""
        raise NotImplementedError(f"{type(self).__name__} has no successor")

    def _other_key(self, other: object) -> tuple[Any, ...]:
        if type(other) is not type(self):
            if isinstance(other, Position):
                raise TypeError(
                    f"cannot order a {type(self).__name__} against a {type(other).__name__}: "
                    "positions of different sources have no common order"
                )
            raise TypeError(f"cannot order a {type(self).__name__} against {type(other).__name__}")
        return other.sort_key()

    def __lt__(self, other: object) -> bool:
        return self.sort_key() < self._other_key(other)

    def __le__(self, other: object) -> bool:
        return self.sort_key() <= self._other_key(other)

    def __gt__(self, other: object) -> bool:
        return self.sort_key() > self._other_key(other)

    def __ge__(self, other: object) -> bool:
        return self.sort_key() >= self._other_key(other)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.sort_key() == other.sort_key()

    def __hash__(self) -> int:
        return hash((self.kind, self.sort_key()))


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class PgPosition(Position):
    """PostgreSQL: commit LSN of the transaction and the change's 0-based index in it.

    Snapshot rows carry the slot's consistent-point LSN with ``snapshot=True`` and a
    running row number as index; they order before every streaming position whose
    commit LSN is >= that consistent point (those changes were not in the snapshot).
    """

    lsn: int
    index: int = 0
    snapshot: bool = False
    kind: ClassVar[str] = "pg"

    def sort_key(self) -> tuple[int, int, int]:
        return (self.lsn, 0 if self.snapshot else 1, self.index)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "pg", "lsn": self.lsn, "index": self.index, "snapshot": self.snapshot}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> PgPosition:
        return cls(_int(d, "pg", "lsn"), _int(d, "pg", "index"), _bool(d, "pg", "snapshot"))

    def successor(self) -> PgPosition:
        return PgPosition(self.lsn, self.index + 1, self.snapshot)

    def __str__(self) -> str:
        if self.snapshot:
            return f"{lsn_to_str(self.lsn)}:snapshot:{self.index}"
        return f"{lsn_to_str(self.lsn)}:{self.index}"


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class BinlogPosition(Position):
    """MySQL/MariaDB binlog: file, position of the transaction (or rows event), row index.

    Ordered by (file sequence number, pos, row); the GTID and server id travel along
    for resuming and display but do not take part in the order. Snapshot rows carry
    the binlog position read at the start of the snapshot and order before every
    streaming position at or after it, like ``PgPosition``.
    """

    file: str
    pos: int
    row: int = 0
    gtid: str | None = None
    server_id: int | None = None
    snapshot: bool = False
    _file_key: tuple[int, str] = field(init=False, repr=False, compare=False)
    kind: ClassVar[str] = "binlog"

    def __post_init__(self) -> None:
        # Parsed once: positions are compared for every record a consumer reads.
        object.__setattr__(self, "_file_key", binlog_file_sequence(self.file))

    def sort_key(self) -> tuple[int, str, int, int, int]:
        seq, base = self._file_key
        return (seq, base, self.pos, 0 if self.snapshot else 1, self.row)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "binlog",
            "file": self.file,
            "pos": self.pos,
            "row": self.row,
            "gtid": self.gtid,
            "server_id": self.server_id,
            "snapshot": self.snapshot,
        }

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> BinlogPosition:
        file = d.get("file")
        if not isinstance(file, str):
            raise ValidationError(f"position (binlog).file: expected a binlog file name, got {file!r}")
        gtid = d.get("gtid")
        if gtid is not None and not isinstance(gtid, str):
            raise ValidationError(f"position (binlog).gtid: expected a string or null, got {gtid!r}")
        return cls(
            file,
            _int(d, "binlog", "pos"),
            _int(d, "binlog", "row"),
            gtid,
            _int(d, "binlog", "server_id", optional=True),
            _bool(d, "binlog", "snapshot"),
        )

    def __str__(self) -> str:
        s = f"{self.file}:{self.pos}:{self.row}"
        return s + ":snapshot" if self.snapshot else s

    def successor(self) -> BinlogPosition:
        return BinlogPosition(self.file, self.pos, self.row + 1, self.gtid, self.server_id, self.snapshot)


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class LedgerPosition(Position):
    """The ledger's global position (gap-free, assigned at append)."""

    position: int
    kind: ClassVar[str] = "ledger"

    def sort_key(self) -> tuple[int]:
        return (self.position,)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ledger", "position": self.position}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> LedgerPosition:
        return cls(_int(d, "ledger", "position"))

    def __str__(self) -> str:
        return str(self.position)

    def successor(self) -> LedgerPosition:
        return LedgerPosition(self.position + 1)


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class KafkaPosition(Position):
    """A record's place in the Kafka topic kappaflow read it from (partition, offset).

    For records that carry no source position kappaflow knows (a connector it has no layout
    for, a flattened record without metadata fields): unique, and increasing within a
    partition, which is where all changes of one key are. ``seq`` orders records derived
    from one Kafka record (a tombstone's delete) after it.
    """

    partition: int
    offset: int
    seq: int = 0
    kind: ClassVar[str] = "kafka"

    def sort_key(self) -> tuple[int, int, int]:
        return (self.partition, self.offset, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "kafka", "partition": self.partition, "offset": self.offset, "seq": self.seq}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> KafkaPosition:
        seq = _int(d, "kafka", "seq", optional=True)
        return cls(_int(d, "kafka", "partition"), _int(d, "kafka", "offset"), seq or 0)

    def successor(self) -> KafkaPosition:
        return KafkaPosition(self.partition, self.offset, self.seq + 1)

    def __str__(self) -> str:
        return f"kafka:{self.partition}/{self.offset}" + (f"+{self.seq}" if self.seq else "")
