"""Compatibility with Debezium's JsonConverter output.

The fixtures follow the documented shapes of Debezium's PostgreSQL and MySQL
connectors (create/update/delete/snapshot-read events, with and without the
``schema`` part; the 2.5 layout with ``transaction`` last and the 2.7+/3.x
layout with ``ts_us``/``ts_ns``); the decimal bytes are the values Debezium's
PostgreSQL connector emits for numeric(10,2).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any
from uuid import UUID

import orjson
import pytest

from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.events import (
    ChangeEvent,
    Column,
    EventCodec,
    FieldType,
    Op,
    Snapshot,
    SourceInfo,
    TableSchema,
    TransactionInfo,
)
from kappaflow.events.connect import parse_value_schema, render_value_schema

FT = FieldType


def f(ctype: str, name: str, optional: bool = False, **extra: Any) -> dict[str, Any]:
    return {"type": ctype, "optional": optional, **extra, "field": name}


SNAPSHOT_FIELD_25 = {
    "type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
    "parameters": {"allowed": "true,last,false,incremental"}, "default": "false", "field": "snapshot",
}
SNAPSHOT_FIELD_3 = {**SNAPSHOT_FIELD_25, "parameters": {
    "allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"}}
TRANSACTION_FIELD = {
    "type": "struct",
    "fields": [f("string", "id"), f("int64", "total_order"), f("int64", "data_collection_order")],
    "optional": True, "name": "event.block", "version": 1, "field": "transaction",
}
PG_SOURCE_FIELDS_25 = [
    f("string", "version"), f("string", "connector"), f("string", "name"), f("int64", "ts_ms"), SNAPSHOT_FIELD_25,
    f("string", "db"), f("string", "sequence", True), f("string", "schema"), f("string", "table"),
    f("int64", "txId", True), f("int64", "lsn", True), f("int64", "xmin", True),
]
PG_SOURCE_FIELDS_27 = [
    *PG_SOURCE_FIELDS_25[:7], f("int64", "ts_us", True), f("int64", "ts_ns", True), *PG_SOURCE_FIELDS_25[7:],
]
MYSQL_SOURCE_FIELDS_3 = [
    f("string", "version"), f("string", "connector"), f("string", "name"), f("int64", "ts_ms"), SNAPSHOT_FIELD_3,
    f("string", "db"), f("string", "sequence", True), f("int64", "ts_us", True), f("int64", "ts_ns", True),
    f("string", "table", True), f("int64", "server_id"), f("string", "gtid", True), f("string", "file"),
    f("int64", "pos"), f("int32", "row"), f("int64", "thread", True), f("string", "query", True),
]


def customers_row(topic: str, optional: bool, field: str) -> dict[str, Any]:
    return {
        "type": "struct",
        "fields": [f("int32", "id", default=0), f("string", "first_name"), f("string", "last_name"),
                   f("string", "email")],
        "optional": optional, "name": f"{topic}.Value", "field": field,
    }


# PostgreSQL connector, Debezium 2.7+ layout: create event with the schema part.
PG_CREATE: dict[str, Any] = {
    "schema": {
        "type": "struct",
        "fields": [
            customers_row("PostgreSQL_server.inventory.customers", True, "before"),
            customers_row("PostgreSQL_server.inventory.customers", True, "after"),
            {"type": "struct", "fields": PG_SOURCE_FIELDS_27, "optional": False,
             "name": "io.debezium.connector.postgresql.Source", "field": "source"},
            TRANSACTION_FIELD,
            f("string", "op"), f("int64", "ts_ms", True), f("int64", "ts_us", True), f("int64", "ts_ns", True),
        ],
        "optional": False, "name": "PostgreSQL_server.inventory.customers.Envelope", "version": 2,
    },
    "payload": {
        "before": None,
        "after": {"id": 1, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"},
        "source": {
            "version": "2.7.3.Final", "connector": "postgresql", "name": "PostgreSQL_server",
            "ts_ms": 1559033904863, "snapshot": "false", "db": "postgres", "sequence": '["24023119","24023128"]',
            "ts_us": 1559033904863123, "ts_ns": 1559033904863123000, "schema": "public", "table": "customers",
            "txId": 555, "lsn": 24023128, "xmin": None,
        },
        "transaction": None, "op": "c", "ts_ms": 1559033904866, "ts_us": 1559033904866001,
        "ts_ns": 1559033904866001000,
    },
}

# The same connector's update and delete payloads without the schema part (REPLICA IDENTITY DEFAULT:
# `before` holds only the key), in the older shape whose `snapshot` was a boolean.
PG_UPDATE: dict[str, Any] = {
    "before": {"id": 1},
    "after": {"id": 1, "first_name": "Anne Marie", "last_name": "Kretchmar", "email": "annek@noanswer.org"},
    "source": {"version": "1.9.7.Final", "connector": "postgresql", "name": "PostgreSQL_server", "ts_ms": 1559033904863,
               "snapshot": False, "db": "postgres", "schema": "public", "table": "customers", "txId": 556,
               "lsn": 24023128, "xmin": None},
    "op": "u", "ts_ms": 1465584025523,
}
PG_DELETE: dict[str, Any] = {
    "before": {"id": 1},
    "after": None,
    "source": {"version": "1.9.7.Final", "connector": "postgresql", "name": "PostgreSQL_server", "ts_ms": 1559033904863,
               "snapshot": False, "db": "postgres", "schema": "public", "table": "customers", "txId": 556,
               "lsn": 46523128, "xmin": None},
    "op": "d", "ts_ms": 1465581902461,
}


def orders_row(optional: bool, field: str) -> dict[str, Any]:
    return {
        "type": "struct",
        "fields": [
            f("int32", "order_id", default=0),
            f("int32", "quantity"),
            {"type": "bytes", "optional": False, "name": "org.apache.kafka.connect.data.Decimal", "version": 1,
             "parameters": {"scale": "2", "connect.decimal.precision": "10"}, "field": "price"},
            {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "version": 1,
             "default": 0, "field": "order_date"},
            f("string", "status", True, default="PENDING"),
        ],
        "optional": optional, "name": "pg.public.orders.Value", "field": field,
    }


# PostgreSQL connector, Debezium 2.5 layout (transaction last, Envelope version 1): snapshot read.
PG_SNAPSHOT_READ: dict[str, Any] = {
    "schema": {
        "type": "struct",
        "fields": [
            orders_row(True, "before"), orders_row(True, "after"),
            {"type": "struct", "fields": PG_SOURCE_FIELDS_25, "optional": False,
             "name": "io.debezium.connector.postgresql.Source", "field": "source"},
            f("string", "op"), f("int64", "ts_ms", True), TRANSACTION_FIELD,
        ],
        "optional": False, "name": "pg.public.orders.Envelope", "version": 1,
    },
    "payload": {
        "before": None,
        "after": {"order_id": 1, "quantity": 1, "price": "AdTA", "order_date": 1767610078945635, "status": "COMPLETED"},
        "source": {"version": "2.5.4.Final", "connector": "postgresql", "name": "pg", "ts_ms": 1767611532462,
                   "snapshot": "first", "db": "testdb", "sequence": '[null,"26843720"]', "schema": "public",
                   "table": "orders", "txId": 742, "lsn": 26843720, "xmin": None},
        "op": "r", "ts_ms": 1767611532655, "transaction": None,
    },
}

# MySQL connector, Debezium 3.x layout: update event with the schema part.
MYSQL_UPDATE: dict[str, Any] = {
    "schema": {
        "type": "struct",
        "fields": [
            {"type": "struct", "fields": [f("int32", "id"), f("string", "email", True)], "optional": True,
             "name": "dbserver1.mydb.customers.Value", "field": "before"},
            {"type": "struct", "fields": [f("int32", "id"), f("string", "email", True)], "optional": True,
             "name": "dbserver1.mydb.customers.Value", "field": "after"},
            {"type": "struct", "fields": MYSQL_SOURCE_FIELDS_3, "optional": False,
             "name": "io.debezium.connector.mysql.Source", "version": 1, "field": "source"},
            TRANSACTION_FIELD,
            f("string", "op"), f("int64", "ts_ms", True), f("int64", "ts_us", True), f("int64", "ts_ns", True),
        ],
        "optional": False, "name": "dbserver1.mydb.customers.Envelope", "version": 2,
    },
    "payload": {
        "before": {"id": 230, "email": "john@example.com"},
        "after": {"id": 230, "email": "john.updated@example.com"},
        "source": {"version": "3.2.1.Final", "connector": "mysql", "name": "dbserver1", "ts_ms": 1755598927000,
                   "snapshot": "false", "db": "mydb", "sequence": None, "ts_us": 1755598927000000,
                   "ts_ns": 1755598927000000000, "table": "customers", "server_id": 1, "gtid": None,
                   "file": "binlog.000003", "pos": 169054, "row": 0, "thread": 12, "query": None},
        "transaction": {"id": "file=binlog.000003,pos=168970", "total_order": 1, "data_collection_order": 1},
        "op": "u", "ts_ms": 1755598927581, "ts_us": 1755598927581026, "ts_ns": 1755598927581026596,
    },
}


def test_reads_a_postgresql_create_with_schema() -> None:
    ev = EventCodec().decode_value(orjson.dumps(PG_CREATE))
    assert ev.op is Op.CREATE and ev.before is None
    assert ev.after == {"id": 1, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}
    assert ev.source == SourceInfo("postgresql", "PostgreSQL_server", "postgres", "public", "customers",
                                   PgPosition(24023128, 0), 1559033904863, 555, Snapshot.FALSE,
                                   1559033904863123, 1559033904863123000, {"sequence": '["24023119","24023128"]'})
    assert ev.ts_ms == 1559033904866 and ev.transaction is None
    assert (ev.ts_us, ev.ts_ns) == (1559033904866001, 1559033904866001000)
    assert ev.key is None  # Debezium's value schema names no key: it is in the record key
    key_schema = parse_value_schema(PG_CREATE["schema"], key=["id"])
    assert key_schema.name == "PostgreSQL_server.inventory.customers"
    assert key_schema.column("id") == Column("id", FT.INT32, optional=False, default=0)
    assert EventCodec().decode_value(orjson.dumps(PG_CREATE), key_schema).key == {"id": 1}


def test_reads_postgresql_update_and_delete_without_schema() -> None:
    schema = TableSchema(
        "PostgreSQL_server.public.customers",
        (Column("id", FT.INT32, optional=False), Column("first_name", FT.STRING, optional=False),
         Column("last_name", FT.STRING, optional=False), Column("email", FT.STRING, optional=False)),
        key=("id",),
    )
    codec = EventCodec()
    up = codec.decode_value(orjson.dumps(PG_UPDATE), schema)
    assert up.op is Op.UPDATE and up.before == {"id": 1} and up.after["first_name"] == "Anne Marie"  # type: ignore[index]
    assert up.key == {"id": 1} and up.source.snapshot is Snapshot.FALSE and up.source.tx_id == 556
    de = codec.decode_value(orjson.dumps(PG_DELETE), schema)
    assert de.op is Op.DELETE and de.after is None and de.key == {"id": 1}
    assert de.source.position == PgPosition(46523128, 0)
    assert up.source.position < de.source.position
    # record key as Debezium writes it (schemaless) and the tombstone after the delete
    assert codec.decode_record(b'{"id":1}', orjson.dumps(PG_DELETE), schema) == de
    assert codec.decode_record(b'{"id":1}', None, schema) is None


def test_reads_a_snapshot_read_with_decimal_and_micro_timestamp() -> None:
    ev = EventCodec().decode_value(orjson.dumps(PG_SNAPSHOT_READ))
    assert ev.op is Op.READ
    assert ev.after == {
        "order_id": 1, "quantity": 1, "price": Decimal("1200.00"),
        "order_date": datetime(2026, 1, 5, 10, 47, 58, 945635), "status": "COMPLETED",
    }
    assert ev.source.snapshot is Snapshot.FIRST
    assert ev.source.position == PgPosition(26843720, 0, snapshot=True)
    table = parse_value_schema(PG_SNAPSHOT_READ["schema"])
    assert table.column("price") == Column("price", FT.DECIMAL, optional=False, scale=2, precision=10)
    assert table.column("order_date") == Column("order_date", FT.TIMESTAMP, default=datetime(1970, 1, 1))
    assert table.column("status").default == "PENDING"


def test_reads_a_mysql_update_with_transaction_block() -> None:
    ev = EventCodec().decode_value(orjson.dumps(MYSQL_UPDATE))
    assert ev.op is Op.UPDATE
    assert ev.before == {"id": 230, "email": "john@example.com"}
    assert ev.source.connector == "mysql" and ev.source.schema is None and ev.source.db == "mydb"
    assert ev.source.position == BinlogPosition("binlog.000003", 169054, 0, None, 1)
    assert ev.transaction == TransactionInfo("file=binlog.000003,pos=168970", 1, 1)


def test_reads_debezium_logical_types() -> None:
    """The time/data logical types of Debezium's adaptive modes, including millisecond ones."""
    fields = [
        f("int32", "id"),
        {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "version": 1, "field": "d"},
        {"type": "int32", "optional": True, "name": "io.debezium.time.Time", "version": 1, "field": "t_ms"},
        {"type": "int64", "optional": True, "name": "io.debezium.time.Timestamp", "version": 1, "field": "ts_ms"},
        {"type": "int64", "optional": True, "name": "io.debezium.time.NanoTimestamp", "version": 1, "field": "ts_ns"},
        {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "version": 1, "field": "tz"},
        {"type": "struct", "fields": [f("int32", "scale"), f("bytes", "value")], "optional": True,
         "name": "io.debezium.data.VariableScaleDecimal", "version": 1, "doc": "Variable scaled decimal",
         "field": "n"},
        {"type": "string", "optional": True, "name": "io.debezium.data.Uuid", "version": 1, "field": "u"},
        {"type": "string", "optional": True, "name": "io.debezium.data.Json", "version": 1, "field": "j"},
        {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
         "parameters": {"allowed": "new,paid"}, "field": "e"},
        {"type": "array", "items": {"type": "int32", "optional": True}, "optional": True, "field": "a"},
        {"type": "string", "optional": True, "name": "io.debezium.data.Xml", "version": 1, "field": "x"},
        {"type": "double", "optional": True, "parameters": {"__debezium.source.column.type": "NUMERIC",
                                                             "__debezium.source.column.scale": "2"}, "field": "m"},
    ]
    schema = {"type": "struct", "fields": [
        {"type": "struct", "fields": fields, "optional": True, "name": "s.public.t.Value", "field": "before"},
        {"type": "struct", "fields": fields, "optional": True, "name": "s.public.t.Value", "field": "after"},
        {"type": "struct", "fields": PG_SOURCE_FIELDS_25, "optional": False,
         "name": "io.debezium.connector.postgresql.Source", "field": "source"},
        f("string", "op"), f("int64", "ts_ms", True),
    ], "optional": False, "name": "s.public.t.Envelope"}
    after = {
        "id": 1, "d": 17702, "t_ms": 54796945, "ts_ms": 1529507596945, "ts_ns": 1529507596945104000,
        "tz": "2018-06-20T15:13:16.945104Z", "n": {"scale": 2, "value": "BNI="},
        "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "j": '{"k": [1, 2]}', "e": "paid", "a": [1, None], "x": "<a/>",
        "m": 12.5,
    }
    payload = {"before": None, "after": after, "op": "c", "ts_ms": 1,
               "source": {**PG_SNAPSHOT_READ["payload"]["source"], "snapshot": "false"}}
    ev = EventCodec().decode_value(orjson.dumps({"schema": schema, "payload": payload}))
    assert ev.after == {
        "id": 1, "d": date(2018, 6, 20), "t_ms": time(15, 13, 16, 945000),
        "ts_ms": datetime(2018, 6, 20, 15, 13, 16, 945000), "ts_ns": datetime(2018, 6, 20, 15, 13, 16, 945104),
        "tz": datetime(2018, 6, 20, 15, 13, 16, 945104, tzinfo=UTC),
        "n": Decimal("12.34"), "u": UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"), "j": {"k": [1, 2]}, "e": "paid",
        "a": [1, None], "x": "<a/>", "m": Decimal("12.5"),
    }
    table = parse_value_schema(schema)
    assert table.column("e").allowed == ("new", "paid")
    assert table.column("m").type is FT.DECIMAL and table.column("m").scale == 2


