"""The compiled row decoder's readers against the binary formats as MySQL documents them.

Values are encoded here from the documentation, not by a server (the equivalence test on a
real binlog is ``test_mysql_rowdecoder.py``):

* DECIMAL -- MySQL Reference Manual, "Precision Math: DECIMAL Data Type Characteristics":
  nine decimal digits per four bytes, leftover digits in 1-4 bytes (1-2 digits: 1 byte, 3-4: 2,
  5-6: 3, 7-9: 4), integer and fraction parts packed separately, big-endian; MySQL's
  ``decimal2bin`` (strings/decimal.cc) then inverts every byte of a negative number and flips
  the first bit.
* DATETIME(fsp) / TIMESTAMP(fsp) -- MySQL Internals, "Date and Time Data Type Representation":
  DATETIME is 5 bytes (1 sign bit, 17 bits year*13+month, 5 day, 5 hour, 6 minute, 6 second),
  TIMESTAMP 4 bytes of seconds since the epoch (UTC), both big-endian and followed by the
  fraction in 0-3 bytes (fsp 1-2: 1 byte of hundredths, 3-4: 2 bytes of ten-thousandths, 5-6:
  3 bytes of microseconds).

Each reader is called many times on values that share dates and seconds, so the per-column
caches are exercised too; the inline forms the generated image uses are checked the same way.
"""

from __future__ import annotations

import datetime as dt

from hypothesis import given, settings
from hypothesis import strategies as st

from kappaflow.connectors.mysql.rowdecoder import RowDecoder, _compile_image, _datetime2, _decimal, _timestamp2

_DIG2BYTES = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)
_EPOCH = dt.datetime(1970, 1, 1)


def _encode_decimal(unscaled: int, precision: int, scale: int) -> bytes:
    intg = precision - scale
    digits = str(abs(unscaled)).rjust(precision, "0")
    ip, fp = digits[:intg], digits[intg:]
    intg0, intg0x = divmod(intg, 9)
    frac0, frac0x = divmod(scale, 9)
    out = b""
    if intg0x:
        out += int(ip[:intg0x]).to_bytes(_DIG2BYTES[intg0x], "big")
    for k in range(intg0):
        out += int(ip[intg0x + 9 * k: intg0x + 9 * k + 9]).to_bytes(4, "big")
    for k in range(frac0):
        out += int(fp[9 * k: 9 * k + 9]).to_bytes(4, "big")
    if frac0x:
        out += int(fp[9 * frac0:]).to_bytes(_DIG2BYTES[frac0x], "big")
    if unscaled < 0:
        out = bytes(b ^ 0xFF for b in out)
    return bytes([out[0] ^ 0x80]) + out[1:]


def _expected_decimal(unscaled: int, scale: int) -> str:
    sign = "-" if unscaled < 0 else ""
    ip, fp = divmod(abs(unscaled), 10 ** scale)
    return sign + str(ip) + (f".{fp:0{scale}d}" if scale else "")


