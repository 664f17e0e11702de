"""Benchmark: PostgreSQL capture throughput into the embedded log and into Kafka.

Writes N row changes (N/2 inserts, then N/2 updates, in transactions of 1000 rows)
to a six-column table of mixed types on a private PostgreSQL, with one replication
slot per measurement created beforehand (so every measurement drains the same
backlog), then measures:

* ``raw_receive_per_s``: the same changes received over the replication protocol
  (pgoutput, COPY_BOTH) without decoding — the ceiling for any client;
* ``embedded_changes_per_s``: ``PostgresConnector`` into the embedded log;
* ``capture_with_metrics_per_s``: the same into another embedded log with the capture's
  ``/metrics`` endpoint on (the collectors ``kappaflow capture --metrics-port`` serves, with the
  source probe) and scraped every second over HTTP; ``metrics_vs_embedded`` is its ratio to
  ``embedded_changes_per_s`` (goal >= 0.97: metrics are read per scrape from per-batch counters,
  never updated per row);
* ``kafka_changes_per_s``: ``PostgresConnector`` into Kafka (a private tansu broker) with the
  kafka-python client;
* ``kafka_fast_changes_per_s``: the same with the confluent-kafka (librdkafka) client (goal: >= 0.7 of
  ``embedded_changes_per_s`` of the same run; ``kafka_fast_vs_embedded`` is that ratio);
* ``kafka_raw_produce_per_s``: plain kafka-python producing N records of the same key and
  value sizes with the same one ``kf.op`` header every captured record carries (the ceiling
  for anything writing these records to that broker from Python);
  ``kafka_raw_produce_no_headers_per_s`` is the same without the header (for reference:
  kafka-python spends ~20% more per record with a header);
* ``kafka_fast_raw_produce_per_s``: plain confluent-kafka producing the same records (acks=all,
  idempotent), nothing else running: the ceiling of ``kafka_fast_changes_per_s`` on this broker and
  machine. ``kafka_fast_raw_vs_embedded`` is the highest ``kafka_fast_vs_embedded`` the broker allows;
  ``kafka_fast_vs_raw_produce`` is how close capture comes to it.

Usage: ``python bench/capture_postgres.py [--changes 1000000] [--skip-kafka]``.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from kappaflow.config import PostgresSourceConfig, SnapshotMode
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.connectors.postgres.replication import XLOGDATA, ReplicationConnection
from kappaflow.testing.servers.postgres import PrivatePostgres

TABLE = """CREATE TABLE bench (
    id bigint PRIMARY KEY,
    name text NOT NULL,
    amount numeric(12, 2),
    created timestamptz NOT NULL,
    active boolean,
    doc jsonb
)"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_changes(dsn: str, n: int) -> float:
    half = n // 2
    t0 = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(1, half + 1, 1000):
            end = min(half, start + 999)
            conn.execute(
                "INSERT INTO bench SELECT i, 'customer ' || i, i * 1.25, now(), i %% 2 = 0, "
                "jsonb_build_object('k', i, 'tag', 'abc') FROM generate_series(%s::bigint, %s::bigint) i",
                (start, end))
        for start in range(1, half + 1, 1000):
            end = min(half, start + 999)
            conn.execute("UPDATE bench SET amount = amount + 1, active = NOT active WHERE id BETWEEN %s AND %s",
                         (start, end))
    return time.perf_counter() - t0


def raw_receive(dsn: str, slot: str, n: int) -> float:
    """Receive the slot's changes without decoding; count Insert/Update messages."""
    repl = ReplicationConnection(dsn)
    repl.start(slot, 0, ["bench_pub"], messages=False)
    seen = 0
    t0 = time.perf_counter()
    while seen < n:
        for m in repl.read_many(5.0, 8192):
            if m[0] == XLOGDATA and m[25] in (73, 85):
                seen += 1
    dt = time.perf_counter() - t0
    repl.close()
    return n / dt


def capture(dsn: str, slot: str, log_obj: object, n: int, name: str) -> tuple[float, dict[str, object]]:
    cfg = PostgresSourceConfig(name=name, dsn=dsn, tables=["public.bench"], slot=slot, publication="bench_pub",
                               snapshot_mode=SnapshotMode.NEVER, heartbeat_interval_s=30)
    conn = PostgresConnector(cfg, log_obj, partitions=4, progress=False)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    summary = conn.run(until_caught_up=True)
    dt = time.perf_counter() - t0
    if summary.events != n:
        raise SystemExit(f"{name}: captured {summary.events} events, expected {n}")
    return n / dt, summary.to_dict()