# -- kappaflow's output has Debezium's shape ----------------------------------------------------------
def strip_kf(obj: Any) -> Any:
    """Drop kappaflow's additions (kf_* fields, kf.* parameters) to compare with Debezium's shape."""
    if isinstance(obj, list):
        return [strip_kf(x) for x in obj if not (isinstance(x, dict) and str(x.get("field", "")).startswith("kf_"))]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k.startswith("kf_"):
                continue
            if k == "parameters":
                v = {pk: pv for pk, pv in v.items() if not pk.startswith("kf.")}
                if not v:
                    continue
            out[k] = strip_kf(v)
        return out
    return obj


ORDERS = TableSchema(
    "pg.public.orders",
    (
        Column("order_id", FT.INT32, optional=False, default=0),
        Column("quantity", FT.INT32, optional=False),
        Column("price", FT.DECIMAL, optional=False, scale=2, precision=10),
        Column("order_date", FT.TIMESTAMP, default=datetime(1970, 1, 1)),
        Column("status", FT.STRING, default="PENDING"),
    ),
    key=("order_id",),
)


def test_encoder_writes_the_postgresql_envelope_shape() -> None:
    """A 2.5 record read and written back comes out in the 2.6+ layout Debezium writes today
    (the shape of PG_CREATE): transaction after source, ts_us/ts_ns in the source and the
    envelope, Envelope version 2; every value of the record kept."""
    dbz = PG_SNAPSHOT_READ
    event = EventCodec().decode_value(orjson.dumps(dbz), ORDERS)
    out = orjson.loads(EventCodec("precise", include_schema=True, version="2.5.4.Final").encode_value(event, ORDERS))
    assert list(out) == ["schema", "payload"]
    # payload: the 2.6+ keys in Debezium's order, the record's values (kf_pos is kappaflow's addition)
    assert list(out["payload"]) == list(PG_CREATE["payload"])
    assert list(strip_kf(out["payload"]["source"])) == list(PG_CREATE["payload"]["source"])
    ts, ts_src = dbz["payload"]["ts_ms"], dbz["payload"]["source"]["ts_ms"]
    expected = {**dbz["payload"], "ts_us": ts * 1000, "ts_ns": ts * 1_000_000,
                "source": {**dbz["payload"]["source"], "ts_us": ts_src * 1000, "ts_ns": ts_src * 1_000_000}}
    assert strip_kf(out["payload"]) == expected
    assert out["payload"]["source"]["kf_pos"] == {"kind": "pg", "lsn": 26843720, "index": 0, "snapshot": True}
    # schema: the 2.6+ Connect schema, field by field
    ours, theirs = strip_kf(out["schema"]), PG_CREATE["schema"]
    assert ours["name"] == "pg.public.orders.Envelope" and ours["version"] == theirs["version"] == 2
    assert [x["field"] for x in ours["fields"]] == [x["field"] for x in theirs["fields"]]
    assert ours["fields"][:2] == dbz["schema"]["fields"][:2]  # before/after row structs
    # the source block (kappaflow declares Debezium 3.x's list of snapshot values)
    want = [SNAPSHOT_FIELD_3 if x["field"] == "snapshot" else x for x in PG_SOURCE_FIELDS_27]
    assert ours["fields"][2]["fields"] == want
    assert ours["fields"][2]["name"] == theirs["fields"][2]["name"]
    assert ours["fields"][3:] == theirs["fields"][3:]  # transaction, op, ts_ms, ts_us, ts_ns


