"""Follow: the view tracks the log; exactly-once in effect across kill -9 of the driver."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from tests._kill import trial_count
from tests.projections import defs
from tests.projections.pj_helpers import orders_schema, totals_reference, view_rows
from tests.projections.test_replay import order, random_history

pytestmark = pytest.mark.integration
RUNNER = Path(__file__).with_name("follow_runner.py")


def wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def positions(dsn: str, projection: str) -> dict[tuple[str, int], int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT topic, partition, next_offset FROM kappaflow.projection_positions "
            "WHERE projection = %s AND target = 'live'",
            (projection,),
        ).fetchall()
    return {(t, p): o for t, p, o in rows}


def caught_up(log: Any, topic: str, dsn: str, projection: str) -> bool:
    pos = positions(dsn, projection)
    return all(pos.get((topic, p), 0) >= e for p, e in log.end_offsets(topic).items())


def more_changes(w: TableWriter, rnd: random.Random, n: int, minute: int) -> None:
    for _ in range(n):
        i = rnd.randint(1, 60)
        k = (i,)
        if k not in w.rows:
            w.insert(order(i, rnd.randint(1, 6), rnd.randint(1, 9999), "new", minute))
        elif rnd.random() < 0.2:
            w.delete(k)
        else:
            w.update(
                k,
                {
                    "customer_id": rnd.randint(1, 6),
                    "status": rnd.choice(["new", "paid", "cancelled"]),
                    "amount": Decimal(rnd.randint(1, 9999)) / 100,
                },
            )
    w.flush()


def test_follow_tracks_the_log_and_equals_a_fresh_replay(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    w = TableWriter(embedded_log, orders_schema("fo"), partitions=2)
    random_history(w, seed=21, n=150)
    totals = defs.totals("fo", name="fo_totals")
    latest = defs.latest("fo", name="fo_latest")
    followers = [Follower(p, rt, trigger="0.2s").start() for p in (totals, latest)]
    try:
        rnd = random.Random(4)
        for step in range(3):
            for f in followers:
                assert f.wait_for(lambda s, f=f: f.caught_up(), 180), f"{f.spec.name} did not catch up"
            assert view_rows(pg_dsn, totals.name, "customer_id, n, total, last, statuses") == totals_reference(w.rows)
            more_changes(w, rnd, 60, 1000 + step)
        for f in followers:
            assert f.wait_for(lambda s, f=f: f.caught_up(), 180)
    finally:
        for f in followers:
            f.stop()
    followed = {p.name: view_rows(pg_dsn, p.name, "*") for p in (totals, latest)}
    assert followed[totals.name] and followed[latest.name]
    for p in (totals, latest):
        replay(p, rt)
    # latest-row versions are offsets: the whole row including versions matches;
    # grouped versions are write watermarks, so compare values only
    assert view_rows(pg_dsn, latest.name, "*") == followed[latest.name]
    assert [r[:-1] for r in view_rows(pg_dsn, totals.name, "*")] == [r[:-1] for r in followed[totals.name]]


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_follow_on_kafka_tracks_the_log(spark: Any, kafka_broker: Any, pg_dsn: str, tmp_path: Any, client: str,
                                       request: pytest.FixtureRequest) -> None:
    """A follower streaming from a Kafka log read with each client (`[log.kafka] client`)."""
    from kappaflow.config import KafkaClientConfig, LogConfig
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    log = request.getfixturevalue("confluent_log" if client == "confluent" else "kafka_log")
    url = f"kafka://{kafka_broker.bootstrap}"
    source = "fk" + client.replace("-", "")[:4]
    options = LogConfig(url=url, kafka=KafkaClientConfig(client=client)).open_options()
    runtime = Runtime(spark, url, PostgresSink(pg_dsn), log_options=options, checkpoint_dir=tmp_path / "ckpt")
    w = TableWriter(log, orders_schema(source), partitions=2)
    random_history(w, seed=31, n=120)
    totals = defs.totals(source, name=f"{source}_totals")
    follower = Follower(totals, runtime, trigger="0.2s").start()
    try:
        rnd = random.Random(8)
        for step in range(2):
            assert follower.wait_for(lambda s: follower.caught_up(), 180), "the follower did not catch up"
            assert view_rows(pg_dsn, totals.name, "customer_id, n, total, last, statuses") == totals_reference(w.rows)
            more_changes(w, rnd, 40, 2000 + step)
        assert follower.wait_for(lambda s: follower.caught_up(), 180)
        assert view_rows(pg_dsn, totals.name, "customer_id, n, total, last, statuses") == totals_reference(w.rows)
    finally:
        follower.stop()
        runtime.close()


def test_a_grouped_batch_touching_one_group_leaves_the_others(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    """Regression: a follow batch recomputes only the groups it touches; the rest stay as they are."""
    w = TableWriter(embedded_log, orders_schema("fg"), partitions=2)
    for i in range(1, 13):
        w.insert(order(i, 1 + i % 4, 100 * i, "new", i))
    w.flush()
    totals = defs.totals("fg", name="fg_totals")
    replay(totals, rt)
    assert view_rows(pg_dsn, totals.name, "customer_id, n, total, last, statuses") == totals_reference(w.rows)
    f = Follower(totals, rt, trigger="0.2s").start()
    try:
        # one group at a time: an update inside group 1, a move 1 -> 2, a delete in group 3
        for change in (lambda: w.update((4,), {"amount": Decimal("9.99")}),
                       lambda: w.update((8,), {"customer_id": 2}),
                       lambda: w.delete((3,))):
            change()
            w.flush()
            assert f.wait_for(lambda s: f.caught_up(), 180), "the follower did not catch up"
            assert view_rows(pg_dsn, totals.name, "customer_id, n, total, last, statuses") == \
                totals_reference(w.rows)
    finally:
        f.stop()


def test_a_follower_reconnects_after_its_postgresql_connection_is_killed(
        rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    """Regression: the follower restarted its query on the same (dead) connection after a
    PostgreSQL restart or a killed backend ("the connection is closed" on every attempt) until
    it gave up; it now opens fresh connections before each restart."""
    w = TableWriter(embedded_log, orders_schema("frc"), partitions=2)
    for i in range(1, 5):
        w.insert(order(i, 1, 100 * i, "new", i))
    w.flush()
    latest = defs.latest("frc", name="frc_latest")
    replay(latest, rt)
    f = Follower(latest, rt, trigger="0.2s", backoff_s=0.2, max_backoff_s=0.5, max_restarts=8).start()
    try:
        assert f.wait_for(lambda s: f.caught_up(), 120), "the follower did not catch up"
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (f.sink.conn.info.backend_pid,))
        w.insert(order(9, 1, 900, "new", 9))
        w.flush()
        assert f.wait_for(lambda s: f.caught_up(), 120), f"no catch-up after the connection was killed: {f.error!r}"
        assert f.restarts >= 1 and f.failed is None
        assert [r[0] for r in view_rows(pg_dsn, latest.name, "id")] == [1, 2, 3, 4, 9]
    finally:
        f.stop()


def test_a_follower_that_lost_its_lock_takes_it_again_before_writing(
        rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    """All of the follower's PostgreSQL sessions killed (as by a server restart): the advisory lock
    went with its session, so no batch may be written until the follower holds the lock again."""
    from kappaflow.projections.sinks.postgres import PostgresSink

    w = TableWriter(embedded_log, orders_schema("flk"), partitions=2)
    for i in range(1, 5):
        w.insert(order(i, 1, 100 * i, "new", i))
    w.flush()
    latest = defs.latest("flk", name="flk_latest")
    replay(latest, rt)
    f = Follower(latest, rt, trigger="0.2s", backoff_s=0.2, max_backoff_s=0.5, max_restarts=8).start()
    try:
        assert f.wait_for(lambda s: f.caught_up(), 120), "the follower did not catch up"
        lock_pid = f._lock_sink.conn.info.backend_pid
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                      ([lock_pid, f.sink.conn.info.backend_pid],))
        assert not f._lock_sink.holds_lock(latest.name)
        w.insert(order(9, 1, 900, "new", 9))
        w.flush()

        def relocked_and_caught_up() -> bool:
            try:
                return f._lock_sink.holds_lock(latest.name) and f.caught_up()
            except Exception:  # the old lock connection is dead until the follower replaces it
                return False

        wait(relocked_and_caught_up, 120, f"the follower to take its lock again and catch up ({f.error!r})")
        assert f.restarts >= 1 and f.failed is None
        assert f._lock_sink.conn.info.backend_pid != lock_pid
        with PostgresSink(pg_dsn) as other:  # the lock is really held again
            assert not other.try_lock(latest.name), "another process could take the follower's lock"
        assert [r[0] for r in view_rows(pg_dsn, latest.name, "id")] == [1, 2, 3, 4, 9]
    finally:
        f.stop()


def test_a_second_follower_of_the_same_projection_is_refused(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    """A second follower is refused; so is a replay while another replay builds the view (a replay of a
    followed projection hands its view over to the follower: test_replay_while_following.py)."""
    from kappaflow.projections.engine import ProjectionBusy
    from kappaflow.projections.handover import build_lock_name
    from kappaflow.projections.sinks.postgres import PostgresSink

    w = TableWriter(embedded_log, orders_schema("busy"), partitions=1)
    w.insert(order(1, 1, 100, "new", 0))
    w.flush()
    proj = defs.latest("busy", name="busy_latest")
    f = Follower(proj, rt).start()
    try:
        with pytest.raises(ProjectionBusy):
            Follower(proj, rt).start()
        with PostgresSink(pg_dsn) as builder:
            assert builder.try_lock(build_lock_name(proj.name))
            with pytest.raises(ProjectionBusy, match="is being replayed in the postgres sink by another process"):
                replay(proj, rt)
    finally:
        f.stop()


def test_follow_refuses_a_view_table_of_another_shape(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    from kappaflow.projections.sinks.base import ViewSchemaMismatch

    w = TableWriter(embedded_log, orders_schema("sm"), partitions=1)
    w.insert(order(1, 1, 100, "new", 0))
    w.flush()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('CREATE TABLE public."sm_totals" (customer_id bigint PRIMARY KEY, n text, _kf_version bigint)')
    with pytest.raises(ViewSchemaMismatch) as err:
        Follower(defs.totals("sm", name="sm_totals"), rt).start()
    msg = str(err.value)
    assert '"public"."sm_totals"' in msg and "'n' is text" in msg and "'total' is missing" in msg


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the follower process starts its own Spark after every kill; minutes on a busy machine
def test_follow_killed_with_sigkill_mid_batch_resumes_exactly_once(
    spark: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path
) -> None:
    """3 seeded kill -9 trials (5 with KF_THOROUGH_KILLS=1) of a follower process while it applies batches; after each
    restart the view must equal a fresh replay (custom fold: a batch applied twice would
    count its events twice)."""
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink, ensure_migrated

    ensure_migrated(pg_dsn)
    source = "kill"
    w = TableWriter(embedded_log, orders_schema(source), partitions=2)
    random_history(w, seed=8, n=200)
    proj = defs.custom(source)
    ckpt = tmp_path / "ckpt"
    rnd = random.Random(1234)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(RUNNER), str(embedded_log.path), pg_dsn, str(ckpt), source, "custom"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    proc = start()
    try:
        for trial in range(trial_count(3, 5)):
            before = sum(positions(pg_dsn, proj.name).values())
            more_changes(w, rnd, 80, 2000 + trial)
            # let it commit at least one batch of the new changes, then kill at a random moment
            wait(lambda b=before: sum(positions(pg_dsn, proj.name).values()) > b, 240, f"trial {trial}: progress")
            time.sleep(rnd.uniform(0.0, 1.0))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            proc = start()
        wait(lambda: caught_up(embedded_log, w.topic, pg_dsn, proj.name), 300, "the follower to catch up")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
    followed = view_rows(pg_dsn, proj.name, "id, customer_id, changes, last_op")
    assert [(r[0], r[1]) for r in followed] == [(r["id"], r["customer_id"]) for _, r in sorted(w.rows.items())]
    rt = Runtime(spark, str(embedded_log.path), PostgresSink(pg_dsn), checkpoint_dir=tmp_path / "other")
    try:
        replay(proj, rt)
    finally:
        rt.close()
    assert view_rows(pg_dsn, proj.name, "id, customer_id, changes, last_op") == followed
