"""What replay/follow/verify run against: a SparkSession, the log, the views sink.

``Runtime.from_settings(settings)`` builds it from ``kappaflow.toml``; tests and
applications may build one directly: ``Runtime(spark, log_url, sink)``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from kappaflow.errors import ConfigError
from kappaflow.projections.datasource import FORMAT, offsets_to_json, open_cached_log, register
from kappaflow.projections.sinks.base import Sink

Offsets = dict[str, dict[int, int]]


def spark_session(master: str = "local[*]", app_name: str = "kappaflow", conf: dict[str, str] | None = None,
                  ship_modules: tuple[str, ...] = ()) -> SparkSession:
    """A SparkSession for kappaflow jobs (workers run this interpreter; UTC; few shuffle partitions).

    `ship_modules` names extra top-level modules executors need on a cluster (e.g. `examples`).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    cores = os.cpu_count() or 2
    defaults = {
        "spark.sql.shuffle.partitions": str(max(2, min(cores * 2, 64))),
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "20000",
        "spark.driver.memory": "2g",
    }
    for k, v in {**defaults, **(conf or {})}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not master.startswith("local"):
        # Executors on a cluster get kappaflow's code the way --py-files would ship it.
        from kappaflow.spark import code_archive

        spark.sparkContext.addPyFile(str(code_archive(ship_modules)))
    register(spark)
    return spark


@dataclass
class Runtime:
    spark: SparkSession
    log_url: str
    sink: Sink
    log_options: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path = Path(".kappaflow/checkpoints")
    dsn: str | None = None  # the views database (registry), when the sink is PostgreSQL

    def __post_init__(self) -> None:
        register(self.spark)
        if self.dsn is None and getattr(self.sink, "dsn", None):
            self.dsn = self.sink.dsn

    @classmethod
    def from_settings(cls, settings: Any, spark: SparkSession | None = None) -> Runtime:
        from kappaflow.projections.sinks.postgres import PostgresSink

        log_url = settings.log.url
        if not settings.log.is_kafka:
            p = Path(log_url.removeprefix("file:"))
            log_url = str(p if p.is_absolute() else settings.base_dir / p)
        options = settings.log.kafka.client_options() if settings.log.is_kafka else {}
        if options:
            options = {k: v for k, v in options.items() if k != "client_id"}
        dsn = settings.views.postgres_connect_dsn()
        if spark is None:
            spark = spark_session(settings.spark.master, settings.spark.app_name, settings.spark.conf)
        return cls(spark=spark, log_url=log_url, sink=PostgresSink(dsn), log_options=options,
                   checkpoint_dir=settings.resolve(settings.spark.checkpoint_dir), dsn=dsn)

    # --- log access -------------------------------------------------------------------------
    def reader(self) -> Any:
        return open_cached_log(self.log_url, self.log_options)

    def end_offsets(self, topics: list[str]) -> Offsets:
        log = self.reader()
        return {t: dict(log.end_offsets(t)) for t in topics}

    def _options(self) -> dict[str, str]:
        opts = {"log": self.log_url}
        for k, v in self.log_options.items():
            opts[f"kafka.{k}"] = str(v)
        return opts

    def raw(self, topic: str, start: Offsets | str = "earliest", end: Offsets | str = "latest",
            max_records_per_partition: int | None = None, *, latest_per_key: bool = False) -> DataFrame:
        """The raw records of one topic between two offset maps (batch)."""
        reader = self.spark.read.format(FORMAT).options(**self._options()).option("topics", topic)
        if latest_per_key:
            reader = reader.option("latestPerKey", "true")
        reader = reader.option("startingOffsets", start if isinstance(start, str) else offsets_to_json(
            {topic: start.get(topic, {})}))
        reader = reader.option("endingOffsets", end if isinstance(end, str) else offsets_to_json(
            {topic: end.get(topic, {})}))
        if max_records_per_partition:
            reader = reader.option("maxRecordsPerPartition", str(max_records_per_partition))
        return reader.load()

    def stream(self, topics: list[str], start: Offsets, max_per_trigger: int | None = None, *,
               latest_per_key: bool = False) -> DataFrame:
        reader = self.spark.readStream.format(FORMAT).options(**self._options()).option("topics", ",".join(topics))
        if latest_per_key:
            reader = reader.option("latestPerKey", "true")
        reader = reader.option("startingOffsets", offsets_to_json(start))
        if max_per_trigger:
            reader = reader.option("maxRecordsPerTrigger", str(max_per_trigger))
        return reader.load()

    def registry(self) -> Any:
        from kappaflow.projections.registry import Registry

        if not self.dsn:
            raise ConfigError("views.postgres_dsn: the projections registry lives in the PostgreSQL views database")
        return Registry(self.dsn)

    def close(self) -> None:
        self.sink.close()


__all__ = ["Runtime", "spark_session"]
