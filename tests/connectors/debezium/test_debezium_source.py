"""Debezium topics in (through a Kafka-protocol broker) and kappaflow topics out, compared with
what kappaflow's own MySQL connector writes for the same rows."""

from __future__ import annotations

import base64
import copy
import datetime as dt
from pathlib import Path
from typing import Any

import orjson
import pytest

from kappaflow.events import EventCodec, TableSchema

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).with_name("fixtures")
PREFIX = "mysql-server-1"


def _fx(name: str) -> dict[str, Any]:
    return orjson.loads((FIXTURES / name).read_bytes())


def _source(db: str, table: str, pos: int, ts_ms: int) -> dict[str, Any]:
    return {"version": "2.7.0.Final", "connector": "mysql", "name": PREFIX, "ts_ms": ts_ms, "snapshot": "false",
            "db": db, "sequence": None, "table": table, "server_id": 1, "gtid": None, "file": "mysql-bin.000003",
            "pos": pos, "row": 0, "thread": 7, "query": None}


def _debezium_records(db: str) -> list[tuple[str, bytes | None, bytes | None]]:
    """What a Debezium MySQL connector writes for the statements of the test (documented formats)."""
    cust = f"{PREFIX}.{db}.customers"
    prod = f"{PREFIX}.{db}.products"
    create = _fx("mysql_customers_create_schema.json")
    create["payload"]["source"] = _source(db, "customers", 154, 1465491411000)
    update = _fx("mysql_customers_update.json")
    update["source"] = _source(db, "customers", 484, 1465581029000)
    delete = _fx("mysql_customers_delete.json")
    delete["source"] = _source(db, "customers", 805, 1465581902000)
    key = orjson.dumps(_fx("mysql_customers_key_schema.json"))
    plain_key = b'{"id":1004}'

    # products: the MySQL connector's default mapping (decimal.handling.mode=precise, adaptive_time_microseconds)
    pschema = copy.deepcopy(_fx("pg_products_logical_types.json")["schema"])
    for part in pschema["fields"][:2]:
        part["fields"] = [f for f in part["fields"] if f["field"] in ("id", "price", "born", "updated", "seen", "doc")]
        part["name"] = f"{PREFIX}.{db}.products.Value"
    pschema["fields"][2] = create["schema"]["fields"][2]  # the MySQL source struct
    pschema["fields"] = pschema["fields"][:5]
    pschema["name"] = f"{PREFIX}.{db}.products.Envelope"
    price = base64.b64encode((1250).to_bytes(2, "big", signed=True)).decode()
    product = {"schema": pschema, "payload": {
        "before": None, "op": "c", "ts_ms": 1714564800250, "source": _source(db, "products", 1200, 1714564800000),
        "after": {"id": 7, "price": price, "born": 19783, "updated": 1714564800123456,
                  "seen": "2024-01-02T03:04:05.654321Z", "doc": "{\"a\": [1, \"x\"]}"}}}
    no_scale = copy.deepcopy(product)
    for part in no_scale["schema"]["fields"][:2]:
        del part["fields"][1]["parameters"]["scale"]
    no_scale["payload"]["after"]["id"] = 8
    no_op = copy.deepcopy(update)
    del no_op["op"]
    return [
        (cust, key, orjson.dumps(create)),
        (f"{PREFIX}.transaction", b'{"id":"571:53195829"}', (FIXTURES / "transaction_begin.json").read_bytes()),
        (cust, plain_key, orjson.dumps(update)),
        (cust, plain_key, b'{"before": {"id": 1004}, "after": '),  # malformed JSON
        (cust, plain_key, orjson.dumps(no_op)),  # an envelope without op
        (cust, plain_key, orjson.dumps(delete)),
        (cust, plain_key, None),  # Debezium's tombstone
        (prod, b'{"id":8}', orjson.dumps(no_scale)),  # a decimal without its scale
        (prod, b'{"id":7}', orjson.dumps(product)),
        (f"__debezium-heartbeat.{PREFIX}", b'{"serverName":"mysql-server-1"}', b'{"ts_ms": 1714564377000}'),
        # a PostgreSQL connector's snapshot row, then a TRUNCATE of its table
        ("PostgreSQL_server.public.customers", b'{"id":1}', (FIXTURES / "pg_customers_read.json").read_bytes()),
        ("PostgreSQL_server.public.customers", None, (FIXTURES / "pg_truncate.json").read_bytes()),
    ]


