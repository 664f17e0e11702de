"""Ledger benchmark: appends, bank transfers, conditional appends, global reads, snapshot loads.

    .venv/bin/python bench/ledger.py [--dsn URL] [--fast] [--writers 8] [--accounts 1000] [--seconds 10]
                                     [--read-events 200000] [--tags 1000]

Needs the bench extra for the peer (``pip install -e '.[bench]'``, scripts/bootstrap.sh does).

Without --dsn a private PostgreSQL is started from the machine's binaries, DURABLE by default
(fsync on, synchronous_commit on: every acknowledged append survives a power cut); --fast
turns both off (the test-suite setting) to show the cost of durability.
Baselines measured in the same run, on the same server:
- ``floor_transfers_per_s``: the same transfer workload stripped to the bone
  (``bench/ledger_lockfree_probe.py``: one read and one minimal durable append function per
  transfer, no hash chain, no ordering, no typed events) -- what no ledger with the guarantees can
  beat here; ``transfers_vs_floor`` is the ledger's share of it; ``floor_cpu_ms_client`` /
  ``floor_cpu_ms_server`` its CPU per transfer (measured like ``transfer_cpu_ms_*``), and
  ``transfers_vs_floor_cpu`` the share those CPU costs predict (floor CPU / ledger CPU per
  transfer, client + server; the box is CPU-bound): it says whether the gap is spent in the
  client or the server;
- ``ceiling_min_durable_txn_per_s``: the writers doing nothing but a minimal durable transaction;
- ``peer_read_all_events_per_s``: the `eventsourcing` library (9.5, PostgreSQL recorder and
  mapper; ``bench/ledger_peer.py``) reading the same number of events in global order into typed
  domain events, next to ``read_all_events_per_s`` (the ledger's ``iter_all()`` into registered
  pydantic events).

Also: ``conditional_appends_per_s`` -- the writers each read a tag's events (``read_query``) and
append with that read's condition, over `--tags` tags (the DCB decision loop; compare with
``transfers_per_s``, the same read-then-append shape with an expected version); and
``snapshot_load_speedup`` -- loading a 10,000-event stream through a Fold from its snapshot vs
from its first event.

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ledger_lockfree_probe


def create_database(dsn: str, name: str) -> str:
    """A fresh database next to `dsn`'s (dropped first if it exists)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{name}"


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


def ceiling_worker(dsn: str, seconds: float, ready: Any, go: Any, out: Any, finish: Any) -> None:
    """The ceiling for any ledger here: a minimal durable transaction (one INSERT of two rows,
    autocommit, the server's synchronous commit) from a Python client, as fast as it goes."""
    import psycopg

    done = 0
    lat: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        sql = "insert into ceiling_probe (a, b) values (%s, %s), (%s, %s)"
        conn.execute(sql, (0, 0, 0, 0), prepare=True)
        ready.put(0)
        go.wait()
        stop_at = time.perf_counter() + seconds
        cpu0 = time.process_time()
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            conn.execute(sql, (done, 1, done, 2), prepare=True)
            lat.append((time.perf_counter() - t) * 1000)
            done += 1
        out.put({"done": done, "append_lat": lat, "transfer_lat": lat, "conflicts": 0,
                 "cpu": time.process_time() - cpu0})
        finish.wait(600)


def transfer_worker(dsn: str, seed: int, accounts: int, seconds: float, ready: Any, go: Any,
                    out: Any, finish: Any, raw: bool) -> None:
    """Bank transfers (read the source account, check funds, atomic two-stream append with the
    source's expected version), or with `raw` the two-stream append alone (no read, no rule)."""
    from examples.bank.bank import Bank
    from examples.bank.events import TransferReceived, TransferSent, registry, stream_id
    from kappaflow.ledger import ExpectedVersion, Ledger, StreamAppend

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

        setattr(ledger, "append_many", timed)  # noqa: B010 - time the ledger call inside Bank
        bank = Bank(ledger)
        for a in range(accounts if not raw else 0):  # warm the cache (the initial full reads)
            bank.account(str(a))
        append_lat.clear()
        ready.put(seed)
        go.wait()
        stop_at = time.perf_counter() + seconds
        cpu0 = time.process_time()
        while time.perf_counter() < stop_at:
            a, b = rnd.sample(range(accounts), 2)
            t = time.perf_counter()
            tid, amount = uuid.uuid4().hex, rnd.randint(1, 100)
            if raw:
                ledger.append_many([
                    StreamAppend(stream_id(str(a)), [TransferSent(transfer_id=tid, to_account=str(b), amount=amount)]),
                    StreamAppend(stream_id(str(b)), [TransferReceived(transfer_id=tid, from_account=str(a),
                                                                      amount=amount)], ExpectedVersion.STREAM_EXISTS),
                ], idempotency_key=tid)
            else:
                bank.transfer(str(a), str(b), amount, transfer_id=tid)
            transfer_lat.append((time.perf_counter() - t) * 1000)
            done += 1
        out.put({"done": done, "append_lat": append_lat, "transfer_lat": transfer_lat,
                 "conflicts": bank.conflicts, "cpu": time.process_time() - cpu0})
        finish.wait(600)  # keep the connection (and its server process's CPU count) until measured


