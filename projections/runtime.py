"""What replay/follow/verify run against: a SparkSession, the log, the view sinks.

``Runtime.from_settings(settings)`` builds it from ``kappaflow.toml`` (one sink per
configured ``[views.<kind>]`` table: ``postgres.dsn``, ``search.url``, ``redis.url``; see the sink
registry, ``sinks/registry.py``); tests and
applications may build one directly: ``Runtime(spark, log_url, sink)`` (one sink) or
``Runtime(spark, log_url, pg_sink, sinks={"postgres": pg_sink, "redis": redis_sink})``.
A projection writes to the sinks it names (``Projection.sinks``), see ``sinks_for``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from kappaflow.errors import ConfigError
from kappaflow.projections.datasource import (
    FORMAT,
    consistent_end_offsets,
    log_options_to_spark,
    offsets_to_json,
    open_cached_log,
    register,
)
from kappaflow.projections.sinks.base import Sink
from kappaflow.projections.sinks.registry import SINKS, open_sinks

Offsets = dict[str, dict[int, int]]

SINK_SETTINGS = {name: kind.setting_key for name, kind in SINKS.items()}
"""The ``kappaflow.toml`` key that configures each sink (from the sink registry)."""


def spark_session(master: str = "local[*]", app_name: str = "kappaflow", conf: dict[str, str] | None = None,
                  ship_modules: tuple[str, ...] = (), log_level: str = "off") -> SparkSession:
    """A SparkSession for kappaflow jobs (workers run this interpreter; UTC; few shuffle partitions).

    `ship_modules` names extra top-level modules executors need on a cluster (e.g. `examples`).
    `log_level`: Spark's own logging (driver JVM log4j, py4j), off by default: kappaflow says
    what failed in one line of its own (``kappaflow.logs``).
    """
    from kappaflow.logs import quiet_spark_python, spark_log_conf

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
        # A Python worker connects back to the JVM within this time (Spark's default 15 s): on a busy
        # machine a streaming source's Python runner took longer and failed the query ("Python worker
        # failed to connect back").
        "spark.python.authenticate.socketTimeout": "120s",
    }
    merged = {**defaults, **(conf or {})}
    merged.update(spark_log_conf(log_level, merged))
    for k, v in merged.items():
        builder = builder.config(k, v)
    quiet_spark_python(log_level)
    _launch_driver_jvm(master, app_name, merged)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level.upper())
    if not master.startswith("local"):
        # Executors on a cluster get kappaflow's code the way --py-files would ship it.
        from kappaflow.spark import code_archive

        spark.sparkContext.addPyFile(str(code_archive(ship_modules)))
    register(spark)
    return spark


def _launch_driver_jvm(master: str, app_name: str, conf: dict[str, str]) -> None:
    """Start the driver JVM with its stdout/stderr piped through this process.

    Why: a JVM inheriting the follower's stderr outlives a follower killed with -9 long enough to
    print its own shutdown errors (``RpcEnvStoppedException`` from the stream execution thread,
    ``Py4JNetworkException``) as the last lines of the follower's log, where they read like the cause.
    Piped, whatever the JVM prints is forwarded line by line while this process lives and goes
    nowhere once it is gone. pyspark's own ``launch_gateway`` does the start (same command, same
    ``--conf`` arguments); a gateway that already exists (a session in this process) is reused.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return  # a gateway of this process, or spark-submit's (its JVM is not ours to pipe)
    spark_conf = SparkConf(loadDefaults=False).setMaster(master).setAppName(app_name)
    for k, v in conf.items():
        spark_conf.set(k, v)
    gateway = launch_gateway(spark_conf, popen_kwargs={"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT})
    if gateway.proc is not None and gateway.proc.stdout is not None:
        threading.Thread(target=_forward, args=(gateway.proc.stdout,), name="kappaflow-jvm-output",
                         daemon=True).start()
    SparkContext._gateway = gateway
    SparkContext._jvm = gateway.jvm


def _forward(stream: Any) -> None:
    """Copy the driver JVM's output to this process's stderr, one line at a time."""
    for line in iter(stream.readline, b""):
        try:
            sys.stderr.write(line.decode("utf-8", "replace"))
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed at interpreter exit
            return


def session_from_settings(settings: Any) -> SparkSession:
    """The SparkSession ``[spark]`` describes (master, app name, conf, log level)."""
    sp = settings.spark
    return spark_session(sp.master, sp.app_name, sp.conf, log_level=sp.log_level)


def ledger_keys_of(settings: Any) -> dict[str, dict[str, str]]:
    """The ``ledgerKeys`` data source option for the configured ledger sources (no secrets)."""
    from kappaflow.config import LedgerSourceConfig

    out: dict[str, dict[str, str]] = {}
    for name, src in settings.sources.items():
        if isinstance(src, LedgerSourceConfig):
            spec = {"name": name, "dsn": src.dsn, "schema": src.schema_name}
            if src.password_env:
                spec["password_env"] = src.password_env
            out[f"{name}."] = spec
    return out


@dataclass
class Runtime:
    """``sink`` is the primary sink (PostgreSQL when configured); ``sinks`` every configured
    one by kind ("postgres", "search", "redis"), ``sink`` included."""

    spark: SparkSession
    log_url: str
    sink: Sink
    log_options: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path = Path(".kappaflow/checkpoints")
    dsn: str | None = None  # the views database (registry), when a sink is PostgreSQL
    sinks: dict[str, Sink] = field(default_factory=dict)
    # Ledger sources: topic prefix -> where the subject keys live, so projections read personal
    # fields decrypted (kappaflow.ledger.personal). Passwords stay in the environment.
    ledger_keys: dict[str, dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.spark is not None and getattr(self.spark, "sparkContext", None) is not None:
            register(self.spark)
        self.sinks = dict(self.sinks)
        if self.sink.kind not in self.sinks:
            self.sinks[self.sink.kind] = self.sink
        for kind, s in self.sinks.items():
            if kind != s.kind:
                raise ConfigError(f"Runtime.sinks[{kind!r}]: the sink is a {s.kind!r} sink")
        pg = self.sinks.get("postgres")
        if self.dsn is None and pg is not None and getattr(pg, "dsn", None):
            self.dsn = getattr(pg, "dsn", None)

    def attach_spark(self, spark: SparkSession) -> None:
        """Use `spark` from now on: a runtime built ``with_spark=False`` gets its session late,
        e.g. after the CLI has checked the projection's locks (Spark takes seconds to start)."""
        self.spark = spark
        register(spark)

    def sink_for(self, projection: str, kind: str) -> Sink:
        """The configured sink of `kind`, or a ConfigError naming the projection and the missing key."""
        s = self.sinks.get(kind)
        if s is None:
            key = SINK_SETTINGS.get(kind, f"views.{kind}")
            env = "KAPPAFLOW_" + key.upper().replace(".", "__")
            raise ConfigError(
                f"projection {projection!r} writes to the {kind} sink, but {key} is not configured "
                f"(set it in kappaflow.toml or {env})"
            )
        return s

    def sinks_for(self, spec: Any, only: Sequence[str] | None = None) -> dict[str, Sink]:
        """The sinks of a projection (``spec.sinks``, in order), or the `only` ones among them."""
        declared = tuple(getattr(spec, "sinks", ("postgres",)))
        names = declared
        if only:
            unknown = [n for n in only if n not in declared]
            if unknown:
                raise ConfigError(
                    f"--sink {','.join(unknown)}: projection {spec.name!r} does not write to {unknown} "
                    f"(its sinks: {list(declared)})"
                )
            names = tuple(n for n in declared if n in only)
        return {n: self.sink_for(spec.name, n) for n in names}

    @classmethod
    def from_settings(cls, settings: Any, spark: SparkSession | None = None, *, with_spark: bool = True) -> Runtime:
        """From ``kappaflow.toml``. ``with_spark=False``: no SparkSession (status, query)."""
        log_url = settings.log.url
        if not settings.log.is_kafka:
            p = Path(log_url.removeprefix("file:"))
            log_url = str(p if p.is_absolute() else settings.base_dir / p)
        options = settings.log.open_options()  # {} for the embedded log
        sinks = open_sinks(settings.views)
        dsn = settings.views.postgres.connect_dsn() if settings.views.postgres.configured else None
        if spark is None and with_spark:
            spark = session_from_settings(settings)
        primary = sinks.get("postgres") or next(iter(sinks.values()))
        return cls(spark=spark, log_url=log_url, sink=primary, log_options=options,  # type: ignore[arg-type]
                   checkpoint_dir=settings.resolve(settings.spark.checkpoint_dir), dsn=dsn, sinks=sinks,
                   ledger_keys=ledger_keys_of(settings))

    # --- log access -------------------------------------------------------------------------
    def reader(self) -> Any:
        return open_cached_log(self.log_url, self.log_options)

    def end_offsets(self, topics: list[str]) -> Offsets:
        log = self.reader()
        return {t: dict(log.end_offsets(t)) for t in topics}

    def read_end(self, topics: list[str], consistency: str = "transactions") -> Offsets:
        """Where a replay of `topics` stops: the newest consistent cut of each source
        (``kappaflow.connectors.cuts``), or the log's end with ``per_key``."""
        if consistency == "per_key":
            return self.end_offsets(topics)
        return consistent_end_offsets(self.log_url, self.log_options, topics)

    def _options(self) -> dict[str, str]:
        opts = {"log": self.log_url, **log_options_to_spark(self.log_options)}
        if self.ledger_keys:
            import json

            opts["ledgerKeys"] = json.dumps(self.ledger_keys, sort_keys=True)
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
               latest_per_key: bool = False, consistency: str = "transactions") -> DataFrame:
        reader = self.spark.readStream.format(FORMAT).options(**self._options()).option("topics", ",".join(topics))
        reader = reader.option("consistency", consistency)
        if latest_per_key:
            reader = reader.option("latestPerKey", "true")
        reader = reader.option("startingOffsets", offsets_to_json(start))
        if max_per_trigger:
            reader = reader.option("maxRecordsPerTrigger", str(max_per_trigger))
        return reader.load()

    def registry(self) -> Any:
        from kappaflow.projections.registry import Registry

        if not self.dsn:
            raise ConfigError("views.postgres.dsn: the projections registry lives in the PostgreSQL views database")
        return Registry(self.dsn)

    def close(self) -> None:
        seen: set[int] = set()
        for s in [self.sink, *self.sinks.values()]:
            if id(s) not in seen:
                seen.add(id(s))
                s.close()


__all__ = ["SINK_SETTINGS", "Runtime", "open_sinks", "session_from_settings", "spark_session"]