def _produce(bootstrap: str, records: list[tuple[str, bytes | None, bytes | None]]) -> list[str]:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    topics = sorted({t for t, _, _ in records})
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1) for t in topics])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        for topic, key, value in records:
            producer.send(topic, key=key, value=value)
        producer.flush(30)
    finally:
        producer.close()
    return topics


def _decoded(log: Any, source: str, table: str) -> list[tuple[str, Any, Any, Any]]:
    """(op, key, before, after) with Python values, decoded with the source's schema topic."""
    schemas = {orjson.loads(r.key): TableSchema.from_dict(orjson.loads(r.value))
               for r in log.iter_partition(f"{source}.__schema", 0) if r.value is not None}
    schema = schemas[table]
    codec = EventCodec()
    out = []
    topic = f"{source}.{table}"
    for p in range(log.partitions(topic)):
        for rec in log.iter_partition(topic, p):
            if rec.value is None:
                continue
            ev = codec.decode_record(rec.key, rec.value, schema)
            out.append((ev.op.value, ev.key, ev.before, ev.after))
    return out


def test_debezium_topics_decode_like_kappaflows_own_capture(mariadb_server: Any, mariadb_db: str, kafka_broker: Any,
                                                            tmp_path: Path) -> None:
    from kappaflow.connectors.debezium import DebeziumSource
    from kappaflow.connectors.mysql.connector import MySQLConnector
    from kappaflow.log.embedded import EmbeddedLog

    db = mariadb_db
    # 1. kappaflow's own connector on the same rows
    mariadb_server.execute(
        "CREATE TABLE customers (id INT PRIMARY KEY, first_name VARCHAR(255) NOT NULL, "
        "last_name VARCHAR(255) NOT NULL, email VARCHAR(255) NOT NULL)",
        "CREATE TABLE products (id INT PRIMARY KEY, price DECIMAL(8,2) NOT NULL, born DATE, updated DATETIME(6), "
        "seen TIMESTAMP(6) NULL, doc JSON)", db=db)
    with EmbeddedLog(tmp_path / "own") as own:
        conn = MySQLConnector(name="own", log=own, dsn=f"mysql://root@{mariadb_server.host}:{mariadb_server.port}/{db}",
                              tables=[f"{db}.customers", f"{db}.products"], partitions=1)
        conn.run(until_caught_up=True)
        mariadb_server.execute(
            "SET time_zone='+00:00'",
            "INSERT INTO customers VALUES (1004, 'Anne', 'Kretchmar', 'annek@noanswer.org')",
            "UPDATE customers SET first_name='Anne Marie' WHERE id=1004", "DELETE FROM customers WHERE id=1004",
            "INSERT INTO products VALUES (7, 12.50, '2024-03-01', '2024-05-01 12:00:00.123456', "
            "'2024-01-02 03:04:05.654321', '{\"a\": [1, \"x\"]}')", db=db)
        conn.run(until_caught_up=True)
        own_customers = _decoded(own, "own", f"{db}.customers")
        own_products = _decoded(own, "own", f"{db}.products")

    # 2. the same changes as a Debezium connector writes them, read from Kafka
    topics = _produce(kafka_broker.bootstrap, _debezium_records(db))
    with EmbeddedLog(tmp_path / "dbz") as log:
        src = DebeziumSource(name="dbz", log=log, bootstrap=kafka_broker.bootstrap, topics=topics, partitions=1)
        summary = src.run(until_caught_up=True)
        assert summary.events == 6
        # the truncate: an op=t marker, then for every key the topic held its delete (the row the
        # log last held, flagged kf_truncate, at the truncate's position) and its tombstone
        recs_pg = list(log.iter_partition("dbz.public.customers", 0))
        pg = [(r.key, None if r.value is None else orjson.loads(r.value)["op"]) for r in recs_pg]
        assert pg == [(b'{"id":1}', "r"), (b"{}", "t"), (b'{"id":1}', "d"), (b'{"id":1}', None)]
        snap, marker, delete = (orjson.loads(r.value) for r in recs_pg[:3])
        assert delete["before"] == snap["after"] and delete["after"] is None and delete["kf_truncate"] is True
        assert delete["source"] == marker["source"]
        assert _decoded(log, "dbz", f"{db}.customers") == own_customers
        assert _decoded(log, "dbz", f"{db}.products") == own_products
        assert own_products[0][3]["seen"] == dt.datetime(2024, 1, 2, 3, 4, 5, 654321, tzinfo=dt.UTC)
        # deletes are followed by kappaflow's tombstone, Debezium's own tombstone was skipped
        recs = list(log.iter_partition(f"dbz.{db}.customers", 0))
        assert [r.value is None for r in recs] == [False, False, False, True]
        # bad input went to the dead-letter topic with the reason and its position; the rest went on
        dead = [orjson.loads(r.value) for r in log.iter_partition("dbz.__dead_letter", 0)]
        assert len(dead) == 3
        assert "malformed JSON" in dead[0]["reason"] and dead[0]["offset"] == 2
        assert "op: missing" in dead[1]["reason"] and dead[1]["offset"] == 3
        assert "scale" in dead[2]["reason"] and dead[2]["topic"] == f"{PREFIX}.{db}.products"
        assert f"partition 0 offset {dead[0]['offset']}" in dead[0]["reason"]
        routed = list(log.iter_partition("dbz.__transactions", 0))
        assert len(routed) == 1 and orjson.loads(routed[0].value)["status"] == "BEGIN"
        assert src.skipped == {"heartbeat": 1, "tombstone": 1}

        # a second run resumes after the stored offsets: nothing is written twice
        again = DebeziumSource(name="dbz", log=log, bootstrap=kafka_broker.bootstrap, topics=topics, partitions=1)
        assert again.run(until_caught_up=True).events == 0
        assert len(list(log.iter_partition(f"dbz.{db}.customers", 0))) == 4


