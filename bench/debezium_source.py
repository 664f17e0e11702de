"""Benchmark: Debezium topics into the embedded log vs. plain consuming and parsing them.

Starts a tansu broker (Kafka protocol), produces N Debezium JSON records with schemas
(``JsonConverter`` with ``schemas.enable=true``): the PostgreSQL connector's create and update
events of the documentation's layout (2.6+ source block, ``ts_us``/``ts_ns``, transaction block)
for an orders table of typed columns (int, string, ``Decimal`` bytes, ``MicroTimestamp``,
``ZonedTimestamp``, ``Json``), 60% creates, 40% updates, over 4 partitions keyed by id. Then,
alternating, in the same run:

* raw:      kafka-python ``KafkaConsumer`` reads every record and ``orjson.loads`` each value
            (what any consumer of the topics has to pay) -- the baseline;
* debezium: ``DebeziumSource`` reads the same topic into a fresh embedded log (records decoded
            by their schema, typed, ordered, re-encoded, keyed, partitioned, appended, offsets
            committed).

Usage: ``python bench/debezium_source.py [--records 500000] [--repeat 2]``. The last line is one
JSON object with ``debezium_records_per_s`` and ``raw_consume_parse_per_s`` (goal: ratio >= 0.7),
wall clock, best of the alternating runs; ``cpu_ratio`` (raw CPU / Debezium source CPU of this
process) is the figure load from other processes does not distort.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

TOPIC = "bench.public.orders"


def _schema() -> dict[str, Any]:
    def f(t: str, field: str, opt: bool = True, **kw: Any) -> dict[str, Any]:
        return {"type": t, "optional": opt, **kw, "field": field}

    row = [f("int32", "id", False), f("int32", "customer_id"), f("string", "status"),
           f("bytes", "amount", name="org.apache.kafka.connect.data.Decimal", version=1,
             parameters={"scale": "2", "connect.decimal.precision": "12"}),
           f("int64", "created", name="io.debezium.time.MicroTimestamp", version=1),
           f("string", "updated", name="io.debezium.time.ZonedTimestamp", version=1),
           f("string", "note"), f("string", "attrs", name="io.debezium.data.Json", version=1)]
    source = [f("string", "version", False), f("string", "connector", False), f("string", "name", False),
              f("int64", "ts_ms", False),
              {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
               "parameters": {"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,"
                                         "incremental"}, "default": "false", "field": "snapshot"},
              f("string", "db", False), f("string", "sequence"), f("int64", "ts_us"), f("int64", "ts_ns"),
              f("string", "schema", False), f("string", "table", False), f("int64", "txId"), f("int64", "lsn"),
              f("int64", "xmin")]
    tx = {"type": "struct", "fields": [f("string", "id", False), f("int64", "total_order", False),
                                       f("int64", "data_collection_order", False)],
          "optional": True, "name": "event.block", "version": 1, "field": "transaction"}
    return {"type": "struct", "fields": [
        {"type": "struct", "fields": row, "optional": True, "name": f"{TOPIC}.Value", "field": "before"},
        {"type": "struct", "fields": row, "optional": True, "name": f"{TOPIC}.Value", "field": "after"},
        {"type": "struct", "fields": source, "optional": False, "name": "io.debezium.connector.postgresql.Source",
         "field": "source"},
        tx, f("string", "op", False), f("int64", "ts_ms"), f("int64", "ts_us"), f("int64", "ts_ns")],
        "optional": False, "name": f"{TOPIC}.Envelope", "version": 2}


def _records(n: int) -> list[tuple[bytes, bytes]]:
    import orjson

    schema = orjson.dumps(_schema())
    key_schema = b'{"type":"struct","fields":[{"type":"int32","optional":false,"field":"id"}],"optional":false,' \
                 b'"name":"bench.public.orders.Key"}'
    creates = int(n * 0.6)
    out = []
    lsn = 24023128
    for i in range(n):
        rid = i if i < creates else (i - creates) % creates
        op = "c" if i < creates else "u"
        amount = base64.b64encode((1000 + i % 100000).to_bytes(4, "big", signed=True)).decode()
        after = {"id": rid, "customer_id": rid % 997, "status": "new" if op == "c" else "paid", "amount": amount,
                 "created": 1714564800123456 + i, "updated": "2024-05-01T12:00:00.5Z",
                 "note": f"order number {rid}", "attrs": '{"gift": false, "lines": 3}'}
        lsn += 120
        ts = 1714564800000 + i // 10
        payload = {"before": None, "after": after,
                   "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "bench", "ts_ms": ts,
                              "snapshot": "false", "db": "shop", "sequence": f'["{lsn - 120}","{lsn}"]',
                              "ts_us": ts * 1000, "ts_ns": ts * 1_000_000, "schema": "public", "table": "orders",
                              "txId": 700 + i // 5, "lsn": lsn, "xmin": None},
                   "transaction": {"id": f"{700 + i // 5}:{lsn}", "total_order": i % 5 + 1,
                                   "data_collection_order": i % 5 + 1},
                   "op": op, "ts_ms": ts + 3, "ts_us": (ts + 3) * 1000, "ts_ns": (ts + 3) * 1_000_000}
        value = b'{"schema":' + schema + b',"payload":' + orjson.dumps(payload) + b"}"
        key = b'{"schema":' + key_schema + b',"payload":{"id":%d}}' % rid
        out.append((key, value))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--partitions", type=int, default=4)
    opts = ap.parse_args()

    import orjson
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    from kappaflow.connectors.debezium import DebeziumSource
    from kappaflow.log.embedded import EmbeddedLog
    from kappaflow.log.partitioner import partition_for
    from kappaflow.testing.servers.tansu import TansuBroker

    work = Path(tempfile.mkdtemp(prefix="kf-bench-dbz-"))
    broker = TansuBroker().start()
    try:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics([NewTopic(TOPIC, num_partitions=opts.partitions, replication_factor=1)])
        admin.close()
        t0 = time.perf_counter()
        records = _records(opts.records)
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=20, batch_size=512 * 1024,
                                 max_request_size=8 * 1024 * 1024)
        for key, value in records:
            rid = orjson.loads(key)["payload"]["id"]
            producer.send(TOPIC, key=key, value=value, partition=partition_for(orjson.dumps({"id": rid}),
                                                                               opts.partitions))
        producer.flush(600)
        producer.close()
        produce_s = time.perf_counter() - t0
        raw_bytes = sum(len(v) for _k, v in records)
        del records

        def raw() -> tuple[int, float, float]:
            """Baseline: kafka-python consume of every record and an orjson parse of its value."""
            consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False, group_id=None,
                                     auto_offset_reset="earliest")
            tps = [TopicPartition(TOPIC, p) for p in range(opts.partitions)]
            consumer.assign(tps)
            for tp in tps:
                consumer.seek_to_beginning(tp)
            n = 0
            loads = orjson.loads
            t0, c0 = time.perf_counter(), time.process_time()
            idle = 0
            while n < opts.records and idle < 50:
                polled = consumer.poll(timeout_ms=200, max_records=5000)
                if not polled:
                    idle += 1
                    continue
                idle = 0
                for msgs in polled.values():
                    for m in msgs:
                        loads(m.value)
                        n += 1
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            consumer.close()
            return n, took, cpu

        def debezium(run: int) -> tuple[int, int, float, float]:
            """kappaflow: the same topic read by the Debezium source into a fresh embedded log."""
            log = EmbeddedLog(work / f"log{run}")
            src = DebeziumSource(name="bench", log=log, bootstrap=broker.bootstrap, topics=[TOPIC],
                                 partitions=opts.partitions)
            t0, c0 = time.perf_counter(), time.process_time()
            summary = src.run(until_caught_up=True)
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            dead = src.dead_letters
            log.close()
            if dead:
                raise SystemExit(f"{dead} dead letters: the benchmark's records should all be valid")
            return summary.events, summary.records, took, cpu

        raws, dbz = [], []
        for run in range(opts.repeat):
            raws.append(raw())
            dbz.append(debezium(run))
        raw_n, raw_s, _ = min(raws, key=lambda r: r[1])
        events, written, dbz_s, _ = min(dbz, key=lambda r: r[2])
        raw_cpu = min(r[2] for r in raws)
        dbz_cpu = min(d[3] for d in dbz)
        raw_rate = raw_n / raw_s if raw_s else 0.0
        dbz_rate = events / dbz_s if dbz_s else 0.0
        result = {
            "records": opts.records,
            "record_bytes_avg": round(raw_bytes / opts.records),
            "produce_s": round(produce_s, 2),
            "raw_records": raw_n,
            "raw_s": round(raw_s, 2),
            "raw_cpu_s": round(raw_cpu, 2),
            "debezium_events": events,
            "log_records": written,
            "debezium_s": round(dbz_s, 2),
            "debezium_cpu_s": round(dbz_cpu, 2),
            "cpu_ratio": round(raw_cpu / dbz_cpu, 3) if dbz_cpu else None,
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "debezium_records_per_s": round(dbz_rate),
            "raw_consume_parse_per_s": round(raw_rate),
            "ratio": round(dbz_rate / raw_rate, 3) if raw_rate else None,
        }
        print(json.dumps(result))
    finally:
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
