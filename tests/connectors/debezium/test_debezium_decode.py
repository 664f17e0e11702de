"""Records from Debezium's documentation and repository, decoded and written back (no server needed).

Each test names where its record comes from (``dbz_helpers.SOURCES``, or inline). For each:
the decoded event (op, key, before/after values and types, absent vs NULL, unavailable
columns, position and order) and the round trip back to Debezium JSON, compared field by
field with the record (``assert_round_trip``).
"""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import orjson
import pytest
from dbz_helpers import assert_round_trip, decode, fx, fx_bytes

from kappaflow.connectors.debezium.decode import DebeziumDecoder
from kappaflow.connectors.debezium.sources.db2 import Db2Position
from kappaflow.connectors.debezium.sources.generic import KafkaPosition
from kappaflow.connectors.debezium.sources.mongodb import MongoPosition
from kappaflow.connectors.debezium.sources.oracle import OraclePosition
from kappaflow.connectors.debezium.sources.sqlserver import SqlServerPosition
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import ValidationError
from kappaflow.events import FieldType, Op, Snapshot, TransactionInfo

ANNE = {"id": 1004, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}
PG = "PostgreSQL_server.public.customers"


# -- PostgreSQL ------------------------------------------------------------------------------------
def test_pg_create_update_delete_truncate_from_the_documentation() -> None:
    """pg_doc_create/update/delete/truncate.json: the PostgreSQL connector's documented events."""
    dec = DebeziumDecoder("PostgreSQL_server")
    key = {"schema": {"type": "struct", "name": f"{PG}.Key", "optional": False,
                      "fields": [{"type": "int32", "optional": False, "field": "id"}]}, "payload": {"id": 1}}
    c = decode(dec, PG, fx("pg_doc_create.json"), key, offset=0)
    assert c.kind == "event" and c.topic == "PostgreSQL_server.public.customers"
    ev = c.event
    assert ev is not None and c.schema is not None
    assert ev.op is Op.CREATE and ev.key == {"id": 1} and ev.before is None
    assert ev.after == {"id": 1, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}
    assert [(col.name, col.type, col.optional) for col in c.schema.columns] == [
        ("id", FieldType.INT32, False), ("first_name", FieldType.STRING, False),
        ("last_name", FieldType.STRING, False), ("email", FieldType.STRING, False)]
    assert ev.source.snapshot is Snapshot.TRUE and ev.source.tx_id == 555
    assert ev.source.position == PgPosition(24023128, 0, snapshot=True)
    assert (ev.source.ts_us, ev.source.ts_ns) == (1559033904863123, 1559033904863123000)
    assert (ev.ts_us, ev.ts_ns) == (1559033904863841, 1559033904863841257)
    assert_round_trip(c, fx("pg_doc_create.json"))

    u = decode(dec, PG, fx("pg_doc_update.json"), key, offset=1)
    assert u.event is not None and u.event.op is Op.UPDATE
    # REPLICA IDENTITY DEFAULT: `before` holds the key only -- the other columns are absent, not NULL
    assert u.event.before == {"id": 1} and "email" not in u.event.before
    assert u.event.after == {"id": 1, "first_name": "Anne Marie", "last_name": "Kretchmar",
                             "email": "annek@noanswer.org"}
    # the documented update has the create's LSN: it comes after it in the partition, so it orders after it
    assert u.event.source.position > ev.source.position
    assert_round_trip(u, fx("pg_doc_update.json"))

    d = decode(dec, PG, fx("pg_doc_delete.json"), key, offset=2)
    assert d.event is not None and d.event.op is Op.DELETE and d.event.after is None and d.event.key == {"id": 1}
    assert d.event.source.position == PgPosition(46523128, 0)
    assert_round_trip(d, fx("pg_doc_delete.json"))
    # the tombstone Debezium writes after the delete: kappaflow writes its own
    t = decode(dec, PG, None, key, offset=3)
    assert t.kind == "skip" and t.reason == "tombstone"

    tr = decode(dec, PG, fx("pg_doc_truncate.json"), None, offset=4)
    assert tr.event is not None and tr.event.op is Op.TRUNCATE and tr.event.key is None
    assert tr.event.before is None and tr.event.after is None
    assert_round_trip(tr, fx("pg_doc_truncate.json"))


def test_pg_logical_decoding_messages_become_an_event_topic() -> None:
    """pg_doc_message_*.json: op "m" -> a record on <source>.message with prefix and content."""
    dec = DebeziumDecoder("PostgreSQL_server")
    m = decode(dec, "PostgreSQL_server.message", fx("pg_doc_message_transactional.json"), {"prefix": "foo"})
    assert m.kind == "message" and m.topic == "PostgreSQL_server.message" and m.key == b"foo"
    assert m.value is not None
    doc = orjson.loads(m.value)
    assert (doc["prefix"], doc["content"], doc["transactional"]) == ("foo", "Ymfy", True)
    assert doc["position"] == 0 and doc["lsn"] == 46523128 and doc["txId"] == 556 and doc["ts_ms"] == 1559033904863
    n = decode(dec, "PostgreSQL_server.message", fx("pg_doc_message_nontransactional.json"), {"prefix": "foo"},
               offset=1)
    nd = orjson.loads(n.value or b"")
    assert nd["transactional"] is False and nd["txId"] is None
    # the second has the same LSN: it is ordered after the first (its position in the partition)
    assert PgPosition.from_dict(nd["kf_pos"]) > PgPosition.from_dict(doc["kf_pos"])