def capture_with_metrics(dsn: str, slot: str, log_dir: Path, n: int, name: str) -> tuple[float, int]:
    """``capture`` with the capture's metrics endpoint on and a scraper fetching /metrics every second;
    returns the rate and the number of scrapes."""
    import threading
    import urllib.request

    from kappaflow.log.embedded import EmbeddedLog
    from kappaflow.metrics.capture import CaptureCollector
    from kappaflow.metrics.core import MetricsEndpoint, new_registry
    from kappaflow.metrics.log import LogCollector
    from kappaflow.metrics.probes import CachedProbe, open_probe

    cfg = PostgresSourceConfig(name=name, dsn=dsn, tables=["public.bench"], slot=slot, publication="bench_pub",
                               snapshot_mode=SnapshotMode.NEVER, heartbeat_interval_s=30)
    log_obj = EmbeddedLog(log_dir)
    conn = PostgresConnector(cfg, log_obj, partitions=4, progress=False)
    raw_probe = open_probe(cfg)
    probe = CachedProbe(raw_probe, 5.0) if raw_probe is not None else None
    collector = CaptureCollector(cfg, lambda: [conn], probe=probe)
    registry = new_registry(collector, LogCollector(appended=collector.appended, log_dir=log_dir))
    stop = threading.Event()
    scrapes = [0]
    try:
        with MetricsEndpoint(registry, port=0) as endpoint:
            url = f"http://127.0.0.1:{endpoint.port}/metrics"

            def scrape() -> None:
                while not stop.wait(1.0):
                    with urllib.request.urlopen(url, timeout=10) as resp:
                        resp.read()
                    scrapes[0] += 1

            scraper = threading.Thread(target=scrape, daemon=True)
            scraper.start()
            t0 = time.perf_counter()
            summary = conn.run(until_caught_up=True)
            dt = time.perf_counter() - t0
            stop.set()
            scraper.join(timeout=15)
    finally:
        stop.set()
        if probe is not None:
            probe.close()
        log_obj.close()
    if summary.events != n:
        raise SystemExit(f"{name}: captured {summary.events} events, expected {n}")
    return n / dt, scrapes[0]


def sample_sizes(log_obj: object, topic: str) -> tuple[int, int]:
    recs = log_obj.read(topic, 0, 0, 1000)  # type: ignore[attr-defined]
    keys = sum(len(r.key or b"") for r in recs) // max(1, len(recs))
    vals = sum(len(r.value or b"") for r in recs) // max(1, len(recs))
    return keys, vals


def kafka_raw_produce(bootstrap: str, n: int, key_size: int, value_size: int, *, headers: bool) -> float:
    """kafka-python alone: n records of the captured records' key/value sizes (and their one
    ``kf.op`` header when ``headers``), same producer settings as KafkaLog (acks=all, linger 20 ms)."""
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin import NewTopic

    topic = f"raw-produce-bench-{'h' if headers else 'n'}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20, batch_size=512 * 1024,
                             max_request_size=8 * 1024 * 1024)
    value = b"v" * value_size
    keys = [(b"%0*d" % (key_size, i))[-key_size:] for i in range(n)]
    hdr = [("kf.op", b"c")] if headers else None
    t0 = time.perf_counter()
    for k in keys:
        producer.send(topic, key=k, value=value, headers=hdr)
    producer.flush()
    dt = time.perf_counter() - t0
    producer.close()
    return n / dt


