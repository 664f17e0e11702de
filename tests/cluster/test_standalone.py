"""Projections on a real Spark standalone cluster equal the local[*] result, by configuration only.

The master and the worker are separate JVMs started from the PySpark installation. Executors run a
Python that sees the third-party packages but NOT this working tree, so kappaflow's code reaches them
only because the driver ships it (a zip added with addPyFile, as `--py-files` would).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from examples.shop.demo import seed
from examples.shop.projections import CustomerActivity, CustomerTotals
from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.replay import replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.testing.servers.spark_cluster import SparkStandalone, isolated_python

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DIR = Path(tempfile.mkdtemp(prefix="kappaflow-cluster-test-"))
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def executor_python() -> str:
    """PYSPARK_PYTHON for the cluster: the isolated Python inside executors, the full one elsewhere.

    The driver machine runs kappaflow (its planner workers import the data source there, as on any
    real driver host); the executors stand for other machines without kappaflow installed. Spark
    gives both the same PYSPARK_PYTHON, so a wrapper picks by working directory: executors run inside
    the worker's work dir.
    """
    folder = CLUSTER_DIR
    isolated = isolated_python(folder / "venv")
    res = subprocess.run([isolated, "-c", "import kappaflow"], cwd="/", capture_output=True, text=True, check=False)
    assert res.returncode != 0, "the executors' Python must not see kappaflow unless it is shipped"
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\ncase "$PWD" in {CLUSTER_DIR / "spark"}/*) exec {isolated} "$@";; esac\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture(scope="module")
def cluster(executor_python: str) -> Iterator[SparkStandalone]:
    c = SparkStandalone(cores=2, memory="1500m", executor_python=executor_python,
                        workdir=CLUSTER_DIR / "spark").start()
    try:
        yield c
    finally:
        c.stop()
        import shutil

        shutil.rmtree(CLUSTER_DIR, ignore_errors=True)


def _rows(dsn: str, table: str, order: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT * FROM public.{table} ORDER BY {order}").fetchall()  # test-owned names


def _capture(db: str, log_dir: Path) -> None:
    with EmbeddedLog(log_dir) as log:
        cfg = PostgresSourceConfig(name="shop", dsn=db, tables=["public.customers", "public.orders"])
        PostgresConnector(cfg, log, partitions=2).run(StopSignal(), until_caught_up=True)


def _kappaflow(config: Path, *args: str, executor_python: str, **kw: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, PYSPARK_PYTHON=executor_python, PYSPARK_DRIVER_PYTHON=sys.executable)
    return subprocess.Popen([sys.executable, "-m", "kappaflow.cli", "--config", str(config), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_cluster_replay_and_follow_equal_local(tmp_path: Path, pg_server: Any, spark: Any, cluster: SparkStandalone,
                                               executor_python: str) -> None:
    source_db = pg_server.create_database("cl_source")
    local_db = pg_server.create_database("cl_local")
    cluster_db = pg_server.create_database("cl_cluster")
    try:
        seed(source_db, customers=12, orders=300)
        log_dir = tmp_path / "log"
        _capture(source_db, log_dir)

        rt = Runtime(spark, str(log_dir), PostgresSink(local_db))
        for projection in (CustomerTotals, CustomerActivity):
            replay(projection, rt)

        config = tmp_path / "kappaflow.toml"
        config.write_text(
            f'[log]\nurl = "{log_dir}"\n[views]\npostgres_dsn = "{cluster_db}"\n'
            f'[spark]\nmaster = "{cluster.url}"\ncheckpoint_dir = "{tmp_path / "ckpt"}"\n'
            '[spark.conf]\n"spark.executor.memory" = "1g"\n"spark.cores.max" = "2"\n'
            )
        # A replay with a custom Python fold: the fold itself and the data source run on executors.
        proc = _kappaflow(config, "replay", "examples.shop:CustomerActivity", executor_python=executor_python)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"cluster replay failed:\n{out[-15000:]}"
        assert _rows(cluster_db, "order_activity", "id") == _rows(local_db, "order_activity", "id")

        # follow on the cluster while the source changes; the local replay of the same log is the reference
        follower = _kappaflow(config, "follow", "examples.shop:CustomerTotals", "--trigger", "0.5s",
                              executor_python=executor_python, start_new_session=True)
        try:
            with psycopg.connect(source_db) as conn:
                conn.execute("UPDATE public.orders SET customer_id = 1 WHERE id BETWEEN 1 AND 40")
                conn.execute("UPDATE public.orders SET status = 'cancelled' WHERE id BETWEEN 41 AND 60")
                conn.execute("DELETE FROM public.orders WHERE id BETWEEN 61 AND 70")
            _capture(source_db, log_dir)
            replay(CustomerTotals, rt)
            expected = _rows(local_db, "customer_totals", "customer_id")
            deadline = time.monotonic() + 180
            got: list[tuple[Any, ...]] = []
            while time.monotonic() < deadline:
                if follower.poll() is not None:
                    pytest.fail(f"cluster follow exited:\n{follower.stdout.read() if follower.stdout else ''}")
                try:
                    got = _rows(cluster_db, "customer_totals", "customer_id")
                except psycopg.errors.UndefinedTable:
                    got = []  # the follower has not created its view yet
                if got == expected:
                    break
                time.sleep(0.5)
            assert got == expected, "the cluster follower did not reach the local replay's view within 180 s"
        finally:
            os.killpg(follower.pid, signal.SIGTERM)
            try:
                follower.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(follower.pid, signal.SIGKILL)
                follower.wait(10)
    finally:
        for name in ("cl_source", "cl_local", "cl_cluster"):
            pg_server.drop_database(name)