def test_pg_incremental_and_blocking_snapshot_reads_follow_the_partition_order() -> None:
    """Incremental snapshot reads ("snapshot": "incremental", lsn and txId null) are emitted at the
    high watermark, after the streamed changes of the chunk's window (DBLog; the PostgreSQL
    documentation's "Incremental snapshots" section); they must order after what their partition
    delivered before them and before what comes after. Records: the documented create/update,
    and a read of the same row as an incremental snapshot writes it."""
    dec = DebeziumDecoder("PostgreSQL_server")
    key = {"id": 1}
    up = fx("pg_doc_update.json")
    up["payload"]["source"]["lsn"] = 50000000
    u = decode(dec, PG, up, key, offset=0)
    read = fx("pg_doc_create.json")
    src = read["payload"]["source"]
    src.update({"snapshot": "incremental", "lsn": None, "txId": None})
    read["payload"]["op"] = "r"
    r = decode(dec, PG, read, key, offset=1)
    assert r.kind == "event" and r.event is not None and r.event.op is Op.READ
    assert r.event.source.snapshot is Snapshot.INCREMENTAL
    assert r.event.source.position > u.event.source.position  # type: ignore[union-attr]
    later = fx("pg_doc_delete.json")
    later["payload"]["source"]["lsn"] = 50000100
    d = decode(dec, PG, later, key, offset=2)
    assert d.event is not None and d.event.source.position > r.event.source.position
    # written back, the read keeps lsn/txId null as Debezium wrote them
    out = assert_round_trip(r, read)
    assert out["payload"]["source"]["lsn"] is None and out["payload"]["source"]["txId"] is None
    # a blocking snapshot read whose LSN is the snapshot's (older than the streamed change before it)
    blocking = fx("pg_doc_create.json")
    blocking["payload"]["op"] = "r"
    blocking["payload"]["source"].update({"snapshot": "true", "lsn": 100})
    b = decode(dec, PG, blocking, key, offset=3)
    assert b.event is not None and b.event.source.position > d.event.source.position
    # the order state is saved with the offsets: the same records after a restart get the same positions
    again = DebeziumDecoder("PostgreSQL_server")
    again.order = type(dec.order).from_dict(orjson.loads(orjson.dumps(dec.order.to_dict())))
    assert decode(again, PG, blocking, key, offset=3).event.source.position.successor() == \
        b.event.source.position.successor().successor()  # type: ignore[union-attr]


def test_a_first_record_without_position_gets_its_kafka_coordinates() -> None:
    """An incremental read as the first record of its partition: Kafka coordinates, then successors."""
    dec = DebeziumDecoder("PostgreSQL_server")
    read = fx("pg_doc_create.json")
    read["payload"]["op"] = "r"
    read["payload"]["source"].update({"snapshot": "incremental", "lsn": None, "txId": None})
    r = decode(dec, PG, read, {"id": 1}, partition=3, offset=41)
    assert r.event is not None and r.event.source.position == KafkaPosition(3, 41)


