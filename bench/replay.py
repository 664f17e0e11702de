"""Projection benchmark: replay 1M change events over 100k keys into PostgreSQL views, and
follow latency from a commit in the source table to the row being visible in the view.

    .venv/bin/python bench/replay.py [--events 1000000] [--keys 100000] [--samples 200]

Measured (Spark start-up and a small warm-up replay excluded; each rate is change events /
the whole ``replay()`` call: plan, shadow table, build, swap). Change events are the
inserts, updates and deletes written; the log also holds one tombstone per delete
(``log_records``), which is not an event and not counted in the rates:

- ``declarative_events_per_s``: latest row per key (``orders`` -> view keyed by ``id``);
- ``grouped_events_per_s``: count + sum by ``customer_id`` (1,000 groups, retraction-aware);
- ``custom_fold_events_per_s``: a Python ``apply()`` fold per order;
- ``copy_baseline_rows_per_s``: a plain psycopg ``COPY`` of the latest-row view's final rows
  into an empty table (the floor a view write cannot beat);
- ``kafka_replay_events_per_s``: the declarative replay again, reading the same log copied into Kafka
  (a private tansu broker) with the confluent-kafka client on the driver and the executors (goal:
  >= 0.7 of ``declarative_events_per_s``; ``kafka_replay_vs_declarative`` is that ratio);
- ``follow_latency_p50_s`` / ``_p99_s``: ``UPDATE`` committed in the source table ->
  the PostgreSQL connector (a separate capture process) -> log -> follower (trigger 0.5 s)
  -> row visible in the view; 200 samples, one update every 0.1 s;
- ``follow_events_per_s`` / ``consistent_follow_events_per_s``: catch-up of a follower (trigger
  0.5 s, default micro-batch limit) from an empty view over the same backlog, captured by the same
  PostgreSQL connector process: the snapshot of 1,000 rows plus ``--catchup-events`` row changes in
  source transactions of 1..20 rows each. ``follow_events_per_s`` reads with
  ``consistency = "per_key"`` (micro-batches end at the log's end), ``consistent_follow_events_per_s``
  with the default ``"transactions"`` (micro-batches end at consistent cuts); each runs twice in
  A-B-B-A order and the mean is reported (goal: ``consistent_follow_vs_per_key`` >= 0.9). Both
  count log records from follower start to the stored positions at the log's end;
- ``cli_replay_wall_s``: what a user waits for: ``kappaflow replay`` of each projection as a
  command of its own over the same log (Python start, Spark start-up, planning, build, swap),
  run after the in-process Spark stopped (``--skip-cli`` skips it).
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def generate(log_path: Path, events: int, keys: int, topic_source: str = "bench") -> dict[str, Any]:
    """`events` changes over `keys` orders: inserts, then updates (2% deletes, re-inserts)."""
    from kappaflow.events import Column, FieldType, TableSchema
    from kappaflow.log.embedded import EmbeddedLog
    from kappaflow.projections.simulate import TableWriter

    schema = TableSchema(
        f"{topic_source}.public.orders",
        (
            Column("id", FieldType.INT64, optional=False),
            Column("customer_id", FieldType.INT64),
            Column("amount", FieldType.DECIMAL, scale=2, precision=12),
            Column("status", FieldType.STRING),
            Column("created_at", FieldType.TIMESTAMPTZ),
        ),
        ("id",),
    )
    lg = EmbeddedLog(log_path, synchronous="normal")
    w = TableWriter(lg, schema, partitions=4)
    rnd = random.Random(7)
    base = datetime(2024, 1, 1, tzinfo=UTC)
    n = 0

    def amount() -> Decimal:
        return Decimal(rnd.randint(100, 99_999)) / 100

    for i in range(min(keys, events)):
        w.insert(
            {
                "id": i,
                "customer_id": rnd.randrange(1000),
                "amount": amount(),
                "status": "new",
                "created_at": base + timedelta(seconds=i),
            }
        )
        n += 1
        if len(w.pending) >= 20_000:
            w.flush()
    while n < events:
        k = (rnd.randrange(keys),)
        if k in w.rows:
            if rnd.random() < 0.02:
                w.delete(k)
            else:
                w.update(
                    k,
                    {
                        "customer_id": rnd.randrange(1000),
                        "amount": amount(),
                        "status": rnd.choice(("new", "paid", "shipped")),
                    },
                )
        else:
            w.insert(
                {
                    "id": k[0],
                    "customer_id": rnd.randrange(1000),
                    "amount": amount(),
                    "status": "new",
                    "created_at": base,
                }
            )
        n += 1
        if len(w.pending) >= 20_000:
            w.flush()
    w.flush()
    records = sum(lg.end_offsets(w.topic).values())
    lg.close()
    return {"events": n, "records": records, "rows": len(w.rows)}


def projections(source: str) -> tuple[type, type, type]:
    from kappaflow.projections import Count, Projection, Sum

    class Latest(Projection):
        name = f"{source}_latest"
        sources = [f"{source}.public.orders"]
        key = ["id"]

    class Grouped(Projection):
        name = f"{source}_by_customer"
        sources = [f"{source}.public.orders"]
        key = ["customer_id"]
        aggregates = {"orders": Count(), "total": Sum("amount")}

    class Custom(Projection):
        name = f"{source}_custom"
        sources = [f"{source}.public.orders"]
        key = ["id"]
        schema = "id bigint, customer_id bigint, amount decimal(12,2), updates bigint"

        def apply(self, row: Any, ev: Any) -> Any:
            if ev.op == "d":
                return None
            a = ev.after
            return {"customer_id": a["customer_id"], "amount": a["amount"], "updates": row["updates"] + 1 if row else 1}

    return Latest, Grouped, Custom


def copy_to_kafka(log_path: Path, bootstrap: str) -> None:
    """Every topic of the embedded log into Kafka: same partitions, configs, offsets, headers, timestamps."""
    from kappaflow.log import Record, open_log
    from kappaflow.log.embedded import EmbeddedLog

    with EmbeddedLog(log_path, read_only=True) as src, open_log(f"kafka://{bootstrap}", client="confluent") as dst:
        for topic, config in src.list_topics().items():
            dst.create_topic(topic, config)
            for p in range(config.partitions):
                chunk: list[Record] = []
                for r in src.iter_partition(topic, p):
                    chunk.append(Record(r.key, r.value, r.headers, r.timestamp_ms or None))
                    if len(chunk) >= 20_000:
                        dst.append_quiet(topic, chunk, partition=p)
                        chunk = []
                if chunk:
                    dst.append_quiet(topic, chunk, partition=p)


def kafka_replay(spark: Any, log_path: Path, warm_path: Path, dsn: str, work: Path, events: int) -> float:
    """`declarative_events_per_s` with the log in Kafka, read by the confluent client (warm-up excluded)."""
    from kappaflow.projections.replay import replay
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink
    from kappaflow.testing.servers.tansu import TansuBroker

    with TansuBroker().start() as broker:
        t0 = time.perf_counter()
        copy_to_kafka(log_path, broker.bootstrap)
        warm = warm_path.exists()  # no warm-up log with --warmup-events 0
        if warm:
            copy_to_kafka(warm_path, broker.bootstrap)
        log(f"copied the log into Kafka in {time.perf_counter() - t0:.1f}s")
        rt = Runtime(spark, f"kafka://{broker.bootstrap}", PostgresSink(dsn), log_options={"client": "confluent"},
                     checkpoint_dir=work / "ckpt-kafka")
        try:
            if warm:
                replay(projections("warm")[0], rt)  # warm-up: executors open their Kafka clients
            latest = projections("bench")[0]
            t = time.perf_counter()
            res = replay(latest, rt)
            secs = time.perf_counter() - t
        finally:
            rt.close()
    log(f"{latest.name} from Kafka: {res.rows} rows from {events} change events in {secs:.2f}s "
        f"-> {events / secs:,.0f} events/s")
    return events / secs  # change events, like declarative_events_per_s (tombstones are no events)


def copy_baseline(dsn: str, view: str) -> float:
    """COPY the view's final rows (read back once) into an empty table with the same columns."""
    import io

    import psycopg

    with psycopg.connect(dsn) as conn:
        buf = io.BytesIO()
        with conn.cursor() as cur, cur.copy(f'COPY public."{view}" TO STDOUT') as cp:
            for chunk in cp:
                buf.write(chunk)
        data = buf.getvalue()
        rows = data.count(b"\n")
        conn.execute(f'CREATE TABLE public.copy_baseline (LIKE public."{view}" INCLUDING ALL)')
        conn.commit()
        t0 = time.perf_counter()
        with conn.cursor() as cur, cur.copy("COPY public.copy_baseline FROM STDIN") as cp:
            cp.write(data)
        conn.commit()
        secs = time.perf_counter() - t0
        conn.execute("DROP TABLE public.copy_baseline")
        conn.commit()
    return rows / secs


