"""Shared parts of the Debezium tests: fixtures, decoding, and the field-by-field round trip.

Every fixture is a record from Debezium's documentation or Debezium's repository; ``SOURCES``
says where each comes from. Documentation examples are JSON with the callout comments
(``// <1>``) and trailing commas removed and ``{debezium-version}`` set to 2.7.0.Final;
where an example repeats a key (SQL Server's and MongoDB's create events write ``ts_ms``
three times for ts_ms/ts_us/ts_ns) the keys are the ones the surrounding text describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from kappaflow.connectors.debezium.decode import DebeziumDecoder, Decoded
from kappaflow.events import EventCodec

FIXTURES = Path(__file__).with_name("fixtures")

PG_DOC = "https://debezium.io/documentation/reference/stable/connectors/postgresql.html"
MYSQL_DOC = "https://debezium.io/documentation/reference/stable/connectors/mysql.html"
SQLSERVER_DOC = "https://debezium.io/documentation/reference/stable/connectors/sqlserver.html"
ORACLE_DOC = "https://debezium.io/documentation/reference/stable/connectors/oracle.html"
DB2_DOC = "https://debezium.io/documentation/reference/stable/connectors/db2.html"
MONGODB_DOC = "https://debezium.io/documentation/reference/stable/connectors/mongodb.html"
UNWRAP_DOC = "https://debezium.io/documentation/reference/stable/transformations/event-flattening.html"
CLOUDEVENTS_DOC = "https://debezium.io/documentation/reference/stable/integrations/cloudevents.html"
SERDE_REPO = "debezium/debezium: debezium-connector-common/src/test/resources/json/"
PLACEHOLDER_REPO = ("debezium/debezium: debezium-connector-postgres/src/main/java/io/debezium/connector/postgresql/"
                    "UnchangedToastedPlaceholder.java")

SOURCES = {
    "pg_doc_create.json": f"{PG_DOC} (create events)",
    "pg_doc_update.json": f"{PG_DOC} (update events; schema: 'the same schema as a create event')",
    "pg_doc_delete.json": f"{PG_DOC} (delete events)",
    "pg_doc_truncate.json": f"{PG_DOC} (truncate events)",
    "pg_doc_message_transactional.json": f"{PG_DOC} (message events, transactional)",
    "pg_doc_message_nontransactional.json": f"{PG_DOC} (message events, non-transactional)",
    "pg_doc_transaction_end.json": f"{PG_DOC} (transaction metadata)",
    "transaction_begin.json": f"{PG_DOC} (transaction metadata)",
    "serde-with-schema.json": f"{SERDE_REPO}serde-with-schema.json",
    "serde-without-schema.json": f"{SERDE_REPO}serde-without-schema.json",
    "serde-unwrapped.json": f"{SERDE_REPO}serde-unwrapped.json",
    "mysql_customers_update.json": f"{MYSQL_DOC} (update events)",
    "mysql_customers_delete.json": f"{MYSQL_DOC} (delete events)",
    "sqlserver_doc_create.json": f"{SQLSERVER_DOC} (create events)",
    "sqlserver_doc_update.json": f"{SQLSERVER_DOC} (update events)",
    "sqlserver_doc_delete.json": f"{SQLSERVER_DOC} (delete events)",
    "oracle_doc_create.json": f"{ORACLE_DOC} (create events: the source block as documented, without connector/db)",
    "oracle_doc_truncate.json": f"{ORACLE_DOC} (truncate events)",
    "db2_doc_update.json": f"{DB2_DOC} (update events)",
    "db2_doc_delete.json": f"{DB2_DOC} (delete events)",
    "mongodb_doc_create.json": f"{MONGODB_DOC} (create events)",
    "mongodb_doc_update.json": f"{MONGODB_DOC} (update events, change streams capture mode)",
    "cloudevents_doc_json.json": f"{CLOUDEVENTS_DOC} (example with JSON data)",
    "cloudevents_doc_avro.json": f"{CLOUDEVENTS_DOC} (example with Avro data)",
    "flattened_doc_rewrite_delete.json": f"{UNWRAP_DOC} (delete.handling.mode=rewrite)",
    "flattened_doc_add_fields.json": f"{UNWRAP_DOC} (add.fields=op,table,lsn,source.ts_ms; row fields of the "
                                     "tutorial's customers table)",
}


def fx_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def fx(name: str) -> Any:
    return orjson.loads(fx_bytes(name))


def decode(dec: DebeziumDecoder, topic: str, value: Any, key: Any = None, *, partition: int = 0,
           offset: int = 0) -> Decoded:
    """Decode one record (dicts are serialised first)."""
    v = value if value is None or isinstance(value, bytes) else orjson.dumps(value)
    k = key if key is None or isinstance(key, bytes) else orjson.dumps(key)
    return dec.decode(topic, partition, offset, k, v)


_SNAPSHOT_BOOL = {True: "true", False: "false"}
# fields kappaflow writes that a documented record may not have, and what they may hold then
_ADDED_SOURCE = {"kf_pos", "sequence", "ts_us", "ts_ns", "txId"}
_ADDED_ENVELOPE = {"transaction", "ts_us", "ts_ns"}


def written_back(d: Decoded, doc: Any, *, mode: str = "precise") -> Any:
    """The decoded event written as Debezium JSON again, with the input's converter settings."""
    assert d.event is not None and d.schema is not None
    with_schema = isinstance(doc, dict) and set(doc) == {"schema", "payload"} and doc["schema"] is not None
    payload = doc["payload"] if with_schema else doc
    codec = EventCodec(mode, include_schema=with_schema, version=payload["source"].get("version", "x"))
    return orjson.loads(codec.encode_value(d.event, d.schema))


