"""The floor for bank transfers on this machine (not product code): the ledger's workload, stripped.

It sized a lock-free redesign of the ledger (built on branch ``lockfree``, not adopted: on this
2-core machine it measured 0.8-0.9x the current design, see the README) and is the baseline
``bench/ledger.py`` measures the ledger against in the same run: the same machine and workload
(8 writer processes, 1,000 accounts, durable server: fsync on, synchronous_commit on):

- positions from a sequence and each event's transaction id (``xid8``): a tailing reader would
  read only below ``pg_snapshot_xmin(pg_current_snapshot())``, which is gap-safe without
  commit-ordered positions;
- one round trip per append: a PL/pgSQL function bumps both stream versions (in stream-id order,
  so two opposite transfers cannot deadlock; the debit with its expected version), inserts both
  events and the idempotency row, and commits durably (PostgreSQL's group commit shares fsyncs);
- the same client loop as the bank: read the source account's unseen events, check funds, append.

Not modelled: the hash chain and its sealer, gap-safe ordering, typed events, metadata, stream
types, contiguous position blocks. So it is a floor no ledger with those guarantees can beat here.

    .venv/bin/python bench/ledger_lockfree_probe.py [--writers 8] [--accounts 1000] [--seconds 8]

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

DDL = """
DROP TABLE IF EXISTS p_events, p_streams, p_idem CASCADE;
CREATE TABLE p_streams (id text PRIMARY KEY, version int NOT NULL);
CREATE TABLE p_events (
    position bigserial PRIMARY KEY, stream_id text NOT NULL, version int NOT NULL, type text NOT NULL,
    data text NOT NULL, xid xid8 NOT NULL DEFAULT pg_current_xact_id(), UNIQUE (stream_id, version));
CREATE TABLE p_idem (key text PRIMARY KEY, position bigint NOT NULL);
CREATE OR REPLACE FUNCTION p_transfer(a text, b text, exp_a int, da text, db text, k text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE va int; vb int; pos bigint;
BEGIN
  IF a < b THEN
    UPDATE p_streams SET version = version + 1 WHERE id = a AND version = exp_a RETURNING version INTO va;
    IF va IS NULL THEN RAISE EXCEPTION 'conflict'; END IF;
    UPDATE p_streams SET version = version + 1 WHERE id = b RETURNING version INTO vb;
  ELSE
    UPDATE p_streams SET version = version + 1 WHERE id = b RETURNING version INTO vb;
    UPDATE p_streams SET version = version + 1 WHERE id = a AND version = exp_a RETURNING version INTO va;
    IF va IS NULL THEN RAISE EXCEPTION 'conflict'; END IF;
  END IF;
  WITH ins AS (INSERT INTO p_events (stream_id, version, type, data)
               VALUES (a, va, 'TransferSent', da), (b, vb, 'TransferReceived', db) RETURNING position)
  SELECT max(position) INTO pos FROM ins;
  INSERT INTO p_idem VALUES (k, pos);
  RETURN pos;
END $$;
"""


def writer(dsn: str, seed: int, accounts: int, seconds: float, ready: Any, go: Any, out: Any, finish: Any) -> None:
    import orjson
    import psycopg

    rnd = random.Random(seed)
    cache: dict[str, tuple[int, int]] = {}
    read = "SELECT version, data FROM p_events WHERE stream_id = %s AND version > %s ORDER BY version"
    append = "SELECT p_transfer(%s, %s, %s, %s, %s, %s)"
    done = conflicts = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        ready.put(seed)
        go.wait()
        cpu0 = time.process_time()
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            a, b = (f"acc-{i}" for i in rnd.sample(range(accounts), 2))
            amount = rnd.randint(1, 10)
            while True:
                version, balance = cache.get(a, (0, 1000))
                for v, data in conn.execute(read, (a, version), prepare=True).fetchall():
                    d = orjson.loads(data)
                    balance += d["amount"] if d["in"] else -d["amount"]
                    version = v
                cache[a] = (version, balance)
                if balance < amount:
                    break  # refused on the current state
                tid = uuid.uuid4().hex
                try:
                    conn.execute(append, (a, b, version,
                                          orjson.dumps({"amount": amount, "in": False, "transfer": tid}).decode(),
                                          orjson.dumps({"amount": amount, "in": True, "transfer": tid}).decode(),
                                          tid), prepare=True)
                    done += 1
                    break
                except psycopg.errors.RaiseException:
                    conflicts += 1  # someone appended to the account meanwhile: catch up, decide again
        out.put((done, conflicts, time.process_time() - cpu0))
        finish.wait(600)  # keep the connection (and its server process's CPU count) until measured


def run(dsn: str, writers: int, accounts: int, seconds: float,
        server_cpu: Callable[[str], float] | None = None) -> dict[str, Any]:
    """The probe's workload on `dsn` (its own ``p_*`` tables): the floor for bench/ledger.py.

    `server_cpu(dsn)`: the server's CPU seconds so far (bench/ledger.py's ``server_cpu_seconds``);
    read before the start and before the writers disconnect, so ``server_cpu_ms_per_transfer``
    is measured exactly as the ledger's ``transfer_cpu_ms_server`` is."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute("INSERT INTO p_streams SELECT 'acc-' || g, 0 FROM generate_series(0, %s) g", (accounts - 1,))
        durable = {k: str(conn.execute(f"SHOW {k}").fetchone()[0])  # type: ignore[index]
                   for k in ("fsync", "synchronous_commit")}
    ctx = mp.get_context("spawn")
    out, ready, go, finish = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=writer, args=(dsn, s, accounts, seconds, ready, go, out, finish))
             for s in range(writers)]
    for p in procs:
        p.start()
    for _ in procs:  # every writer has its connection open: start them at the same instant
        ready.get(timeout=120)
    cpu0 = server_cpu(dsn) if server_cpu is not None else 0.0
    go.set()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    server = server_cpu(dsn) - cpu0 if server_cpu is not None else None
    finish.set()
    for p in procs:
        p.join(timeout=30)
    done = sum(r[0] for r in results)
    return {
        "lockfree_transfers_per_s": round(done / seconds),
        "conflicts_retried": sum(r[1] for r in results),
        "client_cpu_ms_per_transfer": round(1000 * sum(r[2] for r in results) / max(done, 1), 3),
        "server_cpu_ms_per_transfer": None if server is None else round(1000 * server / max(done, 1), 3),
        "writers": writers, "accounts": accounts, "durable": durable,
        "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", help="an existing database (default: a private durable PostgreSQL)")
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--accounts", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    if args.writers < 1 or args.accounts < 2 or args.seconds <= 0:
        ap.error("expected --writers >= 1, --accounts >= 2, --seconds > 0")
    server = None
    dsn = args.dsn
    if dsn is None:
        from kappaflow.testing.servers.postgres import PrivatePostgres

        server = PrivatePostgres(wal_level="replica", durable=True, settings={"max_connections": "100"}).start()
        dsn = server.create_database("ledger_probe")
    try:
        print(json.dumps(run(dsn, args.writers, args.accounts, args.seconds)))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