def catch_up(spark: Any, src: str, log_path: Path, work: Path, events: int) -> dict[str, Any]:
    """Follower catch-up rates with and without cuts over one backlog (see the module docstring)."""
    import psycopg

    from kappaflow.connectors.cuts import CutIndex
    from kappaflow.log import open_log
    from kappaflow.projections import Projection
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    topic = "bf.public.items"
    rnd = random.Random(17)
    written = 0
    with psycopg.connect(src, autocommit=True) as c:
        while written < events:
            n = min(rnd.randint(1, 20), events - written)
            first = rnd.randint(1, 1000 - n + 1)
            c.execute("UPDATE public.items SET val = val + 1 WHERE id BETWEEN %s AND %s", (first, first + n - 1))
            written += n
    want = 1000 + events
    deadline = time.monotonic() + 600
    while True:  # the capture process has the backlog in the log, and its newest cut covers it
        lg = open_log(str(log_path), read_only=True)
        try:
            ends = dict(lg.end_offsets(topic))
            index = CutIndex(lg)
            index.refresh()
            cut = (index.cut("bf") or {}).get(topic)
        finally:
            lg.close()
        if sum(ends.values()) >= want and cut == ends:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the capture did not write {want} records with a cut at their end in 600 s "
                               f"(log end {ends}, cut {cut})")
        time.sleep(0.2)
    records = sum(ends.values())
    rt = Runtime(spark, str(log_path), PostgresSink(src), checkpoint_dir=work / "catchup-ckpt")
    rates: dict[str, list[float]] = {"per_key": [], "transactions": []}
    try:
        for run, consistency in enumerate(("per_key", "transactions", "transactions", "per_key")):
            proj = type(f"CatchUp{run}", (Projection,), {
                "name": f"bench_catchup_{run}", "sources": [topic], "key": ["id"], "consistency": consistency,
                "__module__": __name__})
            t = time.perf_counter()
            f = Follower(proj, rt, trigger="0.5s").start()
            try:
                deadline = time.monotonic() + 600
                while not f.caught_up():
                    f.check()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{proj.name}: the follower did not catch up in 600 s")
                    time.sleep(0.05)
                secs = time.perf_counter() - t
            finally:
                f.stop()
            rates[consistency].append(records / secs)
            log(f"catch-up {consistency} #{run}: {records} records in {secs:.2f}s -> {records / secs:,.0f}/s")
    finally:
        rt.close()
    per_key = sum(rates["per_key"]) / 2
    consistent = sum(rates["transactions"]) / 2
    return {"catchup_records": records, "follow_events_per_s": round(per_key),
            "consistent_follow_events_per_s": round(consistent),
            "consistent_follow_vs_per_key": round(consistent / per_key, 3)}


