"""Replay survives kill -9 at any moment (no downtime on rebuild: the old view serves until the swap).

A projection writing to PostgreSQL, search and Redis starts with live views built the way a
follower builds them (``ensure`` + apply). A replay process (``replay_runner.py``) is killed with
SIGKILL at seeded moments: inside the Spark build, between two sinks' builds, before any swap,
between two sinks' swaps, and after a search alias / Redis pointer switch but before the old
index / build is dropped. Meanwhile a reader thread reads every live view in a loop: each read must
equal the reference (never empty, never partial). After each kill the projection lock must come
free (PostgreSQL's session lock at once, the leases within their TTL); a last replay must run to
completion and leave the views equal to the reference and nothing behind: no shadow table or
positions, no index or Redis build beside the live one, no lock held.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.projections.engine import apply_range, nest, prepare
from kappaflow.projections.replay import as_spec
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.base import Sink, Target, ViewSpec
from kappaflow.projections.sinks.postgres import KF_SCHEMA, PostgresSink
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink
from tests._kill import thorough_kills, wait_for
from tests.projections.pj_helpers import orders_schema
from tests.projections.replay_runner import LOCK_TTL_S, projection
from tests.projections.test_replay import random_history

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RUNNER = Path(__file__).with_name("replay_runner.py")
# hold points of the runner (it has more: build2, swap), in the order a replay reaches them; every one
# is a Spark process (~20 s on two cores). By default the search alias switch is left out: after it the
# search and the Redis pointer switch take the same path (old build dropped after the switch), and the
# Redis one comes later, with more behind it. KF_THOROUGH_KILLS=1 runs all four.
ALL_HOLDS = ["build", "mid_swap", "drop_old_search", "drop_old_redis"]
HOLDS = ALL_HOLDS if thorough_kills() else [h for h in ALL_HOLDS if h != "drop_old_search"]


def open_sinks(pg_dsn: str, search_url: str, redis_url: str) -> dict[str, Sink]:
    return {"postgres": PostgresSink(pg_dsn), "search": SearchSink(search_url), "redis": RedisSink(redis_url)}


class Reader(threading.Thread):
    """Reads every live view until stopped; counts reads and keeps the ones that differ from the reference."""

    def __init__(self, sinks: dict[str, Sink], targets: dict[str, Target], reference: dict[str, list[Any]]) -> None:
        super().__init__(daemon=True)
        self.sinks, self.targets, self.reference = sinks, targets, reference
        self.stop_flag = threading.Event()
        self.reads = dict.fromkeys(sinks, 0)
        self.bad: list[str] = []

    def run(self) -> None:
        while not self.stop_flag.wait(0.05):  # a breather between rounds: the replay needs the cores
            for name, sink in self.sinks.items():
                try:
                    rows = list(sink.scan(self.targets[name]))
                except Exception as exc:  # a failed read is a failure too: the live view must keep serving
                    self.bad.append(f"{name}: read failed: {exc!r}")
                    continue
                self.reads[name] += 1
                if rows != self.reference[name]:
                    self.bad.append(f"{name}: {len(rows)} rows, expected {len(self.reference[name])}")

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(30)


def leftovers(sinks: dict[str, Sink], view: ViewSpec, pg_dsn: str) -> list[str]:
    """Everything of `view` beside its live table / index / build (with its positions and lock)."""
    out: list[str] = []
    with psycopg.connect(pg_dsn) as conn:
        tables = conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_tables WHERE tablename LIKE %s",
            (f"%{view.name}%",),
        ).fetchall()
        # the live view's own tables: the view, and beside it (kappaflow schema) its deleted keys and, for a
        # grouped view, its state and group changes; a killed replay's shadow ones carry a __<label> suffix
        pg = sinks["postgres"]
        assert isinstance(pg, PostgresSink)
        live = Target(view, view.name)
        keep = {f"public.{view.name}"} | {
            f"{KF_SCHEMA}.{t}" for t in (pg.deleted_table(live), pg.state_table(live), pg.changes_table(live))}
        out += [f"postgres table {t}" for (t,) in tables if t not in keep]
        targets = conn.execute(
            "SELECT DISTINCT target FROM kappaflow.projection_positions WHERE projection = %s", (view.projection,)
        ).fetchall()
        out += [f"postgres positions of target {t!r}" for (t,) in targets if t != "live"]
    search = sinks["search"]
    assert isinstance(search, SearchSink)
    live_index = search.physical_index(Target(view, search.alias(view)))
    indexes = search.client.get_alias(index=f"{search.alias(view)}__kf_*")
    out += [f"search index {i}" for i in indexes if i != live_index]
    redis = sinks["redis"]
    assert isinstance(redis, RedisSink)
    base, live_build = redis.base(view), redis.live_build(view)
    builds = {b.decode() for b in redis.client.smembers(f"{base}:builds")}
    out += [f"redis build {b}" for b in builds if b != live_build]
    keep = {f"{base}:current", f"{base}:builds", f"{base}:{live_build}"}
    stray = [k.decode() for k in redis.client.scan_iter(match=f"{base}:*", count=1000)]
    stray = [k for k in stray if k not in keep and not k.startswith(f"{base}:{live_build}:")]
    out += [f"redis key {k}" for k in sorted(stray)[:5]] + ([f"... {len(stray)} stray keys"] if stray else [])
    return out


def test_replay_killed_with_sigkill_at_any_moment_keeps_serving_and_reruns_cleanly(
    spark: Any, embedded_log: Any, pg_dsn: str, search_server: Any, redis_server: Any, source_name: str,
    tmp_path: Path,
) -> None:
    w = TableWriter(embedded_log, orders_schema(source_name), partitions=2)
    random_history(w, seed=17, n=300)
    view_name = f"{source_name}_latest"
    spec = as_spec(projection(source_name, view_name))
    sinks = open_sinks(pg_dsn, search_server.url, redis_server.url)
    rt = Runtime(spark, str(embedded_log.path), sinks["postgres"], dsn=pg_dsn, sinks=sinks)
    plan = prepare(spec, rt)
    view = plan.view
    # live views as a follower makes them (ensure creates a first build/index, labelled "live")
    end = rt.end_offsets(spec.topics)
    targets = {k: s.ensure(view) for k, s in sinks.items()}
    for k, s in sinks.items():
        apply_range(plan, rt, targets[k], nest({}, spec.topics, {t: len(end[t]) for t in spec.topics}), end, sink=s)
    reference = {k: list(s.scan(targets[k])) for k, s in sinks.items()}
    assert [r["id"] for r in reference["postgres"]] == [k[0] for k in sorted(w.rows)]
    for k in ("search", "redis"):
        assert reference[k] == reference["postgres"], k

    reader = Reader(open_sinks(pg_dsn, search_server.url, redis_server.url), targets, reference)
    rnd = random.Random(20261122)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    signal_file = tmp_path / "reached"

    def run(hold: str) -> subprocess.Popen[bytes]:
        signal_file.unlink(missing_ok=True)
        return subprocess.Popen(
            [sys.executable, str(RUNNER), str(embedded_log.path), pg_dsn, search_server.url, redis_server.url,
             source_name, view_name, hold, str(signal_file)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def output(proc: subprocess.Popen[bytes]) -> str:
        return proc.stdout.read().decode(errors="replace")[-4000:] if proc.stdout else ""

    reader.start()
    try:
        for hold in HOLDS:
            proc = run(hold)
            try:
                def reached(p: subprocess.Popen[bytes] = proc) -> bool:
                    return signal_file.exists() or p.poll() is not None

                # a Spark start and build: ~20 s alone, minutes on two cores shared with other Spark jobs
                wait_for(reached, 300, f"replay to reach {hold}")
                assert proc.poll() is None, f"{hold}: the replay ended before the kill:\n{output(proc)}"
                if hold == "build":
                    time.sleep(rnd.uniform(0.2, 1.5))  # a seeded moment inside the Spark build
                    assert proc.poll() is None, f"{hold}: the replay ended before the kill:\n{output(proc)}"
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            assert not reader.bad, f"after a kill at {hold}: the live view was not the reference: {reader.bad[:5]}"
            # PostgreSQL's lock goes with the session; a search/Redis lease runs out after its TTL
            wait_for(lambda: not any(s.is_locked(spec.name) for s in sinks.values()), 5 + 2 * LOCK_TTL_S,
                     f"the projection lock to come free after the kill at {hold}")
        proc = run("none")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    finally:
        reader.stop()
    assert not reader.bad, f"the live view was not the reference: {reader.bad[:5]}"
    assert all(n > 0 for n in reader.reads.values()), reader.reads
    for k, s in sinks.items():
        assert list(s.scan(targets[k])) == reference[k], f"{k}: the replayed view differs from the reference"
        assert not s.is_locked(spec.name), f"{k}: the projection lock is still held"
    assert leftovers(sinks, view, pg_dsn) == []
    rt.close()