def conditional_worker(dsn: str, seed: int, tags: int, seconds: float, ready: Any, go: Any, out: Any,
                       finish: Any) -> None:
    """The DCB decision loop: read one tag's events by query, decide (a capacity of 10^9: never
    full, so the run measures the mechanism), append an event with that tag under the read's
    condition; a conflict re-reads and decides again."""
    from kappaflow.ledger import AppendConditionFailedError, Ledger, NewEvent, Query

    rnd = random.Random(seed)
    done = conflicts = 0
    lat: list[float] = []
    with Ledger(dsn, pool_size=1) as ledger:
        ledger.read_query(Query.where(tags=["slot:0"]), after=0, limit=1)  # warm the connection
        ready.put(seed)
        go.wait()
        stop_at = time.perf_counter() + seconds
        cpu0 = time.process_time()
        while time.perf_counter() < stop_at:
            tag = f"slot:{rnd.randrange(tags)}"
            q = Query.where(tags=[tag], types=["Reserved"])
            t = time.perf_counter()
            while True:
                seen = ledger.read_query(q, decode=False)
                try:
                    ledger.append(f"reservation-{seed}-{done}", [NewEvent("Reserved", {"n": len(seen.events)},
                                                                          tags=[tag])], condition=seen.condition)
                    break
                except AppendConditionFailedError:
                    conflicts += 1
            lat.append((time.perf_counter() - t) * 1000)
            done += 1
        out.put({"done": done, "append_lat": lat, "transfer_lat": lat, "conflicts": conflicts,
                 "cpu": time.process_time() - cpu0})
        finish.wait(600)