def follow_latency(spark: Any, server_dsn: str, work: Path, samples: int,
                   catchup_events: int = 0) -> tuple[list[float], dict[str, Any]]:
    """Source UPDATE committed -> visible in the view, with capture running in another process
    (first, with `catchup_events`: the catch-up rates of ``catch_up``, on the same capture)."""
    import psycopg
    from psycopg import sql

    from kappaflow.config import LogConfig, PostgresSourceConfig, Settings, ViewsConfig
    from kappaflow.projections import Projection
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    with psycopg.connect(server_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS bench_src WITH (FORCE)"))
        c.execute(sql.SQL("CREATE DATABASE bench_src"))
    parts = urlsplit(server_dsn)
    src = urlunsplit((parts.scheme, parts.netloc, "/bench_src", "", ""))
    with psycopg.connect(src, autocommit=True) as c:
        c.execute("CREATE TABLE public.items (id bigint PRIMARY KEY, val bigint NOT NULL, note text)")
        c.execute("INSERT INTO public.items SELECT g, 0, 'x' FROM generate_series(1, 1000) g")
    log_path = work / "follow-log"
    settings = Settings(
        log=LogConfig(url=str(log_path)),
        views=ViewsConfig(postgres_dsn=src),
        sources={"bf": PostgresSourceConfig(name="bf", dsn=src, tables=["public.items"])},
        base_dir=work,
    )
    cfg = work / "follow.toml"
    settings.save(cfg)
    capture = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from kappaflow.cli.capture import main; main(sys.argv[1:])",
            "--config",
            str(cfg),
            "bf",
        ],
        cwd=str(ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (log_path / "meta.db").exists() or not _has_topic(log_path, "bf.public.items"):
            if capture.poll() is not None:
                raise RuntimeError(
                    f"capture exited: {capture.stderr.read().decode()[-2000:] if capture.stderr else ''}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("capture did not create the topic in 120 s")
            time.sleep(0.2)
        catch = catch_up(spark, src, log_path, work, catchup_events) if catchup_events else {}

        class Items(Projection):
            name = "bench_items"
            sources = ["bf.public.items"]
            key = ["id"]

        rt = Runtime(spark, str(log_path), PostgresSink(src), checkpoint_dir=work / "ckpt")
        f = Follower(Items, rt, trigger="0.5s").start()
        try:
            deadline = time.monotonic() + 180
            while not _view_count(src) >= 1000:
                f.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("the follower did not load the snapshot in 180 s")
                time.sleep(0.1)
            pending: dict[int, float] = {}
            lat: list[float] = []
            lock = threading.Lock()
            stop = threading.Event()

            def poll() -> None:
                with psycopg.connect(src, autocommit=True) as c:
                    while not stop.is_set():
                        with lock:
                            want = dict(pending)
                        if want:
                            rows = c.execute(
                                "SELECT id, val FROM public.bench_items WHERE id = ANY(%s)", (list(want),)
                            ).fetchall()
                            now = time.monotonic()
                            with lock:
                                for i, v in rows:
                                    t0 = pending.get(i)
                                    if t0 is not None and v == _expected.get(i):
                                        lat.append(now - t0)
                                        del pending[i]
                        time.sleep(0.01)

            _expected: dict[int, int] = {}
            th = threading.Thread(target=poll, daemon=True)
            th.start()
            with psycopg.connect(src, autocommit=True) as c:
                for s in range(samples):
                    i = 1 + (s * 7) % 1000
                    with lock:
                        _expected[i] = s + 1
                    c.execute("UPDATE public.items SET val = %s WHERE id = %s", (s + 1, i))
                    with lock:
                        pending[i] = time.monotonic()
                    time.sleep(0.1)
            deadline = time.monotonic() + 60
            while True:
                with lock:
                    if not pending:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{len(pending)} updates never became visible")
                time.sleep(0.05)
            stop.set()
            th.join(5)
            return lat, catch
        finally:
            f.stop()
            rt.close()
    finally:
        capture.terminate()
        try:
            capture.wait(30)
        except subprocess.TimeoutExpired:
            capture.kill()


def _has_topic(path: Path, topic: str) -> bool:
    try:
        from kappaflow.log.embedded import EmbeddedLog

        lg = EmbeddedLog(path, read_only=True)
        try:
            return topic in lg.list_topics()
        finally:
            lg.close()
    except Exception:
        return False


def _view_count(dsn: str) -> int:
    import psycopg

    try:
        with psycopg.connect(dsn) as c:
            return int(c.execute("SELECT count(*) FROM public.bench_items").fetchone()[0])
    except psycopg.Error:
        return 0


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def cli_replay_wall(work: Path, log_path: Path, dsn: str, master: str) -> dict[str, float]:
    """Wall seconds of ``kappaflow replay`` per projection, each a fresh process (what a user waits for)."""
    (work / "kappaflow.toml").write_text(
        f'[log]\nurl = "{log_path}"\n[views]\npostgres_dsn = "{dsn}"\n'
        f'[spark]\nmaster = "{master}"\ncheckpoint_dir = "{work / "cli-ckpt"}"\n'
    )
    (work / "bench_cli_projections.py").write_text(
        "from replay import projections\nLatest, Grouped, Custom = projections('bench')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")])}
    out: dict[str, float] = {}
    for kind in ("Latest", "Grouped", "Custom"):
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "kappaflow.cli", "replay", f"bench_cli_projections:{kind}"],
            cwd=work, env=env, capture_output=True, text=True, check=False,
        )
        secs = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"kappaflow replay {kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        out[kind.lower()] = round(secs, 1)
        log(f"kappaflow replay bench_cli_projections:{kind}: {secs:.1f}s wall ({proc.stdout.strip()})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument(
        "--dsn",
        default=os.environ.get("KAPPAFLOW_BENCH_DSN"),
        help="a PostgreSQL server with wal_level=logical (default: a private one)",
    )
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--skip-follow", action="store_true")
    ap.add_argument("--catchup-events", type=int, default=200_000,
                    help="row changes of the follow catch-up backlog (0: skip the catch-up rates)")
    ap.add_argument("--skip-cli", action="store_true", help="skip timing `kappaflow replay` as a command")
    ap.add_argument("--skip-kafka", action="store_true", help="skip kafka_replay_events_per_s")
    ap.add_argument("--warmup-events", type=int, default=200_000,
                    help="events of the warm-up log replayed (unmeasured) before measuring; 0: no warm-up")
    args = ap.parse_args()

    from kappaflow.projections.replay import replay
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink

    work = Path(tempfile.mkdtemp(prefix="kappaflow-bench-replay-"))
    server = None
    try:
        dsn = args.dsn
        if not dsn:
            from kappaflow.testing.servers.postgres import PrivatePostgres

            server = PrivatePostgres(wal_level="logical").start()
            dsn = server.dsn()
        log_path = work / "log"
        t0 = time.perf_counter()
        gen = generate(log_path, args.events, args.keys)
        if args.warmup_events:
            generate(log_path.with_name("warm"), args.warmup_events, max(1, args.warmup_events // 10),
                     topic_source="warm")
        log(f"generated {gen} in {time.perf_counter() - t0:.1f}s")

        spark = spark_session(args.master)
        result: dict[str, Any] = {
            "events": gen["events"],
            "log_records": gen["records"],
            "keys": args.keys,
            "view_rows": gen["rows"],
            "cores": os.cpu_count(),
            "master": args.master,
        }
        # warm-up on a smaller log (JVM JIT of the JSON parser and codegen, Python workers and
        # their imports): part of start-up, not measured. A cold first replay is ~2-3x slower.
        if args.warmup_events:
            warm = Runtime(spark, str(log_path.with_name("warm")), PostgresSink(dsn))
            for _ in range(2):
                for p in projections("warm"):
                    replay(p, warm)
            warm.close()

        rt = Runtime(spark, str(log_path), PostgresSink(dsn), checkpoint_dir=work / "ckpt")
        latest, grouped, custom = projections("bench")
        for key, proj in (
            ("declarative_events_per_s", latest),
            ("grouped_events_per_s", grouped),
            ("custom_fold_events_per_s", custom),
        ):
            t = time.perf_counter()
            res = replay(proj, rt)
            secs = time.perf_counter() - t
            # change events, not log records: a delete's tombstone is not an event
            result[key] = round(gen["events"] / secs)
            result[key.replace("_events_per_s", "_seconds")] = round(secs, 3)
            log(
                f"{proj.name}: {res.rows} rows from {gen['events']} change events ({gen['records']} log records "
                f"with tombstones) in {secs:.2f}s -> {gen['events'] / secs:,.0f} events/s "
                f"(build {res.build_seconds:.2f}s)"
            )
        result["copy_baseline_rows_per_s"] = round(copy_baseline(dsn, latest.name))
        rt.close()
        if not args.skip_kafka:
            from kappaflow.log import kafka_client

            if kafka_client("confluent").installed:
                rate = kafka_replay(spark, log_path, log_path.with_name("warm"), dsn, work, gen["events"])
                result["kafka_replay_events_per_s"] = round(rate)
                result["kafka_replay_vs_declarative"] = round(rate / result["declarative_events_per_s"], 3)
        if not args.skip_follow:
            lat, catch = follow_latency(spark, dsn, work, args.samples, args.catchup_events)
            result.update(catch)
            result["follow_samples"] = len(lat)
            result["follow_latency_p50_s"] = round(percentile(lat, 0.5), 3)
            result["follow_latency_p99_s"] = round(percentile(lat, 0.99), 3)
        spark.stop()
        if not args.skip_cli:
            result["cli_replay_wall_s"] = cli_replay_wall(work, log_path, dsn, args.master)
        print(json.dumps(result))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