def test_encoder_writes_the_mysql_source_shape() -> None:
    event = EventCodec().decode_value(orjson.dumps(MYSQL_UPDATE))
    table = parse_value_schema(MYSQL_UPDATE["schema"])
    out = orjson.loads(EventCodec(include_schema=True).encode_value(event, table))
    ours_source = next(x for x in out["schema"]["fields"] if x["field"] == "source")
    assert ours_source["name"] == "io.debezium.connector.mysql.Source"
    assert [x for x in strip_kf(ours_source["fields"]) if x["field"] != "txId"] == MYSQL_SOURCE_FIELDS_3
    src = out["payload"]["source"]
    assert [k for k in src if k not in ("kf_pos", "txId")] == list(MYSQL_UPDATE["payload"]["source"])
    assert {k: v for k, v in src.items() if k not in ("kf_pos", "txId", "version")} == {
        k: v for k, v in MYSQL_UPDATE["payload"]["source"].items() if k != "version"}
    assert out["payload"]["transaction"] == MYSQL_UPDATE["payload"]["transaction"]
    assert [k for k in out["payload"] if k != "schema"] == list(MYSQL_UPDATE["payload"])
    assert src["file"] == "binlog.000003" and src["pos"] == 169054 and src["server_id"] == 1 and src["thread"] == 12