def kafka_fast_raw_produce(bootstrap: str, n: int, key_size: int, value_size: int) -> float:
    """confluent-kafka alone: n records of the captured records' key/value sizes with their one
    ``kf.op`` header, acks=all and idempotence on, no PostgreSQL and no decoding. The ceiling of
    ``kafka_fast_changes_per_s`` on this broker and machine: capture cannot append faster than the
    client and broker take the same records with nothing else to do."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = "raw-produce-bench-fast"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)]).values():
        fut.result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                         "linger.ms": 20, "batch.size": 1024 * 1024, "queue.buffering.max.messages": 1_000_000,
                         "queue.buffering.max.kbytes": 1024 * 1024, "compression.type": "none"})
    value = b"v" * value_size
    keys = [(b"%0*d" % (key_size, i))[-key_size:] for i in range(n)]
    hdr = [("kf.op", b"c")]
    produce, poll = producer.produce, producer.poll
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        while True:
            try:
                produce(topic, value, k, i % 4, headers=hdr)
                break
            except BufferError:
                poll(0.01)
        if not i % 10_000:
            poll(0)
    if producer.flush(120):
        raise RuntimeError("confluent raw produce: records still queued after 120 s")
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--skip-kafka", action="store_true")
    ap.add_argument("--skip-embedded", action="store_true")
    args = ap.parse_args()
    n = args.changes
    result: dict[str, object] = {"changes": n}
    work = Path(tempfile.mkdtemp(prefix="kf-bench-pg-"))
    pg = PrivatePostgres(settings={"max_wal_size": "8GB", "checkpoint_timeout": "30min"}).start()
    broker = None
    try:
        dsn = pg.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(TABLE)
            conn.execute("CREATE PUBLICATION bench_pub FOR TABLE bench")
            for slot in ("bench_raw", "bench_emb", "bench_metrics", "bench_kafka", "bench_kafka_fast"):
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        log(f"writing {n} changes ...")
        result["write_s"] = round(write_changes(dsn, n), 2)

        log("raw receive ...")
        result["raw_receive_per_s"] = round(raw_receive(dsn, "bench_raw", n))

        if not args.skip_embedded:
            from kappaflow.log.embedded import EmbeddedLog

            log("capture into the embedded log ...")
            elog = EmbeddedLog(work / "log")
            try:
                rate, summary = capture(dsn, "bench_emb", elog, n, "emb")
                result["embedded_changes_per_s"] = round(rate)
                result["embedded_summary"] = {k: summary[k] for k in ("events", "records", "elapsed_s")}
                key_size, value_size = sample_sizes(elog, "emb.public.bench")
                result["record_key_bytes"] = key_size
                result["record_value_bytes"] = value_size
            finally:
                elog.close()
            log("capture into the embedded log, /metrics scraped every second ...")
            rate, scrapes = capture_with_metrics(dsn, "bench_metrics", work / "log-metrics", n, "met")
            result["capture_with_metrics_per_s"] = round(rate)
            result["metrics_scrapes"] = scrapes
            result["metrics_vs_embedded"] = round(rate / result["embedded_changes_per_s"], 3)  # type: ignore[operator]
        else:
            key_size, value_size = 12, 560

        if not args.skip_kafka:
            from kappaflow.log import kafka_client
            from kappaflow.log.kafka import KafkaLog
            from kappaflow.testing.servers.tansu import TansuBroker

            broker = TansuBroker().start()
            log("capture into Kafka (tansu), kafka-python client ...")
            klog = KafkaLog(broker.bootstrap)
            try:
                rate, _summary = capture(dsn, "bench_kafka", klog, n, "kfk")
                result["kafka_changes_per_s"] = round(rate)
            finally:
                klog.close()
            if kafka_client("confluent").installed:
                log("capture into Kafka (tansu), confluent-kafka client ...")
                flog = kafka_client("confluent").load()(broker.bootstrap)
                try:
                    rate, _summary = capture(dsn, "bench_kafka_fast", flog, n, "kff")
                    result["kafka_fast_changes_per_s"] = round(rate)
                finally:
                    flog.close()
            if kafka_client("confluent").installed:
                log("raw confluent-kafka produce ...")
                result["kafka_fast_raw_produce_per_s"] = round(
                    kafka_fast_raw_produce(broker.bootstrap, n, key_size, value_size))
            log("raw kafka-python produce ...")
            result["kafka_raw_produce_per_s"] = round(
                kafka_raw_produce(broker.bootstrap, n, key_size, value_size, headers=True))
            result["kafka_raw_produce_no_headers_per_s"] = round(
                kafka_raw_produce(broker.bootstrap, n, key_size, value_size, headers=False))

        raw = result["raw_receive_per_s"]
        if "embedded_changes_per_s" in result:
            result["embedded_vs_raw"] = round(result["embedded_changes_per_s"] / raw, 3)  # type: ignore[operator]
        if "kafka_fast_changes_per_s" in result and "embedded_changes_per_s" in result:
            result["kafka_fast_vs_embedded"] = round(
                result["kafka_fast_changes_per_s"] / result["embedded_changes_per_s"], 3)  # type: ignore[operator]
        if "kafka_fast_raw_produce_per_s" in result:
            fast_raw = result["kafka_fast_raw_produce_per_s"]
            result["kafka_fast_vs_raw_produce"] = round(
                result.get("kafka_fast_changes_per_s", 0) / fast_raw, 3)  # type: ignore[operator]
            if "embedded_changes_per_s" in result:  # the highest kafka_fast_vs_embedded this broker allows
                result["kafka_fast_raw_vs_embedded"] = round(
                    fast_raw / result["embedded_changes_per_s"], 3)  # type: ignore[operator]
        if "kafka_changes_per_s" in result:
            result["kafka_vs_raw_produce"] = round(
                result["kafka_changes_per_s"] / result["kafka_raw_produce_per_s"], 3)  # type: ignore[operator]
    finally:
        if broker is not None:
            broker.stop()
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
