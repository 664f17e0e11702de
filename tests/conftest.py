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
    try:
        from kappaflow.projections.datasource import register

        register(session)
    except ImportError:
        pass
    try:
        yield session
    finally:
        session.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using a server fixture are integration tests even when not marked by hand."""
    server_fixtures = {"pg_server", "pg_dsn", "mariadb_server", "mariadb_db", "redis_server",
                       "search_server", "kafka_broker", "kafka_log", "any_log", "spark"}
    for item in items:
        if server_fixtures & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
