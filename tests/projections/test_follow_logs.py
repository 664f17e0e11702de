"""What a follower prints: timestamped lines saying when it runs and has caught up, one line per
failure during a PostgreSQL outage, no Spark / py4j / JVM noise, nothing after a kill -9.

Issue 13 items 16 and 17: one PostgreSQL restart produced ~250 lines of Spark and Python stack
traces in a follower's log; a follower killed with -9 left a dying JVM's error as its last line;
"following ... Ctrl-C stops" was printed long before the follower ran a batch.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from tests._kill import wait_for
from tests.projections import defs
from tests.projections.pj_helpers import orders_schema
from tests.projections.test_follow import more_changes
from tests.projections.test_replay import random_history

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
KAPPAFLOW_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S")
# Printed by the java launcher itself (Spark starts its JVM with an incubator module), not by a logger.
JVM_START_LINE = "WARNING: Using incubator modules: jdk.incubator.vector"


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _stop_fast(pg: Any) -> None:
    """Stop the server the way a restart does (``pg_ctl stop -m fast``: clients disconnected at
    once); the default smart shutdown would wait for the follower's sessions to end."""
    from kappaflow.testing.servers._process import as_user
    from kappaflow.testing.servers.postgres import find_pg_bin

    subprocess.run(as_user(pg.os_user, [str(find_pg_bin() / "pg_ctl"), "-D", str(pg.datadir), "stop", "-m", "fast",
                                        "-w", "-t", "60"]), check=True, capture_output=True)
    pg.proc.wait(30)
    pg.proc = None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_follower_output_through_a_postgresql_restart_and_a_kill_9(
    embedded_log: Any, spark: Any, tmp_path: Path
) -> None:
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink
    from kappaflow.testing.servers.postgres import PrivatePostgres

    # Its own PostgreSQL: this test stops and restarts it under the follower.
    pg = PrivatePostgres(keep=True).start()
    proc: subprocess.Popen[bytes] | None = None
    stop_writing = threading.Event()
    try:
        dsn = pg.create_database("views")
        w = TableWriter(embedded_log, orders_schema("flog"), partitions=2)
        random_history(w, seed=5, n=120)
        proj = defs.custom("flog", name="flog_changes")
        rt = Runtime(spark, str(embedded_log.path), PostgresSink(dsn), checkpoint_dir=tmp_path / "unused")
        try:
            replay(proj, rt)
        finally:
            rt.close()
        (tmp_path / "flog_proj.py").write_text(
            "from tests.projections import defs\nChanges = defs.custom('flog', name='flog_changes')\n"
        )
        (tmp_path / "kappaflow.toml").write_text(
            f'[log]\nurl = "{embedded_log.path}"\npartitions = 2\n[views]\npostgres_dsn = "{dsn}"\n'
            f'[spark]\nmaster = "local[1]"\ncheckpoint_dir = "{tmp_path / "ckpt"}"\n'
            '[spark.conf]\n"spark.ui.enabled" = "false"\n"spark.sql.shuffle.partitions" = "2"\n'
        )
        out = tmp_path / "follow.log"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
        with out.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kappaflow.cli", "follow", "flog_proj:Changes", "--trigger", "0.3s"],
                cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
            )

        def end() -> int:
            return sum(embedded_log.end_offsets(w.topic).values())

        def printed(pattern: str) -> bool:
            assert proc is not None and proc.poll() is None, "the follower exited:\n" + out.read_text()
            return any(re.search(pattern, ln) for ln in _lines(out))

        name = re.escape("flog_changes/postgres")
        wait_for(lambda: printed(rf"follower {name} running: position [\d,]+ of log end"), 240,
                 "the follower to say it runs")
        wait_for(lambda: printed(rf"follower {name} caught up: position {end():,} = log end \(lag 0\)"), 240,
                 "the follower to say it caught up")
        # --- a PostgreSQL outage: stopped while changes arrive, started again ---------------------------
        _stop_fast(pg)
        more_changes(w, random.Random(3), 40, 3000)
        wait_for(lambda: printed(rf"WARNING follower {name}: restart failed: .*; restarting from the sink's "
                                 r"positions in [\d.]+s \(attempt \d+/\d+\)"), 180,
                 "a failure line per failed restart during the outage")
        pg.start()
        wait_for(lambda: printed(rf"follower {name} caught up: position {end():,} = log end"), 240,
                 "the follower to catch up after PostgreSQL came back")
        lines = _lines(out)
        noise = [ln for ln in lines if not KAPPAFLOW_LINE.match(ln) and ln != JVM_START_LINE]
        assert not noise, "lines that are not kappaflow's own (Spark, py4j, JVM, tracebacks):\n" + "\n".join(noise[:40])
        failures = [ln for ln in lines if " WARNING " in ln and "failed" in ln]
        # each failure: what failed, the cause, and what happens next
        assert failures and all(re.search(r"; (restarting from the sink's positions|retrying) in [\d.]+s \(attempt "
                                          r"\d+/\d+\)$", ln) for ln in failures), "\n".join(failures)
        assert len(lines) < 40, "too many lines for one outage:\n" + "\n".join(lines)

        # --- kill -9 of the follower process (not its JVM) while it applies batches ----------------------
        def write() -> None:
            rnd = random.Random(11)
            minute = 4000
            while not stop_writing.is_set():
                more_changes(w, rnd, 10, minute)
                minute += 1
                time.sleep(0.05)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        seen = len(_lines(out))
        wait_for(lambda: any(" batch " in ln for ln in _lines(out)[seen:]), 180, "a batch of the new changes")
        jvms = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_for(lambda: not any(_alive(p) for p in jvms), 120, "the follower's JVM to exit after the kill")
        stop_writing.set()
        writer.join(30)
        lines = _lines(out)
        noise = [ln for ln in lines if not KAPPAFLOW_LINE.match(ln) and ln != JVM_START_LINE]
        assert not noise, "a dying JVM or Python worker printed:\n" + "\n".join(noise[:40])
        assert KAPPAFLOW_LINE.match(lines[-1]), lines[-1]
    finally:
        stop_writing.set()
        if proc is not None and proc.poll() is None:
            for child in _children(proc.pid):
                os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.wait(30)
        pg.keep = False
        pg.stop()