def test_unavailable_placeholders_are_never_values() -> None:
    """Every form of the placeholder Debezium's PostgreSQL connector writes for a column it could
    not read (``UnchangedToastedPlaceholder``, ``dbz_helpers.PLACEHOLDER_REPO``): text, bytea
    (bytes/base64, base64-url-safe, hex), json/jsonb, hstore (map and JSON), text[], int[]/bigint[]
    (one element per placeholder byte), uuid[] (Java's name UUID of the placeholder), geometry,
    geography, point -- and a configured ``unavailable.value.placeholder``."""
    p = b"__debezium_unavailable_value"
    forms: dict[str, Any] = {
        "bio": p.decode(),
        "photo": base64.b64encode(p).decode(),
        "photo_url": base64.urlsafe_b64encode(p).decode(),
        "photo_hex": p.hex(),
        "doc": p.decode(),
        "attrs": {p.decode(): p.decode()},
        "attrs_json": orjson.dumps({p.decode(): p.decode()}).decode(),
        "tags": [p.decode()],
        "scores": list(p),
        "ids": [str(uuid.UUID(bytes=__import__("hashlib").md5(p).digest(), version=3))],
        "geom": {"wkb": base64.b64encode(bytes.fromhex("0101000020E6100000000000FC83D797C1000000FC83D797C1")).decode(),
                 "srid": 4326},
        "geog": {"wkb": base64.b64encode(bytes.fromhex("0101000020E61000000C21E7FDFF7F66401842CEFBFF7F5640")).decode(),
                 "srid": 4326},
        "pt": {"x": -99999999.0, "y": -99999999.0, "wkb": None, "srid": None},
    }
    up = fx("pg_doc_update.json")["payload"]
    up["after"].update(forms)
    up["before"] = {"id": 1, "bio": p.decode()}
    dec = DebeziumDecoder("PostgreSQL_server")
    d = decode(dec, PG, up, {"id": 1})
    ev = d.event
    assert ev is not None
    assert set(ev.unavailable) == set(forms)
    assert ev.after == {"id": 1, "first_name": "Anne Marie", "last_name": "Kretchmar", "email": "annek@noanswer.org"}
    assert ev.before == {"id": 1}  # unknown in the before image too: absent
    # a value that only looks like one is a value
    up2 = fx("pg_doc_update.json")["payload"]
    up2["after"]["first_name"] = "__debezium_unavailable"
    assert decode(dec, PG, up2, {"id": 1}, offset=1).event.unavailable == ()  # type: ignore[union-attr]
    # a configured placeholder
    custom = DebeziumDecoder("PostgreSQL_server", placeholder="??toast??")
    up3 = fx("pg_doc_update.json")["payload"]
    up3["after"]["email"] = "??toast??"
    e3 = decode(custom, PG, up3, {"id": 1}).event
    assert e3 is not None and e3.unavailable == ("email",) and "email" not in e3.after  # type: ignore[operator]


def test_placeholder_in_a_jsonb_column_with_schema() -> None:
    """A jsonb column (io.debezium.data.Json) holding the placeholder: refused before, now unavailable."""
    doc = fx("pg_products_logical_types.json")
    doc["payload"]["before"] = None
    doc["payload"]["after"]["doc"] = "__debezium_unavailable_value"
    doc["payload"]["op"] = "u"
    d = decode(DebeziumDecoder("PostgreSQL_server"), "PostgreSQL_server.inventory.products", doc, {"id": 7})
    assert d.event is not None and d.event.unavailable == ("doc",) and "doc" not in d.event.after  # type: ignore[operator]
    out = assert_round_trip(d, doc, unavailable={"doc": ...})
    assert out["payload"]["kf_unavailable"] == ["doc"]


# -- MySQL -------------------------------------------------------------------------------------------
def test_mysql_serde_examples_from_debeziums_repository() -> None:
    """serde-with-schema.json / serde-without-schema.json / serde-unwrapped.json (Debezium's SerDes tests)."""
    topic = "mysql-server-1.inventory.customers"
    for name in ("serde-with-schema.json", "serde-without-schema.json"):
        dec = DebeziumDecoder("mysql-server-1")
        d = decode(dec, topic, fx(name), {"id": 1004})
        ev = d.event
        assert ev is not None and d.topic == "mysql-server-1.inventory.customers"
        assert ev.op is Op.CREATE and ev.key == {"id": 1004} and ev.after == ANNE and ev.before is None
        assert ev.source.position == BinlogPosition("mysql-bin.000003", 154, 0, None, 0)
        assert ev.source.extra == {"thread": 7, "query": "INSERT INTO customers (first_name, last_name, email) "
                                                         "VALUES ('Anne', 'Kretchmar', 'annek@noanswer.org')"}
        assert_round_trip(d, fx(name))
    # schemaless: the schema is inferred from the values
    assert d.schema is not None and d.schema.column("id").type is FieldType.INT64
    # the same row flattened by ExtractNewRecordState
    flat = decode(DebeziumDecoder("mysql-server-1"), topic, fx("serde-unwrapped.json"), {"id": 1004}, partition=1,
                  offset=9)
    assert flat.event is not None and flat.event.op is Op.CREATE and flat.event.after == ANNE
    assert flat.event.source.position == KafkaPosition(1, 9)


def test_mysql_update_and_delete_from_the_documentation() -> None:
    """mysql_customers_update.json / _delete.json (MySQL connector documentation)."""
    dec = DebeziumDecoder("mysql-server-1")
    t = "mysql-server-1.inventory.customers"
    u = decode(dec, t, fx("mysql_customers_update.json"), {"id": 1004}, offset=0)
    assert u.event is not None and u.event.before == ANNE and u.event.after == dict(ANNE, first_name="Anne Marie")
    assert_round_trip(u, fx("mysql_customers_update.json"))
    d = decode(dec, t, fx("mysql_customers_delete.json"), {"id": 1004}, offset=1)
    assert d.event is not None and d.event.op is Op.DELETE and d.event.source.position > u.event.source.position
    assert_round_trip(d, fx("mysql_customers_delete.json"))


