"""EventCodec: round trips for every type (hypothesis), all decimal modes, with and
without the schema part; NULL versus absent; keys and tombstones; bad input."""

from __future__ import annotations

import math
import os
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kappaflow.connectors.ledger.source_info import LedgerPosition
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import ValidationError
from kappaflow.events import (
    DECIMAL_MODES,
    JSON_NULL,
    ChangeEvent,
    Column,
    EventCodec,
    FieldType,
    Op,
    Snapshot,
    SourceInfo,
    TableSchema,
    TransactionInfo,
    decode_row_values,
    encode_row_values,
    op_header,
    tombstone_for,
    topic_name,
)
from kappaflow.events.values import _enc_timestamptz, _enc_timestamptz_native, time_unit

FT = FieldType
ABSENT = object()
# KF_EVENTS_EXAMPLES=1000 for a deeper local run; the default keeps the suite quick.
SETTINGS = settings(
    max_examples=int(os.environ.get("KF_EVENTS_EXAMPLES", "40")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# -- strategies ----------------------------------------------------------------------------------------
TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), TEXT
)
JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda ch: st.one_of(st.lists(ch, max_size=4), st.dictionaries(TEXT, ch, max_size=4)), max_leaves=10
)
JSON_DOCS = st.one_of(JSON_VALUES.filter(lambda v: v is not None), st.just(JSON_NULL))
ZONES = st.one_of(
    st.just(UTC),
    st.builds(lambda m: timezone(timedelta(minutes=m)), st.integers(-23 * 60 - 59, 23 * 60 + 59)),
    st.sampled_from([ZoneInfo("Europe/Berlin"), ZoneInfo("America/New_York"), ZoneInfo("Asia/Kolkata")]),
)
ALLOWED = ("red", "green", "blue", "ultra violet")


def decimals(scale: int, precision: int) -> st.SearchStrategy[Decimal]:
    bound = 10**precision - 1
    return st.builds(lambda u: Decimal(f"{u}E-{scale}"), st.integers(-bound, bound))


