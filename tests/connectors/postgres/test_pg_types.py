"""Text-format converters and the generated fast row parser (pure unit tests)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import orjson
import pytest
from pg_helpers import tup

from kappaflow.connectors.postgres import types as t
from kappaflow.connectors.postgres.decoder import UNCHANGED, parse_tuple
from kappaflow.connectors.postgres.rows import (
    TableCodec,
    _js_timestamptz,
    _js_timestamptz_slow,
    column_codec,
    encode_envelope,
    tx_block,
)
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import SourceError, ValidationError
from kappaflow.events import JSON_NULL, ChangeEvent, EventCodec, Op, SourceInfo, TransactionInfo


@pytest.mark.parametrize(
    ("text", "elem", "expected"),
    [
        (b"{}", int, []),
        (b"{1,NULL,3}", int, [1, None, 3]),
        (b"{{1,2},{3,4}}", int, [[1, 2], [3, 4]]),
        (b'{"a b","c,d","e\\"f",NULL,"NULL","\\\\"}', t._text, ["a b", "c,d", 'e"f', None, "NULL", "\\"]),
        (b"[0:1]={7,8}", int, [7, 8]),
        (b'{"{x}",y}', t._text, ["{x}", "y"]),
    ],
)
def test_array_text_format(text: bytes, elem: t.Converter, expected: list[object]) -> None:
    assert t.parse_array(text, elem) == expected


def test_array_garbage_is_an_error() -> None:
    with pytest.raises(ValueError):
        t.parse_array(b"{1,2", int)
    with pytest.raises(ValueError):
        t.parse_array(b"{1}x", int)


@pytest.mark.parametrize(
    ("text", "micros"),
    [
        (b"P1D", 86_400_000_000),
        (b"PT1H2M3.5S", 3_723_500_000),
        (b"P-1DT-2H", -(86_400 + 7200) * 1_000_000),
        (b"PT-0.000001S", -1),
        (b"P1Y2M", round(14 * 365.25 / 12 * 86_400_000_000)),
        (b"PT0S", 0),
    ],
)
def test_interval_iso8601(text: bytes, micros: int) -> None:
    assert t.interval_micros(text) == micros


def test_scalars() -> None:
    assert t._bytea(b"\\x00ff") == b"\x00\xff"
    assert t._bits(b"1010") == bytes([0b1010])  # rightmost bit is bit 0; bytes little-endian (Debezium Bits)
    assert t._bits(b"100000001") == bytes([1, 1])
    assert t._date(b"infinity") == dt.date.max
    assert t._time(b"24:00:00") == dt.time.max
    assert t._timestamptz(b"2024-01-02 03:04:05.5+00") == dt.datetime(2024, 1, 2, 3, 4, 5, 500000,
                                                                       tzinfo=dt.UTC)
    assert t._json(b"null") is JSON_NULL
    assert t._json(b'{"a": 123456789012345678901234567890}') == {"a": 123456789012345678901234567890}
    assert t._numeric(b"NaN").is_nan()


@pytest.mark.parametrize("text", [
    b"2026-11-22 14:11:25.123456+00", b"2026-11-22 14:11:25+00", b"2026-11-22 14:11:25.1+00",
    b"0099-01-01 00:00:00.000001+00", b"infinity", b"-infinity",
])
def test_timestamptz_fast_path_equals_datetime_path(text: bytes) -> None:
    assert _js_timestamptz(text) == _js_timestamptz_slow(text)


def test_timestamps_python_cannot_hold_are_errors_not_garbage() -> None:
    for text in (b"12345-01-01 00:00:00+00", b"2000-01-01 00:00:00+00 BC"):
        with pytest.raises(ValueError):
            _js_timestamptz(text)


def _codec() -> TableCodec:
    cols = [
        column_codec("id", t.INT8, -1, optional=False),
        column_codec("name", t.TEXT, -1),
        column_codec("amount", t.NUMERIC, (12 << 16 | 2) + 4),
        column_codec("created", t.TIMESTAMPTZ, -1),
        column_codec("active", t.BOOL, -1),
        column_codec("doc", t.JSONB, -1),
        column_codec("tags", 1009, -1),  # text[]
        column_codec("f", t.FLOAT8, -1),
        column_codec("u", t.UUID, -1),
        column_codec("vc", t.VARCHAR, -1),
    ]
    return TableCodec(source="src", db="db", schema="public", table="t", columns=cols, key=["id"],
                      codec=EventCodec())


def test_generated_parser_matches_generic_path() -> None:
    tc = _codec()
    rows = [
        [b"1", b"a", b"1.25", b"2024-01-02 03:04:05+00", b"t", b'{"k": [1, 2]}', b'{x,"y z"}', b"1e+100",
         b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", b"plain"],
        [b"2", None, None, None, None, None, None, None, None, None],
        [b"3", "é".encode() * 40, b"-0.50", b"2024-01-02 03:04:05.000001+00", b"f", b"null", b"{}", b"NaN",
         None, 'tab\t "q" \\ \x01 \u2028 é'.encode()],
        [b"-9223372036854775808", b'\x7f', b"NaN", b"infinity", b"t", b'"s"', rb'{"\\"}', b"-Infinity", None,
         b"x" * 300],
    ]
    for raw in rows:
        buf = b"xx" + tup(*raw)
        fast = tc.fast(buf, 2)
        assert fast is not None
        generic, end = parse_tuple(buf, 2)
        assert fast[0] == tc.json_row(generic)
        assert fast[1] == end == len(buf)
        fj = tc.fast_json(buf, 2)
        assert fj is not None
        assert fj[0] == orjson.dumps(tc.json_row(generic))  # the same bytes as the dict path
        assert fj[1] == tc.key_of(tc.json_row(generic))
        assert fj[2] == len(buf)
        assert tc.values_json(raw)[:2] == fj[:2]  # the snapshot's builder agrees
    # unchanged TOAST and other shapes are left to the generic path
    unchanged = b"xx" + tup(b"1", UNCHANGED, None, None, None, None, None, None, None, None)
    assert tc.fast(unchanged, 2) is None and tc.fast_json(unchanged, 2) is None
    assert tc.fast(b"xx" + tup(b"1"), 2) is None and tc.fast_json(b"xx" + tup(b"1"), 2) is None


def test_bad_value_names_the_column() -> None:
    tc = _codec()
    with pytest.raises(ValidationError, match=r"column 'id' \(int8\): cannot convert 'x1'"):
        tc.json_row((b"x1", b"a", b"1", None, None, None, None, None, None, None))
    with pytest.raises(ValidationError, match=r"column 'tags' \(_text\): cannot convert '\{a'"):
        tc.json_row((b"1", b"a", b"1", None, None, None, b"{a", None, None, None))


def test_envelope_bytes_equal_the_event_codec() -> None:
    tc = _codec()
    codec = EventCodec()
    raw = (b"7", b'quote " and \\', b"10.00", b"2024-01-02 03:04:05.5+00", b"t", b'{"b": 1, "a": [true]}',
           b'{"a b",NULL}', b"0.25", b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", None)
    py = tc.py_row(raw)
    assert py["amount"] == Decimal("10.00")
    pos = PgPosition(0x1234, 3)
    # Debezium's lsn is the change's own LSN, sequence [last committed LSN, this LSN]
    extra = {"sequence": '["4000","4400"]', "lsn": 4400}
    ev = ChangeEvent(Op.UPDATE, {"id": 7}, {"id": 7}, py,
                     SourceInfo("postgresql", "src", "db", "public", "t", pos, 1700, 99, extra=extra),
                     1800, TransactionInfo("99:4660", 4, 2), unavailable=("doc",))
    js = tc.json_row(raw)
    prefix = tc.source_prefix(1700, "false", 99, 0x1234, last_commit_lsn=4000, change_lsn=4400)
    mine = encode_envelope(orjson.dumps({"id": 7}), orjson.dumps(js), prefix,
                           3, False, b"u", 1800, tx_block("99:4660", 4, 2), ("doc",))
    assert mine == codec.encode_value(ev, tc.schema)
    assert codec.decode_value(mine, tc.schema).source == ev.source
    assert tc.key_of(js) == codec.encode_key({"id": 7}, tc.schema)


def test_offset_round_trip_and_malformed_offset() -> None:
    from kappaflow.connectors.postgres.offset import PgOffset, SnapshotProgress, TableProgress

    off = PgOffset(slot="s", lsn=123, phase="snapshot", last_commit_lsn=100, events=7,
                   snapshot=SnapshotProgress(lsn=120, next_index=5,
                                             tables={"public.t": TableProgress(False, ["4", "a b"], 5)}))
    assert PgOffset.from_dict(orjson.loads(orjson.dumps(off.to_dict()))) == off
    with pytest.raises(ValidationError, match="postgres offset: malformed stored offset"):
        PgOffset.from_dict({"kind": "pg", "slot": "s"})
    with pytest.raises(ValidationError, match="kind 'binlog' is not 'pg'"):
        PgOffset.from_dict({"kind": "binlog", "slot": "s", "lsn": 1})


@pytest.mark.parametrize(("info", "match"), [
    ({"plugin": "test_decoding"}, "uses plugin 'test_decoding', not pgoutput"),
    ({"database": "other"}, "belongs to database 'other'"),
    ({"wal_status": "lost"}, r"was invalidated \(wal_status=lost\).*kappaflow capture SOURCE --resnapshot"),
    ({"active": True, "active_pid": 4242}, r"in use by another process \(PID 4242\)"),
])
def test_unusable_slots_are_explained(info: dict[str, object], match: str) -> None:
    from kappaflow.connectors.postgres.slots import SlotInfo, check_slot_usable

    base: dict[str, object] = dict(name="kappaflow_x", plugin="pgoutput", database="shop", active=False,
                                   active_pid=None, confirmed_flush_lsn=100, restart_lsn=90, wal_status="reserved",
                                   lag_bytes=0)
    base.update(info)
    with pytest.raises(SourceError, match=match) as ei:
        check_slot_usable(SlotInfo(**base), "shop", "postgresql://u@h:5432/shop")  # type: ignore[arg-type]
    assert "password" not in str(ei.value)
    check_slot_usable(SlotInfo(**{**base, **{"plugin": "pgoutput", "database": "shop", "active": False,
                                             "wal_status": "reserved"}}), "shop", "x")  # type: ignore[arg-type]