# -- the other connectors ------------------------------------------------------------------------------
def test_sql_server_records_are_ordered_by_commit_lsn_change_lsn_and_serial() -> None:
    """sqlserver_doc_*.json (SQL Server connector documentation; event_serial_no quoted there)."""
    dec = DebeziumDecoder("server1")
    topic = "server1.testDB.dbo.customers"
    events = [decode(dec, topic, fx(n), {"id": 1005}, offset=i).event
              for i, n in enumerate(("sqlserver_doc_create.json", "sqlserver_doc_update.json",
                                     "sqlserver_doc_delete.json"))]
    assert [e.op for e in events] == [Op.CREATE, Op.UPDATE, Op.DELETE]  # type: ignore[union-attr]
    assert events[0].source.position == SqlServerPosition("00000027:00000758:0005", "00000027:00000758:0003", 1)
    assert events[1].source.position == SqlServerPosition("00000027:00000ac0:0007", "00000027:00000ac0:0002", 2)
    assert events[0].source.position < events[1].source.position < events[2].source.position  # type: ignore[union-attr]
    assert events[0].source.db == "testDB" and events[0].source.schema == "dbo"  # type: ignore[union-attr]
    dec2 = DebeziumDecoder("server1")
    for i, n in enumerate(("sqlserver_doc_create.json", "sqlserver_doc_update.json", "sqlserver_doc_delete.json")):
        d = decode(dec2, topic, fx(n), {"id": 1005}, offset=i)
        assert d.topic == "server1.dbo.customers"
        assert_round_trip(d, fx(n))


def test_oracle_records_from_the_documentation() -> None:
    """oracle_doc_create.json (documented without connector/db/schema/table in its source block:
    the connector comes from the source struct's name, schema and table from the topic) and
    oracle_doc_truncate.json."""
    dec = DebeziumDecoder("server1")
    c = decode(dec, "server1.DEBEZIUM.CUSTOMERS", fx("oracle_doc_create.json"), {"ID": 1004})
    assert c.event is not None and c.topic == "server1.DEBEZIUM.CUSTOMERS"
    assert c.event.source.connector == "oracle" and c.event.source.table == "CUSTOMERS"
    assert c.event.source.position == OraclePosition(2122185, 2122185)
    assert c.event.after == {"ID": 1004, "FIRST_NAME": "Anne", "LAST_NAME": "Kretchmar", "EMAIL": "annek@noanswer.org"}
    # the documented source block lacks what the Oracle connector's source struct declares:
    # written back, the block has them
    out = assert_round_trip(c, fx("oracle_doc_create.json"), added={"connector", "db", "schema", "table"})
    assert out["payload"]["source"]["row_id"] == "AAASgjAAMAAAACnAAA"
    t = decode(DebeziumDecoder("oracle_server"), "oracle_server.DEBEZIUM.TEST_TABLE", fx("oracle_doc_truncate.json"))
    assert t.event is not None and t.event.op is Op.TRUNCATE
    assert t.event.source.position == OraclePosition(13271102, 13234397)
    assert_round_trip(t, fx("oracle_doc_truncate.json"))


def test_db2_records_from_the_documentation() -> None:
    dec = DebeziumDecoder("myconnector")
    t = "myconnector.MYSCHEMA.CUSTOMERS"
    u = decode(dec, t, fx("db2_doc_update.json"), {"ID": 1005}, offset=0)
    d = decode(dec, t, fx("db2_doc_delete.json"), {"ID": 1005}, offset=1)
    assert u.event is not None and d.event is not None
    assert u.event.source.position == Db2Position("00000027:00000ac0:0007", "00000027:00000ac0:0002")
    assert u.event.source.position < d.event.source.position
    assert u.topic == "myconnector.MYSCHEMA.CUSTOMERS"
    assert_round_trip(u, fx("db2_doc_update.json"))
    assert_round_trip(d, fx("db2_doc_delete.json"))


def test_mongodb_documents_become_id_and_document_rows() -> None:
    """mongodb_doc_create.json / mongodb_doc_update.json (MongoDB connector documentation)."""
    dec = DebeziumDecoder("fulfillment")
    topic = "fulfillment.inventory.customers"
    c = decode(dec, topic, fx("mongodb_doc_create.json"), {"id": "1004"})
    assert c.event is not None and c.topic == "fulfillment.inventory.customers"
    assert c.event.key == {"id": "1004"}
    assert c.event.after == {"id": "1004", "document": {"_id": {"$numberLong": "1004"}, "first_name": "Anne",
                                                        "last_name": "Kretchmar", "email": "annek@noanswer.org"}}
    assert c.event.source.position == MongoPosition(1558965508, 31)
    assert c.schema is not None and c.schema.key == ("id",)
    u = decode(dec, topic, fx("mongodb_doc_update.json"), {"id": "1004"}, offset=1)
    assert u.event is not None and u.event.op is Op.UPDATE
    assert u.event.after["document"]["first_name"] == "Anne Marie"  # type: ignore[index]
    assert u.event.before["document"]["first_name"] == "unknown"  # type: ignore[index]
    # change_streams mode: no `after`, only updateDescription -> unavailable, repaired by the source
    no_after = fx("mongodb_doc_update.json")
    del no_after["after"]
    p = decode(dec, topic, no_after, {"id": "1004"}, offset=2)
    assert p.event is not None and p.event.unavailable == ("document",) and p.patch is not None
    assert p.patch({"id": "1004", "document": {"first_name": "Anne", "x": 1}})["document"] == {
        "first_name": "Anne Marie", "x": 1}