def values_for(col: Column, mode: str) -> st.SearchStrategy[Any]:
    t = col.type
    ints = {FT.INT8: 7, FT.INT16: 15, FT.INT32: 31, FT.INT64: 63, FT.YEAR: 31}
    if t in ints:
        b = ints[t]
        return st.integers(-(1 << b), (1 << b) - 1)
    if t in (FT.FLOAT32, FT.FLOAT64):
        return st.floats()  # NaN and +/-Infinity included
    if t is FT.BOOLEAN:
        return st.booleans()
    if t in (FT.STRING,):
        return TEXT
    if t in (FT.BYTES, FT.BITS):
        return st.binary(max_size=24)
    if t is FT.DECIMAL:
        assert col.scale is not None and col.precision is not None
        s = decimals(col.scale, col.precision)
        if mode == "string":
            s = st.one_of(s, st.sampled_from([Decimal("NaN"), Decimal("Infinity"), Decimal("-Infinity")]))
        return s
    if t is FT.VARIABLE_DECIMAL:
        s = st.builds(lambda u, e: Decimal(f"{u}E{e}"), st.integers(-(10**40), 10**40), st.integers(-30, 10))
        if mode == "string":
            s = st.one_of(s, st.just(Decimal("NaN")))
        return s
    if t is FT.DATE:
        return st.dates()
    if t is FT.TIME:
        unit = time_unit(col)
        if unit == "ms":  # a millisecond column holds what it can carry
            return st.times().map(lambda v: v.replace(microsecond=v.microsecond // 1000 * 1000))
        return st.times()
    if t is FT.TIMESTAMP:
        if time_unit(col) == "ms":
            return st.datetimes().map(lambda v: v.replace(microsecond=v.microsecond // 1000 * 1000))
        if time_unit(col) == "ns":  # int64 nanoseconds: 1677..2262
            return st.datetimes(min_value=datetime(1678, 1, 1), max_value=datetime(2261, 12, 31))
        return st.datetimes()
    if t is FT.TIMESTAMPTZ:
        return st.datetimes(min_value=datetime(1, 1, 3), max_value=datetime(9999, 12, 29), timezones=ZONES)
    if t is FT.INTERVAL:
        return st.timedeltas(min_value=timedelta(days=-(10**7)), max_value=timedelta(days=10**7))
    if t is FT.UUID:
        return st.uuids()
    if t is FT.JSON:
        return JSON_DOCS
    if t is FT.ENUM:
        return st.sampled_from(ALLOWED)
    if t is FT.SET:
        return st.frozensets(st.sampled_from(ALLOWED))
    if t is FT.ARRAY:
        assert col.items is not None
        return st.lists(st.one_of(st.none(), values_for(col.items, mode)), max_size=5)
    if t is FT.STRUCT:
        assert col.fields is not None
        return st.fixed_dictionaries({f.name: st.one_of(st.none(), values_for(f, mode)) for f in col.fields})
    if t is FT.MAP:
        assert col.fields is not None
        k, v = col.fields
        return st.dictionaries(values_for(k, mode), st.one_of(st.none(), values_for(v, mode)), max_size=4)
    raise AssertionError(t)


@st.composite
def columns(draw: st.DrawFn, ftype: FieldType, name: str = "v", depth: int = 0) -> Column:
    kw: dict[str, Any] = {}
    if ftype is FT.DECIMAL:
        kw["scale"] = draw(st.sampled_from([0, 2, 5, 18]))
        kw["precision"] = draw(st.sampled_from([kw["scale"] + 1, kw["scale"] + 10, 60]))
    if ftype in (FT.ENUM, FT.SET):
        kw["allowed"] = ALLOWED
    if ftype is FT.BITS:
        kw["length"] = draw(st.integers(1, 64))
    if ftype is FT.ARRAY:
        item_types = [FT.INT32, FT.STRING, FT.DECIMAL, FT.TIMESTAMPTZ, FT.JSON, FT.DATE]
        if depth == 0:
            item_types.append(FT.ARRAY)
        kw["items"] = draw(columns(draw(st.sampled_from(item_types)), "item", depth + 1))
    if ftype is FT.STRUCT:  # e.g. io.debezium.data.geometry.Point: x, y, wkb, srid
        kw["fields"] = (Column("x", FT.FLOAT64, optional=False), Column("y", FT.FLOAT64, optional=False),
                        Column("wkb", FT.BYTES), Column("srid", FT.INT32))
        kw["logical"] = "io.debezium.data.geometry.Point"
    if ftype is FT.MAP:  # hstore (string keys) or a sparse vector's entries (int16 keys)
        if draw(st.booleans()):
            kw["fields"] = (Column("key", FT.STRING, optional=False), Column("value", FT.STRING))
        else:
            kw["fields"] = (Column("key", FT.INT16, optional=False), Column("value", FT.FLOAT64, optional=False))
    if ftype is FT.TIME:
        kw["logical"] = draw(st.sampled_from([None, "io.debezium.time.Time", "io.debezium.time.NanoTime",
                                              "org.apache.kafka.connect.data.Time"]))
    if ftype is FT.TIMESTAMP:
        kw["logical"] = draw(st.sampled_from([None, "io.debezium.time.Timestamp", "io.debezium.time.NanoTimestamp",
                                              "org.apache.kafka.connect.data.Timestamp"]))
    if ftype is FT.STRING:
        kw["logical"] = draw(st.sampled_from([None, "io.debezium.data.Xml", "io.debezium.time.ZonedTime"]))
    return Column(name, ftype, optional=True, native_type=draw(st.sampled_from([None, "text", "numeric(9,2)"])), **kw)


def src(position: Any = None, **kw: Any) -> SourceInfo:
    args: dict[str, Any] = {
        "connector": "postgresql", "name": "shop", "db": "shopdb", "schema": "public", "table": "t",
        "position": position or PgPosition(0x16B3748, 2), "ts_ms": 1_700_000_000_000, "tx_id": 771,
    }
    args.update(kw)
    return SourceInfo(**args)


SOURCES = st.one_of(
    st.builds(lambda lsn, i, s: src(PgPosition(lsn, i, s), snapshot=Snapshot.TRUE if s else Snapshot.FALSE),
              st.integers(0, (1 << 64) - 1), st.integers(0, 10**6), st.booleans()),
    st.builds(lambda n, p, r, g: src(BinlogPosition(f"mysql-bin.{n:06d}", p, r, g, 1), connector="mysql",
                                     schema=None, tx_id=g),
              st.integers(1, 999999), st.integers(4, 1 << 32), st.integers(0, 99),
              st.one_of(st.none(), st.just("0-1-9"))),
    st.builds(lambda p: src(LedgerPosition(p), connector="ledger", tx_id="tx-1"), st.integers(0, 1 << 60)),
)


# -- comparison helpers ---------------------------------------------------------------------------------
def norm(v: Any) -> Any:
    """Make NaN comparable; keep types visible."""
    if isinstance(v, float) and math.isnan(v):
        return "float-nan"
    if isinstance(v, Decimal) and v.is_nan():
        return "decimal-nan"
    if isinstance(v, datetime) and v.tzinfo is not None:
        # the instant; == between zones is False for times in a DST gap/fold (PEP 495)
        return ("instant", v.replace(tzinfo=None) - (v.utcoffset() or timedelta(0)))
    if isinstance(v, list):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    return v


def expected_value(col: Column, v: Any, mode: str) -> Any:
    """What decoding gives back for v: itself, except decimal 'double' mode (a float's repr)."""
    if v is None:
        return None
    if col.type in (FT.DECIMAL, FT.VARIABLE_DECIMAL) and mode == "double":
        f = float(v)
        return Decimal(repr(f)) if math.isfinite(f) else Decimal(repr(f).replace("inf", "Infinity"))
    if col.type is FT.ARRAY:
        assert col.items is not None
        return [expected_value(col.items, x, mode) for x in v]
    if col.type is FT.MAP and col.fields is not None and col.fields[1].type is FT.FLOAT64:
        return {k: x for k, x in v.items()}
    return v


def assert_row(schema: TableSchema, got: dict[str, Any] | None, sent: dict[str, Any] | None, mode: str) -> None:
    if sent is None:
        assert got is None
        return
    assert got is not None
    assert set(got) == set(sent), "absent columns must stay absent, present ones present"
    for name, v in sent.items():
        col = schema.column(name)
        exp = expected_value(col, v, mode)
        assert norm(got[name]) == norm(exp), (name, v, got[name])
        if col.type is FT.TIMESTAMPTZ and v is not None:
            assert got[name].utcoffset() == timedelta(0)
        if v is not None and not isinstance(v, (frozenset, Decimal, float)):
            assert type(got[name]) is type(v) or col.type is FT.ARRAY, (name, type(got[name]), type(v))


def assert_events_equal(schema: TableSchema, got: ChangeEvent, sent: ChangeEvent, mode: str) -> None:
    assert got.op is sent.op
    assert got.source == sent.source
    assert got.source.position.to_dict() == sent.source.position.to_dict()
    assert got.ts_ms == sent.ts_ms
    assert got.transaction == sent.transaction
    assert got.unavailable == sent.unavailable
    assert_row(schema, got.before, sent.before, mode)
    assert_row(schema, got.after, sent.after, mode)


def one_column_schema(col: Column) -> TableSchema:
    return TableSchema("shop.public.t", (Column("id", FT.INT64, optional=False), col), key=("id",))


def event_for(op: Op, row: dict[str, Any], source: SourceInfo, **kw: Any) -> ChangeEvent:
    before = row if op in (Op.UPDATE, Op.DELETE) else None
    after = row if op in (Op.CREATE, Op.READ, Op.UPDATE) else None
    return ChangeEvent(op, {"id": row["id"]}, before, after, source, 1_700_000_000_123, **kw)


# -- round trips -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ftype", list(FieldType), ids=lambda t: t.value)
@SETTINGS
@given(data=st.data())
def test_round_trip_every_type(ftype: FieldType, data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(DECIMAL_MODES), label="decimal_mode")
    include_schema = data.draw(st.booleans(), label="include_schema")
    col = data.draw(columns(ftype))
    schema = one_column_schema(col)
    value = data.draw(st.one_of(values_for(col, mode), st.none(), st.just(ABSENT)), label="value")
    row: dict[str, Any] = {"id": data.draw(st.integers(-(1 << 63), (1 << 63) - 1))}
    if value is not ABSENT:
        row["v"] = value
    op = data.draw(st.sampled_from([Op.CREATE, Op.UPDATE, Op.DELETE, Op.READ]))
    tx = data.draw(st.one_of(st.none(), st.builds(TransactionInfo, TEXT, st.integers(1, 99), st.integers(1, 99))))
    event = event_for(op, row, data.draw(SOURCES), transaction=tx)
    codec = EventCodec(mode, include_schema)

    raw = codec.encode_value(event, schema)
    back = codec.decode_value(raw, schema)
    assert_events_equal(schema, back, event, mode)
    assert back.key == event.key
    if include_schema:  # the embedded schema alone is enough
        alone = codec.decode_value(raw)
        assert_events_equal(schema, alone, event, mode)
        assert alone.key == event.key  # from the kf.key schema parameter
    # re-encoding the decoded event gives the same bytes (deterministic encoding)
    assert codec.encode_value(back, schema) == raw

    key = codec.encode_key(event.key, schema)
    assert codec.decode_key(key, schema) == event.key
    assert codec.decode_record(key, raw, schema) is not None


@SETTINGS
@given(data=st.data())
def test_round_trip_random_tables(data: st.DataObject) -> None:
    """Several columns of mixed types, absent and NULL values mixed."""
    mode = data.draw(st.sampled_from(DECIMAL_MODES))
    include_schema = data.draw(st.booleans())
    types = data.draw(st.lists(st.sampled_from(list(FieldType)), min_size=1, max_size=8))
    cols = [data.draw(columns(t, f"c{i}")) for i, t in enumerate(types)]
    schema = TableSchema("db1.inventory.things", (Column("id", FT.STRING, optional=False), *cols), key=("id",))
    row: dict[str, Any] = {"id": data.draw(TEXT)}
    for c in cols:
        v = data.draw(st.one_of(values_for(c, mode), st.none(), st.just(ABSENT)))
        if v is not ABSENT:
            row[c.name] = v
    unavailable = tuple(data.draw(st.lists(st.sampled_from([c.name for c in cols]), unique=True, max_size=2)))
    event = event_for(Op.UPDATE, row, data.draw(SOURCES), unavailable=unavailable)
    codec = EventCodec(mode, include_schema)
    raw = codec.encode_value(event, schema)
    assert_events_equal(schema, codec.decode_value(raw, schema), event, mode)
    if include_schema:
        assert_events_equal(schema, codec.decode_value(raw), event, mode)
    # the row fast path agrees with the envelope's row
    payload = orjson.loads(raw)
    payload = payload["payload"] if include_schema else payload
    assert orjson.loads(orjson.dumps(codec.encode_row_values(schema, row))) == payload["after"]
    assert norm(codec.decode_row_values(schema, payload["after"])) == norm(
        {k: expected_value(schema.column(k), v, mode) for k, v in row.items()}
    )


def test_null_and_absent_stay_different() -> None:
    schema = one_column_schema(Column("v", FT.STRING))
    codec = EventCodec()
    for row in ({"id": 1, "v": None}, {"id": 1}):
        event = event_for(Op.CREATE, row, src())
        raw = codec.encode_value(event, schema)
        assert orjson.loads(raw)["after"] == row  # absent is not written as null
        assert codec.decode_value(raw, schema).after == row
        assert codec.decode_value(raw).after == row  # without a schema too


def test_json_null_document_differs_from_sql_null() -> None:
    schema = one_column_schema(Column("doc", FT.JSON))
    codec = EventCodec()
    for value, wire in ((JSON_NULL, "null"), (None, None), ({"a": None}, '{"a":null}'), ([], "[]")):
        raw = codec.encode_value(event_for(Op.CREATE, {"id": 1, "doc": value}, src()), schema)
        assert orjson.loads(raw)["after"]["doc"] == wire
        assert codec.decode_value(raw, schema).after == {"id": 1, "doc": value}


def test_json_keeps_big_integers_and_unicode_exact() -> None:
    schema = one_column_schema(Column("doc", FT.JSON))
    doc = {"big": 2**70, "neg": -(2**65), "s": "日本語 \u2028 🙂", "nested": [{"x": [1.5, None, True]}]}
    codec = EventCodec()
    raw = codec.encode_value(event_for(Op.CREATE, {"id": 1, "doc": doc}, src()), schema)
    assert codec.decode_value(raw, schema).after["doc"] == doc  # type: ignore[index]


@SETTINGS
@given(st.datetimes(min_value=datetime(1, 1, 3), max_value=datetime(9999, 12, 29), timezones=ZONES))
def test_timestamptz_fast_path_is_byte_identical(v: datetime) -> None:
    fast = orjson.dumps(_enc_timestamptz_native(v), option=orjson.OPT_UTC_Z)
    assert fast == orjson.dumps(_enc_timestamptz(v))
    assert norm(datetime.fromisoformat(orjson.loads(fast))) == norm(v)


# -- exact encodings (Debezium's own values) ------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "wire"),
    # base64 strings as Debezium's PostgreSQL connector emits them for numeric(10,2)
    [("1200.00", "AdTA"), ("25.50", "CfY="), ("75.00", "HUw="), ("300.00", "dTA="), ("50.00", "E4g="),
     ("0.00", "AA=="), ("-0.01", "/w=="), ("1.28", "AIA="), ("-1.28", "gA=="), ("-1.29", "/38=")],
)
def test_precise_decimal_bytes_match_debezium(value: str, wire: str) -> None:
    schema = one_column_schema(Column("price", FT.DECIMAL, scale=2, precision=10))
    row = encode_row_values(schema, {"id": 1, "price": Decimal(value)}, decimal_mode="precise")
    assert row["price"] == wire
    assert decode_row_values(schema, row, decimal_mode="precise")["price"] == Decimal(value)


def test_value_encodings_follow_debezium_defaults() -> None:
    cols = (
        Column("id", FT.INT32, optional=False),
        Column("d", FT.DATE), Column("t", FT.TIME), Column("ts", FT.TIMESTAMP), Column("tz", FT.TIMESTAMPTZ),
        Column("iv", FT.INTERVAL), Column("u", FT.UUID), Column("j", FT.JSON), Column("b", FT.BYTES),
        Column("e", FT.ENUM, allowed=ALLOWED), Column("s", FT.SET, allowed=ALLOWED), Column("y", FT.YEAR),
        Column("n", FT.DECIMAL, scale=3), Column("vn", FT.VARIABLE_DECIMAL), Column("f", FT.FLOAT64),
        Column("a", FT.ARRAY, items=Column("item", FT.INT32)),
    )
    schema = TableSchema("s.public.all", cols, key=("id",))
    row = {
        "id": 1, "d": date(2018, 6, 20), "t": time(15, 13, 16, 945104), "ts": datetime(2018, 6, 20, 15, 13, 16, 945104),
        "tz": datetime(2018, 6, 20, 17, 13, 16, 945104, tzinfo=timezone(timedelta(hours=2))),
        "iv": -timedelta(days=1, microseconds=5), "u": __import__("uuid").UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        "j": {"k": [1, "v"]}, "b": b"\x00\xff", "e": "green", "s": frozenset({"blue", "red"}), "y": 2024,
        "n": Decimal("-1.5"), "vn": Decimal("12.340"), "f": float("nan"), "a": [1, None, 3],
    }
    for mode, n, vn in (("string", "-1.500", "12.340"), ("double", -1.5, 12.34),
                        ("precise", "+iQ=", {"scale": 3, "value": "MDQ="})):
        wire = orjson.loads(orjson.dumps(encode_row_values(schema, row, decimal_mode=mode)))
        assert wire == {
            "id": 1, "d": 17702, "t": 54796945104, "ts": 1529507596945104, "tz": "2018-06-20T15:13:16.945104Z",
            "iv": -86400000005, "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "j": '{"k":[1,"v"]}', "b": "AP8=",
            "e": "green", "s": "red,blue", "y": 2024, "n": n, "vn": vn, "f": "NaN", "a": [1, None, 3],
        }
        back = decode_row_values(schema, wire, decimal_mode=mode)
        assert norm(back) == norm({**row, "n": Decimal("-1.5"), "vn": Decimal("12.34")})


def test_fixed_scale_decimals_are_canonical_so_keys_match() -> None:
    schema = TableSchema("s.public.k", (Column("k", FT.DECIMAL, scale=2, optional=False),), key=("k",))
    for mode in DECIMAL_MODES[:2]:
        codec = EventCodec(mode)
        assert codec.encode_key({"k": Decimal("1.5")}, schema) == codec.encode_key({"k": Decimal("1.500")}, schema)


# -- keys, tombstones, headers --------------------------------------------------------------------------
def test_keys_in_key_order_with_and_without_schema_part() -> None:
    schema = TableSchema(
        "shop.public.lines",
        (Column("line", FT.INT32), Column("order_id", FT.UUID), Column("qty", FT.INT32)),
        key=("order_id", "line"),
    )
    oid = __import__("uuid").UUID(int=5)
    plain = EventCodec().encode_key({"line": 2, "order_id": oid}, schema)
    assert plain is not None
    assert plain == b'{"order_id":"00000000-0000-0000-0000-000000000005","line":2}'
    with_schema = orjson.loads(EventCodec(include_schema=True).encode_key({"line": 2, "order_id": oid}, schema) or b"")
    assert with_schema["schema"] == {
        "type": "struct",
        "fields": [
            {"type": "string", "optional": False, "name": "io.debezium.data.Uuid", "version": 1, "field": "order_id"},
            {"type": "int32", "optional": False, "field": "line"},
        ],
        "optional": False,
        "name": "shop.public.lines.Key",
    }
    codec = EventCodec()
    assert codec.decode_key(plain, schema) == {"order_id": oid, "line": 2}
    assert codec.decode_key(orjson.dumps(with_schema)) == {"order_id": oid, "line": 2}
    assert codec.decode_key(plain) == {"order_id": str(oid), "line": 2}  # raw without a schema
    assert codec.encode_key(None, schema) is None and codec.decode_key(None) is None
    with pytest.raises(ValidationError, match=r"key: missing key column\(s\) \['line'\]"):
        codec.encode_key({"order_id": oid}, schema)
    with pytest.raises(ValidationError, match=r"key: not key column\(s\) \['qty'\]"):
        codec.encode_key({"order_id": oid, "line": 1, "qty": 3}, schema)


def test_tombstone_follows_a_delete() -> None:
    schema = one_column_schema(Column("v", FT.TIMESTAMPTZ))
    delete = ChangeEvent(Op.DELETE, None, {"id": 9, "v": None}, None, src(), 1)
    key, value = EventCodec().tombstone_for(delete, schema)
    assert value is None and key == EventCodec().encode_key({"id": 9}, schema) == b'{"id":9}'
    k2, v2 = tombstone_for(event_for(Op.DELETE, {"id": 9}, src()))
    assert (k2, v2) == (b'{"id":9}', None)
    with pytest.raises(ValidationError, match="no key"):
        tombstone_for(ChangeEvent(Op.TRUNCATE, None, None, None, src(), 1))
    assert EventCodec().decode_record(key, None, schema) is None


def test_schemaless_key_encoding_by_python_type_is_deterministic() -> None:
    when = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    k = EventCodec().encode_key({"a": Decimal("1.50"), "b": when, "c": b"\x01", "d": date(1970, 1, 2)})
    assert k == b'{"a":"1.50","b":"2024-01-02T03:04:05Z","c":"AQ==","d":1}'
    with pytest.raises(ValidationError, match="key: cannot encode"):
        EventCodec().encode_key({"a": object()})
    with pytest.raises(ValidationError, match="needs the table schema"):
        EventCodec(include_schema=True).encode_key({"a": 1})


def test_helpers() -> None:
    e = event_for(Op.CREATE, {"id": 1}, src())
    assert op_header(e) == (("kf.op", b"c"),)
    assert topic_name(e.source) == "shop.public.t"
    assert topic_name(src(BinlogPosition("b.000001", 4), connector="mysql", schema=None)) == "shop.shopdb.t"


# -- bad input ------------------------------------------------------------------------------------------
SCHEMA = TableSchema(
    "shop.public.orders",
    (Column("id", FT.INT64, optional=False), Column("amount", FT.DECIMAL, scale=2), Column("at", FT.TIMESTAMPTZ)),
    key=("id",),
)
GOOD = orjson.loads(
    EventCodec().encode_value(event_for(Op.CREATE, {"id": 1, "amount": Decimal("2.50")}, src()), SCHEMA)
)


def mutate(**changes: Any) -> bytes:
    d = orjson.loads(orjson.dumps(GOOD))
    for path, v in changes.items():
        target = d
        *parents, last = path.split("__")
        for p in parents:
            target = target[p]
        if v is ABSENT:
            del target[last]
        else:
            target[last] = v
    return orjson.dumps(d)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"before": null, "after": {', r"value: malformed JSON"),
        (b"", r"value: malformed JSON"),
        (b"[1, 2]", r"value: expected a JSON object \(Debezium envelope\)"),
        (mutate(op=ABSENT), r"op: missing"),
        (mutate(op="x"), r"op: expected one of \['c', 'u', 'd', 'r', 't'\], got 'x'"),
        (mutate(op="m"), r"op: expected one of .* got 'm'"),
        (mutate(after__amount=True), r"after.amount: expected decimal string .*got bool True"),
        (mutate(after__amount="12,5"), r"after.amount: expected decimal string"),
        (mutate(after__id="1"), r"after.id: expected int64 .*got str '1'"),
        (mutate(after__id=2**63), r"after.id: expected int64"),
        (mutate(after__at="2024-01-01T00:00:00"), r"after.at: expected ISO-8601 timestamp with zone"),
        (mutate(after__at=1700000000), r"after.at: expected ISO-8601"),
        (mutate(after__extra=1), r"after.extra: column not in schema 'shop.public.orders'"),
        (mutate(after=[1]), r"after: expected an object of column values or null"),
        (mutate(source=ABSENT), r"source: expected an object"),
        (mutate(source__ts_ms="now"), r"source.ts_ms: expected an integer"),
        (mutate(source__table=None), r"source.table: expected a string, got NoneType None"),
        (mutate(source__snapshot="maybe"), r"source.snapshot: expected one of"),
        (mutate(source__kf_pos={"kind": "pg", "lsn": -5, "index": 0}), r"source.kf_pos: position \(pg\).lsn"),
        (mutate(source__kf_pos=ABSENT, source__lsn=ABSENT), r"source.kf_pos: missing"),
        (mutate(ts_ms="late"), r"ts_ms: expected an integer"),
        (mutate(transaction={"id": 5}), r"transaction.id: expected a string"),
        (mutate(transaction={"id": "t", "total_order": 1}), r"transaction.data_collection_order"),
        (mutate(kf_unavailable="amount"), r"kf_unavailable: expected a list of column names"),
    ],
)
def test_bad_values_name_the_field(data: bytes, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EventCodec().decode_value(data, SCHEMA)


def test_row_errors_carry_the_source_position() -> None:
    with pytest.raises(ValidationError, match=r"at position 0/16B3748:2"):
        EventCodec().decode_value(mutate(after__id="x"), SCHEMA)


def test_precise_value_errors() -> None:
    codec = EventCodec("precise")
    raw = orjson.loads(codec.encode_value(event_for(Op.CREATE, {"id": 1, "amount": Decimal("2.50")}, src()), SCHEMA))
    raw["after"]["amount"] = "not base64!"
    with pytest.raises(ValidationError, match=r"after.amount: expected decimal as base64 two's-complement bytes"):
        codec.decode_value(orjson.dumps(raw), SCHEMA)


def test_decimal_without_scale_in_the_embedded_schema() -> None:
    doc = orjson.loads(EventCodec("precise", include_schema=True).encode_value(
        event_for(Op.CREATE, {"id": 1, "amount": Decimal("2.50")}, src()), SCHEMA))
    for f in doc["schema"]["fields"][:2]:
        del f["fields"][1]["parameters"]["scale"]
    with pytest.raises(ValidationError, match=r"schema.after.amount.parameters.scale: missing"):
        EventCodec().decode_value(orjson.dumps(doc))


def test_embedded_schema_errors() -> None:
    doc = orjson.loads(EventCodec("precise", include_schema=True).encode_value(
        event_for(Op.CREATE, {"id": 1}, src()), SCHEMA))
    doc["schema"]["fields"][1]["fields"][2]["type"] = "int64"  # ZonedTimestamp must be a string
    with pytest.raises(ValidationError, match=r"schema.after.at.type: logical type io.debezium.time.ZonedTimestamp"):
        EventCodec().decode_value(orjson.dumps(doc))
    doc["schema"]["fields"][1]["fields"][2] = {"type": "map", "optional": True, "field": "at"}
    with pytest.raises(ValidationError, match=r"schema.after.at: a map schema needs its 'keys' and 'values'"):
        EventCodec().decode_value(orjson.dumps(doc))
    doc["schema"]["fields"][1]["fields"][2] = {"type": "float128", "optional": True, "field": "at"}
    with pytest.raises(ValidationError, match=r"schema.after.at.type: unsupported Connect type 'float128'"):
        EventCodec().decode_value(orjson.dumps(doc))


@pytest.mark.parametrize(
    ("row", "codec", "message"),
    [
        ({"id": 1, "at": datetime(2024, 1, 1)}, EventCodec(), r"after.at: expected ISO-8601 .*aware.*got datetime"),
        ({"id": 1, "amount": "2.5"}, EventCodec(), r"after.amount: expected decimal string .*got str '2.5'"),
        ({"id": 1, "amount": Decimal("2.555")}, EventCodec(), r"after.amount: expected decimal"),
        ({"id": 1, "amount": Decimal("2.555")}, EventCodec("precise"), r"after.amount: expected decimal as base64"),
        ({"id": 1, "amount": Decimal("NaN")}, EventCodec("precise"), r"after.amount"),
        ({"id": 1, "nope": 1}, EventCodec(), r"after.nope: column not in schema 'shop.public.orders'"),
        ({"id": "1"}, EventCodec(validate=True), r"after.id: expected int64 .*got str '1'"),
        ({"id": 2**64}, EventCodec(), r"after.id: expected int64"),
    ],
)
def test_encoding_bad_rows_names_the_field(row: dict[str, Any], codec: EventCodec, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        codec.encode_value(event_for(Op.CREATE, row, src()), SCHEMA)


def test_encoding_interval_beyond_int64_is_rejected() -> None:
    schema = one_column_schema(Column("iv", FT.INTERVAL))
    with pytest.raises(ValidationError, match=r"after.iv: expected interval as int micros"):
        EventCodec().encode_value(event_for(Op.CREATE, {"id": 1, "iv": timedelta(days=999_999_999)}, src()), schema)


def test_codec_options_are_checked() -> None:
    with pytest.raises(ValidationError, match=r"decimal_mode: expected one of \['string', 'precise', 'double'\]"):
        EventCodec("exact")
    with pytest.raises(ValidationError, match="include_schema"):
        EventCodec(include_schema="yes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="tombstone"):
        EventCodec().decode_value(None)


def test_decoding_without_schema_returns_raw_json_values() -> None:
    raw = EventCodec().encode_value(
        event_for(Op.CREATE, {"id": 1, "amount": Decimal("2.5"), "at": datetime(2024, 1, 1, tzinfo=UTC)}, src()), SCHEMA
    )
    ev = EventCodec().decode_value(raw)
    assert ev.after == {"id": 1, "amount": "2.50", "at": "2024-01-01T00:00:00Z"} and ev.key is None



def test_odd_column_names_and_a_column_called_payload() -> None:
    names = ['payload', 'schema', 'a "quoted" name', "back\\slash", "new\nline", "日本", "x'); import os; ('"]
    schema = TableSchema("s.public.odd", tuple(Column(n, FT.DECIMAL, scale=1) for n in names), key=("payload",))
    row = {n: Decimal(i) for i, n in enumerate(names)}
    for mode in DECIMAL_MODES:
        codec = EventCodec(mode, include_schema=True)
        raw = codec.encode_value(ChangeEvent(Op.CREATE, {"payload": row["payload"]}, None, row, src(), 1), schema)
        for _ in range(2):  # the second decode takes the cached-schema fast path
            back = codec.decode_value(raw)
            assert back.after == row and back.key == {"payload": Decimal(0)}


def test_cached_schema_fast_path_still_reports_bad_payloads() -> None:
    codec = EventCodec("precise", include_schema=True)
    raw = codec.encode_value(event_for(Op.CREATE, {"id": 1, "amount": Decimal("2.50")}, src()), SCHEMA)
    assert codec.decode_value(raw).after == {"id": 1, "amount": Decimal("2.50")}
    head, _, _ = raw.partition(b',"payload":')
    with pytest.raises(ValidationError, match="value: malformed JSON"):
        codec.decode_value(head + b',"payload":{"op":')
    with pytest.raises(ValidationError, match=r"after.amount: expected decimal as base64"):
        codec.decode_value(raw.replace(b'"amount":"APo="', b'"amount":true'))
    # JsonConverter decimal.format=NUMERIC writes the Connect Decimal as a JSON number: read exactly
    assert codec.decode_value(raw.replace(b'"amount":"APo="', b'"amount":12')).after == {"id": 1, "amount": 12}
    numeric = codec.decode_value(raw.replace(b'"amount":"APo="', b'"amount":12345678901234567.25'))
    assert numeric.after == {"id": 1, "amount": Decimal("12345678901234567.25")}
    with pytest.raises(ValidationError, match=r"payload: expected a JSON object"):
        codec.decode_value(head + b',"payload":[1]}')
    # a parameter named "payload" inside the schema does not confuse the split
    doc = orjson.loads(raw)
    doc["schema"]["fields"][1]["fields"][0]["parameters"] = {"payload": "x"}
    tricky = orjson.dumps(doc)
    for _ in range(2):
        assert codec.decode_value(tricky).after == {"id": 1, "amount": Decimal("2.50")}
