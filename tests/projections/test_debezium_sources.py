"""Projections over topics fed from Debezium: semantic types as Debezium wrote them, keyless tables.

The records follow the PostgreSQL connector documentation's data type mappings
(https://debezium.io/documentation/reference/stable/connectors/postgresql.html#postgresql-data-types:
``io.debezium.time.Timestamp`` milliseconds, ``NanoTimestamp`` nanoseconds, ``io.debezium.time.Time``
milliseconds past midnight, ``io.debezium.data.geometry.Geometry``, hstore as a map) and its
create event ("create events"); kappaflow keeps those units in the log, and the projections must
read them as what they mean.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import orjson
import pytest

from kappaflow.errors import ConfigError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.projections import Projection
from kappaflow.projections.api import ProjectionSpec
from kappaflow.projections.plan import Plan


def _field(t: str, name: str, logical: str | None = None, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": t, "optional": True, **kw}
    if logical:
        d.update(name=logical, version=1)
    d["field"] = name
    return d


def test_a_latest_row_view_over_a_keyless_topic_is_refused_when_loaded() -> None:
    schemas = {"dbz.public.logs": TableSchema("dbz.public.logs", (Column("msg", FieldType.STRING),), ())}

    class Logs(Projection):
        name = "logs"
        sources = ["dbz.public.logs"]
        key = ["msg"]

    with pytest.raises(ConfigError, match=r"have no key: their table has no primary key .* key_columns"):
        Plan.build(None, ProjectionSpec.from_class(Logs), schemas)  # type: ignore[arg-type]


@pytest.mark.integration
def test_debezium_time_units_and_structs_reach_the_view(rt: Any, embedded_log: Any, pg_dsn: str,
                                                      kafka_broker: Any) -> None:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from kappaflow.connectors.debezium import DebeziumSource
    from kappaflow.projections.replay import replay
    from tests.projections.pj_helpers import view_rows

    prefix = "dbzp" + uuid.uuid4().hex[:8]
    topic = f"{prefix}.public.readings"
    cols = [_field("int32", "id", optional=False), _field("int64", "at_ms", "io.debezium.time.Timestamp"),
            _field("int64", "at_ns", "io.debezium.time.NanoTimestamp"),
            _field("int32", "t_ms", "io.debezium.time.Time"),
            {"type": "struct", "optional": True, "name": "io.debezium.data.geometry.Geometry", "version": 1,
             "doc": "Geometry", "fields": [{"type": "bytes", "optional": False, "field": "wkb"},
                                           {"type": "int32", "optional": True, "field": "srid"}], "field": "geom"},
            {"type": "map", "keys": {"type": "string", "optional": False},
             "values": {"type": "string", "optional": True}, "optional": True, "field": "attrs"}]
    cols[0]["optional"] = False
    value = {"schema": {"type": "struct", "name": f"{topic}.Envelope", "optional": False, "fields": [
        {"type": "struct", "fields": cols, "optional": True, "name": f"{topic}.Value", "field": "before"},
        {"type": "struct", "fields": cols, "optional": True, "name": f"{topic}.Value", "field": "after"},
        {"type": "struct", "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source",
         "fields": []},
        {"type": "string", "optional": False, "field": "op"}]},
        "payload": {"before": None, "op": "c", "ts_ms": 1559033904863,
                    "after": {"id": 1, "at_ms": 1529507596945, "at_ns": 1529507596945104000, "t_ms": 54796945,
                              "geom": {"wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": 3187}, "attrs": {"k": "v"}},
                    "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": prefix,
                               "ts_ms": 1559033904863, "snapshot": "false", "db": "postgres", "schema": "public",
                               "table": "readings", "txId": 555, "lsn": 24023128, "xmin": None}}}
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    producer.send(topic, key=b'{"id":1}', value=orjson.dumps(value))
    producer.flush(30)
    producer.close()
    src = DebeziumSource(name=prefix, log=embedded_log, bootstrap=kafka_broker.bootstrap, topics=[topic], partitions=1)
    assert src.run(until_caught_up=True).events == 1
    # the log keeps Debezium's units (written back as read)
    (rec,) = list(embedded_log.iter_partition(f"{prefix}.public.readings", 0))
    after = orjson.loads(rec.value)["after"]
    assert (after["at_ms"], after["at_ns"], after["t_ms"]) == (1529507596945, 1529507596945104000, 54796945)

    class Readings(Projection):
        name = f"readings_{prefix}"
        sources = [f"{prefix}.public.readings"]
        key = ["id"]

    replay(Readings, rt)
    ((rid, at_ms, at_ns, t_ms, geom, attrs),) = view_rows(pg_dsn, f"readings_{prefix}",
                                                         "id, at_ms, at_ns, t_ms, geom, attrs")
    assert rid == 1
    assert at_ms == dt.datetime(2018, 6, 20, 15, 13, 16, 945000)
    assert at_ns == dt.datetime(2018, 6, 20, 15, 13, 16, 945104)
    assert t_ms == 54796945000  # micros past midnight, like every TIME column kappaflow folds
    assert orjson.loads(geom) == {"wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": 3187}
    assert orjson.loads(attrs) == {"k": "v"}
