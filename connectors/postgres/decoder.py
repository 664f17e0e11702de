"""pgoutput (logical replication protocol version 1) message decoder.

Parses the messages the built-in ``pgoutput`` plugin emits — Begin, Commit,
Relation, Type, Insert, Update, Delete, Truncate, Origin and Message — into small
immutable objects, and keeps the relation cache (a Relation message always
precedes the first row message of a table in each session and after every
change of its shape).

Row tuples are decoded to tuples of raw text values: ``bytes`` (text format),
``None`` (SQL NULL) or :data:`UNCHANGED` (an unchanged TOAST value the server did
not send). Converting text to typed values is the job of per-relation converter
tuples (see ``types.py`` and ``streaming.py``), not of the parser.

Malformed input never escapes as ``struct.error``/``IndexError``: the decoder
raises :class:`kappaflow.errors.ValidationError` naming the message type and the
byte position where it stopped making sense.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

from kappaflow.errors import ValidationError

__all__ = [
    "UNCHANGED",
    "Begin",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Origin",
    "PgOutputDecoder",
    "RelColumn",
    "Relation",
    "Truncate",
    "TypeMessage",
    "Update",
    "parse_tuple",
]

# Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
PG_EPOCH_US: Final = 946_684_800_000_000


class _Unchanged:
    """Marker for an unchanged TOAST column ('u'): the server did not resend the value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()

RawTuple = tuple[Any, ...]  # bytes | None | UNCHANGED per column


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # LSN of the commit record
    commit_ts_us: int  # microseconds since the Unix epoch
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int  # end of the commit record: the LSN to acknowledge
    commit_ts_us: int


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelColumn:
    name: str
    type_oid: int
    typmod: int
    key: bool  # part of the replica identity


