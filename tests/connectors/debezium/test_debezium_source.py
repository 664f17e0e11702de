"""Debezium topics in (through a Kafka-protocol broker, tansu) and kappaflow topics out.

The records are the ones of ``test_debezium_decode.py`` (Debezium's documentation and repository,
see ``dbz_helpers.SOURCES``), produced to real topics the way Debezium lays them out
(``<prefix>.<schema|db>.<table>``, ``<prefix>.transaction``, heartbeats), with bad records
between them. Each valid record must land in its kappaflow topic -- never in the dead-letter
topic -- and each bad one in the dead-letter topic with its reason and position, nothing valid
before or after it lost.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import itertools
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from dbz_helpers import fx, fx_bytes

from kappaflow.events import EventCodec, TableSchema

pytestmark = pytest.mark.integration

Rec = tuple[str, bytes | None, bytes | None]


def _j(v: Any) -> bytes | None:
    return None if v is None else orjson.dumps(v)


def _produce(bootstrap: str, records: list[Rec], partitions: int = 1) -> list[str]:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    topics = sorted({t for t, _, _ in records})
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        for topic, key, value in records:
            producer.send(topic, key=key, value=value, partition=0)
        producer.flush(30)
    finally:
        producer.close()
    return topics


def _schemas(log: Any, source: str) -> dict[str, TableSchema]:
    out: dict[str, TableSchema] = {}
    for r in log.iter_partition(f"{source}.__schema", 0):
        if r.value is not None:
            out[orjson.loads(r.key)] = TableSchema.from_dict(orjson.loads(r.value))
    return out


def _events(log: Any, source: str, table: str) -> list[tuple[str, Any, Any, Any]]:
    """(op, key, before, after) in log order per partition, Python values (decoded with the schema topic)."""
    schema = _schemas(log, source)[table]
    codec = EventCodec()
    out = []
    topic = f"{source}.{table}"
    for p in range(log.partitions(topic)):
        for rec in log.iter_partition(topic, p):
            if rec.value is None:
                out.append(("tombstone", orjson.loads(rec.key) if rec.key else None, None, None))
                continue
            ev = codec.decode_record(rec.key, rec.value, schema)
            assert ev is not None
            out.append((ev.op.value, ev.key, ev.before, ev.after))
    return out


def _dead(log: Any, source: str) -> list[dict[str, Any]]:
    t = f"kf.dead_letter.source.{source}"  # kappaflow/deadletters.py
    if t not in log.list_topics():
        return []
    return [orjson.loads(r.value) for r in log.iter_partition(t, 0)]


def _source(log: Any, bootstrap: str, name: str, topics: list[str], **kw: Any) -> Any:
    from kappaflow.connectors.debezium import DebeziumSource

    kw.setdefault("partitions", 2)
    return DebeziumSource(name=name, log=log, bootstrap=bootstrap, topics=topics, **kw)


def test_documented_records_of_every_connector_land_in_their_topics(kafka_broker: Any, embedded_log: Any) -> None:
    run = uuid.uuid4().hex[:8]
    pg, ss, ora, db2, mg, ce = (f"pg{run}", f"ss{run}", f"ora{run}", f"db2{run}", f"mg{run}", f"ce{run}")
    pg_key = {"schema": {"type": "struct", "name": "k", "optional": False,
                         "fields": [{"type": "int32", "optional": False, "field": "id"}]}, "payload": {"id": 1}}
    placeholder_update = fx("pg_doc_update.json")
    placeholder_update["payload"]["after"]["email"] = "__debezium_unavailable_value"
    incremental = fx("pg_doc_create.json")
    incremental["payload"]["op"] = "r"
    incremental["payload"]["source"].update({"snapshot": "incremental", "lsn": None, "txId": None})
    keyless = fx("pg_doc_create.json")
    keyless["payload"]["source"]["table"] = "logs"
    bad_type = copy.deepcopy(fx("pg_doc_create.json"))
    bad_type["schema"]["fields"][1]["fields"][3]["type"] = "float128"
    records: list[Rec] = [
        (f"{pg}.public.customers", _j(pg_key), fx_bytes("pg_doc_create.json")),
        (f"{pg}.transaction", b'{"id":"571:53195829"}', fx_bytes("transaction_begin.json")),
        (f"{pg}.public.customers", _j(pg_key), _j(placeholder_update)),   # email unavailable: repaired
        (f"{pg}.public.customers", _j(pg_key), b'{"before": {"id": 1}, "after": '),  # malformed JSON
        (f"{pg}.public.customers", _j(pg_key), _j(bad_type)),  # a Connect type no connector writes
        (f"{pg}.public.customers", _j(pg_key), _j({**fx("pg_doc_update.json")["payload"], "op": None})),  # no op
        (f"{pg}.public.customers", _j(pg_key), _j(incremental)),
        (f"{pg}.public.customers", _j(pg_key), fx_bytes("pg_doc_delete.json")),
        (f"{pg}.public.customers", _j(pg_key), None),  # Debezium's tombstone after the delete
        (f"{pg}.public.customers", _j({"id": 2}), None),  # a tombstone whose delete was compacted away
        (f"{pg}.transaction", b'{"id":"571:53195832"}', fx_bytes("pg_doc_transaction_end.json")),
        (f"{pg}.message", b'{"prefix":"foo"}', fx_bytes("pg_doc_message_transactional.json")),
        (f"__debezium-heartbeat.{pg}", b'{"serverName":"x"}', fx_bytes("heartbeat.json")),
        (f"{pg}.public.logs", None, _j(keyless)),  # a table without key
        (f"{pg}.public.customers", None, fx_bytes("pg_doc_create.json")),  # no key for a keyed table
        (f"{ss}.testDB.dbo.customers", b'{"id":1005}', fx_bytes("sqlserver_doc_create.json")),
        (f"{ss}.testDB.dbo.customers", b'{"id":1005}', fx_bytes("sqlserver_doc_update.json")),
        (f"{ss}.testDB.dbo.customers", b'{"id":1005}', fx_bytes("sqlserver_doc_delete.json")),
        (f"{ora}.DEBEZIUM.CUSTOMERS", b'{"ID":1004}', fx_bytes("oracle_doc_create.json")),
        (f"{db2}.MYSCHEMA.CUSTOMERS", b'{"ID":1005}', fx_bytes("db2_doc_update.json")),
        (f"{mg}.inventory.customers", b'{"id":"1004"}', fx_bytes("mongodb_doc_create.json")),
        (f"{ce}.s1.a", b'{"pk":1}', fx_bytes("cloudevents_doc_json.json")),
        (f"{ce}.s1.a", b'{"pk":1}', fx_bytes("cloudevents_doc_avro.json")),
    ]
    produced_from = int(time.time() * 1000)
    topics = _produce(kafka_broker.bootstrap, records)
    produced_to = int(time.time() * 1000)
    log = embedded_log
    src = _source(log, kafka_broker.bootstrap, "dbz", topics)
    summary = src.run(until_caught_up=True)
    # PostgreSQL: create, update (email repaired from the create), incremental read, delete (+ tombstone),
    # and the delete made from the tombstone alone
    anne = {"id": 1, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}
    got = _events(log, "dbz", "public.customers")
    assert [(op, k) for op, k, _b, _a in got] == [
        ("c", {"id": 1}), ("u", {"id": 1}), ("r", {"id": 1}), ("d", {"id": 1}), ("tombstone", {"id": 1}),
        ("d", {"id": 2}), ("tombstone", {"id": 2})]
    assert got[1][3] == dict(anne, first_name="Anne Marie")  # the placeholder never became a value
    # the delete made from the lone tombstone has the tombstone's Kafka timestamp as its time (it has
    # no payload of its own): the producer stamped it while this test produced
    lone = [orjson.loads(r.value) for p in range(log.partitions("dbz.public.customers"))
            for r in log.iter_partition("dbz.public.customers", p) if r.value is not None and r.key == b'{"id":2}']
    assert len(lone) == 1 and produced_from <= lone[0]["ts_ms"] <= produced_to, lone
    # positions strictly increase in the order of the input partition (ordering.py)
    from kappaflow.events import Position

    positions = [Position.from_dict(orjson.loads(r.value)["source"]["kf_pos"]) for p in range(2)
                 for r in log.iter_partition("dbz.public.customers", p) if r.value is not None]
    by_key_1 = positions[:4]
    assert all(a < b for a, b in itertools.pairwise(by_key_1))
    # the keyless table: an append-only topic
    assert log.list_topics()["dbz.public.logs"].cleanup_policy.value == "delete"
    assert [r.key for r in log.iter_partition("dbz.public.logs", 0)] == [None]
    # the logical decoding message: the event topic
    (msg,) = list(log.iter_partition("dbz.message", 0)) + list(log.iter_partition("dbz.message", 1))
    assert orjson.loads(msg.value)["prefix"] == "foo" and msg.key == b"foo"
    # transaction metadata routed verbatim
    assert [orjson.loads(r.value)["status"] for r in log.iter_partition("dbz.transaction", 0)] == ["BEGIN", "END"]
    # the other connectors
    assert [op for op, *_ in _events(log, "dbz", "dbo.customers")] == ["c", "u", "d", "tombstone"]
    assert _events(log, "dbz", "DEBEZIUM.CUSTOMERS")[0][3]["EMAIL"] == "annek@noanswer.org"
    assert _events(log, "dbz", "MYSCHEMA.CUSTOMERS")[0][0] == "u"
    assert _events(log, "dbz", "inventory.customers")[0][3]["document"]["first_name"] == "Anne"
    assert _events(log, "dbz", "s1.a")[0][3] == {"pk": 1, "name": "Bob"}
    # the bad records: the dead-letter topic, with the reason and the position
    dead = sorted(_dead(log, "dbz"), key=lambda d: (d["topic"] != f"{pg}.public.customers", d["offset"]))
    assert [(d["topic"], d["offset"]) for d in dead] == [
        (f"{pg}.public.customers", 2), (f"{pg}.public.customers", 3), (f"{pg}.public.customers", 4),
        (f"{pg}.public.customers", 9), (f"{ce}.s1.a", 1)]
    assert "malformed JSON" in dead[0]["reason"] and "float128" in dead[1]["reason"]
    assert "op" in dead[2]["reason"] and "compacted topic" in dead[3]["reason"]
    assert "application/avro" in dead[4]["reason"]
    assert all(f"partition 0 offset {d['offset']}" in d["reason"] for d in dead)
    assert summary.events == 14 and src.skipped == {"heartbeat": 1, "tombstone": 1}

    # a second run resumes after the stored offsets: nothing is written twice
    again = _source(log, kafka_broker.bootstrap, "dbz", topics)
    assert again.run(until_caught_up=True).events == 0
    assert len(_events(log, "dbz", "public.customers")) == len(got)


def test_a_truncate_deletes_every_row_the_topic_held(kafka_broker: Any, embedded_log: Any) -> None:
    """pg_customers_read.json + pg_truncate.json (the PostgreSQL connector's snapshot read and truncate
    events, debezium.io/documentation/reference/stable/connectors/postgresql.html): the op=t marker, then
    for every key the topic held its delete (the row the log last held, flagged kf_truncate, at the
    truncate's position) and its tombstone (connectors/truncate.py)."""
    run = uuid.uuid4().hex[:8]
    topic = f"PostgreSQL_server{run}.public.customers"
    read = fx("pg_customers_read.json")
    topics = _produce(kafka_broker.bootstrap, [(topic, b'{"id":1}', _j(read)),
                                              (topic, None, fx_bytes("pg_truncate.json"))])
    src = _source(embedded_log, kafka_broker.bootstrap, f"t{run}", topics, partitions=1)
    assert src.run(until_caught_up=True).events == 2
    out = f"t{run}.public.customers"
    recs = list(embedded_log.iter_partition(out, 0))
    ops = [(r.key, None if r.value is None else orjson.loads(r.value)["op"]) for r in recs]
    assert ops == [(b'{"id":1}', "r"), (b"{}", "t"), (b'{"id":1}', "d"), (b'{"id":1}', None)]
    snap, marker, delete = (orjson.loads(r.value) for r in recs[:3])
    assert delete["before"] == snap["after"] and delete["after"] is None and delete["kf_truncate"] is True
    assert delete["source"] == marker["source"]
    assert _dead(embedded_log, f"t{run}") == []


def test_unavailable_columns_are_repaired_from_the_log_after_a_restart(kafka_broker: Any, embedded_log: Any) -> None:
    """A TOASTed column left out of an UPDATE (PostgreSQL documentation, "Toasted values"):
    the value comes from what the log holds, even when the source was restarted in between."""
    t = f"pgt{uuid.uuid4().hex[:8]}.public.customers"
    create = fx("pg_doc_create.json")
    big = "x" * 9000
    create["payload"]["after"]["email"] = big
    _produce(kafka_broker.bootstrap, [(t, b'{"id":1}', _j(create))])
    assert _source(embedded_log, kafka_broker.bootstrap, "toast", [t]).run(until_caught_up=True).events == 1
    from kafka import KafkaProducer

    upd = fx("pg_doc_update.json")
    upd["payload"]["after"]["email"] = "__debezium_unavailable_value"
    unknown = fx("pg_doc_update.json")
    unknown["payload"]["after"]["id"] = 3
    unknown["payload"]["before"]["id"] = 3
    unknown["payload"]["after"]["email"] = "__debezium_unavailable_value"
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    producer.send(t, key=b'{"id":1}', value=_j(upd), partition=0)
    producer.send(t, key=b'{"id":3}', value=_j(unknown), partition=0)
    producer.flush(30)
    producer.close()
    assert _source(embedded_log, kafka_broker.bootstrap, "toast", [t]).run(until_caught_up=True).events == 2
    got = _events(embedded_log, "toast", "public.customers")
    assert got[1][3]["email"] == big and got[1][3]["first_name"] == "Anne Marie"
    # no earlier value anywhere: the column stays unavailable (absent), never the placeholder
    (rec,) = [r for p in range(2) for r in embedded_log.iter_partition("toast.public.customers", p)
              if r.key == b'{"id":3}']
    doc = orjson.loads(rec.value)
    assert "email" not in doc["after"] and doc["kf_unavailable"] == ["email"]


def test_a_crash_before_the_offset_is_saved_writes_nothing_twice(kafka_broker: Any, embedded_log: Any) -> None:
    """Records appended, then the process dies before the offset: the next run skips them."""
    t = f"pgc{uuid.uuid4().hex[:8]}.public.customers"
    rows = []
    for i in range(1, 31):
        r = fx("pg_doc_create.json")
        r["payload"]["after"]["id"] = i
        r["payload"]["source"]["lsn"] = 1000 + i
        rows.append((t, orjson.dumps({"id": i}), _j(r)))
    _produce(kafka_broker.bootstrap, rows)

    class Crash(Exception):
        pass

    def fault(step: str) -> None:
        if step == "after_records":
            raise Crash

    src = _source(embedded_log, kafka_broker.bootstrap, "crash", [t], fault=fault, threaded_writer=False)
    with pytest.raises(Crash):
        src.run(until_caught_up=True)
    first = sum(1 for p in range(2) for _ in embedded_log.iter_partition("crash.public.customers", p))
    assert first == 30  # written, offset not saved
    again = _source(embedded_log, kafka_broker.bootstrap, "crash", [t])
    summary = again.run(until_caught_up=True)
    assert summary.duplicates_skipped == 30
    keys = sorted(orjson.loads(r.key)["id"] for p in range(2) for r in embedded_log.iter_partition(
        "crash.public.customers", p))
    assert keys == list(range(1, 31))


PREFIX = "mysql-server-1"


def _mysql_source_block(db: str, table: str, pos: int, ts_ms: int) -> dict[str, Any]:
    return {"version": "2.7.0.Final", "connector": "mysql", "name": PREFIX, "ts_ms": ts_ms, "snapshot": "false",
            "db": db, "sequence": None, "table": table, "server_id": 1, "gtid": None, "file": "mysql-bin.000003",
            "pos": pos, "row": 0, "thread": 7, "query": None}


def test_debezium_topics_decode_like_kappaflows_own_capture(mariadb_server: Any, mariadb_db: str, kafka_broker: Any,
                                                            tmp_path: Path) -> None:
    """The MySQL documentation's customers records, read from Kafka, give the same events as kappaflow's
    own MySQL connector capturing the same statements."""
    from kappaflow.connectors.mysql.connector import MySQLConnector
    from kappaflow.log.embedded import EmbeddedLog

    db = mariadb_db
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
        own_customers = [e for e in _events(own, "own", f"{db}.customers") if e[0] != "tombstone"]
        own_products = _events(own, "own", f"{db}.products")

    cust = f"{PREFIX}.{db}.customers"
    prod = f"{PREFIX}.{db}.products"
    create = fx("mysql_customers_create_schema.json")
    create["payload"]["source"] = _mysql_source_block(db, "customers", 154, 1465491411000)
    update = fx("mysql_customers_update.json")
    update["source"] = _mysql_source_block(db, "customers", 484, 1465581029000)
    delete = fx("mysql_customers_delete.json")
    delete["source"] = _mysql_source_block(db, "customers", 805, 1465581902000)
    pschema = copy.deepcopy(fx("pg_products_logical_types.json")["schema"])
    for part in pschema["fields"][:2]:
        part["fields"] = [f for f in part["fields"] if f["field"] in ("id", "price", "born", "updated", "seen", "doc")]
        part["name"] = f"{prod}.Value"
    pschema["fields"][2] = create["schema"]["fields"][2]
    pschema["fields"] = pschema["fields"][:5]
    pschema["name"] = f"{prod}.Envelope"
    price = base64.b64encode((1250).to_bytes(2, "big", signed=True)).decode()
    product = {"schema": pschema, "payload": {
        "before": None, "op": "c", "ts_ms": 1714564800250,
        "source": _mysql_source_block(db, "products", 1200, 1714564800000),
        "after": {"id": 7, "price": price, "born": 19783, "updated": 1714564800123456,
                  "seen": "2024-01-02T03:04:05.654321Z", "doc": "{\"a\": [1, \"x\"]}"}}}
    topics = _produce(kafka_broker.bootstrap, [
        (cust, orjson.dumps(fx("mysql_customers_key_schema.json")), _j(create)),
        (cust, b'{"id":1004}', _j(update)), (cust, b'{"id":1004}', _j(delete)), (cust, b'{"id":1004}', None),
        (prod, b'{"id":7}', _j(product))])
    with EmbeddedLog(tmp_path / "dbz") as log:
        _source(log, kafka_broker.bootstrap, "dbz", topics).run(until_caught_up=True)
        assert [e for e in _events(log, "dbz", f"{db}.customers") if e[0] != "tombstone"] == own_customers
        assert _events(log, "dbz", f"{db}.products") == own_products
        assert own_products[0][3]["seen"] == dt.datetime(2024, 1, 2, 3, 4, 5, 654321, tzinfo=dt.UTC)