def test_cloudevents_are_read_or_refused_naming_the_format() -> None:
    """cloudevents_doc_json.json is read (data holds the row images, iodebezium* the source);
    cloudevents_doc_avro.json is refused, naming Avro -- never read as a flattened row."""
    dec = DebeziumDecoder("test_server")
    d = decode(dec, "test_server.s1.a", fx("cloudevents_doc_json.json"), {"pk": 1})
    ev = d.event
    assert ev is not None and d.topic == "test_server.s1.a"
    assert ev.op is Op.READ and ev.after == {"pk": 1, "name": "Bob"} and ev.key == {"pk": 1}
    assert ev.source.snapshot is Snapshot.TRUE and ev.source.position == PgPosition(29274832, 0, True)
    assert ev.source.tx_id == 565 and ev.transaction == TransactionInfo("565", 1, 1)
    with pytest.raises(ValidationError, match=r"CloudEvents record .* application/avro data .*dataschema"):
        decode(dec, "test_server.s1.a", fx("cloudevents_doc_avro.json"), {"pk": 1})


# -- ExtractNewRecordState --------------------------------------------------------------------------------
def test_unwrapped_records_as_documented() -> None:
    """flattened_doc_rewrite_delete.json (``__deleted: "true"``), flattened_doc_add_fields.json
    (``__op``, ``__table``, ``__lsn`` and ``__source_ts_ms`` as quoted numbers), the default delete
    (a null value) and ``delete.handling.mode=none`` with schemas (``{"schema", "payload": null}``)."""
    dec = DebeziumDecoder("dbserver1")
    topic = "dbserver1.public.customers"
    a = decode(dec, topic, fx("flattened_doc_add_fields.json"), {"id": 1004}, offset=0)
    assert a.event is not None and a.event.op is Op.CREATE and a.event.after == ANNE
    assert a.topic == "dbserver1.public.MY_TABLE"  # __table names the table
    assert a.event.source.position == PgPosition(123456789, 0) and a.event.source.ts_ms == 123456789
    dec2 = DebeziumDecoder("dbserver1")
    topic2 = "dbserver1.public.t"
    r = decode(dec2, topic2, fx("flattened_doc_rewrite_delete.json"), {"pk": 2}, offset=0)
    assert r.event is not None and r.event.op is Op.DELETE and r.event.before == {"pk": 2, "cola": None}
    assert r.event.key == {"pk": 2} and "cola" in r.event.before  # NULL, not absent
    # the tombstone after it (drop.tombstones=false): nothing more to do
    assert decode(dec2, topic2, None, {"pk": 2}, offset=1).kind == "skip"
    # delete.handling.mode=none with schemas: the value's payload is null -> a delete of the key
    n = decode(dec2, topic2, {"schema": None, "payload": None}, {"pk": 3}, offset=2)
    assert n.event is not None and n.event.op is Op.DELETE and n.event.key == {"pk": 3}
    # the default (drop): only the tombstone is left, and it deletes the key
    t = decode(dec2, topic2, None, {"pk": 4}, offset=3)
    assert t.event is not None and t.event.op is Op.DELETE and t.event.key == {"pk": 4}


def test_a_tombstone_deletes_its_key_when_the_delete_is_gone() -> None:
    """Compaction removed the delete event while the consumer was behind: the tombstone alone must
    delete the key (the PostgreSQL documentation's "Tombstone events"). Records: the documented
    create, then the tombstone of its key."""
    dec = DebeziumDecoder("PostgreSQL_server")
    c = decode(dec, PG, fx("pg_doc_create.json"), {"id": 1}, offset=0)
    t = dec.decode(PG, 0, 7, b'{"id":1}', None, timestamp_ms=1700000000000)
    assert t.kind == "event" and t.event is not None and t.event.op is Op.DELETE
    assert t.event.key == {"id": 1} and t.event.before == {"id": 1} and t.event.ts_ms == 1700000000000
    assert t.event.source.position > c.event.source.position  # type: ignore[union-attr]
    assert t.topic == c.topic and t.event.source.table == "customers"


