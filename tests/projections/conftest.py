"""Fixtures for projection tests: a Runtime on the shared SparkSession."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def source_name() -> str:
    """A unique source (topic prefix) per test: Kafka topics outlive a test."""
    return "s" + uuid.uuid4().hex[:8]


@pytest.fixture
def rt(spark: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path) -> Iterator[Any]:
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    runtime = Runtime(spark, str(embedded_log.path), PostgresSink(pg_dsn), checkpoint_dir=tmp_path / "ckpt")
    yield runtime
    runtime.close()