@st.composite
def _decimals(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    precision = draw(st.integers(1, 65))
    scale = draw(st.integers(0, min(precision, 30)))
    bound = 10 ** precision - 1
    values = draw(st.lists(st.one_of(st.integers(-bound, bound), st.sampled_from([0, bound, -bound, 1, -1])),
                           min_size=1, max_size=20))
    return precision, scale, values


@settings(max_examples=300, deadline=None)
@given(_decimals())
def test_decimal_reader_follows_the_documented_format(case: tuple[int, int, list[int]]) -> None:
    precision, scale, values = case
    read = _decimal(precision, scale, None)
    for u in values:
        raw = _encode_decimal(u, precision, scale)
        assert read(b"\x00" + raw + b"\xff", 1) == (_expected_decimal(u, scale), 1 + len(raw)), (precision, scale, u)


def _fraction(us: int, fsp: int) -> tuple[bytes, int]:
    """The stored fraction bytes and the microseconds they stand for."""
    n = (fsp + 1) // 2
    if n == 0:
        return b"", 0
    unit = {1: 10_000, 2: 100, 3: 1}[n]
    kept = us // unit // 10 ** ((2 * n - fsp) if fsp % 2 else 0) * 10 ** ((2 * n - fsp) if fsp % 2 else 0)
    return kept.to_bytes(n, "big"), kept * unit


def _encode_datetime(v: dt.datetime, fsp: int) -> tuple[bytes, int]:
    ym = v.year * 13 + v.month
    packed = (1 << 39) | ym << 22 | v.day << 17 | v.hour << 12 | v.minute << 6 | v.second
    frac, us = _fraction(v.microsecond, fsp)
    return packed.to_bytes(5, "big") + frac, us


_times = st.datetimes(min_value=dt.datetime(1000, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59))


@settings(max_examples=200, deadline=None)
@given(fsp=st.integers(0, 6), nullable=st.booleans(), values=st.lists(_times, min_size=1, max_size=30))
def test_datetime_reader_follows_the_documented_format(fsp: int, nullable: bool, values: list[dt.datetime]) -> None:
    read = _datetime2(fsp, nullable)
    image = _compile_image(("c",), (read,), (("datetime2", (fsp + 1) // 2, read),))
    for v in values + values:  # twice: the second time every date comes from the cache
        raw, us = _encode_datetime(v, fsp)
        expected = (v.replace(microsecond=0) - _EPOCH) // dt.timedelta(microseconds=1) + us
        assert read(raw, 0) == (expected, len(raw))
        assert image(b"\x00" + raw, 0) == ({"c": expected}, 1 + len(raw))
    zero = bytes([0x80]) + bytes(4 + (fsp + 1) // 2)  # 0000-00-00 00:00:00
    assert read(zero, 0)[0] == (None if nullable else 0)
    assert image(b"\x00" + zero, 0)[0] == {"c": None if nullable else 0}


@settings(max_examples=200, deadline=None)
@given(fsp=st.integers(0, 6), nullable=st.booleans(),
       values=st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 999_999)), min_size=1, max_size=30))
def test_timestamp_reader_follows_the_documented_format(fsp: int, nullable: bool,
                                                        values: list[tuple[int, int]]) -> None:
    read = _timestamp2(fsp, nullable)
    image = _compile_image(("c",), (read,), (("timestamp2", (fsp + 1) // 2, read),))
    for sec, micro in values + values:
        frac, us = _fraction(micro, fsp)
        raw = sec.to_bytes(4, "big") + frac
        if sec == 0 and us == 0:
            expected = None if nullable else "1970-01-01T00:00:00Z"
        else:  # Debezium's ZonedTimestamp: ISO-8601 in UTC, the fraction only when there is one
            expected = (_EPOCH + dt.timedelta(seconds=sec, microseconds=us)).isoformat() + "Z"
        assert read(raw, 0) == (expected, len(raw))
        assert image(b"\x00" + raw, 0) == ({"c": expected}, 1 + len(raw))


def test_generated_image_reads_nulls_and_every_inline_kind() -> None:
    """A row with NULLs takes the checked branch of the generated function; without, the straight one."""
    import struct

    from kappaflow.connectors.mysql.rowdecoder import _enum, _int_reader, _string

    s32 = struct.Struct("<i").unpack_from
    readers = (_int_reader(s32, 4), _enum(1, ["", "a", "b"]), _string(1, "utf-8"), _string(2, "utf-8", json=True))
    inline = (("unpack", s32, 4), ("enum1", ("", "a", "b")), ("str", 1, "utf-8"), ("json", 2))
    names = ("i", "e", "s", "j")
    image = _compile_image(names, readers, inline)
    body = struct.pack("<i", -7) + b"\x02" + b"\x03h\xc3\xa9" + b"\x0b\x00" + b'{"a": [1 ]}'
    assert image(b"\x00" + body, 0) == ({"i": -7, "e": "b", "s": "hé", "j": '{"a":[1]}'}, 1 + len(body))
    nulls = image(b"\x0a" + struct.pack("<i", 5) + b"\x03h\xc3\xa9", 0)  # columns 1 and 3 NULL
    assert nulls == ({"i": 5, "e": None, "s": "hé", "j": None}, 9)
    assert RowDecoder(names, readers, inline).image(b"\x0f", 0) == (dict.fromkeys(names), 1)
