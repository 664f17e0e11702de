"""Joins benchmark: lookups (many-to-one) replayed and followed into PostgreSQL.

    .venv/bin/python bench/joins.py [--order-changes 1000000] [--orders 200000] [--customers 100000]
                                    [--products 10000] [--catchup 200000] [--fanout 1000] [--samples 20]

Data (issue 15): order changes over `orders` orders, `customers` customers and `products` products,
with customer and product updates interleaved (5% and 0.5% of the order changes).

- ``join_replay_events_per_s``: replay of an OrderDocuments-shaped view (orders + customer name/city +
  product name/category: two lookups) into PostgreSQL: change events of all three topics / the
  whole ``replay()`` call; ``declarative_events_per_s``: a plain latest-row view of the same orders
  in the same run (order events / its replay); ``join_vs_declarative`` the ratio of the two rates;
- ``join_catchup_changes_per_s``: `catchup` changes on both sides (orders moved, customers renamed,
  products recategorised) appended while the follower is stopped, then the follower started:
  changes / seconds from its start until its positions reach the log end;
- ``fanout_latency_p50_s`` / ``_p99_s``: a customer with `fanout` orders renamed (appended to the
  log; capture is not part of this figure) -> all of those view rows show the new name, with the
  follower running (trigger 0.5 s); `samples` renames, one after the other.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def schemas(source: str) -> dict[str, Any]:
    from kappaflow.events import Column, FieldType, TableSchema

    t = f"{source}.public."
    return {
        "customers": TableSchema(t + "customers", (
            Column("id", FieldType.INT64, optional=False), Column("name", FieldType.STRING),
            Column("city", FieldType.STRING)), ("id",)),
        "products": TableSchema(t + "products", (
            Column("id", FieldType.INT64, optional=False), Column("name", FieldType.STRING),
            Column("category", FieldType.STRING)), ("id",)),
        "orders": TableSchema(t + "orders", (
            Column("id", FieldType.INT64, optional=False), Column("customer_id", FieldType.INT64),
            Column("product_id", FieldType.INT64), Column("amount", FieldType.DECIMAL, scale=2, precision=12),
            Column("status", FieldType.STRING)), ("id",)),
    }


class Data:
    """The three tables written to the log (TableWriter keeps their current rows)."""

    def __init__(self, log_path: Path, source: str = "jb") -> None:
        from kappaflow.log.embedded import EmbeddedLog
        from kappaflow.projections.simulate import TableWriter

        self.log = EmbeddedLog(log_path)
        self.w = {n: TableWriter(self.log, s, partitions=4) for n, s in schemas(source).items()}
        self.rnd = random.Random(15)
        self.events = {n: 0 for n in self.w}
        self.step = 0

    def flush(self) -> None:
        for w in self.w.values():
            w.flush()

    def put(self, table: str, row: dict[str, Any]) -> None:
        self.w[table].upsert(row)
        self.events[table] += 1
        if sum(len(w.pending) for w in self.w.values()) >= 20_000:
            self.flush()

    def customer(self, i: int) -> None:
        self.step += 1
        self.put("customers", {"id": i, "name": f"customer {i}.{self.step}", "city": f"city {self.step % 97}"})

    def product(self, i: int) -> None:
        self.step += 1
        self.put("products", {"id": i, "name": f"product {i}", "category": f"cat {self.rnd.randint(1, 50)}"})

    def order(self, i: int, customers: int, products: int, customer: int | None = None) -> None:
        self.put("orders", {
            "id": i, "customer_id": customer or self.rnd.randint(1, customers),
            "product_id": self.rnd.randint(1, products), "amount": Decimal(self.rnd.randint(100, 99999)) / 100,
            "status": self.rnd.choice(["new", "paid", "shipped"]),
        })


def projections(source: str) -> tuple[type, type]:
    from kappaflow.projections import Lookup, Projection

    t = f"{source}.public."

    class OrderDocuments(Projection):
        name = "bench_order_documents"
        sources = [t + "orders"]
        key = ["id"]
        lookups = [
            Lookup("customer", t + "customers", on={"customer_id": "id"}, columns=["name", "city"]),
            Lookup("product", t + "products", on={"product_id": "id"}, columns=["name", "category"]),
        ]

    class Orders(Projection):
        name = "bench_orders_plain"
        sources = [t + "orders"]
        key = ["id"]

    return OrderDocuments, Orders


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--order-changes", type=int, default=1_000_000)
    ap.add_argument("--orders", type=int, default=200_000)
    ap.add_argument("--customers", type=int, default=100_000)
    ap.add_argument("--products", type=int, default=10_000)
    ap.add_argument("--catchup", type=int, default=200_000)
    ap.add_argument("--fanout", type=int, default=1_000)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--dsn", default=os.environ.get("KAPPAFLOW_BENCH_DSN"),
                    help="a PostgreSQL server for the views (default: a private one)")
    args = ap.parse_args()

    import psycopg

    from kappaflow.projections.engine import prepare
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.replay import as_spec, replay
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink

    work = Path(tempfile.mkdtemp(prefix="kappaflow-bench-joins-"))
    server = None
    try:
        dsn = args.dsn
        if not dsn:
            from kappaflow.testing.servers.postgres import PrivatePostgres

            server = PrivatePostgres().start()
            dsn = server.dsn()
        t0 = time.perf_counter()
        d = Data(work / "log")
        for c in range(1, args.customers + 1):
            d.customer(c)
        for p in range(1, args.products + 1):
            d.product(p)
        for n in range(args.order_changes):
            d.order(n % args.orders + 1 if n >= args.orders else n + 1, args.customers, args.products)
            if n % 20 == 0:
                d.customer(d.rnd.randint(1, args.customers))
            if n % 200 == 0:
                d.product(d.rnd.randint(1, args.products))
        d.flush()
        generated = dict(d.events)
        log(f"generated {generated} in {time.perf_counter() - t0:.1f}s")

        spark = spark_session(args.master)
        rt = Runtime(spark, str(work / "log"), PostgresSink(dsn), dsn=dsn, checkpoint_dir=work / "ckpt")
        docs, plain = projections("jb")
        result: dict[str, Any] = {"cores": os.cpu_count(), "master": args.master, "events": generated}
        all_events = sum(generated.values())
        t = time.perf_counter()
        res = replay(plain, rt)
        secs = time.perf_counter() - t
        result["declarative_events_per_s"] = round(generated["orders"] / secs)
        log(f"plain view: {res.rows} rows in {secs:.1f}s")
        t = time.perf_counter()
        res = replay(docs, rt)
        secs = time.perf_counter() - t
        result["join_replay_events_per_s"] = round(all_events / secs)
        ratio = result["join_replay_events_per_s"] / result["declarative_events_per_s"]
        result["join_vs_declarative"] = round(ratio, 3)
        log(f"joined view: {res.rows} rows in {secs:.1f}s")

        # catch-up: changes on both sides appended while nothing follows
        for n in range(args.catchup):
            r = n % 10
            if r < 6:
                d.order(d.rnd.randint(1, args.orders), args.customers, args.products)
            elif r < 9:
                d.customer(d.rnd.randint(1, args.customers))
            else:
                d.product(d.rnd.randint(1, args.products))
        d.flush()
        f = Follower(docs, rt, trigger="0.5s", max_records_per_batch=200_000)
        t = time.perf_counter()
        f.start()
        if not f.wait_for(lambda s: f.caught_up(), 3600):
            raise SystemExit("the follower did not catch up within an hour")
        secs = time.perf_counter() - t
        result["join_catchup_changes_per_s"] = round(args.catchup / secs)
        log(f"catch-up: {args.catchup} changes in {secs:.1f}s ({f.stats.batches} batches)")

        # fan-out: one customer with `fanout` orders, renamed `samples` times
        hub = args.customers + 1
        d.customer(hub)
        first = args.orders + 1
        for i in range(first, first + args.fanout):
            d.order(i, args.customers, args.products, customer=hub)
        d.flush()
        view = prepare(as_spec(docs), rt).view.name
        latencies: list[float] = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            def count(name: str) -> int:
                row = conn.execute(
                    f'SELECT count(*) FROM public."{view}" WHERE customer_id = %s AND customer_name = %s', (hub, name)
                ).fetchone()
                return int(row[0]) if row else 0

            if not f.wait_for(lambda s: f.caught_up(), 600):
                raise SystemExit("the follower did not take the fan-out orders")
            for s in range(args.samples):
                name = f"renamed {s}"
                t = time.perf_counter()
                d.put("customers", {"id": hub, "name": name, "city": "Oslo"})
                d.flush()
                deadline = time.monotonic() + 120
                while count(name) < args.fanout:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"rename {s}: not all {args.fanout} rows changed within 120 s")
                    time.sleep(0.01)
                latencies.append(time.perf_counter() - t)
        f.stop()
        result["fanout_rows"] = args.fanout
        result["fanout_latency_p50_s"] = round(percentile(latencies, 0.5), 3)
        result["fanout_latency_p99_s"] = round(percentile(latencies, 0.99), 3)
        rt.close()
        print(json.dumps(result))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