def assert_round_trip(d: Decoded, doc: Any, *, mode: str = "precise", unavailable: dict[str, Any] | None = None,
                      added: set[str] | frozenset[str] = frozenset()) -> Any:
    """Write the decoded event back and compare it with the documented record field by field.

    Every field of the documented payload and source block comes back with the same value
    (a boolean ``snapshot`` of Debezium 1.x comes back as the 2.x enum text); kappaflow adds
    only ``kf_pos``, and what 2.6+ writes where the record was older (``ts_us``/``ts_ns``
    derived from ``ts_ms``, ``sequence`` null, an empty ``transaction``). With a schema part,
    the row structs match field by field. ``unavailable``: columns whose documented value is
    the placeholder, with the value they are expected to have after the repair (absent:
    ``...``). ``added``: source fields the record lacks that kappaflow is expected to write.
    JSON document columns (``io.debezium.data.Json``) compare as JSON: kappaflow writes them
    compact.
    """
    out = written_back(d, doc, mode=mode)
    with_schema = isinstance(doc, dict) and set(doc) == {"schema", "payload"} and doc["schema"] is not None
    theirs = doc["payload"] if with_schema else doc
    ours = out["payload"] if with_schema else out
    for k, v in theirs.items():
        if k == "source":
            continue
        if k in ("before", "after") and v is not None:
            json_cols = _json_columns(doc)
            v = {c: orjson.loads(x) if c in json_cols and isinstance(x, str) else x
                 for c, x in v.items() if c not in (unavailable or {})}
            got = {c: orjson.loads(x) if c in json_cols and isinstance(x, str) else x
                   for c, x in ours[k].items() if c not in (unavailable or {})}
            assert got == v, (k, got, v)
            continue
        assert ours.get(k) == v, (k, ours.get(k), v)
    for k in set(ours) - set(theirs):
        assert k in _ADDED_ENVELOPE or k == "kf_unavailable" or (k in ("before", "after") and ours[k] is None), k
        if k in ("ts_us", "ts_ns"):
            assert ours[k] == theirs["ts_ms"] * (1000 if k == "ts_us" else 1_000_000)
    src_theirs, src_ours = theirs["source"], ours["source"]
    for k, v in src_theirs.items():
        if k == "version":
            continue  # the writer's version: kappaflow's when kappaflow writes
        want = _SNAPSHOT_BOOL.get(v, v) if k == "snapshot" and isinstance(v, bool) else v
        assert src_ours.get(k, "<absent>") == want, (k, src_ours.get(k, "<absent>"), want)
    for k in set(src_ours) - set(src_theirs):
        assert k in _ADDED_SOURCE or k in added, f"source.{k} written but not in the record"
        if k in ("ts_us", "ts_ns"):
            assert src_ours[k] == src_theirs["ts_ms"] * (1000 if k == "ts_us" else 1_000_000)
        elif k == "sequence":
            assert src_ours[k] is None
    if with_schema:
        by_field = {f["field"]: f for f in out["schema"]["fields"]}
        for f in doc["schema"]["fields"]:
            if f["field"] in ("before", "after") and f.get("type") == "struct":
                assert_same_struct(by_field[f["field"]], f)
    return out


def _json_columns(doc: Any) -> set[str]:
    if not (isinstance(doc, dict) and set(doc) == {"schema", "payload"} and doc["schema"]):
        return set()
    out = set()
    for f in doc["schema"]["fields"]:
        if f["field"] in ("before", "after") and f.get("type") == "struct":
            out |= {c["field"] for c in f["fields"] if c.get("name") == "io.debezium.data.Json"}
    return out


def assert_same_struct(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Connect struct schemas field by field (kappaflow may add ``version`` and ``kf.*`` parameters)."""
    assert [f["field"] for f in ours["fields"]] == [f["field"] for f in theirs["fields"]]
    for o, t in zip(ours["fields"], theirs["fields"], strict=True):
        for k, v in t.items():
            if k == "fields":
                assert_same_struct(o, t)
            elif k == "parameters":
                assert {p: x for p, x in o.get("parameters", {}).items() if not p.startswith("kf.")} == v, (o, t)
            else:
                assert o.get(k) == v, (t["field"], k, o.get(k), v)
        for k in set(o) - set(t):
            assert k in ("version", "parameters"), (t["field"], k)