def test_follower_says_when_it_runs_and_when_it_caught_up(
    rt: Any, embedded_log: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """In process: the progress lines come from the follower's state, not from its start() returning."""
    from kappaflow.cli.follow_progress import FollowProgress
    from kappaflow.projections.follow import FollowerGroup

    w = TableWriter(embedded_log, orders_schema("fprog"), partitions=2)
    random_history(w, seed=3, n=60)
    proj = defs.latest("fprog", name="fprog_latest")
    replay(proj, rt)
    more_changes(w, random.Random(2), 30, 500)  # the view is behind when the follower starts
    end = sum(embedded_log.end_offsets(w.topic).values())
    group = FollowerGroup(proj, rt, trigger="0.2s")
    progress = FollowProgress(group, interval=0.1)
    caplog.set_level(logging.INFO, logger="kappaflow")
    group.start()
    progress.start()
    try:
        f = group["postgres"]
        assert f.wait_for(lambda s: f.caught_up(), 180), "the follower did not catch up"
        wait_for(lambda: any("caught up" in r.getMessage() for r in caplog.records), 60, "the caught-up line")
    finally:
        progress.stop()
        group.stop()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("kappaflow.follow")]
    running = [m for m in messages if " running: " in m]
    assert running and re.match(r"follower fprog_latest/postgres running: position [\d,]+ of log end [\d,]+ "
                                r"\(lag [\d,]+ records\)", running[0]), messages
    caught = [m for m in messages if " caught up: " in m]
    assert caught[-1] == f"follower fprog_latest/postgres caught up: position {end:,} = log end (lag 0)", messages
    assert messages.index(running[0]) < messages.index(caught[-1])
    batches = [m for m in messages if " batch " in m]
    assert batches and all(re.search(r"; lag [\d,]+$", m) for m in batches), messages


def test_a_failure_that_crossed_spark_is_described_in_one_line(spark: Any) -> None:
    """A Python error inside a Spark task reaches the driver wrapped in Spark's and py4j's text
    (the Python traceback, the Java stack); ``describe`` names the error that was raised."""
    from kappaflow.logs import describe

    def boom(batches: Any) -> Any:
        for _ in batches:
            raise ValueError("order 7: amount is not a number")
        yield from ()

    with pytest.raises(Exception) as info:
        spark.range(3).mapInArrow(boom, "id long").collect()
    assert len(str(info.value).splitlines()) > 1  # what used to be logged: the whole traceback
    assert describe(info.value) == "ValueError: order 7: amount is not a number"


def test_a_streaming_batch_failure_is_described_in_one_line(rt: Any, embedded_log: Any, tmp_path: Path) -> None:
    """A kappaflow error raised in a foreachBatch function comes back from Spark as a
    StreamingQueryException holding the Python traceback; the follower's line is its message."""
    from kappaflow.errors import SinkError
    from kappaflow.logs import describe

    w = TableWriter(embedded_log, orders_schema("fdesc"), partitions=1)
    random_history(w, seed=1, n=5)

    def fail(df: Any, batch_id: int) -> None:
        raise SinkError("PostgreSQL sink: writing the batch: server closed the connection unexpectedly")

    q = (rt.stream([w.topic], {w.topic: {0: 0}}).writeStream.foreachBatch(fail)
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        with pytest.raises(Exception) as info:
            q.awaitTermination(120)
    finally:
        q.stop()
    assert "Traceback" in str(info.value)
    assert describe(info.value) == "PostgreSQL sink: writing the batch: server closed the connection unexpectedly"
    assert describe(RuntimeError("connection failed: refused\n\tIs the server running?")) == (
        "RuntimeError: connection failed: refused Is the server running?")


def test_spark_log_level_is_configurable_and_checked(tmp_path: Path) -> None:
    from kappaflow.config import Settings
    from kappaflow.errors import ConfigError
    from kappaflow.logs import spark_log_conf

    assert Settings().spark.log_level == "off"
    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text('[spark]\nlog_level = "WARN"\n')
    assert Settings.load(cfg).spark.log_level == "warn"
    cfg.write_text('[spark]\nlog_level = "loud"\n')
    with pytest.raises(ConfigError, match="log_level"):
        Settings.load(cfg)
    opts = spark_log_conf("info", {"spark.driver.extraJavaOptions": "-Xss4m"})["spark.driver.extraJavaOptions"]
    assert opts.startswith("-Xss4m ") and "-Dkappaflow.spark.log.level=info" in opts
    assert "-Dlog4j2.configurationFile=file:" in opts
