#!/usr/bin/env python
"""Log throughput: append then read N records (~200 bytes, K distinct keys) on each backend.

Measured in the same run, alternating, best of `--repeat` rounds (the machine is shared):

* ``sqlite_raw_append_per_s``: the raw baseline, a plain SQLite batched insert of the same
  rows, ``INSERT INTO records(key, value, ts)`` into a rowid table with ``executemany``,
  one transaction per batch, WAL mode and ``synchronous=FULL`` (the embedded log's
  durability). Rows are prepared as tuples *outside* the timed region, so the baseline
  is SQLite's own insert speed with no per-record Python work at all.
* ``embedded_append_per_s`` / ``embedded_read_per_s``: `EmbeddedLog.append` of the same
  records in the same batch size (a compacted topic with `--partitions` partitions), then
  `iter_partition` over every partition (LogRecords built and CRC-verified).
* ``kafka_*``: filled by `bench_kafka` / `bench_kafka_raw` (the Kafka backend's part);
  null when no broker is given or the Kafka backend is not importable. ``kafka_append_per_s`` /
  ``kafka_read_per_s`` use the kafka-python client, ``kafka_fast_append_per_s`` /
  ``kafka_fast_read_per_s`` the confluent-kafka (librdkafka) client, the same way;
  ``kafka_raw_append_per_s`` is a plain kafka-python producer (the baseline; goal for the fast
  client: >= 3x of it, and >= 150k/s), ``kafka_fast_vs_raw`` their ratio.

The record set is built once and `gc.freeze()`d before timing, so the 500k input objects
the harness holds are not rescanned by every full garbage collection (a streaming
producer does not hold its whole input); this applies to every measurement alike.

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kappaflow.log.base import CleanupPolicy, Record, TopicConfig


def make_records(n: int, keys: int, value_bytes: int, seed: int = 1) -> list[Record]:
    """n records with `keys` distinct keys (b"key-%08d", 12 bytes) and random values."""
    rnd = random.Random(seed)
    names = [b"key-%08d" % i for i in range(keys)]
    ts = 1_700_000_000_000
    return [Record(names[rnd.randrange(keys)], rnd.randbytes(value_bytes), timestamp_ms=ts + i)
            for i in range(n)]


class Timer:
    """Wall-clock and this process's CPU time (user + system) of a block."""

    def __enter__(self) -> Timer:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def bench_sqlite_raw(records: list[Record], workdir: Path, batch: int) -> Timer:
    """Plain SQLite batched insert of the same rows; returns the timer of the inserts."""
    rows = [(r.key, r.value, r.timestamp_ms) for r in records]
    path = workdir / "raw.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE records(key BLOB, value BLOB, ts INTEGER)")
    with Timer() as timer:
        for i in range(0, len(rows), batch):
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO records(key, value, ts) VALUES (?, ?, ?)", rows[i : i + batch])
            conn.execute("COMMIT")
    conn.close()
    return timer


def bench_embedded(records: list[Record], workdir: Path, batch: int, partitions: int) -> tuple[Timer, Timer]:
    """EmbeddedLog append (batches of `batch`) then a full read; returns their timers."""
    from kappaflow.log.embedded import EmbeddedLog

    with EmbeddedLog(workdir / "embedded") as log:
        log.create_topic("bench", TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.COMPACT))
        with Timer() as append:
            for i in range(0, len(records), batch):
                log.append("bench", records[i : i + batch])
        count = 0
        with Timer() as read:
            for p in range(partitions):
                for _ in log.iter_partition("bench", p):
                    count += 1
    if count != len(records):
        raise AssertionError(f"embedded read {count} records, appended {len(records)}")
    return append, read


def _kafka_topic(prefix: str) -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def bench_kafka(records: list[Record], bootstrap: str, batch: int, partitions: int,
                client: str = "kafka-python") -> tuple[float, float] | None:
    """The Kafka log (`client`: "kafka-python" or "confluent") append then read of the same records;
    returns (append/s, read/s), best of 2 rounds.

    Append goes in calls of `batch` records, each durable on return (flush + every record's
    acknowledgement), like a connector appending one source batch at a time. Read is
    `iter_partition` over every partition (end offset probe, LogRecords built).
    """
    from kappaflow.log import kafka_client

    try:
        cls = kafka_client(client).load()
    except Exception:  # the client is not installed
        return None
    best_append = best_read = 0.0
    with cls(bootstrap) as log:
        for round_no in range(2):
            topic = _kafka_topic(f"bench-{client}")
            log.create_topic(topic, TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.COMPACT))
            try:
                start, cpu = time.perf_counter(), time.process_time()
                for i in range(0, len(records), batch):
                    log.append(topic, records[i : i + batch])
                append_s, append_cpu = time.perf_counter() - start, time.process_time() - cpu
                start, cpu = time.perf_counter(), time.process_time()
                count = 0
                for p in range(partitions):
                    for _ in log.iter_partition(topic, p):
                        count += 1
                read_s, read_cpu = time.perf_counter() - start, time.process_time() - cpu
            finally:
                log.delete_topic(topic)
            if count != len(records):
                raise AssertionError(f"kafka ({client}) read {count} records, appended {len(records)}")
            best_append = max(best_append, len(records) / append_s)
            best_read = max(best_read, count / read_s)
            # cpu: this process only (all client threads), not the broker's: the client's own cost
            print(f"kafka {client} round {round_no + 1}: append {len(records) / append_s:,.0f}/s "
                  f"(client cpu {len(records) / append_cpu:,.0f}/s), read {count / read_s:,.0f}/s "
                  f"(client cpu {count / read_cpu:,.0f}/s)", file=sys.stderr)
    return best_append, best_read


