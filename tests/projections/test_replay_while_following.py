"""Replay while following (issue 16 item 2): the replay builds beside the live view, the follower
takes the rebuilt view between two batches and follows it on; on_definition_change at start."""

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

from kappaflow.errors import ConfigError
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.handover import HandoverFailed
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.simulate import TableWriter
from tests.projections import defs
from tests.projections.pj_helpers import orders_schema, totals_reference, view_rows
from tests.projections.test_follow import RUNNER, more_changes, positions, wait
from tests.projections.test_replay import random_history

pytestmark = pytest.mark.integration


class WriterLoop:
    """Appends changes to the orders table all the time, from its own thread (the only writer of `w`)."""

    def __init__(self, w: TableWriter, seed: int) -> None:
        self.w, self.rnd = w, random.Random(seed)
        self.stop_ = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="writer-loop", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop_.wait(0.02):  # pacing, not synchronisation
                more_changes(self.w, self.rnd, 4, 5000 + self.rounds)
                self.rounds += 1
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> WriterLoop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_.set()
        self.thread.join(timeout=30)
        assert self.error is None, f"the writer loop failed: {self.error!r}"


@pytest.fixture(params=["postgres", "redis", "search"])
def sink_rt(request: pytest.FixtureRequest, spark: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path) -> Any:
    """(sink name, runtime): the view in PostgreSQL, Redis or OpenSearch (the registry and the offers stay
    in the PostgreSQL views database)."""
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    pg = PostgresSink(pg_dsn)
    sinks: dict[str, Any] = {"postgres": pg}
    if request.param == "redis":
        from kappaflow.projections.sinks.redis import RedisSink

        sinks["redis"] = RedisSink(request.getfixturevalue("redis_server").url)
    if request.param == "search":
        from kappaflow.projections.sinks.search import SearchSink

        sinks["search"] = SearchSink(request.getfixturevalue("search_server").url)
    rt = Runtime(spark, str(embedded_log.path), pg, dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt", sinks=sinks)
    try:
        yield request.param, rt
    finally:
        rt.close()


def view_of(rt: Any, sink: str, proj: type[Any]) -> dict[int, tuple[int, int, int]]:
    """defs.custom's view in `sink`: order id -> (customer, changes, version)."""
    spec = as_spec(proj)
    s = rt.sinks[sink]
    live = s.live(prepare(spec, rt).view)
    assert live is not None, f"{spec.name}/{sink}: no live view"
    return {int(r["id"]): (int(r["customer_id"]), int(r["changes"]), int(r["_kf_version"])) for r in s.scan(live)}


def test_replay_while_following_hands_over_with_nothing_lost_or_twice(sink_rt: Any, embedded_log: Any) -> None:
    sink, rt = sink_rt
    w = TableWriter(embedded_log, orders_schema("rwf"), partitions=2)
    random_history(w, seed=5, n=150)
    proj = defs.custom("rwf", name="rwf_changes")  # counts every change of an order: applied twice would show
    proj.sinks = (sink,)
    f = Follower(proj, rt, trigger="0.2s").start()
    try:
        with WriterLoop(w, seed=11) as writer:
            assert f.wait_for(lambda s: s.batches > 0, 180), f"{f.name}: no first batch"
            query, rounds = f.query, writer.rounds
            res = replay(proj, rt, handover_timeout_s=90)
            assert res.sinks[sink].handed_over, res
            assert writer.rounds > rounds, "no change was appended during the replay"
            # the same streaming query, never restarted, and its batches go on past the swap
            assert f.handovers == 1 and f.query is query and f.restarts == 0 and f.healthy
            at_swap = f.stats.batches
            assert f.wait_for(lambda s: s.batches >= at_swap + 2, 120), f"{f.name}: no batch after the swap"
        assert f.wait_for(lambda s: f.caught_up(), 180), f"{f.name} did not catch up"
        followed = view_of(rt, sink, proj)
    finally:
        f.stop()
    with rt.registry() as reg:
        assert reg.get(proj.name).generation == 2  # created by the follower, then the handover's swap
    assert followed
    # every change (before, during and after the replay) exactly once: the number of changes per order
    # since its last insert, from the writer's own history in plain Python
    assert {k: v[:2] for k, v in followed.items()} == changes_reference(embedded_log, w.topic)


def changes_reference(log: Any, topic: str) -> dict[int, tuple[int, int]]:
    """defs.custom's view from the log in plain Python: order id -> (customer, changes since its insert)."""
    import orjson

    out: dict[int, tuple[int, int]] = {}
    records = []
    for p in range(log.partitions(topic)):
        records += [r.value for r in log.read(topic, p, 0, 1_000_000) if r.value is not None]  # no tombstones
    for value in records:  # per key, the log is in order; keys are independent
        ev = orjson.loads(value)
        if ev["op"] == "d":
            out.pop(ev["before"]["id"], None)
            continue
        after = ev["after"]
        prev = out.get(after["id"])
        out[after["id"]] = (after["customer_id"], (prev[1] if prev else 0) + 1)
    return out


def test_on_definition_change_fail_or_rebuild(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    w = TableWriter(embedded_log, orders_schema("odc"), partitions=2)
    random_history(w, seed=9, n=80)
    v1 = defs.totals("odc", name="odc_totals")
    f = Follower(v1, rt, trigger="0.2s").start()
    try:
        assert f.wait_for(lambda s: f.caught_up(), 180)
    finally:
        f.stop()
    built = view_rows(pg_dsn, v1.name, "*")
    v2 = defs.totals("odc", name="odc_totals")
    v2.where = "status = 'paid'"  # an edited definition: another fingerprint
    with pytest.raises(ConfigError, match=r"definition fingerprint differs.*on_definition_change"):
        Follower(v2, rt, trigger="0.2s").start()  # "fail", the default
    v2.on_definition_change = "fail"  # the projection's own setting wins over the runtime's
    with pytest.raises(ConfigError, match="definition fingerprint differs"):
        Follower(v2, rt, trigger="0.2s", on_definition_change="rebuild").start()
    assert view_rows(pg_dsn, v1.name, "*") == built, "a refused start changed the view"
    v2.on_definition_change = None
    f = Follower(v2, rt, trigger="0.2s", on_definition_change="rebuild").start()
    try:
        more_changes(w, random.Random(3), 30, 7000)
        assert f.wait_for(lambda s: f.caught_up(), 180)
        assert f.rebuilds == 1
        paid = {k: r for k, r in w.rows.items() if r["status"] == "paid"}
        assert view_rows(pg_dsn, v2.name, "customer_id, n, total, last, statuses") == totals_reference(paid)
    finally:
        f.stop()
    with rt.registry() as reg:
        assert reg.get(v2.name).fingerprint == as_spec(v2).fingerprint()
    with pytest.raises(ConfigError, match="on_definition_change"):
        Follower(v2, rt, on_definition_change="sometimes")


def test_replay_refuses_cleanly_when_the_follower_dies_mid_handover(
    rt: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path
) -> None:
    source = "rwd"
    w = TableWriter(embedded_log, orders_schema(source), partitions=2)
    random_history(w, seed=17, n=120)
    proj = defs.custom(source)  # what follow_runner.py follows for KIND "custom"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), str(embedded_log.path), pg_dsn, str(tmp_path / "ckpt-sub"), source, "custom"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    outcome: list[BaseException | None] = []
    try:
        ends = embedded_log.end_offsets(w.topic)
        wait(
            lambda: all(positions(pg_dsn, proj.name).get((w.topic, p), 0) >= e for p, e in ends.items()),
            180,
            "the subprocess follower to catch up",
        )

        def run_replay() -> None:
            try:
                replay(proj, rt, handover_timeout_s=60, catch_up_rounds=0)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        with WriterLoop(w, seed=23):  # changes after the build: the follower has a range to catch up
            t = threading.Thread(target=run_replay, name="replay", daemon=True)
            t.start()
            with psycopg.connect(pg_dsn, autocommit=True) as conn:

                def claimed() -> bool:
                    row = conn.execute(
                        "SELECT state FROM kappaflow.handovers WHERE projection = %s", (proj.name,)
                    ).fetchone()
                    return bool(row and row[0] == "taking")

                # Polled every 10 ms, not wait()'s 100 ms: on a quiet machine the claimed state can last
                # only a fraction of a second (a small range to catch up), and a 100 ms poll missed it once.
                deadline = time.monotonic() + 180
                while not (claimed() or not t.is_alive()):
                    assert time.monotonic() < deadline, "timed out after 180s waiting for the follower's claim"
                    time.sleep(0.01)
                assert t.is_alive(), f"the replay ended before the follower claimed the view: {outcome}"
                os.killpg(proc.pid, signal.SIGKILL)  # mid-handover: between its claim and its report
            t.join(timeout=120)
        assert not t.is_alive(), "the replay did not give up within its bounded wait"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], HandoverFailed), outcome
    assert "died" in str(outcome[0])
    with psycopg.connect(pg_dsn) as conn:  # no offer and no shadow left behind
        assert conn.execute("SELECT count(*) FROM kappaflow.handovers").fetchone() == (0,)
        left = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE %s", (f"%{proj.name}%handover%",)
        ).fetchone()
        assert left == (0,), "the handover shadow was left behind"
    # the live view is intact: a new follower resumes from its positions, and the view then holds every
    # change exactly once (plain-Python reference of the log)
    f = Follower(proj, rt, trigger="0.2s").start()
    try:
        assert f.wait_for(lambda s: f.caught_up(), 180)
        followed = view_rows(pg_dsn, proj.name, "id, customer_id, changes")
    finally:
        f.stop()
    assert {r[0]: (r[1], r[2]) for r in followed} == changes_reference(embedded_log, w.topic)