# -- schemaless topics --------------------------------------------------------------------------------------
def test_schemaless_nulls_and_new_columns_widen_the_inferred_schema() -> None:
    """schemas.enable=false: the MySQL documentation's update (mysql_customers_update.json) with a
    column that is NULL in the first records, then has a value, and a column added later."""
    dec = DebeziumDecoder("mysql-server-1", schemas_enabled=False)
    t = "mysql-server-1.inventory.customers"
    base = fx("mysql_customers_update.json")
    first = dict(base, after=dict(base["after"], nickname=None), before=dict(base["before"], nickname=None))
    s1 = decode(dec, t, first, {"id": 1004}, offset=0).schema
    assert s1 is not None and s1.column("nickname").native_type == "json null"
    second = dict(base, after=dict(base["after"], nickname=None))
    assert decode(dec, t, second, {"id": 1004}, offset=1).kind == "event"  # still NULL: fine
    third = dict(base, after=dict(base["after"], nickname="Annie", score=1))
    d3 = decode(dec, t, third, {"id": 1004}, offset=2)
    assert d3.schema is not None and d3.schema.column("nickname").type is FieldType.STRING
    assert d3.schema.column("score").type is FieldType.INT64
    fourth = dict(base, after=dict(base["after"], nickname=None, score=2.5))
    d4 = decode(dec, t, fourth, {"id": 1004}, offset=3)
    assert d4.schema is not None and d4.schema.column("score").type is FieldType.FLOAT64
    assert d4.event is not None and d4.event.after["nickname"] is None  # type: ignore[index]
    bad = dict(base, after=dict(base["after"], score="high"))
    with pytest.raises(ValidationError, match=r"score: .*json number.*json string"):
        decode(dec, t, bad, {"id": 1004}, offset=4)


# -- keyless tables -----------------------------------------------------------------------------------------
def test_a_table_without_key_has_no_key_columns_unless_declared() -> None:
    """The PostgreSQL documentation: "If the table does not have a primary or unique key, then
    the change event's key is null". The documented create with a null key."""
    d = decode(DebeziumDecoder("PostgreSQL_server"), PG, fx("pg_doc_create.json"), None)
    assert d.event is not None and d.event.key is None and d.schema is not None and d.schema.key == ()
    keyed = DebeziumDecoder("PostgreSQL_server", key_columns={"public.customers": ["email"]})
    k = decode(keyed, PG, fx("pg_doc_create.json"), None)
    assert k.event is not None and k.event.key == {"email": "annek@noanswer.org"} and k.schema.key == ("email",)


# -- types and modes --------------------------------------------------------------------------------------
def _typed_record(fields: list[dict[str, Any]], after: dict[str, Any]) -> dict[str, Any]:
    doc = fx("pg_doc_create.json")
    for part in doc["schema"]["fields"][:2]:
        part["fields"] = [{"type": "int32", "optional": False, "field": "id"}, *fields]
    doc["payload"]["after"] = {"id": 1, **after}
    return doc


