"""Record-batch encoding and batch partitioning for the embedded log.

Records are stored like Kafka stores them: many records per stored batch, so the
per-row cost of SQLite (B-tree insert, record formatting) is paid once per batch
instead of once per record. A batch is one SQLite row ``(base, last, n, idx, data, crc)``:

* ``idx``: a little-endian index, ``<BqqI`` header (format version, base offset,
  last offset, record count n) followed by six arrays of n items: offset deltas
  (uint32), timestamps (int64), key lengths, value lengths (int32, -1 = null),
  header-blob lengths (int32) and per-record CRC32s (uint32).
* ``data``: all keys, then all values, then all header blobs, concatenated.
* ``crc``: CRC32 of ``idx``, so damage to lengths/offsets/timestamps is caught;
  each record's CRC32 covers its key, value and header bytes, so a flipped bit in
  a payload is named by its exact offset while the records before it stay readable.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import fields
from itertools import accumulate, repeat
from typing import Any, NamedTuple, TypeVar

from kappaflow.errors import ValidationError
from kappaflow.log.base import Appended, Headers, LogRecord

FORMAT_VERSION = 1
_HEADER = struct.Struct("<BqqI")
_BIG_ENDIAN = sys.byteorder == "big"
_E = b""
_crc32 = zlib.crc32


class BatchDamaged(Exception):
    """Raised by `decode`; `offset` is the first offset that cannot be trusted.

    `records` holds the records before the damage that were decoded and verified.
    """

    def __init__(self, reason: str, offset: int, records: list[LogRecord]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset
        self.records = records


def _le(a: array) -> bytes:
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(code: str, buf: bytes | memoryview) -> array:
    a = array(code)
    a.frombytes(buf)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a


# --- bulk construction of result objects ---------------------------------------------------
_T = TypeVar("_T")
_new = object.__new__


def _slot_setters(cls: type) -> list[Any] | None:
    """Slot setters in field order, when `cls` is a plain slotted dataclass (else None)."""
    names = [f.name for f in fields(cls)]
    if getattr(cls, "__slots__", None) != tuple(names) or hasattr(cls, "__post_init__"):
        return None
    return [getattr(cls, name).__set__ for name in names]


_SETTERS: dict[type, list[Any] | None] = {cls: _slot_setters(cls) for cls in (Appended, LogRecord)}


def build(cls: type[_T], n: int, *columns: Iterable[Any]) -> list[_T]:
    """n instances of the frozen dataclass `cls` from one iterable per field, in field order.

    The same objects `cls(*row)` would give, built column by column in C loops (slot
    setters driven by map) instead of one Python-level __init__ per record: reading and
    appending make hundreds of thousands of these, and __init__ was half the read time.
    Falls back to __init__ if `cls` ever stops being a plain slotted dataclass.
    """
    setters = _SETTERS.get(cls)
    if setters is None:
        return list(map(cls, *columns))
    objs: list[_T] = list(map(_new, repeat(cls, n)))
    for setter, column in zip(setters, columns, strict=True):
        deque(map(setter, objs, column), 0)
    return objs


# --- headers ---------------------------------------------------------------------------------
_HNAME = struct.Struct("<H")
_HVAL = struct.Struct("<i")


def encode_headers(headers: Headers, index: int) -> bytes:
    """Headers as ``(u16 name length, utf-8 name, i32 value length, value)*``."""
    parts: list[bytes] = []
    try:
        for name, value in headers:
            if not isinstance(name, str):
                raise ValidationError(
                    f"record {index}: header name: expected str, got {type(name).__name__}")
            if not isinstance(value, bytes):
                raise ValidationError(
                    f"record {index}: header {name!r} value: expected bytes, got {type(value).__name__}")
            raw = name.encode()
            if len(raw) > 0xFFFF:
                raise ValidationError(f"record {index}: header name longer than 65535 bytes")
            parts += (_HNAME.pack(len(raw)), raw, _HVAL.pack(len(value)), value)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValidationError):
            raise
        raise ValidationError(
            f"record {index}: headers: expected a sequence of (str, bytes) pairs, got {headers!r:.80}"
        ) from None
    return _E.join(parts)


def decode_headers(blob: bytes) -> Headers:
    out: list[tuple[str, bytes]] = []
    pos = 0
    end = len(blob)
    while pos < end:
        (nlen,) = _HNAME.unpack_from(blob, pos)
        pos += 2
        name = blob[pos : pos + nlen].decode()
        pos += nlen
        (vlen,) = _HVAL.unpack_from(blob, pos)
        pos += 4
        out.append((name, blob[pos : pos + vlen]))
        pos += vlen
    return tuple(out)


def lengths(items: Sequence[bytes | None]) -> list[int]:
    """len() of each item, -1 for None."""
    if None in items:
        return [-1 if x is None else len(x) for x in items]
    return list(map(len, items))  # type: ignore[arg-type]


# --- encoding --------------------------------------------------------------------------------
class Batch(NamedTuple):
    """One stored batch row."""

    base: int
    last: int
    n: int
    idx: bytes
    data: bytes
    crc: int


def encode(
    offsets: Sequence[int] | None,
    base: int,
    keys: Sequence[bytes | None],
    values: Sequence[bytes | None],
    timestamps: Sequence[int],
    headers: Sequence[bytes] | None = None,
    crcs: Sequence[int] | None = None,
    klens: Sequence[int] | None = None,
    vlens: Sequence[int] | None = None,
) -> Batch:
    """Encode one batch. `offsets` None means consecutive offsets from `base`.

    `headers` are already-encoded header blobs (None: no record has headers); `crcs`
    are the records' CRCs when re-encoding verified records (compaction); `klens`/`vlens`
    are the key/value lengths (-1 = None) when the caller has them already.
    """
    n = len(keys)
    if offsets is None:
        deltas = array("I", range(n))
        last = base + n - 1
    else:
        base = offsets[0]
        last = offsets[-1]
        deltas = array("I", [o - base for o in offsets])
    klen = array("i", lengths(keys) if klens is None else klens)
    vlen = array("i", lengths(values) if vlens is None else vlens)
    if crcs is None:
        # CRC32 of key || value || headers (a CRC chained over parts equals the CRC of their
        # concatenation); joined and checksummed in C loops when no key or value is None.
        if None in keys or None in values:
            if headers is None:
                crcs = [_crc32(v or _E, _crc32(k or _E)) for k, v in zip(keys, values, strict=True)]
            else:
                crcs = [
                    _crc32(h, _crc32(v or _E, _crc32(k or _E)))
                    for k, v, h in zip(keys, values, headers, strict=True)
                ]
        elif headers is None:
            crcs = list(map(_crc32, map(_E.join, zip(keys, values, strict=True))))  # type: ignore[arg-type]
        else:
            crcs = list(map(_crc32, map(_E.join, zip(keys, values, headers, strict=True))))  # type: ignore[arg-type]
    hlen = array("i", bytes(4 * n)) if headers is None else array("i", map(len, headers))
    idx = b"".join((
        _HEADER.pack(FORMAT_VERSION, base, last, n),
        _le(deltas),
        _le(array("q", timestamps)),
        _le(klen),
        _le(vlen),
        _le(hlen),
        _le(array("I", crcs)),
    ))
    chunks = list(filter(None, keys))
    chunks += filter(None, values)
    if headers is not None:
        chunks += filter(None, headers)
    return Batch(base, last, n, idx, b"".join(chunks), _crc32(idx))


# --- decoding --------------------------------------------------------------------------------
class Decoded(NamedTuple):
    offsets: list[int]
    timestamps: array
    klen: array
    vlen: array
    hlen: array
    crcs: array


def decode_index(base: int, last: int, n: int, idx: bytes, crc: int) -> Decoded:
    """Parse and verify a batch index; ValueError with the reason when it is damaged."""
    if _crc32(idx) != crc:
        raise ValueError("batch index CRC32 mismatch")
    if len(idx) != _HEADER.size + 28 * n:
        raise ValueError(f"batch index is {len(idx)} bytes, expected {_HEADER.size + 28 * n} for {n} records")
    version, hbase, hlast, hn = _HEADER.unpack_from(idx)
    if version != FORMAT_VERSION:
        raise ValueError(f"unknown batch format version {version}")
    if (hbase, hlast, hn) != (base, last, n):
        raise ValueError(f"batch row says base={base} last={last} n={n}, index says {hbase}/{hlast}/{hn}")
    mv = memoryview(idx)
    p = _HEADER.size
    deltas = _from_le("I", mv[p : p + 4 * n])
    p += 4 * n
    ts = _from_le("q", mv[p : p + 8 * n])
    p += 8 * n
    klen = _from_le("i", mv[p : p + 4 * n])
    p += 4 * n
    vlen = _from_le("i", mv[p : p + 4 * n])
    p += 4 * n
    hlen = _from_le("i", mv[p : p + 4 * n])
    p += 4 * n
    crcs = _from_le("I", mv[p : p + 4 * n])
    offsets = [base + d for d in deltas]
    if n and offsets[-1] != last:
        raise ValueError("batch offsets do not end at the batch's last offset")
    return Decoded(offsets, ts, klen, vlen, hlen, crcs)


def _cuts(lens: Sequence[int], start: int) -> list[int]:
    """Start positions of pieces of `lens` (-1 = None, zero bytes) from `start`, plus the end."""
    if min(lens, default=0) >= 0:
        return list(accumulate(lens, initial=start))
    return list(accumulate((ln if ln > 0 else 0 for ln in lens), initial=start))


def _cut(data: bytes, lens: Sequence[int], cuts: list[int], lo: int, hi: int) -> list[bytes | None]:
    if min(lens[lo:hi], default=0) >= 0:
        return [data[a:b] for a, b in zip(cuts[lo:hi], cuts[lo + 1 : hi + 1], strict=True)]
    return [None if ln < 0 else data[a:b]
            for a, b, ln in zip(cuts[lo:hi], cuts[lo + 1 : hi + 1], lens[lo:hi], strict=True)]


def decode_fields(
    d: Decoded, data: bytes, lo: int = 0, hi: int | None = None, *, strict: bool = True
) -> tuple[list[bytes | None], list[bytes | None], list[bytes]]:
    """Keys, values and header blobs of records [lo, hi) of the batch (CRCs not checked).

    With `strict`, ValueError when the data blob's size differs from what the index
    accounts for (the blob was cut or grew).
    """
    hi = len(d.offsets) if hi is None else hi
    kc = _cuts(d.klen, 0)
    vc = _cuts(d.vlen, kc[-1])
    hc = _cuts(d.hlen, vc[-1])
    if strict and hc[-1] != len(data):
        raise ValueError(f"batch data is {len(data)} bytes, index accounts for {hc[-1]}")
    keys = _cut(data, d.klen, kc, lo, hi)
    values = _cut(data, d.vlen, vc, lo, hi)
    if any(d.hlen[lo:hi]):
        heads: list[bytes] = [h or _E for h in _cut(data, d.hlen, hc, lo, hi)]
    else:
        heads = [_E] * (hi - lo)
    return keys, values, heads


def first_bad(d: Decoded, keys: Sequence[bytes | None], values: Sequence[bytes | None],
              heads: Sequence[bytes], lo: int = 0) -> int | None:
    """Batch index of the first record whose CRC32 does not match, or None.

    `keys`/`values`/`heads` are the fields of records [lo, lo + len(keys)).
    """
    computed = [
        _crc32(h, _crc32(v or _E, _crc32(k or _E))) for k, v, h in zip(keys, values, heads, strict=True)
    ]
    stored = d.crcs[lo : lo + len(keys)].tolist()
    if computed == stored:
        return None
    for i, (a, b) in enumerate(zip(computed, stored, strict=True)):
        if a != b:
            return lo + i
    return None  # pragma: no cover


def decode(
    topic: str, partition: int, row: tuple[int, int, int, bytes, bytes, int], start: int, limit: int
) -> list[LogRecord]:
    """Verified LogRecords of a batch row with offset >= start, at most `limit`.

    Raises BatchDamaged carrying the verified records before the damage.
    """
    base, last, n, idx, data, crc = row
    if n == 1 and base >= start and limit >= 1:
        single = _decode_single(topic, partition, row)
        if single is not None:
            return [single]
    try:
        d = decode_index(base, last, n, idx, crc)
    except (ValueError, struct.error) as exc:
        raise BatchDamaged(str(exc), max(base, start), []) from None
    lo = bisect_left(d.offsets, start)
    hi = min(n, lo + limit)
    if lo >= hi:
        return []
    reason = "record CRC32 mismatch"
    try:
        keys, values, heads = decode_fields(d, data, lo, hi)
    except ValueError as exc:
        # Lengths are CRC-protected, so a size mismatch means the payload blob was cut or
        # grew: trust the records whose bytes still verify, up to the first that does not.
        reason = str(exc)
        keys, values, heads = decode_fields(d, data, lo, hi, strict=False)
        bad = first_bad(d, keys, values, heads, lo)
    else:
        bad = first_bad(d, keys, values, heads, lo)
    if bad is None:
        return _records(topic, partition, d, keys, values, heads, lo, hi)
    good = _records(topic, partition, d, keys[: bad - lo], values[: bad - lo], heads[: bad - lo], lo, bad)
    raise BatchDamaged(reason, d.offsets[bad], good)


_SINGLE = struct.Struct("<BqqIIqiiiI")  # the whole index of a one-record batch


def _decode_single(topic: str, partition: int, row: tuple[int, int, int, bytes, bytes, int]) -> LogRecord | None:
    """Fast path for one-record batches (small appends); None: take the general path,
    which also produces the precise damage report."""
    base, last, _, idx, data, crc = row
    if len(idx) != _SINGLE.size or _crc32(idx) != crc:
        return None
    version, hbase, hlast, hn, delta, ts, kl, vl, hl, rcrc = _SINGLE.unpack(idx)
    if (version, hbase, hlast, hn, delta) != (FORMAT_VERSION, base, last, 1, 0) or base != last:
        return None
    k_end = max(kl, 0)
    v_end = k_end + max(vl, 0)
    if v_end + hl != len(data):
        return None
    key = data[:k_end] if kl >= 0 else None
    value = data[k_end:v_end] if vl >= 0 else None
    head = data[v_end:]
    if _crc32(head, _crc32(value or _E, _crc32(key or _E))) != rcrc:
        return None
    return LogRecord(topic, partition, base, key, value, decode_headers(head) if hl else (), ts)


def _records(topic: str, partition: int, d: Decoded, keys: Sequence[bytes | None],
             values: Sequence[bytes | None], heads: Sequence[bytes], lo: int, hi: int) -> list[LogRecord]:
    """LogRecords for batch records [lo, hi); the field lists start at lo."""
    if lo >= hi:
        return []
    hs: list[Headers] = [decode_headers(h) if h else () for h in heads] if any(d.hlen[lo:hi]) else [()] * (hi - lo)
    n = hi - lo
    if not (len(keys) == len(values) == len(hs) == n):
        raise ValueError("batch field lists differ in length")  # pragma: no cover - a bug guard
    return build(LogRecord, n, repeat(topic, n), repeat(partition, n), d.offsets[lo:hi], keys, values, hs,
                 d.timestamps[lo:hi])


# --- partitioning ----------------------------------------------------------------------------