@pytest.mark.parametrize("mode", ["string", "precise", "double"])
@pytest.mark.parametrize("kind", ["pg", "binlog", "ledger"])
def test_connect_schema_round_trips_through_from_connect(mode: str, kind: str) -> None:
    schema = TableSchema(
        "shop.public.everything",
        (
            Column("id", FT.INT64, optional=False, native_type="bigint"),
            Column("amount", FT.DECIMAL, scale=2, precision=12),
            Column("ratio", FT.VARIABLE_DECIMAL),
            Column("tags", FT.ARRAY, items=Column("item", FT.STRING)),
            Column("mood", FT.ENUM, allowed=("ok", "meh"), default="ok"),
            Column("flags", FT.SET, allowed=("a", "b")),
            Column("bits", FT.BITS, length=12),
            Column("at", FT.TIMESTAMPTZ, default=datetime(2000, 1, 1, tzinfo=UTC)),
            Column("doc", FT.JSON, default={"x": [1]}),
            Column("y", FT.YEAR), Column("f", FT.FLOAT32), Column("i8", FT.INT8), Column("i16", FT.INT16),
        ),
        key=("id",),
    )
    cs = render_value_schema(schema, decimal_mode=mode, position_kind=kind)
    assert cs["name"] == "shop.public.everything.Envelope"
    back = parse_value_schema(cs)
    assert back == schema
    assert back.fingerprint() == schema.fingerprint()
    assert parse_value_schema(render_value_schema(schema, envelope=False, decimal_mode=mode)) == schema
    # a decoder handed the schema part alone can read the events
    ev = ChangeEvent(Op.CREATE, {"id": 1}, None, {"id": 1, "amount": Decimal("1.25"), "tags": ["a", None]},
                     SourceInfo("postgresql", "shop", "db", "public", "everything", PgPosition(1, 0), 5), 6)
    raw = EventCodec(mode, include_schema=True).encode_value(ev, schema)
    assert EventCodec().decode_value(raw).after == ev.after