TYPE_CASES = [
    # (mapping table of the PostgreSQL documentation, Connect field, wire value, Python value, FieldType)
    ("TIME(3), adaptive", {"type": "int32", "optional": True, "name": "io.debezium.time.Time", "version": 1},
     54796945, dt.time(15, 13, 16, 945000), FieldType.TIME),
    ("TIME(6)", {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTime", "version": 1},
     54796945104, dt.time(15, 13, 16, 945104), FieldType.TIME),
    ("TIME, nanoseconds", {"type": "int64", "optional": True, "name": "io.debezium.time.NanoTime", "version": 1},
     54796945104000, dt.time(15, 13, 16, 945104), FieldType.TIME),
    ("TIME, connect", {"type": "int32", "optional": True, "name": "org.apache.kafka.connect.data.Time",
                       "version": 1}, 54796945, dt.time(15, 13, 16, 945000), FieldType.TIME),
    ("TIMESTAMP(3)", {"type": "int64", "optional": True, "name": "io.debezium.time.Timestamp", "version": 1},
     1529507596945, dt.datetime(2018, 6, 20, 15, 13, 16, 945000), FieldType.TIMESTAMP),
    ("TIMESTAMP (documented value)", {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp",
                                      "version": 1},
     1529507596945104, dt.datetime(2018, 6, 20, 15, 13, 16, 945104), FieldType.TIMESTAMP),
    ("TIMESTAMP, nanoseconds", {"type": "int64", "optional": True, "name": "io.debezium.time.NanoTimestamp",
                                "version": 1},
     1529507596945104000, dt.datetime(2018, 6, 20, 15, 13, 16, 945104), FieldType.TIMESTAMP),
    ("TIMESTAMP, connect", {"type": "int64", "optional": True, "name": "org.apache.kafka.connect.data.Timestamp",
                            "version": 1}, 1529507596945, dt.datetime(2018, 6, 20, 15, 13, 16, 945000),
     FieldType.TIMESTAMP),
    ("DATE, connect", {"type": "int32", "optional": True, "name": "org.apache.kafka.connect.data.Date",
                       "version": 1}, 17702, dt.date(2018, 6, 20), FieldType.DATE),
    ("DATE, isostring", {"type": "string", "optional": True, "name": "io.debezium.time.IsoDate", "version": 1},
     "2018-06-20Z", "2018-06-20Z", FieldType.STRING),
    ("TIMETZ", {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTime", "version": 1},
     "15:13:16.945104Z", "15:13:16.945104Z", FieldType.STRING),
    ("INTERVAL, numeric", {"type": "int64", "optional": True, "name": "io.debezium.time.MicroDuration",
                           "version": 1}, 3_600_000_000, dt.timedelta(hours=1), FieldType.INTERVAL),
    ("INTERVAL, string (documented value)", {"type": "string", "optional": True, "name": "io.debezium.time.Interval",
                                             "version": 1}, "P1Y2M3DT4H5M6.78S", "P1Y2M3DT4H5M6.78S",
     FieldType.STRING),
    ("NUMERIC(8,2), precise", {"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
                               "version": 1, "parameters": {"scale": "2", "connect.decimal.precision": "8"}},
     "BOI=", Decimal("12.50"), FieldType.DECIMAL),
    ("NUMERIC, precise, variable scale", {"type": "struct", "optional": True,
                                          "name": "io.debezium.data.VariableScaleDecimal", "version": 1,
                                          "doc": "Variable scaled decimal",
                                          "fields": [{"type": "int32", "optional": False, "field": "scale"},
                                                     {"type": "bytes", "optional": False, "field": "value"}]},
     {"scale": 3, "value": "AeI="}, Decimal("0.482"), FieldType.VARIABLE_DECIMAL),
    ("BYTEA, bytes", {"type": "bytes", "optional": True}, "AQID", b"\x01\x02\x03", FieldType.BYTES),
    ("BYTEA, hex", {"type": "string", "optional": True}, "010203", "010203", FieldType.STRING),
    ("BIT(3)", {"type": "bytes", "optional": True, "name": "io.debezium.data.Bits", "version": 1,
                "parameters": {"length": "3"}}, "BQ==", b"\x05", FieldType.BITS),
    ("ENUM", {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
              "parameters": {"allowed": "happy,sad"}}, "happy", "happy", FieldType.ENUM),
    ("SET (MySQL)", {"type": "string", "optional": True, "name": "io.debezium.data.EnumSet", "version": 1,
                     "parameters": {"allowed": "a,b,c"}}, "a,c", frozenset({"a", "c"}), FieldType.SET),
    ("XML", {"type": "string", "optional": True, "name": "io.debezium.data.Xml", "version": 1},
     "<a>1</a>", "<a>1</a>", FieldType.STRING),
    ("LTREE", {"type": "string", "optional": True, "name": "io.debezium.data.Ltree", "version": 1},
     "Top.Science.Astronomy", "Top.Science.Astronomy", FieldType.STRING),
    ("UUID", {"type": "string", "optional": True, "name": "io.debezium.data.Uuid", "version": 1},
     "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"), FieldType.UUID),
    ("JSONB", {"type": "string", "optional": True, "name": "io.debezium.data.Json", "version": 1},
     '{"a": [1, 2]}', {"a": [1, 2]}, FieldType.JSON),
    ("HSTORE, json", {"type": "string", "optional": True, "name": "io.debezium.data.Json", "version": 1},
     '{"key" : "val"}', {"key": "val"}, FieldType.JSON),
    ("HSTORE, map", {"type": "map", "keys": {"type": "string", "optional": False},
                     "values": {"type": "string", "optional": True}, "optional": True},
     {"key": "val"}, {"key": "val"}, FieldType.MAP),
    ("VECTOR", {"type": "array", "items": {"type": "double", "optional": False}, "optional": True,
                "name": "io.debezium.data.DoubleVector", "version": 1}, [1.5, 2.0], [1.5, 2.0], FieldType.ARRAY),
    ("HALFVEC", {"type": "array", "items": {"type": "float", "optional": False}, "optional": True,
                 "name": "io.debezium.data.FloatVector", "version": 1}, [0.5], [0.5], FieldType.ARRAY),
    ("SPARSEVEC", {"type": "struct", "optional": True, "name": "io.debezium.data.SparseDoubleVector", "version": 1,
                   "fields": [{"type": "int16", "optional": False, "field": "dimensions"},
                              {"type": "map", "keys": {"type": "int16", "optional": False},
                               "values": {"type": "double", "optional": False}, "optional": False,
                               "field": "vector"}]},
     {"dimensions": 5, "vector": [[1, 0.5], [3, 1.5]]}, {"dimensions": 5, "vector": {1: 0.5, 3: 1.5}},
     FieldType.STRUCT),
    ("GEOMETRY", {"type": "struct", "optional": True, "name": "io.debezium.data.geometry.Geometry", "version": 1,
                  "doc": "Geometry",
                  "fields": [{"type": "bytes", "optional": False, "field": "wkb"},
                             {"type": "int32", "optional": True, "field": "srid"}]},
     {"wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": 3187},
     {"wkb": bytes.fromhex("0101000000000000000000F03F0000000000000040"), "srid": 3187}, FieldType.STRUCT),
    ("POINT", {"type": "struct", "optional": True, "name": "io.debezium.data.geometry.Point", "version": 1,
               "doc": "Geometry (POINT)", "fields": [{"type": "double", "optional": False, "field": "x"},
                          {"type": "double", "optional": False, "field": "y"},
                          {"type": "bytes", "optional": True, "field": "wkb"},
                          {"type": "int32", "optional": True, "field": "srid"}]},
     {"x": 1.0, "y": 2.0, "wkb": None, "srid": None}, {"x": 1.0, "y": 2.0, "wkb": None, "srid": None},
     FieldType.STRUCT),
]


@pytest.mark.parametrize(("what", "field", "wire", "value", "ftype"), TYPE_CASES, ids=[c[0] for c in TYPE_CASES])
def test_types_and_modes_keep_their_semantics_both_ways(what: str, field: dict[str, Any], wire: Any, value: Any,
                                                        ftype: FieldType) -> None:
    """The PostgreSQL documentation's data type mappings (and MySQL's SET): each Connect field
    decodes to its value, and is written back with the same semantic name and wire value."""
    doc = _typed_record([{**field, "field": "v"}], {"v": wire})
    d = decode(DebeziumDecoder("PostgreSQL_server"), PG, doc, {"id": 1})
    assert d.event is not None and d.schema is not None
    assert d.event.after["v"] == value  # type: ignore[index]
    assert d.schema.column("v").type is ftype
    assert_round_trip(d, doc)


def test_decimal_handling_modes_and_the_numeric_decimal_format() -> None:
    """decimal.handling.mode=string/double (with column.propagate.source.type) and JsonConverter
    decimal.format=NUMERIC (a Connect Decimal as a JSON number, read exactly)."""
    numeric = _typed_record([{"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
                              "version": 1, "parameters": {"scale": "2"}, "field": "v"}], {})
    raw = orjson.dumps(numeric).replace(b'"after":{"id":1}', b'"after":{"id":1,"v":123456789012345678.25}')
    d = decode(DebeziumDecoder("PostgreSQL_server"), PG, raw, {"id": 1})
    assert d.event is not None and d.event.after["v"] == Decimal("123456789012345678.25")  # type: ignore[index]
    for mode, wire, ctype in (("string", "12.50", "string"), ("double", 12.5, "double")):
        doc = _typed_record([{"type": ctype, "optional": True, "parameters": {
            "__debezium.source.column.type": "NUMERIC", "__debezium.source.column.length": "8",
            "__debezium.source.column.scale": "2"}, "field": "v"}], {"v": wire})
        e = decode(DebeziumDecoder("PostgreSQL_server"), PG, doc, {"id": 1})
        assert e.event is not None and e.event.after["v"] == Decimal("12.50") if mode == "string" else Decimal("12.5")
        assert e.schema is not None and e.schema.column("v").type is FieldType.DECIMAL


# -- other records -----------------------------------------------------------------------------------------------
def test_transaction_metadata_heartbeats_and_schema_changes_are_routed_or_skipped() -> None:
    dec = DebeziumDecoder("PostgreSQL_server")
    for name in ("transaction_begin.json", "pg_doc_transaction_end.json"):
        tx = decode(dec, "PostgreSQL_server.transaction", fx(name), {"id": fx(name)["id"]})
        assert tx.kind == "route" and tx.topic == "PostgreSQL_server.transaction"
    hb = decode(dec, "__debezium-heartbeat.PostgreSQL_server", fx_bytes("heartbeat.json"), {"serverName": "x"})
    assert hb.kind == "skip" and hb.reason == "heartbeat"
    ddl = decode(dec, "PostgreSQL_server", {"source": {"connector": "mysql"}, "databaseName": "inventory",
                                            "ddl": "ALTER TABLE customers ADD COLUMN x INT", "tableChanges": []},
                 {"databaseName": "inventory"})
    assert ddl.kind == "route" and ddl.topic == "PostgreSQL_server.__debezium_schema"


@pytest.mark.parametrize(("value", "expected"), [
    (b'{"before": null, "after": {"id": 1', "value: malformed JSON"),
    (orjson.dumps({"before": None, "after": {"id": 1}, "source": {"connector": "mysql"}}), "op: missing"),
    (orjson.dumps({"schema": {"type": "struct", "name": "x.Envelope", "fields": [
        {"type": "struct", "optional": True, "field": "after", "name": "x.Value",
         "fields": [{"type": "float128", "optional": True, "field": "v"}]}]},
        "payload": {"op": "c", "after": {"v": 1}, "source": {}}}),
     "unsupported Connect type 'float128'"),
    (orjson.dumps({"after": {"id": 1}, "op": "c", "source": {"connector": "postgresql", "name": "x", "db": "d",
                                                              "schema": "s", "table": "t", "ts_ms": "yesterday"}}),
     "source.ts_ms"),
])
def test_bad_input_is_a_validation_error_naming_the_field(value: bytes, expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        DebeziumDecoder("dbz").decode("t.db.x", 0, 0, b'{"id": 1}', value)