def bench_kafka_raw(records: list[Record], bootstrap: str, batch: int, partitions: int) -> float | None:
    """Plain kafka-python producer of the same records; returns records/s, best of 2 rounds.

    The baseline a user would write: one `KafkaProducer` (kafka-python 3 defaults, i.e.
    idempotent with acks=all, plus linger 20 ms and 512 KiB batches like the backend),
    `send(topic, key=, value=, timestamp_ms=)` for every record with the default (murmur2)
    partitioner, one `flush()` at the end. No per-append durability barrier, no result
    collection: the most favourable case for the baseline.
    """
    try:
        from kafka import KafkaAdminClient, KafkaProducer
    except ImportError:
        return None
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    best = 0.0
    try:
        for round_no in range(2):
            topic = _kafka_topic("bench-raw")
            admin.create_topics({topic: {"num_partitions": partitions, "replication_factor": -1,
                                         "configs": {"cleanup.policy": "compact"}}}, wait_for_metadata=True)
            producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024,
                                     max_request_size=8 * 1024 * 1024)
            try:
                producer.partitions_for(topic)  # topic metadata before timing (one round trip)
                start, cpu = time.perf_counter(), time.process_time()
                send = producer.send
                for r in records:
                    send(topic, key=r.key, value=r.value, timestamp_ms=r.timestamp_ms)
                producer.flush()
                elapsed, used = time.perf_counter() - start, time.process_time() - cpu
            finally:
                producer.close()  # before deleting: its metadata refresh would recreate the topic
                admin.delete_topics([topic])
            best = max(best, len(records) / elapsed)
            print(f"kafka raw round {round_no + 1}: produce {len(records) / elapsed:,.0f}/s "
                  f"(client cpu {len(records) / used:,.0f}/s)", file=sys.stderr)
    finally:
        admin.close()
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=188, help="value size; + 12-byte key ~ 200 bytes")
    ap.add_argument("--batch", type=int, default=10_000, help="records per append call / transaction")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best of each is reported")
    ap.add_argument("--kafka-bootstrap", default=None,
                    help="host:port of a broker for the Kafka part (default: start a private tansu broker)")
    ap.add_argument("--no-kafka", action="store_true", help="skip the Kafka part")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)

    records = make_records(args.records, args.keys, args.value_bytes)
    gc.collect()
    gc.freeze()
    n = args.records
    raw: list[Timer] = []
    app: list[Timer] = []
    rd: list[Timer] = []
    for round_no in range(args.repeat):
        work = Path(tempfile.mkdtemp(prefix="kf-bench-", dir=args.workdir))
        try:
            raw.append(bench_sqlite_raw(records, work, args.batch))
            a, r = bench_embedded(records, work, args.batch, args.partitions)
            app.append(a)
            rd.append(r)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"round {round_no + 1}: sqlite raw {n / raw[-1].wall:,.0f}/s (cpu {n / raw[-1].cpu:,.0f}/s), "
              f"embedded append {n / app[-1].wall:,.0f}/s (cpu {n / app[-1].cpu:,.0f}/s), "
              f"read {n / rd[-1].wall:,.0f}/s (cpu {n / rd[-1].cpu:,.0f}/s)", file=sys.stderr)

    def best(timers: list[Timer], attr: str = "wall") -> int:
        return round(n / min(getattr(t, attr) for t in timers))

    kafka = kafka_raw = kafka_fast = None
    if not args.no_kafka:
        from contextlib import nullcontext

        from kappaflow.testing.servers.tansu import TansuBroker

        broker = nullcontext() if args.kafka_bootstrap else TansuBroker().start()
        with broker:
            bootstrap = args.kafka_bootstrap or broker.bootstrap  # type: ignore[union-attr]
            kafka = bench_kafka(records, bootstrap, args.batch, args.partitions, "kafka-python")
            kafka_fast = bench_kafka(records, bootstrap, args.batch, args.partitions, "confluent")
            kafka_raw = bench_kafka_raw(records, bootstrap, args.batch, args.partitions)

    result: dict[str, Any] = {
        "embedded_append_per_s": best(app),
        "sqlite_raw_append_per_s": best(raw),
        "embedded_read_per_s": best(rd),
        "kafka_append_per_s": None if kafka is None else round(kafka[0]),
        "kafka_raw_append_per_s": None if kafka_raw is None else round(kafka_raw),
        "kafka_read_per_s": None if kafka is None else round(kafka[1]),
        "kafka_fast_append_per_s": None if kafka_fast is None else round(kafka_fast[0]),
        "kafka_fast_read_per_s": None if kafka_fast is None else round(kafka_fast[1]),
        "kafka_fast_vs_raw": None if kafka_fast is None or not kafka_raw else round(kafka_fast[0] / kafka_raw, 2),
        "embedded_vs_raw": round(best(app) / best(raw), 3),
        # CPU time (user + system) of this process: comparable when the machine is shared
        "embedded_append_cpu_per_s": best(app, "cpu"),
        "sqlite_raw_append_cpu_per_s": best(raw, "cpu"),
        "embedded_read_cpu_per_s": best(rd, "cpu"),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "records": args.records,
        "keys": args.keys,
        "batch": args.batch,
        "partitions": args.partitions,
        "rounds": args.repeat,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