def test_on_definition_change_values_are_checked_at_load(tmp_path: Path) -> None:
    """A bad value is a ConfigError naming the field, at load (no Spark, no store)."""
    from kappaflow.config import Settings

    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text('[follow]\non_definition_change = "rebuild"\n')
    assert Settings.load(cfg, environ={}).follow.on_definition_change == "rebuild"
    assert type(Settings.load(cfg, environ={}).follow).model_fields["on_definition_change"].default == "fail"
    with pytest.raises(ConfigError, match=r"follow\.on_definition_change"):
        Settings.load(cfg, environ={"KAPPAFLOW_FOLLOW__ON_DEFINITION_CHANGE": "sometimes"})
    p = defs.totals("odv", name="odv_totals")
    p.on_definition_change = "always"
    with pytest.raises(ConfigError, match="'on_definition_change': expected 'fail' or 'rebuild'"):
        as_spec(p)
    p.on_definition_change = "rebuild"
    assert as_spec(p).on_definition_change == "rebuild"


def test_a_lock_holder_that_goes_away_before_claiming_leaves_the_swap_to_the_replay(
    rt: Any, embedded_log: Any, pg_dsn: str
) -> None:
    """The follow lock is held by a process that takes no offer (and then goes away, as a killed holder
    whose lock is released): the replay takes the lock and swaps its view in itself."""
    from kappaflow.projections.sinks.postgres import PostgresSink

    w = TableWriter(embedded_log, orders_schema("rwg"), partitions=2)
    random_history(w, seed=29, n=80)
    proj = defs.custom("rwg", name="rwg_changes")
    holder = PostgresSink(pg_dsn)
    assert holder.try_lock(proj.name)
    outcome: list[Any] = []

    def run_replay() -> None:
        try:
            outcome.append(replay(proj, rt, handover_timeout_s=120))
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=run_replay, name="replay", daemon=True)
    t.start()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:

            def offered() -> bool:
                row = conn.execute("SELECT state FROM kappaflow.handovers WHERE projection = %s", (proj.name,))
                found = row.fetchone()
                return bool(found and found[0] == "ready")

            wait(lambda: offered() or not t.is_alive(), 180, "the replay to offer its view")
        assert t.is_alive(), f"the replay ended before offering its view: {outcome}"
    finally:
        holder.close()  # the holder goes away: its session lock with it
    t.join(timeout=120)
    assert not t.is_alive(), "the replay did not finish"
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert not outcome[0].sinks["postgres"].handed_over
    rows = view_rows(pg_dsn, proj.name, "id, customer_id, changes")
    assert {r[0]: (r[1], r[2]) for r in rows} == changes_reference(embedded_log, w.topic)
    with PostgresSink(pg_dsn) as other:
        assert other.try_lock(proj.name), "the replay kept the projection's lock"
