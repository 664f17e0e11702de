"""ChangeEvent validation, TableSchema/Column validation and storage round trips."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kappaflow.connectors.ledger.source_info import LedgerPosition
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import ValidationError
from kappaflow.events import (
    JSON_NULL,
    ChangeEvent,
    Column,
    FieldType,
    Op,
    Snapshot,
    SourceInfo,
    TableSchema,
    TransactionInfo,
)
from kappaflow.events.connect import parse_value_schema, render_key_schema, render_value_schema

FT = FieldType
SRC = SourceInfo("postgresql", "shop", "db", "public", "t", PgPosition(10, 0), 1)


# -- ChangeEvent ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "key", "before", "after", "message"),
    [
        (Op.CREATE, {"id": 1}, None, None, r"after: an op 'c' event needs the row after the change"),
        (Op.READ, {"id": 1}, None, None, r"after: an op 'r' event"),
        (Op.UPDATE, {"id": 1}, {"id": 1}, None, r"after: an op 'u' event"),
        (Op.DELETE, None, None, None, r"before: a delete event needs the row before \(or at least the key\)"),
        (Op.DELETE, {"id": 1}, {"id": 1}, {"id": 1}, r"after: a delete event has no row after"),
        (Op.TRUNCATE, None, {"id": 1}, None, r"before/after: a truncate event carries no rows"),
        ("x", None, None, None, r"op: expected one of \['c', 'u', 'd', 'r', 't'\], got 'x'"),
    ],
)
def test_event_consistency_is_checked(op: Any, key: Any, before: Any, after: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChangeEvent(op, key, before, after, SRC, 2)


def test_event_accepts_op_codes_and_normalises() -> None:
    ev = ChangeEvent("c", {"id": 1}, None, {"id": 1}, SRC, 2, unavailable=["big"])  # type: ignore[arg-type]
    assert ev.op is Op.CREATE and ev.unavailable == ("big",) and ev.row == {"id": 1}
    assert ChangeEvent(Op.DELETE, {"id": 1}, None, None, SRC, 2).row is None
    assert ChangeEvent(Op.TRUNCATE, None, None, None, SRC, 2).op is Op.TRUNCATE
    with pytest.raises(AttributeError):
        ev.ts_ms = 5  # type: ignore[misc]


def test_source_info_validation_and_defaults() -> None:
    s = SourceInfo("ledger", "books", "books", None, "entries", LedgerPosition(3), 9, snapshot="last")  # type: ignore[arg-type]
    assert s.snapshot is Snapshot.LAST and s.tx_id is None
    assert SourceInfo("ledger", "b", "b", None, "e", LedgerPosition(3), 9).snapshot is Snapshot.FALSE
    with pytest.raises(ValidationError, match=r"source.snapshot: expected one of"):
        SourceInfo("ledger", "b", "b", None, "e", LedgerPosition(3), 9, snapshot="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"source.position: expected a Position, got dict"):
        SourceInfo("ledger", "b", "b", None, "e", {"kind": "ledger"}, 9)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SourceInfo("ledger", "b")  # type: ignore[call-arg]


def test_events_pickle_for_spark_workers() -> None:
    ev = ChangeEvent(Op.UPDATE, {"id": 1}, {"id": 1, "doc": JSON_NULL}, {"id": 1, "doc": {"a": 1}}, SRC, 2,
                     TransactionInfo("tx", 1, 1), ("x",))
    back = pickle.loads(pickle.dumps(ev))
    assert back == ev and back.before["doc"] is JSON_NULL


# -- Column / TableSchema -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "", "type": FT.INT32}, "column name: expected a non-empty string"),
        ({"name": "a", "type": "money"}, r"column 'a'.type: expected one of \['int8'"),
        ({"name": "a", "type": FT.DECIMAL}, r"column 'a'.scale: a DECIMAL column needs a scale"),
        ({"name": "a", "type": FT.ARRAY}, r"column 'a'.items: an ARRAY column needs an element Column"),
        ({"name": "a", "type": FT.INT32, "items": Column("i", FT.INT32)}, r"column 'a'.items: only ARRAY"),
        ({"name": "a", "type": FT.ENUM, "allowed": "abc"}, r"column 'a'.allowed: expected a sequence of strings"),
        ({"name": "a", "type": FT.INT32, "optional": "yes"}, r"column 'a'.optional: expected true or false"),
        ({"name": "a", "type": FT.DECIMAL, "scale": "2"}, r"column 'a'.scale: expected an integer"),
        ({"name": "a", "type": FT.DECIMAL, "scale": 0, "default": Decimal("1.5")},
         r"column 'a'.default: expected decimal string \(Python decimal.Decimal with at most 0 fractional digits\)"),
        ({"name": "a", "type": FT.TIMESTAMPTZ, "default": datetime(2020, 1, 1)},
         r"column 'a'.default: expected ISO-8601 timestamp with zone"),
    ],
)
def test_column_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Column(**kwargs)


def test_column_coerces_type_names_and_allowed_lists() -> None:
    c = Column("a", "enum", allowed=["x", "y"])  # type: ignore[arg-type]
    assert c.type is FT.ENUM and c.allowed == ("x", "y")


def test_table_schema_validation() -> None:
    a = Column("a", FT.INT32)
    with pytest.raises(ValidationError, match="duplicate column 'a'"):
        TableSchema("s.p.t", (a, a))
    with pytest.raises(ValidationError, match="key: column 'b' is not a column of the table"):
        TableSchema("s.p.t", (a,), key=("b",))
    with pytest.raises(ValidationError, match="key: expected a sequence of column names, got a string"):
        TableSchema("s.p.t", (a,), key="a")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="has no key columns"):
        render_key_schema(TableSchema("s.p.t", [a]))  # type: ignore[arg-type]
    t = TableSchema("s.p.t", [a, Column("b", FT.STRING)], key=["b"])  # type: ignore[arg-type]
    assert t.columns == (a, Column("b", FT.STRING)) and t.key == ("b",)
    assert t.column_names == ("a", "b") and t.column("b").type is FT.STRING
    with pytest.raises(KeyError, match="has no column 'z'"):
        t.column("z")
    ks = t.key_schema()
    assert ks.columns == (Column("b", FT.STRING, optional=False),) and ks.key == ("b",)


COLUMN_TYPES = st.sampled_from([t for t in FieldType if t not in (FT.ARRAY, FT.STRUCT, FT.MAP)])


@st.composite
def table_schemas(draw: st.DrawFn) -> TableSchema:
    cols = []
    for i, t in enumerate(draw(st.lists(COLUMN_TYPES, min_size=1, max_size=6))):
        kw: dict[str, Any] = {"optional": draw(st.booleans())}
        if t is FT.DECIMAL:
            kw["scale"] = draw(st.integers(1, 10))
            kw["default"] = draw(st.sampled_from([None, Decimal("1.5")]))
        if t in (FT.ENUM, FT.SET):
            kw["allowed"] = tuple(draw(st.lists(st.text("abc", min_size=1), max_size=3, unique=True)))
        if t is FT.INT32:
            kw["default"] = draw(st.one_of(st.none(), st.integers(-5, 5)))
        if t is FT.TIMESTAMPTZ:
            kw["default"] = draw(st.sampled_from([None, datetime(2020, 1, 1, tzinfo=UTC)]))
        if t is FT.JSON:
            kw["default"] = draw(st.sampled_from([None, {"a": [1, None]}, JSON_NULL]))
        kw["native_type"] = draw(st.sampled_from([None, "int4", "varchar(20)"]))
        cols.append(Column(f"c{i}", t, **kw))
    if draw(st.booleans()):
        cols.append(Column("arr", FT.ARRAY, items=Column("item", FT.DECIMAL, scale=2)))
    if draw(st.booleans()):  # a PostGIS geometry as Debezium writes it
        cols.append(Column("geom", FT.STRUCT, logical="io.debezium.data.geometry.Geometry",
                           fields=(Column("wkb", FT.BYTES, optional=False), Column("srid", FT.INT32))))
    if draw(st.booleans()):  # hstore.handling.mode=map
        cols.append(Column("attrs", FT.MAP, fields=(Column("key", FT.STRING, optional=False),
                                                    Column("value", FT.STRING))))
    if draw(st.booleans()):
        cols.append(Column("at_ms", FT.TIMESTAMP, logical="io.debezium.time.Timestamp"))
    key = tuple(draw(st.lists(st.sampled_from([c.name for c in cols]), unique=True, max_size=2)))
    return TableSchema(draw(st.sampled_from(["a.b.c", "shop.public.orders"])), tuple(cols), key)


@settings(max_examples=60, deadline=None)
@given(table_schemas())
def test_schema_storage_round_trip_and_fingerprint(schema: TableSchema) -> None:
    import orjson

    stored = orjson.loads(orjson.dumps(schema.to_dict()))  # JSON-safe, as on the schema topic
    back = TableSchema.from_dict(stored)
    assert back == schema
    assert back.fingerprint() == schema.fingerprint()
    assert len(schema.fingerprint()) == 64
    for mode in ("string", "precise"):
        assert parse_value_schema(render_value_schema(schema, decimal_mode=mode)) == schema


def test_fingerprint_changes_with_the_schema() -> None:
    a = TableSchema("s.p.t", (Column("a", FT.INT32),), ("a",))
    assert a.fingerprint() == TableSchema("s.p.t", (Column("a", FT.INT32),), ("a",)).fingerprint()
    for other in (
        TableSchema("s.p.t", (Column("a", FT.INT64),), ("a",)),
        TableSchema("s.p.t", (Column("a", FT.INT32, optional=False),), ("a",)),
        TableSchema("s.p.t", (Column("a", FT.INT32),), ()),
        TableSchema("s.p.u", (Column("a", FT.INT32),), ("a",)),
        TableSchema("s.p.t", (Column("a", FT.INT32, default=1),), ("a",)),
    ):
        assert other.fingerprint() != a.fingerprint()


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"name": 1, "columns": []}, r"table schema.name: expected a string"),
        ({"name": "t", "columns": {}}, r"table schema 't'.columns: expected a list"),
        ({"name": "t", "columns": [], "key": "id"}, r"table schema 't'.key: expected a list of column names"),
        ({"name": "t", "columns": [{"name": "a", "type": "int32", "colour": 1}]},
         r"table schema 't'.columns\[0\]: unknown keys \['colour'\]"),
        ({"name": "t", "columns": [{"name": "a", "type": "decimal", "scale": 2, "default": "x"}]},
         r"table schema 't'.columns\[0\].default: expected decimal string"),
        ({"name": "t", "columns": [{"name": "a", "type": "array"}]}, r"column 'a'.items"),
        ("nope", r"table schema: expected an object"),
    ],
)
def test_schema_from_dict_names_the_bad_field(d: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TableSchema.from_dict(d)


def test_connect_schema_is_a_fresh_copy() -> None:
    t = TableSchema("s.p.t", (Column("a", FT.INT32),), ("a",))
    cs = render_value_schema(t)
    cs["fields"].clear()
    assert render_value_schema(t)["fields"]
    with pytest.raises(ValidationError, match="decimal_mode"):
        render_value_schema(t, decimal_mode="fast")
    with pytest.raises(ValidationError, match="position_kind"):
        render_value_schema(t, position_kind="cobol")


def test_schemas_pickle_without_their_caches() -> None:
    from kappaflow.events import EventCodec

    t = TableSchema("s.p.t", (Column("a", FT.DECIMAL, scale=2), Column("j", FT.JSON, default={"x": 1})), ("a",))
    codec = EventCodec(include_schema=True)
    ev = ChangeEvent(Op.CREATE, {"a": Decimal(1)}, None, {"a": Decimal(1)}, SRC, 2)
    raw = codec.encode_value(ev, t)  # fills the caches with generated code and orjson fragments
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.fingerprint() == t.fingerprint()
    assert codec.encode_value(ev, back) == raw
