"""Many projections in one follow runtime: memory, catch-up rate, restart after kill -9.

    .venv/bin/python bench/follow_many.py [--catchup 10000] [--pending 2000] [--dsn postgresql://...]

Every figure comes from a real ``kappaflow follow`` process (the CLI, its own Spark driver JVM, Spark's
Python workers) against a PostgreSQL views database (a private one unless --dsn) and an embedded log
with three topics (orders, customers, products; 4 partitions each). ``bench_follow_many`` (a module
this script writes into its work folder) holds ten projections over the three topics: latest-row,
grouped and custom folds, three or four per topic.

- ``rss_mb_1``: resident memory of the whole process tree (the CLI's Python, the driver JVM, Python
  workers) following ``bench_follow_many:OrdersLatest`` alone, caught up and idle;
- ``rss_mb_10``: the same for ``follow --all`` (the ten projections in one runtime); ``rss_ratio``;
- ``idle_cpu_pct_1`` / ``idle_cpu_pct_10``: CPU of that tree while caught up and idle (percent of one
  core, over ``--idle-s`` seconds): what polling the log costs with nothing to do;
- ``catchup_changes_per_s``: `catchup` changes appended to the three topics while no runtime runs,
  then ``follow --all`` started: changes / seconds from the process start (Spark start-up included)
  until every view's stored positions reach the log end (``catchup_s``);
- ``restart_to_caught_up_s``: with the runtime caught up, `pending` more changes appended and the
  runtime killed with -9 at once (mid-batch); restarted: seconds from the restart until every view
  is caught up;
- ``read_once_s``: one Spark batch read of every record of the three topics (what one shared read
  per batch would cost), against ``catchup_s`` where every projection reads its own topic: the share
  of a catch-up that a shared read could save is at most ``reads_saved_share``.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

TOPICS = ("fm.public.orders", "fm.public.customers", "fm.public.products")
PROJECTIONS = '''
from typing import Any
from kappaflow.projections import Count, Event, Max, Projection, Sum

ORDERS, CUSTOMERS, PRODUCTS = "fm.public.orders", "fm.public.customers", "fm.public.products"


class OrdersLatest(Projection):
    name = "fm_orders"
    sources = [ORDERS]
    key = ["id"]


class CustomerTotals(Projection):
    name = "fm_customer_totals"
    sources = [ORDERS]
    key = ["customer_id"]
    where = "status <> 'cancelled'"
    aggregates = {"n": Count(), "total": Sum("amount")}


class StatusCounts(Projection):
    name = "fm_status_counts"
    sources = [ORDERS]
    key = ["status"]
    aggregates = {"n": Count(), "total": Sum("amount")}


class OrderChanges(Projection):
    name = "fm_order_changes"
    sources = [ORDERS]
    key = ["id"]
    schema = "id bigint, changes bigint"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        if event.op == "d":
            return None
        return {"changes": (row["changes"] if row else 0) + 1}


class CustomersLatest(Projection):
    name = "fm_customers"
    sources = [CUSTOMERS]
    key = ["id"]


class CityCounts(Projection):
    name = "fm_city_counts"
    sources = [CUSTOMERS]
    key = ["city"]
    aggregates = {"n": Count()}


class CustomerNames(Projection):
    name = "fm_customer_names"
    sources = [CUSTOMERS]
    key = ["id"]
    columns = ["id", "name"]
    derive = {"upper_name": "upper(name)"}


class ProductsLatest(Projection):
    name = "fm_products"
    sources = [PRODUCTS]
    key = ["id"]


class CategoryPrices(Projection):
    name = "fm_category_prices"
    sources = [PRODUCTS]
    key = ["category"]
    aggregates = {"n": Count(), "top": Max("price")}


class ProductChanges(Projection):
    name = "fm_product_changes"
    sources = [PRODUCTS]
    key = ["id"]
    schema = "id bigint, changes bigint"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        if event.op == "d":
            return None
        return {"changes": (row["changes"] if row else 0) + 1}
'''
NAMES = {"fm_orders": 0, "fm_customer_totals": 0, "fm_status_counts": 0, "fm_order_changes": 0,
         "fm_customers": 1, "fm_city_counts": 1, "fm_customer_names": 1,
         "fm_products": 2, "fm_category_prices": 2, "fm_product_changes": 2}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Data:
    def __init__(self, log_path: Path) -> None:
        from kappaflow.events import Column, FieldType, TableSchema
        from kappaflow.log.embedded import EmbeddedLog
        from kappaflow.projections.simulate import TableWriter

        i64, s = FieldType.INT64, FieldType.STRING
        dec = {"scale": 2, "precision": 12}
        self.log = EmbeddedLog(log_path)
        self.w = [
            TableWriter(self.log, TableSchema(TOPICS[0], (
                Column("id", i64, optional=False), Column("customer_id", i64),
                Column("amount", FieldType.DECIMAL, **dec), Column("status", s)), ("id",)), partitions=4),
            TableWriter(self.log, TableSchema(TOPICS[1], (
                Column("id", i64, optional=False), Column("name", s), Column("city", s)), ("id",)), partitions=4),
            TableWriter(self.log, TableSchema(TOPICS[2], (
                Column("id", i64, optional=False), Column("name", s), Column("category", s),
                Column("price", FieldType.DECIMAL, **dec)), ("id",)), partitions=4),
        ]
        self.rnd = random.Random(16)

    def changes(self, n: int) -> None:
        """`n` changes: 60% orders, 25% customers, 15% products (upserts over bounded key ranges)."""
        r = self.rnd
        for _ in range(n):
            x = r.random()
            if x < 0.6:
                self.w[0].upsert({"id": r.randint(1, 20_000), "customer_id": r.randint(1, 2_000),
                                  "amount": Decimal(r.randint(1, 99_999)) / 100,
                                  "status": r.choice(["new", "paid", "shipped", "cancelled"])})
            elif x < 0.85:
                self.w[1].upsert({"id": r.randint(1, 2_000), "name": f"c{r.randint(1, 10**6)}",
                                  "city": r.choice(["Oslo", "Lyon", "Graz", "Turku", "Porto"])})
            else:
                self.w[2].upsert({"id": r.randint(1, 500), "name": f"p{r.randint(1, 10**6)}",
                                  "category": r.choice(["a", "b", "c", "d"]),
                                  "price": Decimal(r.randint(1, 99_999)) / 100})
        for w in self.w:
            w.flush()

    def ends(self) -> list[dict[int, int]]:
        return [dict(self.log.end_offsets(t)) for t in TOPICS]


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_mb(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def cpu_s(pid: int) -> float:
    tck = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in tree(pid):
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])  # with reaped children (workers)
        except (OSError, IndexError, ValueError):
            pass
    return total / tck


class Bench:
    def __init__(self, work: Path, dsn: str, data: Data, trigger: str) -> None:
        self.work, self.dsn, self.data, self.trigger = work, dsn, data, trigger
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *targets: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": f"{self.work}:{ROOT}", "PYSPARK_PYTHON": sys.executable}
        err = (self.work / "follow.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kappaflow.cli", "follow", *targets, "--trigger", self.trigger],
            cwd=self.work, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        return self.proc

    def stop(self, sig: int = signal.SIGTERM) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        # the driver JVM is this process's child: wait for the whole group to be gone
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)

    def caught_up(self, names: list[str]) -> bool:
        import psycopg

        ends = self.data.ends()
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(
                "SELECT projection, topic, partition, next_offset FROM kappaflow.projection_positions "
                "WHERE target = 'live' AND projection = ANY(%s)", (names,)).fetchall()
        pos = {(p, t, part): o for p, t, part, o in rows}
        for name in names:
            i = NAMES[name]
            if any(pos.get((name, TOPICS[i], part), 0) < e for part, e in ends[i].items()):
                return False
        return True

    def wait_caught_up(self, names: list[str], timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"the follow process exited ({self.proc.returncode}); see {self.work}/follow.log")
            try:
                if self.caught_up(names):
                    return time.monotonic() - t0
            except Exception:  # positions table not created yet
                pass
            time.sleep(0.2)
        tail = "\n".join((self.work / "follow.log").read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"not caught up after {timeout}s; the runtime's log ends with:\n{tail}")

    def idle(self, seconds: float) -> tuple[float, float]:
        """(RSS MB, CPU % of one core) of the caught-up runtime over `seconds`."""
        assert self.proc is not None
        time.sleep(3)  # let the last batch's workers settle
        c0, t0 = cpu_s(self.proc.pid), time.monotonic()
        time.sleep(seconds)
        cpu = (cpu_s(self.proc.pid) - c0) / (time.monotonic() - t0) * 100
        return rss_mb(self.proc.pid), cpu


def read_once_s(work: Path, dsn: str) -> float:
    """One Spark batch read of all three topics (records counted), in a session of this process."""
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink

    spark = spark_session("local[2]", conf={"spark.ui.enabled": "false"})
    rt = Runtime(spark, str(work / "log"), PostgresSink(dsn), dsn=dsn)
    try:
        for t in TOPICS:
            rt.raw(t).count()  # warm-up (planning, workers)
        t0 = time.monotonic()
        for t in TOPICS:
            rt.raw(t).count()
        return time.monotonic() - t0
    finally:
        rt.close()
        spark.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--initial", type=int, default=1_000, help="changes in the log before the first runtime starts")
    ap.add_argument("--catchup", type=int, default=10_000, help="changes appended while no runtime runs")
    ap.add_argument("--pending", type=int, default=2_000, help="changes pending at the kill -9")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--trigger", default="0.5s")
    ap.add_argument("--dsn", help="views database (default: a private PostgreSQL)")
    ap.add_argument("--timeout", type=float, default=1200.0)
    args = ap.parse_args()

    from kappaflow.config import FollowConfig, LogConfig, Settings, SparkConfig, ViewsConfig

    work = Path(tempfile.mkdtemp(prefix="kf-follow-many-"))
    server = None
    try:
        dsn = args.dsn
        if not dsn:
            from kappaflow.testing.servers.postgres import PrivatePostgres

            server = PrivatePostgres().start()
            dsn = server.create_database("follow_many")
        (work / "bench_follow_many.py").write_text(PROJECTIONS)
        Settings(log=LogConfig(url=str(work / "log")), base_dir=work, views=ViewsConfig(postgres_dsn=dsn),
                 spark=SparkConfig(master="local[2]", conf={"spark.ui.enabled": "false"}),
                 follow=FollowConfig(projections=["bench_follow_many"])).save(work / "kappaflow.toml")
        data = Data(work / "log")
        data.changes(args.initial)
        b = Bench(work, dsn, data, args.trigger)
        out: dict[str, Any] = {"load_average_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
                               "initial": args.initial, "catchup": args.catchup, "pending": args.pending,
                               "trigger": args.trigger}

        try:
            log("one projection: start, catch up, idle")
            b.start("bench_follow_many:OrdersLatest")
            out["start_to_caught_up_1_s"] = round(b.wait_caught_up(["fm_orders"], args.timeout), 1)
            rss, cpu = b.idle(args.idle_s)
            out["rss_mb_1"], out["idle_cpu_pct_1"] = round(rss), round(cpu, 1)
            b.stop()

            log("ten projections: start, catch up, idle")
            b.start("--all")
            out["start_to_caught_up_10_s"] = round(b.wait_caught_up(list(NAMES), args.timeout), 1)
            rss, cpu = b.idle(args.idle_s)
            out["rss_mb_10"], out["idle_cpu_pct_10"] = round(rss), round(cpu, 1)
            out["rss_ratio"] = round(out["rss_mb_10"] / out["rss_mb_1"], 2)
            b.stop()

            log(f"catch-up: {args.catchup} changes appended while stopped")
            ends_before = data.ends()
            data.changes(args.catchup)
            caught = [sum(a.values()) - sum(b.values()) for a, b in zip(data.ends(), ends_before, strict=True)]
            t0 = time.monotonic()
            b.start("--all")
            b.wait_caught_up(list(NAMES), args.timeout)
            secs = time.monotonic() - t0
            out["catchup_s"] = round(secs, 1)
            out["catchup_changes_per_s"] = round(args.catchup / secs)

            log(f"restart: {args.pending} changes pending, kill -9, restart")
            data.changes(args.pending)
            time.sleep(1.0)  # the runtime has started on them: the kill lands mid-batch
            b.stop(signal.SIGKILL)
            t0 = time.monotonic()
            b.start("--all")
            b.wait_caught_up(list(NAMES), args.timeout)
            out["restart_to_caught_up_s"] = round(time.monotonic() - t0, 1)
            b.stop()

            log("one shared read of the three topics")
            total = sum(sum(e.values()) for e in data.ends())
            out["log_records"] = total
            out["read_once_s"] = round(read_once_s(work, dsn), 2)
            # the catch-up read each topic's records once per projection on it (4, 3 and 3 projections);
            # a shared read would have read them once: the records read twice or more, at read_once_s's rate
            readers = [list(NAMES.values()).count(i) for i in range(len(TOPICS))]
            saved_s = out["read_once_s"] / total * sum(n * (r - 1) for n, r in zip(caught, readers, strict=True))
            out["reads_saved_s"] = round(saved_s, 2)
            out["reads_saved_share"] = round(min(1.0, saved_s / out["catchup_s"]), 3)
        except SystemExit as exc:  # a phase did not finish: the figures so far, and why
            b.stop(signal.SIGKILL)
            out["error"] = str(exc)
        print(json.dumps(out))
        if "error" in out:
            raise SystemExit(1)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