@dataclass(frozen=True, slots=True)
class Relation:
    relid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[RelColumn, ...]

    @property
    def qualified(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass(frozen=True, slots=True)
class TypeMessage:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relid: int
    new: RawTuple


@dataclass(frozen=True, slots=True)
class Update:
    relid: int
    old_kind: str | None  # 'K' (key columns), 'O' (whole old row: REPLICA IDENTITY FULL) or None
    old: RawTuple | None
    new: RawTuple


@dataclass(frozen=True, slots=True)
class Delete:
    relid: int
    old_kind: str  # 'K' or 'O'
    old: RawTuple


@dataclass(frozen=True, slots=True)
class Truncate:
    relids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = Begin | Commit | Origin | Relation | TypeMessage | Insert | Update | Delete | Truncate | LogicalMessage

MESSAGE_NAMES: Final = {
    "B": "Begin", "C": "Commit", "O": "Origin", "R": "Relation", "Y": "Type", "I": "Insert",
    "U": "Update", "D": "Delete", "T": "Truncate", "M": "Message",
}

_u8 = struct.Struct(">B").unpack_from
_i16 = struct.Struct(">h").unpack_from
_i32 = struct.Struct(">i").unpack_from
_u32 = struct.Struct(">I").unpack_from
_u64 = struct.Struct(">Q").unpack_from
_i64 = struct.Struct(">q").unpack_from
_begin = struct.Struct(">QqI").unpack_from
_commit = struct.Struct(">BQQq").unpack_from


class _Malformed(Exception):
    def __init__(self, pos: int, expected: str) -> None:
        super().__init__(expected)
        self.pos = pos
        self.expected = expected


def parse_tuple(buf: bytes, pos: int) -> tuple[RawTuple, int]:
    """TupleData at ``pos`` -> (raw values, position after it). Unchecked fast path.

    Values are ``bytes`` for text ('t') and binary ('b') columns, ``None`` for NULL
    and :data:`UNCHANGED` for unchanged TOAST. Raises IndexError/struct.error on
    truncated input; callers re-run :func:`_parse_tuple_checked` for the message.
    """
    n = _i16(buf, pos)[0]
    pos += 2
    out: list[Any] = []
    append = out.append
    for _ in range(n):
        kind = buf[pos]
        if kind == 116 or kind == 98:  # 't' / 'b'
            ln = _u32(buf, pos + 1)[0]
            pos += 5
            end = pos + ln
            append(buf[pos:end])
            pos = end
        elif kind == 110:  # 'n'
            append(None)
            pos += 1
        elif kind == 117:  # 'u'
            append(UNCHANGED)
            pos += 1
        else:
            raise _Malformed(pos, f"a column kind 'n', 'u', 't' or 'b', got byte 0x{kind:02x}")
    return tuple(out), pos


def _parse_tuple_checked(buf: bytes, pos: int) -> tuple[RawTuple, int]:
    size = len(buf)
    if pos + 2 > size:
        raise _Malformed(pos, "a 2-byte column count")
    n = _i16(buf, pos)[0]
    if n < 0:
        raise _Malformed(pos, f"a non-negative column count, got {n}")
    pos += 2
    out: list[Any] = []
    for i in range(n):
        if pos >= size:
            raise _Malformed(pos, f"column {i + 1} of {n}: a column kind byte")
        kind = buf[pos]
        if kind in (116, 98):
            if pos + 5 > size:
                raise _Malformed(pos + 1, f"column {i + 1} of {n}: a 4-byte value length")
            ln = _u32(buf, pos + 1)[0]
            if pos + 5 + ln > size:
                raise _Malformed(pos + 1, f"column {i + 1} of {n}: {ln} value bytes, only {size - pos - 5} left")
            out.append(buf[pos + 5 : pos + 5 + ln])
            pos += 5 + ln
        elif kind == 110:
            out.append(None)
            pos += 1
        elif kind == 117:
            out.append(UNCHANGED)
            pos += 1
        else:
            raise _Malformed(pos, f"column {i + 1} of {n}: a column kind 'n', 'u', 't' or 'b', got 0x{kind:02x}")
    return tuple(out), pos


def _cstring(buf: bytes, pos: int, what: str) -> tuple[str, int]:
    end = buf.find(b"\x00", pos)
    if end < 0:
        raise _Malformed(pos, f"a NUL-terminated {what}")
    try:
        return buf[pos:end].decode(), end + 1
    except UnicodeDecodeError:
        raise _Malformed(pos, f"a UTF-8 {what}") from None


def _need(buf: bytes, pos: int, n: int, what: str) -> None:
    if pos + n > len(buf):
        raise _Malformed(pos, f"{what} ({n} bytes, only {max(0, len(buf) - pos)} left)")


class PgOutputDecoder:
    """Stateful pgoutput decoder: message bytes -> message objects, plus the relation cache.

    ``relations`` maps relid -> the latest :class:`Relation`; ``types`` maps type OID
    -> :class:`TypeMessage` for user-defined types announced by the server.
    """

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.types: dict[int, TypeMessage] = {}

    def decode(self, data: bytes | bytearray | memoryview, lsn: int | None = None) -> Message:
        """Decode one pgoutput message (the payload of an XLogData message)."""
        buf = bytes(data)
        if not buf:
            raise ValidationError("pgoutput message: empty payload at byte 0 (expected a message type byte)")
        tag = chr(buf[0])
        try:
            return self._decode(tag, buf)
        except _Malformed as exc:
            raise self._error(tag, exc.pos, exc.expected, lsn) from None
        except (struct.error, IndexError):
            # The fast parsers do not check bounds; re-parse with checks for a precise message.
            try:
                self._decode_checked(tag, buf)
            except _Malformed as exc:
                raise self._error(tag, exc.pos, exc.expected, lsn) from None
            raise self._error(tag, len(buf), "more bytes", lsn) from None

    @staticmethod
    def _error(tag: str, pos: int, expected: str, lsn: int | None) -> ValidationError:
        name = MESSAGE_NAMES.get(tag, f"unknown (0x{ord(tag):02x})")
        where = f" at WAL position {lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}" if lsn is not None else ""
        return ValidationError(f"malformed pgoutput {name} message{where}: at byte {pos}: expected {expected}")

    def _decode(self, tag: str, buf: bytes) -> Message:
        if tag == "I":
            relid = _u32(buf, 1)[0]
            if buf[5] != 78:  # 'N'
                raise _Malformed(5, f"'N' (new tuple) marker, got 0x{buf[5]:02x}")
            new, end = parse_tuple(buf, 6)
            self._done(buf, end)
            return Insert(relid, new)
        if tag == "U":
            relid = _u32(buf, 1)[0]
            pos = 5
            kind = buf[pos]
            old_kind: str | None = None
            old: RawTuple | None = None
            if kind == 75 or kind == 79:  # 'K' / 'O'
                old_kind = chr(kind)
                old, pos = parse_tuple(buf, pos + 1)
                kind = buf[pos]
            if kind != 78:
                raise _Malformed(pos, f"'K', 'O' or 'N' tuple marker, got 0x{kind:02x}")
            new, end = parse_tuple(buf, pos + 1)
            self._done(buf, end)
            return Update(relid, old_kind, old, new)
        if tag == "D":
            relid = _u32(buf, 1)[0]
            kind = buf[5]
            if kind != 75 and kind != 79:
                raise _Malformed(5, f"'K' or 'O' tuple marker, got 0x{kind:02x}")
            old, end = parse_tuple(buf, 6)
            self._done(buf, end)
            return Delete(relid, chr(kind), old)
        if tag == "B":
            _need(buf, 1, 20, "final LSN, commit timestamp and xid")
            final_lsn, ts, xid = _begin(buf, 1)
            self._done(buf, 21)
            return Begin(final_lsn, ts + PG_EPOCH_US, xid)
        if tag == "C":
            _need(buf, 1, 25, "flags, commit LSN, end LSN and commit timestamp")
            flags, commit_lsn, end_lsn, ts = _commit(buf, 1)
            self._done(buf, 26)
            return Commit(flags, commit_lsn, end_lsn, ts + PG_EPOCH_US)
        if tag == "R":
            return self._relation(buf)
        if tag == "Y":
            _need(buf, 1, 4, "type OID")
            oid = _u32(buf, 1)[0]
            ns, pos = _cstring(buf, 5, "namespace")
            name, pos = _cstring(buf, pos, "type name")
            self._done(buf, pos)
            t = TypeMessage(oid, ns or "pg_catalog", name)
            self.types[oid] = t
            return t
        if tag == "T":
            _need(buf, 1, 5, "relation count and options")
            n = _i32(buf, 1)[0]
            if n < 0:
                raise _Malformed(1, f"a non-negative relation count, got {n}")
            opts = buf[5]
            _need(buf, 6, 4 * n, f"{n} relation OIDs")
            relids = struct.unpack_from(f">{n}I", buf, 6)
            self._done(buf, 6 + 4 * n)
            return Truncate(tuple(relids), bool(opts & 1), bool(opts & 2))
        if tag == "O":
            _need(buf, 1, 8, "origin LSN")
            olsn = _u64(buf, 1)[0]
            name, pos = _cstring(buf, 9, "origin name")
            self._done(buf, pos)
            return Origin(olsn, name)
        if tag == "M":
            _need(buf, 1, 9, "flags and message LSN")
            flags = buf[1]
            mlsn = _u64(buf, 2)[0]
            prefix, pos = _cstring(buf, 10, "message prefix")
            _need(buf, pos, 4, "content length")
            ln = _u32(buf, pos)[0]
            _need(buf, pos + 4, ln, "message content")
            self._done(buf, pos + 4 + ln)
            return LogicalMessage(bool(flags & 1), mlsn, prefix, buf[pos + 4 : pos + 4 + ln])
        raise _Malformed(0, "a pgoutput message type (one of B C R Y I U D T O M)")

    def _decode_checked(self, tag: str, buf: bytes) -> None:
        """Bounds-checked re-parse of row messages; raises _Malformed at the first problem."""
        if tag in ("I", "U", "D"):
            _need(buf, 1, 4, "relation OID")
            _need(buf, 5, 1, "tuple marker")
            pos = 5
            if tag == "U" and buf[pos] in (75, 79):
                _, pos = _parse_tuple_checked(buf, pos + 1)
                _need(buf, pos, 1, "'N' tuple marker")
            _, pos = _parse_tuple_checked(buf, pos + 1)
            self._done(buf, pos)
        elif tag == "R":
            self._relation(buf)

    def _relation(self, buf: bytes) -> Relation:
        _need(buf, 1, 4, "relation OID")
        relid = _u32(buf, 1)[0]
        ns, pos = _cstring(buf, 5, "namespace")
        name, pos = _cstring(buf, pos, "relation name")
        _need(buf, pos, 3, "replica identity and column count")
        ident = chr(buf[pos])
        if ident not in "dnfi":
            raise _Malformed(pos, f"a replica identity 'd', 'n', 'f' or 'i', got {ident!r}")
        ncols = _i16(buf, pos + 1)[0]
        if ncols < 0:
            raise _Malformed(pos + 1, f"a non-negative column count, got {ncols}")
        pos += 3
        cols = []
        for i in range(ncols):
            _need(buf, pos, 1, f"column {i + 1} flags")
            flags = buf[pos]
            cname, pos = _cstring(buf, pos + 1, f"column {i + 1} name")
            _need(buf, pos, 8, f"column {i + 1} type OID and typmod")
            oid = _u32(buf, pos)[0]
            typmod = _i32(buf, pos + 4)[0]
            pos += 8
            cols.append(RelColumn(cname, oid, typmod, bool(flags & 1)))
        self._done(buf, pos)
        rel = Relation(relid, ns or "pg_catalog", name, ident, tuple(cols))
        self.relations[relid] = rel
        return rel

    @staticmethod
    def _done(buf: bytes, pos: int) -> None:
        if pos != len(buf):
            raise _Malformed(pos, f"end of message, found {len(buf) - pos} trailing bytes")
