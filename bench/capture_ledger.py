"""Benchmark: ledger -> embedded log, through the connector (snapshot and streaming) and the relay.

On a private PostgreSQL (wal_level=logical) with the ledger installed:

* ``snapshot_events_per_s``: ``LedgerConnector`` reading N existing events (snapshot) into
  an empty embedded log;
* ``streaming_events_per_s``: the same connector streaming N events appended after its slot
  was created (the backlog is drained with ``until_caught_up``);
* ``relay_events_per_s``: ``LedgerRelay`` (the no-logical-WAL fallback) writing the same N
  events into another embedded log;
* ``*_cpu_us_per_event``: CPU time of the capturing process per event (decoding, mapping,
  writing; the PostgreSQL server's share is not included) — steadier than rates on a busy machine.

Events go to 8 streams of 2 stream types, appended in batches of 1,000.
Usage: ``python bench/capture_ledger.py [--events 100000]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kappaflow.config import LedgerSourceConfig
from kappaflow.connectors.ledger import LedgerConnector
from kappaflow.ledger import Ledger, LedgerRelay, NewEvent, install
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.testing.servers.postgres import PrivatePostgres


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fill(ledger: Ledger, n: int, start: int = 0) -> None:
    for b in range(start // 1000, (start + n) // 1000):
        stream = f"{'account' if b % 2 else 'order'}-{b % 8}"
        ledger.append(stream, [NewEvent("Recorded", {"seq": b * 1000 + i, "amount": i * 3, "note": "x" * (i % 40)})
                               for i in range(1000)])


def capture(cfg: LedgerSourceConfig, log_dir: Path) -> tuple[float, int, float]:
    """(seconds, events, CPU seconds of this process: decoding, mapping and writing)."""
    with EmbeddedLog(log_dir) as lg:
        t0, c0 = time.perf_counter(), time.process_time()
        s = LedgerConnector(cfg, lg, partitions=4, progress=False).run(until_caught_up=True)
        return time.perf_counter() - t0, s.events, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    args = ap.parse_args()
    n = max(1000, args.events // 1000 * 1000)
    tmp = Path(tempfile.mkdtemp(prefix="kf-bench-ledger-"))
    pg = PrivatePostgres(settings={"max_wal_size": "4GB"}).start()
    try:
        dsn = pg.create_database("bench")
        install(dsn)
        with Ledger(dsn) as ledger:
            log(f"appending {n:,} events")
            fill(ledger, n)
            snap_cfg = LedgerSourceConfig(name="snap", dsn=dsn)
            secs, events, cpu = capture(snap_cfg, tmp / "snap")
            assert events == n, events
            snapshot_rate, snapshot_cpu = n / secs, cpu / n * 1e6
            log(f"snapshot: {snapshot_rate:,.0f} events/s, {snapshot_cpu:.1f} µs CPU per event")

            stream_cfg = LedgerSourceConfig(name="stream", dsn=dsn, snapshot_mode="never")
            capture(stream_cfg, tmp / "stream")  # creates the slot at the current end
            fill(ledger, n, start=n)
            secs, events, cpu = capture(stream_cfg, tmp / "stream")
            assert events == n, events
            streaming_rate, streaming_cpu = n / secs, cpu / n * 1e6
            log(f"streaming: {streaming_rate:,.0f} events/s, {streaming_cpu:.1f} µs CPU per event")

            with EmbeddedLog(tmp / "relay") as lg:
                relay = LedgerRelay(ledger, lg, "relay", partitions=4, batch=5000)
                t0, c0 = time.perf_counter(), time.process_time()
                moved = 0
                while (k := relay.run_once()):
                    moved += k
                relay_rate = moved / (time.perf_counter() - t0)
                relay_cpu = (time.process_time() - c0) / moved * 1e6
            log(f"relay: {relay_rate:,.0f} events/s, {relay_cpu:.1f} µs CPU per event ({moved:,} events)")
    finally:
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"events": n, "snapshot_events_per_s": round(snapshot_rate),
                      "streaming_events_per_s": round(streaming_rate), "relay_events_per_s": round(relay_rate),
                      "snapshot_cpu_us_per_event": round(snapshot_cpu, 1),
                      "streaming_cpu_us_per_event": round(streaming_cpu, 1),
                      "relay_cpu_us_per_event": round(relay_cpu, 1)}))


if __name__ == "__main__":
    main()
