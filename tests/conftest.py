"""Session-wide real servers for the test suite.

Every server is private (own data dir, free loopback port), started once per
session on first use and stopped at exit. Tests that use one are marked
`integration`.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Spark's Python workers must run this interpreter (and see this venv).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

# JVM options for the Spark drivers the tests start in child processes (the followers, replays and CLI
# commands that kill tests run and kill with -9: spark-submit adds SPARK_SUBMIT_OPTS to the driver JVM).
# Those JVMs live seconds to a minute, so the C2 JIT compiler's work never pays off: with the C1 compiler
# only and the serial collector, a windows kill test (three follower processes) took 67 s instead of 80 s
# on the 2-core machine (repeated twice). The session's own SparkSession (the `spark` fixture) is
# started without them: it lives for the whole run, and with C1 only it was no faster (97.6 s vs 94.7 s
# for two Spark-heavy files). Not a product setting: a long-running follower wants C2.
CHILD_SPARK_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", CHILD_SPARK_JVM_OPTS)


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    from kappaflow.testing.servers.postgres import PrivatePostgres

    server = PrivatePostgres(wal_level="logical").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_dsn(pg_server: Any) -> Iterator[str]:
    """A fresh, empty database on the private PostgreSQL; dropped afterwards."""
    name = _unique("t")
    dsn = pg_server.create_database(name)
    try:
        yield dsn
    finally:
        pg_server.drop_database(name)


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[Any]:
    from kappaflow.testing.servers.mariadb import PrivateMariaDB

    server = PrivateMariaDB().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mariadb_db(mariadb_server: Any) -> Iterator[str]:
    """A fresh database (schema) name on the private MariaDB; dropped afterwards."""
    name = _unique("t")
    mariadb_server.execute(f"CREATE DATABASE `{name}`")
    try:
        yield name
    finally:
        mariadb_server.execute(f"DROP DATABASE IF EXISTS `{name}`")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Any]:
    from kappaflow.testing.servers.redis import PrivateRedis

    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def search_server() -> Iterator[Any]:
    from kappaflow.testing.servers.osmem import OsmemServer

    server = OsmemServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Any]:
    from kappaflow.testing.servers.tansu import TansuBroker

    broker = TansuBroker().start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def unique_topic() -> str:
    return _unique("topic").replace("_", "-")


@pytest.fixture
def embedded_log(tmp_path: Path) -> Iterator[Any]:
    from kappaflow.log.embedded import EmbeddedLog

    log = EmbeddedLog(tmp_path / "log")
    try:
        yield log
    finally:
        log.close()


@pytest.fixture
def kafka_log(kafka_broker: Any) -> Iterator[Any]:
    from kappaflow.log.kafka import KafkaLog

    log = KafkaLog(kafka_broker.bootstrap)
    try:
        yield log
    finally:
        log.close()


@pytest.fixture
def confluent_log(kafka_broker: Any) -> Iterator[Any]:
    """The Kafka log through the librdkafka (confluent-kafka) client."""
    from kappaflow.log.kafka.confluent import ConfluentKafkaLog

    log = ConfluentKafkaLog(kafka_broker.bootstrap)
    try:
        yield log
    finally:
        log.close()


@pytest.fixture(params=["embedded", "kafka"])
def any_log(request: pytest.FixtureRequest) -> Any:
    """Both log backends, for tests that must hold on each."""
    return request.getfixturevalue(f"{request.param}_log")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The one SparkSession of the test session (local[2])."""
    from pyspark.sql import SparkSession

    child_opts = os.environ.pop("SPARK_SUBMIT_OPTS", None)  # see CHILD_SPARK_JVM_OPTS: not for this JVM
    try:
        session = (
            SparkSession.builder.master("local[2]")
            .appName("kappaflow-tests")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.default.parallelism", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
    finally:
        if child_opts is not None:
            os.environ["SPARK_SUBMIT_OPTS"] = child_opts
    try:
        from kappaflow.projections.datasource import register

        register(session)
    except ImportError:
        pass
    try:
        yield session
    finally:
        session.stop()


# The longest test files, longest first (seconds per file in a full run, `--durations`). With
# KF_TEST_WORKERS=2 the suite runs on two pytest-xdist workers that take whole files (`--dist loadfile`,
# scripts/test.sh); a file handed
# out last that runs for minutes leaves one worker idle for that long. Longest-first keeps both busy to
# the end. Only an order: no test depends on another's (each file also passes alone).
LONGEST_FIRST = (
    "projections/test_replay_kill.py",
    "projections/test_joins.py",
    "projections/test_follow.py",
    "projections/test_consistent_views.py",
    "projections/test_follow_many.py",
    "ledger/test_bank_consistency.py",
    "cluster/test_standalone.py",
    "projections/test_joins_documents.py",
    "projections/test_follow_differential.py",
    "projections/test_windows.py",
    "projections/test_interval_join.py",
    "projections/test_window_asof.py",
    "monitoring/test_stack.py",
    "projections/test_joins_nested.py",
    "projections/test_session_windows.py",
)


@pytest.fixture(autouse=True, scope="session")
def _no_inherited_console_width() -> Iterator[None]:
    """A pytest-xdist worker runs with COLUMNS=80 in its environment (seen; a plain pytest has none).
    The CLI honours COLUMNS, as documented, so every `CliRunner` output would wrap at 80; the tests
    check the output a pipe gets, which is whole lines. Tests that set a width do it themselves."""
    saved = {k: os.environ.pop(k) for k in ("COLUMNS", "LINES") if k in os.environ}
    yield
    os.environ.update(saved)


def _file_rank(item: pytest.Item) -> int:
    path = item.path.as_posix()
    for rank, suffix in enumerate(LONGEST_FIRST):
        if path.endswith("tests/" + suffix):
            return rank
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using a server fixture are integration tests even when not marked by hand; the longest
    files run first (stable: the rest keep their collection order)."""
    items.sort(key=_file_rank)
    server_fixtures = {"pg_server", "pg_dsn", "mariadb_server", "mariadb_db", "redis_server",
                       "search_server", "kafka_broker", "kafka_log", "any_log", "spark"}
    for item in items:
        if server_fixtures & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
