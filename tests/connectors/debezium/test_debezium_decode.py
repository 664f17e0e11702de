"""Records in Debezium's documented formats decode to kappaflow change events (no server needed).

The fixtures in ``fixtures/`` follow the examples of Debezium's MySQL and PostgreSQL connector
documentation (customers table of the ``inventory`` tutorial database, the envelope with and
without the JsonConverter schema, the logical types) and of ``ExtractNewRecordState``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

from kappaflow.connectors.debezium.decode import DebeziumDecoder
from kappaflow.errors import ValidationError
from kappaflow.events import BinlogPosition, FieldType, LedgerPosition, Op, PgPosition, Snapshot

FIXTURES = Path(__file__).with_name("fixtures")
ANNE = {"id": 1004, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}


def fx(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def test_mysql_create_with_schema() -> None:
    dec = DebeziumDecoder("dbz")
    d = dec.decode("mysql-server-1.inventory.customers", 0, 5, fx("mysql_customers_key_schema.json"),
                   fx("mysql_customers_create_schema.json"))
    assert d.kind == "event" and d.topic == "dbz.inventory.customers"
    ev = d.event
    assert ev is not None and d.schema is not None
    assert ev.op is Op.CREATE and ev.key == {"id": 1004} and ev.after == ANNE and ev.before is None
    assert (ev.source.connector, ev.source.name, ev.source.db, ev.source.table) == ("mysql", "dbz", "inventory",
                                                                                    "customers")
    assert ev.source.position == BinlogPosition("mysql-bin.000003", 154, 0)
    assert ev.source.snapshot is Snapshot.FALSE  # Debezium 1.x wrote a boolean
    assert d.schema.key == ("id",) and d.schema.column("id").type is FieldType.INT32


def test_mysql_update_and_delete_without_schema() -> None:
    dec = DebeziumDecoder("dbz")
    key = b'{"id": 1004}'
    up = dec.decode("mysql-server-1.inventory.customers", 0, 6, key, fx("mysql_customers_update.json"))
    assert up.event is not None and up.event.op is Op.UPDATE
    assert up.event.before == ANNE and up.event.after == dict(ANNE, first_name="Anne Marie")
    assert up.event.key == {"id": 1004} and up.schema is not None and up.schema.key == ("id",)
    dl = dec.decode("mysql-server-1.inventory.customers", 0, 7, key, fx("mysql_customers_delete.json"))
    assert dl.event is not None and dl.event.op is Op.DELETE and dl.event.after is None
    assert dl.event.before == dict(ANNE, first_name="Anne Marie") and dl.event.key == {"id": 1004}
    # Debezium's tombstone after the delete: kappaflow writes its own, so this one is skipped
    tomb = dec.decode("mysql-server-1.inventory.customers", 0, 8, key, None)
    assert tomb.kind == "skip" and tomb.reason == "tombstone"


def test_pg_snapshot_read_and_truncate() -> None:
    dec = DebeziumDecoder("pgdbz")
    r = dec.decode("PostgreSQL_server.public.customers", 1, 0, b'{"id": 1}', fx("pg_customers_read.json"))
    assert r.event is not None and r.event.op is Op.READ and r.topic == "pgdbz.public.customers"
    assert r.event.source.snapshot is Snapshot.TRUE and r.event.source.position == PgPosition(24023128, 0, True)
    assert r.event.source.schema == "public" and r.event.source.tx_id == 555
    t = dec.decode("PostgreSQL_server.public.customers", 1, 1, None, fx("pg_truncate.json"))
    assert t.event is not None and t.event.op is Op.TRUNCATE and t.event.key is None


def test_pg_logical_types_with_schema() -> None:
    dec = DebeziumDecoder("pgdbz")
    d = dec.decode("PostgreSQL_server.inventory.products", 0, 0, b'{"id": 7}', fx("pg_products_logical_types.json"))
    assert d.event is not None and d.schema is not None
    after = d.event.after
    assert after == {
        "id": 7, "price": Decimal("12.50"), "born": dt.date(2024, 3, 1),
        "updated": dt.datetime(2024, 5, 1, 12, 0, 0, 123456),
        "seen": dt.datetime(2024, 1, 2, 3, 4, 5, 654321, tzinfo=dt.UTC), "doc": {"a": [1, "x"]},
        "uid": uuid.UUID("f8f7e5c4-3b4a-4d2e-9c1b-0a9e8d7c6b5a"), "amount": Decimal("0.482"),
    }
    types = {c.name: c.type for c in d.schema.columns}
    assert types == {"id": FieldType.INT32, "price": FieldType.DECIMAL, "born": FieldType.DATE,
                     "updated": FieldType.TIMESTAMP, "seen": FieldType.TIMESTAMPTZ, "doc": FieldType.JSON,
                     "uid": FieldType.UUID, "amount": FieldType.VARIABLE_DECIMAL}
    assert d.schema.column("price").scale == 2
    assert d.event.transaction is not None and d.event.transaction.id == "556:24023928"


def test_flattened_records_extract_new_record_state() -> None:
    dec = DebeziumDecoder("flat")
    c = dec.decode("dbserver1.inventory.customers", 2, 10, b'{"id": 1004}', fx("flattened_create.json"))
    assert c.event is not None and c.event.op is Op.CREATE and c.event.after == ANNE  # no "__" fields left
    assert c.topic == "flat.inventory.customers" and c.event.key == {"id": 1004}
    assert c.event.source.position == LedgerPosition((2 << 48) | 10)  # Kafka coordinates
    d = dec.decode("dbserver1.inventory.customers", 2, 11, b'{"id": 1004}', fx("flattened_rewrite_delete.json"))
    assert d.event is not None and d.event.op is Op.DELETE and d.event.before == dict(ANNE, first_name="Anne Marie")
    # delete.handling.mode=drop: the tombstone is the only trace of the delete
    t = dec.decode("dbserver1.inventory.customers", 2, 12, b'{"id": 1005}', None)
    assert t.event is not None and t.event.op is Op.DELETE and t.event.key == {"id": 1005}
    # with the lsn added as a field (add.fields=lsn), it becomes the position
    withlsn = dec.decode("dbserver1.inventory.customers", 0, 3, b'{"id": 9}',
                         orjson.dumps({"id": 9, "first_name": "x", "last_name": "y", "email": "z", "__lsn": 777}))
    assert withlsn.event is not None and withlsn.event.source.position == PgPosition(777, 0)


def test_transaction_metadata_heartbeats_schema_changes() -> None:
    dec = DebeziumDecoder("dbz")
    tx = dec.decode("mysql-server-1.transaction", 0, 0, b'{"id": "571:53195829"}', fx("transaction_begin.json"))
    assert tx.kind == "route" and tx.topic == "dbz.__transactions"
    hb = dec.decode("__debezium-heartbeat.mysql-server-1", 0, 0, b'{"serverName": "x"}', fx("heartbeat.json"))
    assert hb.kind == "skip" and hb.reason == "heartbeat"
    ddl = dec.decode("mysql-server-1", 0, 0, b'{"databaseName": "inventory"}',
                     orjson.dumps({"source": {"connector": "mysql"}, "databaseName": "inventory",
                                   "ddl": "ALTER TABLE customers ADD COLUMN x INT", "tableChanges": []}))
    assert ddl.kind == "route" and ddl.topic == "dbz.__debezium_schema"


@pytest.mark.parametrize(("value", "expected"), [
    (b'{"before": null, "after": {"id": 1', "value: malformed JSON"),
    (orjson.dumps({"before": None, "after": {"id": 1}, "source": {"connector": "mysql"}}), "op: missing"),
])
def test_bad_input_is_a_validation_error(value: bytes, expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        DebeziumDecoder("dbz").decode("t.db.x", 0, 0, b'{"id": 1}', value)


def test_decimal_with_missing_scale_is_rejected() -> None:
    doc = orjson.loads(fx("pg_products_logical_types.json"))
    for part in doc["schema"]["fields"][:2]:
        del part["fields"][1]["parameters"]["scale"]
    with pytest.raises(ValidationError, match="scale"):
        DebeziumDecoder("dbz").decode("x.inventory.products", 0, 0, b'{"id": 7}', orjson.dumps(doc))
    # schemaless: a {value} without its scale
    bad = orjson.dumps({"before": None, "after": {"id": 1, "amount": {"value": "AeI="}}, "op": "c",
                        "source": orjson.loads(fx("pg_customers_read.json"))["source"]})
    with pytest.raises(ValidationError, match="scale"):
        DebeziumDecoder("dbz").decode("x.public.t", 0, 0, b'{"id": 1}', bad)