def test_kappaflow_topics_have_debezium_shapes(mariadb_server: Any, mariadb_db: str, embedded_log: Any) -> None:
    """A Debezium consumer reads kappaflow's records: same key, same envelope, same source fields."""
    from kappaflow.connectors.debezium.decode import DebeziumDecoder
    from kappaflow.connectors.mysql.connector import MySQLConnector

    db = mariadb_db
    mariadb_server.execute("CREATE TABLE customers (id INT PRIMARY KEY, first_name VARCHAR(255) NOT NULL, "
                           "last_name VARCHAR(255) NOT NULL, email VARCHAR(255) NOT NULL)", db=db)
    conn = MySQLConnector(name=PREFIX, log=embedded_log, tables=[f"{db}.customers"], partitions=1,
                          dsn=f"mysql://root@{mariadb_server.host}:{mariadb_server.port}/{db}")
    conn.run(until_caught_up=True)
    mariadb_server.execute("INSERT INTO customers VALUES (1004, 'Anne', 'Kretchmar', 'annek@noanswer.org')", db=db)
    conn.run(until_caught_up=True)
    (rec,) = list(embedded_log.iter_partition(f"{PREFIX}.{db}.customers", 0))
    documented = _fx("mysql_customers_create_schema.json")
    value = orjson.loads(rec.value)
    assert orjson.loads(rec.key) == {"id": 1004} == _fx("mysql_customers_key_schema.json")["payload"]
    # the documented record is Debezium 1.x's; 2.6+ adds ts_us/ts_ns, kappaflow always writes the transaction
    assert set(documented["payload"]) <= set(value) <= set(documented["payload"]) | {"transaction", "ts_us", "ts_ns"}
    assert value["after"] == documented["payload"]["after"] and value["op"] == "c"
    doc_source_fields = {f["field"] for f in documented["schema"]["fields"][2]["fields"]}
    assert doc_source_fields <= set(value["source"])
    # with the schema part (JsonConverter schemas.enable=true), the schema has Debezium's layout
    schemas = {orjson.loads(r.key): TableSchema.from_dict(orjson.loads(r.value))
               for r in embedded_log.iter_partition(f"{PREFIX}.__schema", 0)}
    schema = schemas[f"{db}.customers"]
    connect = schema.connect_schema(position_kind="binlog")
    assert connect["name"].endswith(".customers.Envelope")
    by_field = {f["field"]: f for f in connect["fields"]}
    doc_by_field = {f["field"]: f for f in documented["schema"]["fields"]}
    assert set(doc_by_field) <= set(by_field)
    for part in ("before", "after"):
        assert [(f["field"], f["type"], f["optional"]) for f in by_field[part]["fields"]] == \
            [(f["field"], f["type"], f["optional"]) for f in doc_by_field[part]["fields"]]
    assert by_field["source"]["name"] == "io.debezium.connector.mysql.Source"
    # and Debezium-format decoding of kappaflow's record gives back the same event
    d = DebeziumDecoder(PREFIX).decode(f"{PREFIX}.{db}.customers", 0, 0, rec.key, rec.value)
    assert d.event is not None and d.event.after == value["after"] and d.event.key == {"id": 1004}
