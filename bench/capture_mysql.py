"""Benchmark: MySQL/MariaDB binlog capture into the embedded log vs. plain mysql-replication parsing.

Starts a private MariaDB (row binlog) and measures two cases, each on its own binlog range:

* narrow:    N row changes on a 7-column table (60% inserts, 30% updates, 10% deletes, 500 rows
             per transaction);
* realistic: a shop ``orders`` table (utf8mb4) with the column types real schemas carry -- ENUM,
             DECIMAL, DATETIME(6), TIMESTAMP(3), TEXT and a JSON document of a few hundred bytes
             (MariaDB: LONGTEXT with a ``json_valid`` check), non-ASCII text included -- written as
             1,000-row multi-row INSERTs, then 1,000-row multi-row UPDATEs (a full before and after
             image per row) and DELETEs.

For each case, in the same run:

* raw:     ``BinLogStreamReader`` over the same binlog range, touching every row's values
           (what any mysql-replication consumer has to pay) -- the baseline;
* capture: ``MySQLConnector`` from the same start position to the end, into a fresh
           embedded log (events encoded, keys partitioned, appended, offsets committed).

Usage: ``python bench/capture_mysql.py [--changes 500000] [--realistic-changes 300000] [--repeat 2]``.
The last line is one JSON object with ``changes_per_s`` / ``raw_parse_per_s`` (narrow) and
``realistic_changes_per_s`` / ``realistic_raw_parse_per_s`` (goal for both: capture >= 80% of raw),
wall-clock, best of the alternating runs; ``cpu_ratio`` / ``realistic_cpu_ratio`` (raw CPU / capture
CPU of this process, writer thread included) are the figures that load from other processes on a
shared machine does not distort.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _generate(server: object, db: str, changes: int) -> int:
    """The narrow case: 7 columns, 500 rows per transaction."""
    import pymysql

    conn = pymysql.connect(host=server.host, port=server.port, user="root", password="",  # type: ignore[attr-defined]
                           database=db, autocommit=False)
    n_ins = int(changes * 0.6)
    n_upd = int(changes * 0.3)
    n_del = changes - n_ins - n_upd
    per_txn = 500
    done = 0
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE orders (id INT PRIMARY KEY, customer INT NOT NULL, status VARCHAR(16) NOT NULL, "
                    "amount DECIMAL(12,2) NOT NULL, note VARCHAR(64), created DATETIME(6) NOT NULL, "
                    "updated TIMESTAMP(3) NULL)")
        conn.commit()
        for start in range(0, n_ins, per_txn):
            rows = [(i, i % 997, "new", f"{i % 10000}.{i % 100:02d}", f"order number {i}",
                     "2024-05-01 12:00:00.123456", "2024-05-01 12:00:00.5")
                    for i in range(start, min(n_ins, start + per_txn))]
            cur.executemany("INSERT INTO orders VALUES (%s,%s,%s,%s,%s,%s,%s)", rows)
            conn.commit()
            done += len(rows)
        for start in range(0, n_upd, per_txn):
            end = min(n_upd, start + per_txn)
            cur.execute("UPDATE orders SET status='paid', amount=amount+1 WHERE id >= %s AND id < %s", (start, end))
            conn.commit()
            done += end - start
        for start in range(0, n_del, per_txn):
            end = min(n_del, start + per_txn)
            lo = n_ins - n_del + start
            cur.execute("DELETE FROM orders WHERE id >= %s AND id < %s", (lo, lo + (end - start)))
            conn.commit()
            done += end - start
    conn.close()
    return done



_SHOP_ORDERS = (
    "CREATE TABLE orders (id INT PRIMARY KEY, customer_id INT NOT NULL, "
    "status ENUM('new','paid','shipped','delivered','cancelled') NOT NULL, amount DECIMAL(12,2) NOT NULL, "
    "currency CHAR(3) NOT NULL, note TEXT, payload JSON NOT NULL, created_at DATETIME(6) NOT NULL, "
    "updated_at TIMESTAMP(3) NULL) DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_unicode_ci")


def _payload(i: int) -> str:
    """A JSON document of ~350 bytes, different per row (what an order's line items look like)."""
    items = [{"sku": f"SKU-{(i * 7 + k) % 100000:06d}", "name": f"Product {(i + k) % 977} deluxe edition",
              "qty": 1 + (i + k) % 4, "price": f"{(i * 13 + k) % 500}.{(i + k) % 100:02d}"}
             for k in range(1 + i % 3)]
    shipping = {"method": "express" if i % 5 == 0 else "standard", "city": ("Zürich", "Kraków", "Malmö", "Lyon")[i % 4],
                "zip": f"{10000 + i % 89999}"}
    return json.dumps({"items": items, "shipping": shipping,
                       "tags": ["web", "promo"] if i % 2 else ["app"], "gift": i % 7 == 0}, ensure_ascii=False)


def _generate_realistic(server: object, db: str, changes: int, per_stmt: int = 1000) -> int:
    """The realistic case: the shop ``orders`` table, 1,000-row multi-row statements.

    40% inserts, 50% updates (status, amount, updated_at of 1,000 rows per statement; every
    row's JSON and TEXT travel in both images), 10% deletes.
    """
    import pymysql

    conn = pymysql.connect(host=server.host, port=server.port, user="root", password="",  # type: ignore[attr-defined]
                           database=db, autocommit=False)
    n_ins = int(changes * 0.4)
    n_upd = int(changes * 0.5)
    n_del = changes - n_ins - n_upd
    statuses = ("paid", "shipped", "delivered")
    done = 0
    with conn.cursor() as cur:
        cur.execute(_SHOP_ORDERS)
        conn.commit()
        for start in range(0, n_ins, per_stmt):
            rows = [(i, i % 4999, "new", f"{i % 100000}.{i % 100:02d}", "EUR",
                     f"Please leave the parcel with the neighbour at number {i % 200}; ring twice — merci, café ☕",
                     _payload(i), f"2024-05-01 12:{i % 60:02d}:{i % 60:02d}.{i % 1000000:06d}",
                     f"2024-05-01 12:00:00.{i % 1000:03d}")
                    for i in range(start, min(n_ins, start + per_stmt))]
            cur.executemany("INSERT INTO orders VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)", rows)  # one multi-row INSERT
            conn.commit()
            done += len(rows)
        updated = 0
        k = 0
        while updated < n_upd:
            lo = (k * per_stmt) % max(per_stmt, n_ins - per_stmt)
            cur.execute("UPDATE orders SET status=%s, amount=amount+1, updated_at=%s WHERE id >= %s AND id < %s",
                        (statuses[k % 3], f"2024-06-01 08:00:{k % 60:02d}.{k % 1000:03d}", lo, lo + per_stmt))
            conn.commit()
            updated += cur.rowcount
            k += 1
        done += updated
        deleted = 0
        lo = max(0, n_ins - n_del)
        while deleted < n_del:
            cur.execute("DELETE FROM orders WHERE id >= %s AND id < %s", (lo, lo + min(per_stmt, n_del - deleted)))
            conn.commit()
            deleted += cur.rowcount
            lo += per_stmt
        done += deleted
    conn.close()
    return done


def _case(server: object, work: Path, name: str, db: str, table: str, generate: Any, changes: int,
          repeat: int) -> dict[str, Any]:
    """Generate one case into ``db`` and measure raw parse vs capture over exactly its binlog range."""
    import pymysql
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

    from kappaflow.connectors.mysql.connector import MySQLConnector
    from kappaflow.connectors.mysql.offset import MySQLOffset
    from kappaflow.connectors.mysql.server import master_status
    from kappaflow.connectors.offsets import OffsetStore
    from kappaflow.log.embedded import EmbeddedLog

    host, port = server.host, server.port  # type: ignore[attr-defined]
    admin = pymysql.connect(host=host, port=port, user="root", password="", autocommit=True)
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {db}")
        start_file, start_pos = master_status(cur)
        cur.execute("SELECT @@GLOBAL.gtid_binlog_pos")
        start_gtid = cur.fetchone()[0]
    admin.close()
    t0 = time.perf_counter()
    done = generate(server, db, changes)
    gen_s = time.perf_counter() - t0

    def raw_parse() -> tuple[int, float, float]:
        """Baseline: plain mysql-replication, every row's values decoded."""
        t0, c0 = time.perf_counter(), time.process_time()
        reader = BinLogStreamReader(
            connection_settings={"host": host, "port": port, "user": "root", "password": ""},
            server_id=4242, resume_stream=True, log_file=start_file, log_pos=start_pos, blocking=False,
            only_schemas=[db], only_events=[WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent],
            enable_logging=False)
        rows = 0
        for ev in reader:
            for row in ev.rows:
                rows += 1
                _ = row.get("values") or row.get("after_values")
        reader.close()
        return rows, time.perf_counter() - t0, time.process_time() - c0

    def capture(run: int) -> tuple[int, int, float, float]:
        """kappaflow: the same binlog range captured into a fresh embedded log."""
        log = EmbeddedLog(work / f"{name}-log{run}")
        offset = MySQLOffset("mariadb", start_file, start_pos, start_gtid, phase="streaming")
        OffsetStore(log).save("bench", offset.to_dict())
        connector = MySQLConnector(name="bench", log=log, dsn=f"mysql://root@{host}:{port}/{db}",
                                   tables=[f"{db}.{table}"], snapshot_mode="never", partitions=4)
        t0, c0 = time.perf_counter(), time.process_time()
        summary = connector.run(until_caught_up=True)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        log.close()
        shutil.rmtree(work / f"{name}-log{run}", ignore_errors=True)
        return summary.events, summary.records, took, cpu

    # alternate the two, best of `repeat` each: the machine is shared and timings are noisy
    raws, caps = [], []
    for run in range(repeat):
        raws.append(raw_parse())
        caps.append(capture(run))
    raw_rows, raw_s, _ = min(raws, key=lambda r: r[1])
    events, records, cap_s, _ = min(caps, key=lambda r: r[2])
    raw_cpu = min(r[2] for r in raws)
    cap_cpu = min(c[3] for c in caps)
    return {
        "changes": done,
        "generate_s": round(gen_s, 2),
        "raw_rows": raw_rows,
        "raw_s": round(raw_s, 2),
        "raw_cpu_s": round(raw_cpu, 2),
        "capture_events": events,
        "capture_records": records,
        "capture_s": round(cap_s, 2),
        "capture_cpu_s": round(cap_cpu, 2),
        "cpu_ratio": round(raw_cpu / cap_cpu, 3),
        "ratio": round((events / cap_s) / (raw_rows / raw_s), 3) if raw_rows and events else None,
        "changes_per_s": round(events / cap_s) if cap_s else None,
        "raw_parse_per_s": round(raw_rows / raw_s) if raw_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=500_000, help="narrow case (0: skip it)")
    ap.add_argument("--realistic-changes", type=int, default=300_000, help="realistic case (0: skip it)")
    ap.add_argument("--repeat", type=int, default=2, help="alternating runs of each; the best is reported")
    opts = ap.parse_args()

    from kappaflow.testing.servers.mariadb import PrivateMariaDB

    work = Path(tempfile.mkdtemp(prefix="kf-bench-mysql-"))
    server = PrivateMariaDB(extra_args=["--max-binlog-size=1073741824"]).start()
    try:
        result: dict[str, Any] = {}
        # one case after the other: each reads exactly its own binlog range to the end
        if opts.changes:
            result.update(_case(server, work, "narrow", "bench", "orders", _generate, opts.changes, opts.repeat))
        if opts.realistic_changes:
            shop = _case(server, work, "realistic", "shop", "orders", _generate_realistic, opts.realistic_changes,
                         opts.repeat)
            result.update({f"realistic_{k}": v for k, v in shop.items()})
        result["load_avg_1m"] = round(os.getloadavg()[0], 2)
        print(json.dumps(result))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
