"""Windows benchmark: an hourly tumbling-window view replayed into PostgreSQL, against the plain grouped view.

    .venv/bin/python bench/windows.py [--events 1000000] [--orders 100000] [--customers 20000] [--days 30]

Data (issue 18): `events` order change events over `orders` orders placed evenly over `days` days of
event time, 10% of them out of order by up to 2 hours and 1% a day late (beyond the allowed lateness);
the other events update one of the 50 newest orders (amount, status), keeping its event time.

- ``window_replay_events_per_s``: replay of hourly tumbling windows per customer (count + sum; delay 5
  minutes, allowed lateness 1 hour, late events dead-lettered): change events / the whole ``replay()``;
- ``grouped_events_per_s``: the plain grouped view (count + sum per customer) over the same log in the
  same run; ``window_vs_grouped`` the ratio of the two rates;
- ``late_events``, ``state_rows_after`` (contributions kept after the replay) and ``open_windows`` (view
  rows not final), ``state_rows_per_open_window`` their ratio;
- ``session_replay_events_per_s``: replay of 30-minute session windows per customer (count + sum; same
  delay, lateness and policy) over the same log, with ``sessions`` (view rows) and
  ``session_state_rows_after``.
Not measured here (yet): follow latency. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write(log_path: Path, events: int, orders: int, customers: int, days: int) -> int:
    from kappaflow.events import Column, FieldType, TableSchema
    from kappaflow.log.embedded import EmbeddedLog
    from kappaflow.projections.simulate import TableWriter

    schema = TableSchema("wb.public.orders", (
        Column("id", FieldType.INT64, optional=False), Column("customer_id", FieldType.INT64),
        Column("amount", FieldType.INT64), Column("status", FieldType.STRING),
        Column("created_at", FieldType.TIMESTAMPTZ)), ("id",))
    w = TableWriter(EmbeddedLog(log_path), schema, partitions=4)
    rnd = random.Random(18)
    t0 = datetime(2024, 1, 1, tzinfo=UTC)
    span = timedelta(days=days)
    created = 0
    for n in range(events):
        clock = t0 + span * (n / events)
        if created < orders and (created == 0 or rnd.random() < orders / events):
            created += 1
            t = clock
            r = rnd.random()
            if r < 0.10:
                t -= timedelta(minutes=rnd.randint(1, 120))
            elif r < 0.11:
                t -= timedelta(days=1)
            w.insert({"id": created, "customer_id": rnd.randint(1, customers), "amount": rnd.randint(1, 999),
                      "status": "new", "created_at": t})
        else:  # an update of one of the 50 newest orders (its event time is when it was placed)
            k = (rnd.randint(max(1, created - 49), created),)
            w.update(k, {"amount": rnd.randint(1, 999), "status": rnd.choice(["paid", "shipped"])})
        if len(w.pending) >= 20_000:
            w.flush()
    w.flush()
    return events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--orders", type=int, default=100_000)
    ap.add_argument("--customers", type=int, default=20_000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--dsn", default=os.environ.get("KAPPAFLOW_BENCH_DSN"),
                    help="a PostgreSQL server for the views (default: a private one)")
    args = ap.parse_args()

    import psycopg

    from kappaflow.projections import Count, Projection, Session, Sum, Tumbling
    from kappaflow.projections.engine import prepare
    from kappaflow.projections.folds.windowed import window_status
    from kappaflow.projections.replay import as_spec, replay
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink

    class HourlyPerCustomer(Projection):
        name = "bench_hourly_per_customer"
        sources = ["wb.public.orders"]
        key = ["customer_id"]
        window = Tumbling("created_at", size="1h", delay="5m", allowed_lateness="1h", late="dead_letter")
        aggregates = {"orders": Count(), "amount": Sum("amount")}

    class SessionsPerCustomer(Projection):
        name = "bench_sessions_per_customer"
        sources = ["wb.public.orders"]
        key = ["customer_id"]
        window = Session("created_at", gap="30m", delay="5m", allowed_lateness="1h", late="dead_letter")
        aggregates = {"orders": Count(), "amount": Sum("amount")}

    class PerCustomer(Projection):
        name = "bench_per_customer"
        sources = ["wb.public.orders"]
        key = ["customer_id"]
        aggregates = {"orders": Count(), "amount": Sum("amount")}

    work = Path(tempfile.mkdtemp(prefix="kappaflow-bench-windows-"))
    server = None
    try:
        dsn = args.dsn
        if not dsn:
            from kappaflow.testing.servers.postgres import PrivatePostgres

            server = PrivatePostgres().start()
            dsn = server.dsn()
        t = time.perf_counter()
        n = write(work / "log", args.events, min(args.orders, args.events), args.customers, args.days)
        log(f"generated {n} events in {time.perf_counter() - t:.1f}s")
        spark = spark_session(args.master)
        rt = Runtime(spark, str(work / "log"), PostgresSink(dsn), dsn=dsn, checkpoint_dir=work / "ckpt")
        result: dict[str, Any] = {"cores": os.cpu_count(), "master": args.master, "events": n,
                                  "note": "busy machine (other work running): indicative only"}
        replay(PerCustomer, rt)  # warm-up (Spark's first job, JIT)
        t = time.perf_counter()
        replay(PerCustomer, rt)
        secs = time.perf_counter() - t
        result["grouped_events_per_s"] = round(n / secs)
        log(f"grouped: {secs:.1f}s")
        t = time.perf_counter()
        res = replay(HourlyPerCustomer, rt)
        secs = time.perf_counter() - t
        result["window_replay_events_per_s"] = round(n / secs)
        result["window_vs_grouped"] = round(result["window_replay_events_per_s"] / result["grouped_events_per_s"], 3)
        log(f"windows: {res.rows} rows in {secs:.1f}s")
        spec = as_spec(HourlyPerCustomer)
        view = prepare(spec, rt).view
        status = window_status(rt.sink, rt.sink.live(view))
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                f'SELECT count(*) FILTER (WHERE NOT final), count(*) FROM public."{view.name}"'
            ).fetchone()
        open_windows, windows = (int(row[0]), int(row[1])) if row else (0, 0)
        result.update(late_events=status["late_events"], windows=windows, open_windows=open_windows,
                      state_rows_after=status["state_rows"],
                      state_rows_per_open_window=round(status["state_rows"] / max(open_windows, 1), 2))
        t = time.perf_counter()
        res = replay(SessionsPerCustomer, rt)
        secs = time.perf_counter() - t
        result["session_replay_events_per_s"] = round(n / secs)
        log(f"sessions: {res.rows} rows in {secs:.1f}s")
        sview = prepare(as_spec(SessionsPerCustomer), rt).view
        result.update(sessions=res.rows,
                      session_state_rows_after=window_status(rt.sink, rt.sink.live(sview))["state_rows"])
        rt.close()
        print(json.dumps(result))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
