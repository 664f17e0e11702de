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
  null when no broker is given or the Kafka backend is not importable.

The record set is built once and `gc.freeze()`d before timing, so the 500k input objects
the harness holds are not rescanned by every full garbage collection (a streaming
producer does not hold its whole input); this applies to every measurement alike.

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def bench_sqlite_raw(records: list[Record], workdir: Path, batch: int) -> float:
    """Plain SQLite batched insert of the same rows; returns records/s."""
    rows = [(r.key, r.value, r.timestamp_ms) for r in records]
    path = workdir / "raw.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE records(key BLOB, value BLOB, ts INTEGER)")
    start = time.perf_counter()
    for i in range(0, len(rows), batch):
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO records(key, value, ts) VALUES (?, ?, ?)", rows[i : i + batch])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return len(rows) / elapsed


def bench_embedded(records: list[Record], workdir: Path, batch: int, partitions: int) -> tuple[float, float]:
    """EmbeddedLog append (batches of `batch`) then a full read; returns (append/s, read/s)."""
    from kappaflow.log.embedded import EmbeddedLog

    with EmbeddedLog(workdir / "embedded") as log:
        log.create_topic("bench", TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.COMPACT))
        start = time.perf_counter()
        for i in range(0, len(records), batch):
            log.append("bench", records[i : i + batch])
        append_s = time.perf_counter() - start
        start = time.perf_counter()
        count = 0
        for p in range(partitions):
            for _ in log.iter_partition("bench", p):
                count += 1
        read_s = time.perf_counter() - start
    if count != len(records):
        raise AssertionError(f"embedded read {count} records, appended {len(records)}")
    return len(records) / append_s, count / read_s


def bench_kafka(records: list[Record], bootstrap: str, batch: int, partitions: int) -> tuple[float, float] | None:
    """KafkaLog append then read of the same records; returns (append/s, read/s).

    Filled by the Kafka backend's author; None while `kappaflow.log.kafka` is not available.
    """
    return None


def bench_kafka_raw(records: list[Record], bootstrap: str, batch: int, partitions: int) -> float | None:
    """Plain kafka-python producer of the same records; returns records/s (Kafka backend's part)."""
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=188, help="value size; + 12-byte key ~ 200 bytes")
    ap.add_argument("--batch", type=int, default=10_000, help="records per append call / transaction")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best of each is reported")
    ap.add_argument("--kafka-bootstrap", default=None, help="host:port of a broker for the Kafka part")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)

    records = make_records(args.records, args.keys, args.value_bytes)
    gc.collect()
    gc.freeze()
    raw: list[float] = []
    app: list[float] = []
    rd: list[float] = []
    for round_no in range(args.repeat):
        work = Path(tempfile.mkdtemp(prefix="kf-bench-", dir=args.workdir))
        try:
            raw.append(bench_sqlite_raw(records, work, args.batch))
            a, r = bench_embedded(records, work, args.batch, args.partitions)
            app.append(a)
            rd.append(r)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"round {round_no + 1}: sqlite raw {raw[-1]:,.0f}/s, embedded append {app[-1]:,.0f}/s, "
              f"read {rd[-1]:,.0f}/s", file=sys.stderr)

    kafka = kafka_raw = None
    if args.kafka_bootstrap:
        kafka = bench_kafka(records, args.kafka_bootstrap, args.batch, args.partitions)
        kafka_raw = bench_kafka_raw(records, args.kafka_bootstrap, args.batch, args.partitions)

    result: dict[str, Any] = {
        "embedded_append_per_s": round(max(app)),
        "sqlite_raw_append_per_s": round(max(raw)),
        "embedded_read_per_s": round(max(rd)),
        "kafka_append_per_s": None if kafka is None else round(kafka[0]),
        "kafka_raw_append_per_s": None if kafka_raw is None else round(kafka_raw),
        "kafka_read_per_s": None if kafka is None else round(kafka[1]),
        "embedded_vs_raw": round(max(app) / max(raw), 3),
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
