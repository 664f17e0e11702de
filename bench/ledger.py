"""Ledger benchmark: batched single-writer appends and bank transfers from concurrent writers.

    .venv/bin/python bench/ledger.py [--dsn URL] [--fast] [--writers 8] [--accounts 1000] [--seconds 10]

Without --dsn a private PostgreSQL is started from the machine's binaries, DURABLE by default
(fsync on, synchronous_commit on: every acknowledged append survives a power cut); --fast
turns both off (the test-suite setting) to show the cost of durability.
Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


def batched(dsn: str, batches: int, size: int) -> tuple[float, list[float]]:
    from kappaflow.ledger import Ledger, NewEvent

    payload = [NewEvent("Recorded", {"sensor": f"s-{i % 97}", "value": i * 0.5, "unit": "kWh", "seq": i})
               for i in range(size)]
    lat: list[float] = []
    with Ledger(dsn, pool_size=1) as ledger:
        for i in range(2):  # warm-up: connection, prepared statement, plan cache
            ledger.append(f"meter-warm{i}", payload)
        t0 = time.perf_counter()
        for i in range(batches):
            t = time.perf_counter()
            ledger.append(f"meter-{i % 50}", payload)
            lat.append((time.perf_counter() - t) * 1000)
        dt = time.perf_counter() - t0
    return batches * size / dt, lat


def single_latency(dsn: str, n: int) -> list[float]:
    from kappaflow.ledger import Ledger, NewEvent

    lat = []
    with Ledger(dsn, pool_size=1) as ledger:
        for i in range(n + 20):
            t = time.perf_counter()
            ledger.append(f"single-{i % 10}", [NewEvent("Pinged", {"i": i})])
            if i >= 20:
                lat.append((time.perf_counter() - t) * 1000)
    return lat


def seed_accounts(dsn: str, n: int) -> None:
    from examples.bank.events import AccountOpened, Deposited, registry, stream_id
    from kappaflow.ledger import ExpectedVersion, Ledger, StreamAppend

    with Ledger(dsn, registry=registry, pool_size=1) as ledger:
        for start in range(0, n, 100):
            ledger.append_many([StreamAppend(stream_id(str(a)), [AccountOpened(owner=f"o{a}"),
                                                                  Deposited(amount=10_000_000)],
                                             ExpectedVersion.NO_STREAM) for a in range(start, min(n, start + 100))])


def transfer_worker(dsn: str, seed: int, accounts: int, start_at: float, stop_at: float,
                    out: Any) -> None:
    from examples.bank.bank import Bank
    from examples.bank.events import registry
    from kappaflow.ledger import Ledger

    rnd = random.Random(seed)
    append_lat: list[float] = []
    transfer_lat: list[float] = []
    done = 0
    with Ledger(dsn, registry=registry, pool_size=1) as ledger:
        inner = ledger.append_many

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                append_lat.append((time.perf_counter() - t) * 1000)

        ledger.append_many = timed  # type: ignore[method-assign]
        bank = Bank(ledger)
        for a in range(accounts):  # warm the cache (initial full reads are not what we measure)
            bank.account(str(a))
        append_lat.clear()
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < stop_at:
            a, b = rnd.sample(range(accounts), 2)
            t = time.perf_counter()
            bank.transfer(str(a), str(b), rnd.randint(1, 100), transfer_id=uuid.uuid4().hex)
            transfer_lat.append((time.perf_counter() - t) * 1000)
            done += 1
    out.put({"done": done, "append_lat": append_lat, "transfer_lat": transfer_lat, "conflicts": bank.conflicts})


def transfers(dsn: str, writers: int, accounts: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # the warm-up (cache loading) takes a moment per writer; everyone starts at the same instant
    start_at = time.time() + 4.0 + accounts / 400
    stop_at = start_at + seconds
    procs = [ctx.Process(target=transfer_worker, args=(dsn, s, accounts, start_at, stop_at, q))
             for s in range(writers)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    if time.time() > stop_at + 60:
        raise RuntimeError("transfer writers overran")
    done = sum(r["done"] for r in results)
    append_lat = [x for r in results for x in r["append_lat"]]
    transfer_lat = [x for r in results for x in r["transfer_lat"]]
    return {"transfers": done, "transfers_per_s": done / seconds, "append_lat": append_lat,
            "transfer_lat": transfer_lat, "conflicts": sum(r["conflicts"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn")
    ap.add_argument("--fast", action="store_true", help="private server with fsync/synchronous_commit off")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--accounts", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()

    from kappaflow.ledger import Ledger, install

    server = None
    durable: bool | None = None
    if args.dsn:
        dsn = args.dsn
    else:
        from kappaflow.testing.servers.postgres import PrivatePostgres

        durable = not args.fast
        server = PrivatePostgres(wal_level="replica", durable=durable,
                                 settings={"max_connections": "100"}).start()
        dsn = server.create_database("bench_ledger")
    try:
        install(dsn)
        import psycopg

        with psycopg.connect(dsn) as conn:
            settings = {k: conn.execute(f"show {k}").fetchone()[0]  # type: ignore[index]
                        for k in ("fsync", "synchronous_commit", "server_version")}
        rate, batch_lat = batched(dsn, args.batches, args.batch_size)
        print(f"batched appends: {rate:,.0f} events/s (batch p50 {statistics.median(batch_lat):.1f} ms)",
              file=sys.stderr)
        single = single_latency(dsn, 300)
        print(f"single-event append latency p50 {pct(single, .5):.2f} ms p99 {pct(single, .99):.2f} ms",
              file=sys.stderr)
        seed_accounts(dsn, args.accounts)
        tr = transfers(dsn, args.writers, args.accounts, args.seconds)
        print(f"transfers: {tr['transfers_per_s']:,.0f}/s with {args.writers} writers "
              f"({tr['conflicts']} conflicts retried)", file=sys.stderr)
        with Ledger(dsn) as ledger:
            t = time.perf_counter()
            report = ledger.verify()
            verify_s = time.perf_counter() - t
            from examples.bank.invariant import check_invariants

            inv = check_invariants(ledger.iter_all())
        result = {
            "batched_append_events_per_s": round(rate),
            "transfers_per_s": round(tr["transfers_per_s"]),
            "append_latency_p50_ms": round(pct(tr["append_lat"], .5), 3),
            "append_latency_p99_ms": round(pct(tr["append_lat"], .99), 3),
            "transfer_command_latency_p50_ms": round(pct(tr["transfer_lat"], .5), 3),
            "transfer_command_latency_p99_ms": round(pct(tr["transfer_lat"], .99), 3),
            "single_append_latency_p50_ms": round(pct(single, .5), 3),
            "single_append_latency_p99_ms": round(pct(single, .99), 3),
            "batch_1000_latency_p50_ms": round(statistics.median(batch_lat), 2),
            "writers": args.writers, "accounts": args.accounts, "transfers": tr["transfers"],
            "conflicts_retried": tr["conflicts"],
            "verify_ok": report.ok, "verify_events": report.checked,
            "verify_events_per_s": round(report.checked / verify_s), "bank_invariant_ok": inv.transfers > 0,
            "durable": durable if durable is not None else settings["fsync"] == "on",
            "pg": settings,
        }
    finally:
        if server is not None:
            server.stop()
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
