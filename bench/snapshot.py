"""Benchmark: an on-demand snapshot of a wide table while changes stream on other tables (issue 22).

On a private PostgreSQL: a table of ``--rows`` rows x 15 columns (ints, numerics, timestamps, text,
jsonb), two small tables taking ``--changes-per-s`` updates per second (transactions of 20 rows
every 10 ms) for the whole measurement, and a capture (``PostgresConnector`` into an embedded
log) that streams them. Then, while the load goes on, ``kappaflow snapshot`` of the wide table is
requested through the capture's request channel and timed from the request to the snapshot's end.

* ``copy_out_rows_per_s``: a plain ``COPY (SELECT <same columns> FROM wide) TO STDOUT`` of the same
  table in the same run (read and split into lines in Python, nothing decoded): the ceiling;
* ``snapshot_rows_per_s``: rows written to the log as ``op=r`` / seconds from the request to the
  snapshot's end (watermarks, chunk queries, window checks, encoding and durable appends included);
  ``snapshot_vs_copy`` is their ratio (goal >= 0.5);
* ``streaming_lag_p99_s`` / ``_p50_s``: for every streamed change of the small tables committed while
  the snapshot ran, log append time - source commit time (``source.ts_ms``), in seconds (goal p99 <= 2);
* ``changes_per_s``: the load actually achieved during the snapshot;
* ``snapshot_cpu_s``: CPU time of this process (capture, writer and load threads; the server's
  processes are not counted) from the request to the snapshot's end; ``streaming_cpu_per_s``: the
  same process's CPU per second in the 1.5 s before the request (streaming and load only);
  ``snapshot_cpu_us_per_row``: (snapshot_cpu_s - streaming_cpu_per_s x seconds) / rows, the
  snapshot's own CPU per row -- the figure to compare on a shared machine, where wall time is not.

Usage: ``python bench/snapshot.py [--rows 2000000] [--chunk-rows 20000]``; the last line printed is
one JSON object. Run it at full size on a quiet machine only (2 cores: everything here is co-located).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg

from kappaflow.config import PostgresSourceConfig, SnapshotMode
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.ondemand import FileChannel
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.testing.servers.postgres import PrivatePostgres

WIDE = """CREATE TABLE wide (
    id bigint PRIMARY KEY, a int, b int, c bigint, d numeric(12, 2), e numeric(18, 4), f double precision,
    g boolean, h timestamptz, i date, j text, k text, l varchar(64), m jsonb, n text)"""
FILL = ("INSERT INTO wide SELECT x, x %% 1000, x %% 7, x * 3, x * 1.25, x / 7.0, x / 3.0, x %% 2 = 0, "
        "now() - x * interval '1 second', current_date - (x %% 365)::int, 'name ' || x, md5(x::text), "
        "'code-' || (x %% 9999), jsonb_build_object('k', x, 'tag', 'abc'), repeat('z', 20) "
        "FROM generate_series(%s::bigint, %s::bigint) x")
COLS = "id, a, b, c, d, e, f, g, h, i, j, k, l, m, n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Load(threading.Thread):
    """``rate`` row updates per second on the small tables, in transactions of 20 rows every 10 ms."""

    def __init__(self, dsn: str, rate: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rate = dsn, rate
        self.halt = threading.Event()
        self.changes = 0

    def run(self) -> None:
        per_tx = 20
        interval = per_tx / self.rate
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            nxt = time.monotonic()
            i = 0
            while not self.halt.is_set():
                table = ("s1", "s2")[i % 2]
                lo = (i * per_tx) % 1000
                conn.execute(f"UPDATE {table} SET v = v + 1 WHERE id >= %s AND id < %s", (lo, lo + per_tx))
                self.changes += per_tx
                i += 1
                nxt += interval
                delay = nxt - time.monotonic()
                if delay > 0:
                    self.halt.wait(delay)


def copy_out(dsn: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    with psycopg.connect(dsn) as conn, conn.cursor() as cur, \
            cur.copy(f"COPY (SELECT {COLS} FROM wide) TO STDOUT") as copy:
        for data in copy:
            n += bytes(data).count(b"\n")
    return n, time.perf_counter() - t0


def lags(log_obj: EmbeddedLog, topics: list[str], start_ms: int, end_ms: int) -> list[float]:
    out = []
    for topic in topics:
        for p in range(log_obj.partitions(topic)):
            for rec in log_obj.iter_partition(topic, p):
                if rec.value is None:
                    continue
                doc = orjson.loads(rec.value)
                commit = doc["source"]["ts_ms"]
                if doc["op"] == "u" and start_ms <= commit <= end_ms and rec.timestamp_ms is not None:
                    out.append(max(0.0, (rec.timestamp_ms - commit) / 1000))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--chunk-rows", type=int, default=20_000)
    ap.add_argument("--changes-per-s", type=int, default=2000)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kf-bench-snapshot-"))
    pg = PrivatePostgres(settings={"max_wal_size": "8GB", "checkpoint_timeout": "30min"}).start()
    result: dict[str, Any] = {"rows": args.rows, "columns": 15, "chunk_rows": args.chunk_rows,
                              "target_changes_per_s": args.changes_per_s}
    try:
        dsn = pg.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(WIDE)
            for start in range(1, args.rows + 1, 100_000):
                conn.execute(FILL, (start, min(args.rows, start + 99_999)))
            for t in ("s1", "s2"):
                conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v int NOT NULL)")
                conn.execute(f"INSERT INTO {t} SELECT x, 0 FROM generate_series(0, 999) x")
            conn.execute("VACUUM ANALYZE")
        log(f"table filled: {args.rows} rows")
        n, secs = copy_out(dsn)
        assert n == args.rows, (n, args.rows)
        result["copy_out_rows_per_s"] = round(n / secs)
        log(f"COPY TO STDOUT: {result['copy_out_rows_per_s']} rows/s")
        cfg = PostgresSourceConfig(name="bench", dsn=dsn, tables=["public.wide", "public.s1", "public.s2"],
                                   snapshot_mode=SnapshotMode.NEVER, snapshot_chunk_rows=args.chunk_rows,
                                   heartbeat_interval_s=1.0)
        elog = EmbeddedLog(work / "log", compact_interval_s=None)
        connector = PostgresConnector(cfg, elog, partitions=4, progress=False)
        stop = StopSignal()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                connector.run(stop)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while connector.summary is None or connector.summary.phase != "streaming":
            if errors or time.monotonic() > deadline:
                raise RuntimeError(f"capture did not start streaming: {errors}")
            time.sleep(0.05)
        load = Load(dsn, args.changes_per_s)
        load.start()
        time.sleep(0.5)  # the load reaches its steady state before the snapshot starts (pacing, not sync)
        cpu_w, t_w = time.process_time(), time.perf_counter()
        time.sleep(1.5)  # meanwhile: the CPU the streaming and the load take without a snapshot
        streaming_cpu_per_s = (time.process_time() - cpu_w) / (time.perf_counter() - t_w)
        channel = FileChannel(work / "log")
        start_ms = int(time.time() * 1000)
        changes0 = load.changes
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        channel.submit("bench", "start", ["public.wide"])
        deadline = time.monotonic() + 3600
        while (connector.summary.ondemand or {}).get("state") != "done":
            if errors or time.monotonic() > deadline:
                raise RuntimeError(f"snapshot did not finish: {errors}")
            time.sleep(0.02)
        secs = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        end_ms = int(time.time() * 1000)
        changes = load.changes - changes0
        load.halt.set()
        load.join()
        time.sleep(1.0)  # let the stream drain the last updates before stopping (pacing, not sync)
        stop.set("bench done")
        thread.join(120)
        channel.close()
        if errors:
            raise errors[0]
        view = connector.summary.ondemand
        rows = view["rows"]
        result["snapshot_rows"] = rows
        result["snapshot_chunks"] = view["tables"]["public.wide"]["chunks"]
        result["snapshot_s"] = round(secs, 2)
        result["snapshot_rows_per_s"] = round(rows / secs)
        result["snapshot_vs_copy"] = round(result["snapshot_rows_per_s"] / result["copy_out_rows_per_s"], 3)
        result["changes_per_s"] = round(changes / secs)
        result["snapshot_cpu_s"] = round(cpu, 2)
        result["streaming_cpu_per_s"] = round(streaming_cpu_per_s, 3)
        result["snapshot_cpu_us_per_row"] = round(max(0.0, cpu - streaming_cpu_per_s * secs) / max(rows, 1) * 1e6, 2)
        lag = lags(elog, ["bench.public.s1", "bench.public.s2"], start_ms, end_ms)
        elog.close()
        if lag:
            lag.sort()
            result["streaming_lag_p50_s"] = round(statistics.median(lag), 3)
            result["streaming_lag_p99_s"] = round(lag[min(len(lag) - 1, int(len(lag) * 0.99))], 3)
            result["streaming_lag_max_s"] = round(lag[-1], 3)
        result["lag_samples"] = len(lag)
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