def read_all_rate(dsn: str, n: int) -> dict[str, Any]:
    """The ledger's typed read-all: `n` events written in batches of 1,000, then iter_all() into
    registered pydantic events (best of two passes; the peer's figure is its best of two too)."""
    from pydantic import BaseModel

    from kappaflow.ledger import EventRegistry, Ledger

    class Deposited(BaseModel):
        amount: int
        reference: str

    registry = EventRegistry()
    registry.register(Deposited)
    best = 0.0
    with Ledger(dsn, registry=registry, pool_size=1) as ledger:
        for b in range(n // 1000):
            ledger.append(f"acct-{b}", [Deposited(amount=i % 1000 + 1, reference=f"r-{b * 1000 + i}")
                                        for i in range(1000)])
        for _ in range(2):
            t0 = time.perf_counter()
            count = 0
            last = None
            for e in ledger.iter_all():
                last = e.event
                count += 1
            best = max(best, count / (time.perf_counter() - t0))
            assert count == n and isinstance(last, Deposited)
    return {"events": n, "events_per_s": best}


def snapshot_speedup(dsn: str, events: int = 10_000, loads: int = 20) -> dict[str, Any]:
    """Loading one account stream of `events` events through ACCOUNT_FOLD: without snapshots
    (every load folds every event) vs with a snapshot every 100 events (a load folds < 100)."""
    from examples.bank.account import ACCOUNT_FOLD
    from examples.bank.events import AccountOpened, Deposited, registry
    from kappaflow.ledger import Ledger

    stream = "account-snapshotbench"
    with Ledger(dsn, registry=registry, pool_size=1) as plain, \
            Ledger(dsn, registry=registry, pool_size=1, snapshot_every={"account": 100}) as snap:
        plain.append(stream, [AccountOpened(owner="bench")] + [Deposited(amount=1)] * 999)
        for v in range(1000, events, 1000):
            plain.append(stream, [Deposited(amount=1)] * 1000, v)
        plain.append(stream, [Deposited(amount=1)] * 37, events)  # a tail past the last snapshot
        snap.load(stream, ACCOUNT_FOLD)  # stores the snapshot

        def timed(ledger: Ledger, fold: Any) -> tuple[float, Any]:
            ledger.load(stream, fold)
            t0 = time.perf_counter()
            for _ in range(loads):
                loaded = ledger.load(stream, fold)
            return (time.perf_counter() - t0) / loads, loaded

        # the same fold under a name no snapshot was stored for: every load folds every event
        full_s, full = timed(plain, dataclasses.replace(ACCOUNT_FOLD, name="account_nosnapshot"))
        snap_s, fast = timed(snap, ACCOUNT_FOLD)
        assert full.state == fast.state and fast.snapshot_version is not None and full.snapshot_version is None
    return {"full_load_ms": full_s * 1000, "snapshot_load_ms": snap_s * 1000, "speedup": full_s / snap_s,
            "stream_events": full.version}


def server_cpu_seconds(dsn: str) -> float:
    """CPU time used so far by the PostgreSQL server's processes (Linux /proc; 0 if unknown)."""
    import os

    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("select pg_postmaster_start_time(), current_setting('data_directory')").fetchone()
    pid_file = Path(str(row[1] if row else ""), "postmaster.pid")
    try:
        postmaster = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == postmaster or int(fields[1]) == postmaster:
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def transfers(dsn: str, writers: int, accounts: int, seconds: float, raw: bool = False,
              ceiling: bool = False, conditional_tags: int = 0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q, ready, go, finish = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    if conditional_tags:
        procs = [ctx.Process(target=conditional_worker, args=(dsn, s, conditional_tags, seconds, ready, go, q, finish))
                 for s in range(writers)]
    elif ceiling:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("create table if not exists ceiling_probe (id bigserial primary key, a int, b int)")
        procs = [ctx.Process(target=ceiling_worker, args=(dsn, seconds, ready, go, q, finish))
                 for _ in range(writers)]
    else:
        procs = [ctx.Process(target=transfer_worker, args=(dsn, s, accounts, seconds, ready, go, q, finish, raw))
                 for s in range(writers)]
    for p in procs:
        p.start()
    for _ in procs:  # every writer has loaded its account cache: start them at the same instant
        ready.get(timeout=600)
    cpu0 = server_cpu_seconds(dsn)
    go.set()
    results = [q.get(timeout=seconds + 600) for _ in procs]
    server_cpu = server_cpu_seconds(dsn) - cpu0
    finish.set()
    for p in procs:
        p.join(60)
    done = sum(r["done"] for r in results)
    append_lat = [x for r in results for x in r["append_lat"]]
    transfer_lat = [x for r in results for x in r["transfer_lat"]]
    client_cpu = sum(r["cpu"] for r in results)
    return {"transfers": done, "transfers_per_s": done / seconds, "append_lat": append_lat,
            "transfer_lat": transfer_lat, "conflicts": sum(r["conflicts"] for r in results),
            "client_cpu_ms_per_transfer": 1000 * client_cpu / max(done, 1),
            "server_cpu_ms_per_transfer": 1000 * server_cpu / max(done, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn")
    ap.add_argument("--fast", action="store_true", help="private server with fsync/synchronous_commit off")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--accounts", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--read-events", type=int, default=200_000)
    ap.add_argument("--tags", type=int, default=1000)
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
            settings = {k: str(conn.execute(f"show {k}").fetchone()[0])  # type: ignore[index]
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
        raw = transfers(dsn, args.writers, args.accounts, args.seconds / 2, raw=True)
        print(f"raw two-stream appends: {raw['transfers_per_s']:,.0f}/s with {args.writers} writers",
              file=sys.stderr)
        import ledger_lockfree_probe

        floor = ledger_lockfree_probe.run(dsn, args.writers, args.accounts, args.seconds,
                                          server_cpu=server_cpu_seconds)
        print(f"floor (stripped transfer workload): {floor['lockfree_transfers_per_s']:,}/s; CPU per transfer "
              f"client {floor['client_cpu_ms_per_transfer']:.3f} ms + server "
              f"{floor['server_cpu_ms_per_transfer']:.3f} ms "
              f"(ledger: {tr['client_cpu_ms_per_transfer']:.3f} + {tr['server_cpu_ms_per_transfer']:.3f} ms)",
              file=sys.stderr)
        ceil = transfers(dsn, args.writers, args.accounts, args.seconds / 2, ceiling=True)
        print(f"ceiling (a minimal durable 2-row INSERT transaction): {ceil['transfers_per_s']:,.0f}/s with "
              f"{args.writers} writers", file=sys.stderr)
        cond = transfers(dsn, args.writers, args.accounts, args.seconds, conditional_tags=args.tags)
        print(f"conditional appends (read by tag, append with the condition): {cond['transfers_per_s']:,.0f}/s "
              f"with {args.writers} writers over {args.tags} tags ({cond['conflicts']} conflicts retried)",
              file=sys.stderr)
        snap = snapshot_speedup(dsn)
        print(f"snapshot load: {snap['full_load_ms']:.1f} ms from the first event vs {snap['snapshot_load_ms']:.2f} ms "
              f"from a snapshot ({snap['speedup']:.0f}x)", file=sys.stderr)
        import ledger_peer

        reads_dsn = create_database(dsn, "bench_ledger_reads")
        install(reads_dsn)
        reads = read_all_rate(reads_dsn, args.read_events)
        peer_dsn = create_database(dsn, "bench_ledger_peer")
        peer = ledger_peer.peer_read_all(peer_dsn, args.read_events)
        print(f"read all, typed: {reads['events_per_s']:,.0f} events/s; the eventsourcing library: "
              f"{peer['events_per_s']:,.0f} events/s", file=sys.stderr)
        with Ledger(dsn) as ledger:
            t = time.perf_counter()
            report = ledger.verify()
            verify_s = time.perf_counter() - t
            from examples.bank.invariant import check_invariants

            inv = check_invariants(ledger.iter_all())
        result = {
            "batched_append_events_per_s": round(rate),
            "transfers_per_s": round(tr["transfers_per_s"]),
            "floor_transfers_per_s": floor["lockfree_transfers_per_s"],
            "transfers_vs_floor": round(tr["transfers_per_s"] / max(floor["lockfree_transfers_per_s"], 1), 3),
            "floor_cpu_ms_client": floor["client_cpu_ms_per_transfer"],
            "floor_cpu_ms_server": floor["server_cpu_ms_per_transfer"],
            # the share the CPU cost per transfer (client + server) predicts on a CPU-bound box: where
            # transfers_vs_floor's gap is spent (compare the *_cpu_ms_* figures)
            "transfers_vs_floor_cpu": round(
                (floor["client_cpu_ms_per_transfer"] + floor["server_cpu_ms_per_transfer"])
                / max(tr["client_cpu_ms_per_transfer"] + tr["server_cpu_ms_per_transfer"], 1e-9), 3),
            "append_latency_p50_ms": round(pct(tr["append_lat"], .5), 3),
            "append_latency_p99_ms": round(pct(tr["append_lat"], .99), 3),
            "transfer_command_latency_p50_ms": round(pct(tr["transfer_lat"], .5), 3),
            "transfer_command_latency_p99_ms": round(pct(tr["transfer_lat"], .99), 3),
            "single_append_latency_p50_ms": round(pct(single, .5), 3),
            "single_append_latency_p99_ms": round(pct(single, .99), 3),
            "batch_1000_latency_p50_ms": round(statistics.median(batch_lat), 2),
            "raw_transfer_appends_per_s": round(raw["transfers_per_s"]),
            "raw_transfer_append_latency_p50_ms": round(pct(raw["transfer_lat"], .5), 3),
            "raw_transfer_cpu_ms_client": round(raw["client_cpu_ms_per_transfer"], 3),
            "raw_transfer_cpu_ms_server": round(raw["server_cpu_ms_per_transfer"], 3),
            "transfer_cpu_ms_client": round(tr["client_cpu_ms_per_transfer"], 3),
            "transfer_cpu_ms_server": round(tr["server_cpu_ms_per_transfer"], 3),
            # upper bound for any transfer on this machine: one minimal durable transaction
            "ceiling_min_durable_txn_per_s": round(ceil["transfers_per_s"]),
            "conditional_appends_per_s": round(cond["transfers_per_s"]),
            "conditional_vs_transfers": round(cond["transfers_per_s"] / max(tr["transfers_per_s"], 1), 3),
            "conditional_append_p50_ms": round(pct(cond["append_lat"], .5), 3),
            "conditional_conflicts_retried": cond["conflicts"],
            "read_all_events_per_s": round(reads["events_per_s"]),
            "peer_read_all_events_per_s": round(peer["events_per_s"]),
            "read_all_vs_peer": round(reads["events_per_s"] / max(peer["events_per_s"], 1), 3),
            "read_all_events": args.read_events,
            "snapshot_load_speedup": round(snap["speedup"], 1),
            "snapshot_full_load_ms": round(snap["full_load_ms"], 2),
            "snapshot_load_ms": round(snap["snapshot_load_ms"], 3),
            "ceiling_min_durable_txn_cpu_ms_client": round(ceil["client_cpu_ms_per_transfer"], 3),
            "ceiling_min_durable_txn_cpu_ms_server": round(ceil["server_cpu_ms_per_transfer"], 3),
            "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
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
