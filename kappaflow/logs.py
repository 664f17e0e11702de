"""How kappaflow's long-running commands log: timestamped lines, one line per failure, Spark quiet.

Why: one PostgreSQL restart under a follower printed ~250 lines of Spark and Python stack
traces before kappaflow's own message (which embedded a traceback of its own), and a follower
killed with -9 left a dying JVM's error as its last line, which reads like the cause. So:

- ``setup`` sends kappaflow's own log lines to stderr, each with a timestamp; a failure is
  one line (``describe``: the cause, without the Spark and py4j wrappers around it) and the
  caller says what happens next; full tracebacks only at debug level (``--debug``).
- Spark's own logging is off by default: the driver JVM's log4j (``spark_log_conf``, applied
  when the JVM starts, so its start-up lines and its shutdown errors after a kill -9 are off
  too), and the Python loggers of py4j and pyspark. ``[spark] log_level`` (or
  ``KAPPAFLOW_SPARK__LOG_LEVEL``) turns them back on: ``warn``, ``error``, ``info``, ``debug``.
  The JVM's own start-up warning about incubator modules is printed by Java itself, not by
  a logger, and stays.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

SPARK_LOG_LEVELS = ("off", "fatal", "error", "warn", "info", "debug", "trace", "all")
"""log4j levels accepted by ``[spark] log_level``."""

DATE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # UTC, as capture's lines (kappaflow.cli.progress_log.stamp)
LINE_FORMAT = "%(asctime)s %(levelname)s %(message)s"

_PY_LEVEL = {"off": logging.CRITICAL + 10, "fatal": logging.CRITICAL, "error": logging.ERROR,
             "warn": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG,
             "all": logging.NOTSET}

# Levels in the config file are resolved by log4j from a system property, so one file serves all.
_LOG4J2 = """\
# kappaflow: Spark's driver-side logging (see kappaflow/logs.py). Level: -Dkappaflow.spark.log.level
status = off
# The root level stays Spark's shell default (warn): Spark prints "Setting default log level to ..."
# when they differ. What reaches stderr is decided by the appender's threshold.
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.filter.threshold.type = ThresholdFilter
appender.stderr.filter.threshold.level = ${sys:kappaflow.spark.log.level:-off}
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yyyy-MM-dd'T'HH:mm:ss'Z'}{UTC} %p spark %c{1}: %m%n%ex
"""


def check_spark_level(level: str) -> str:
    """`level` in lower case, or ValueError naming the accepted levels."""
    lv = level.strip().lower()
    if lv == "warning":
        lv = "warn"
    if lv not in SPARK_LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(SPARK_LOG_LEVELS)}, got {level!r}")
    return lv


def log4j_config_file() -> Path:
    """kappaflow's log4j2 configuration for the driver JVM, written once to the temp folder."""
    path = Path(tempfile.gettempdir()) / "kappaflow-log4j2.properties"
    try:
        if path.read_text() == _LOG4J2:
            return path
    except OSError:
        pass
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent writers: same content, atomic rename
    tmp.write_text(_LOG4J2)
    tmp.replace(path)
    return path


def spark_log_conf(level: str = "off", conf: dict[str, str] | None = None) -> dict[str, str]:
    """The Spark conf that applies `level` to the driver JVM's log4j from its first line.

    Merged into `conf`'s own ``spark.driver.extraJavaOptions`` (the user's options are kept;
    a ``-Dlog4j2.configurationFile`` of theirs wins)."""
    lv = check_spark_level(level)
    existing = (conf or {}).get("spark.driver.extraJavaOptions", "")
    opts = [existing] if existing else []
    if "log4j2.configurationFile" not in existing:
        opts.append(f"-Dlog4j2.configurationFile=file:{log4j_config_file()}")
    opts.append(f"-Dkappaflow.spark.log.level={lv}")
    return {"spark.driver.extraJavaOptions": " ".join(opts)}


def quiet_spark_python(level: str = "off") -> None:
    """py4j's and pyspark's Python loggers at `level` (off: they print nothing; a dying JVM
    makes py4j log a traceback per pending call)."""
    py_level = _PY_LEVEL[check_spark_level(level)]
    for name in ("py4j", "pyspark"):
        logging.getLogger(name).setLevel(py_level)


class _Formatter(logging.Formatter):
    """Timestamped lines; a record's traceback is printed only when the logger is at debug level
    (a failure is one line otherwise: the message already names the cause)."""

    converter = time.gmtime  # type: ignore[assignment]  # typeshed: gmtime(secs=None) is the same

    def __init__(self, debug: bool) -> None:
        super().__init__(LINE_FORMAT, DATE_FORMAT)
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if not self.debug and record.exc_info:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


def setup(*, debug: bool = False, spark_level: str = "off", stream: object = None) -> logging.Logger:
    """Log kappaflow's lines to stderr with timestamps (idempotent); quiet Spark's Python loggers."""
    logger = logging.getLogger("kappaflow")
    for h in list(logger.handlers):
        if getattr(h, "_kappaflow", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(_Formatter(debug))
    handler._kappaflow = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False
    quiet_spark_python(spark_level)
    return logger


# --- one line per failure ---------------------------------------------------------------------------
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Timeout\w*)): ?(.*)$")
_NOISE = ("py4j.protocol.Py4JJavaError", "py4j.Py4JException", "java.util.concurrent.ExecutionException",
          "org.apache.spark.SparkException", "org.apache.spark.sql.execution.streaming.sources."
          "ForeachBatchUserFuncException", "pyspark.errors.exceptions")


def describe(exc: BaseException, limit: int = 400) -> str:
    """One line naming the cause of `exc`.

    kappaflow's own errors are their message. Errors that cross Spark (a failure in a batch
    function or a Python worker reaches the driver as a Py4J / Spark exception whose text holds
    the whole Python traceback and the Java stack) are reduced to the innermost exception
    line of that text. Other errors are ``Type: message``. Whitespace runs (psycopg's
    multi-line messages) become single spaces."""
    from kappaflow.errors import KappaflowError

    text = str(exc) if isinstance(exc, KappaflowError) else _innermost(exc)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _innermost(exc: BaseException) -> str:
    raw = str(exc)
    if "Traceback (most recent call last)" not in raw and not type(exc).__module__.startswith(("py4j", "pyspark")):
        return f"{type(exc).__name__}: {raw}" if raw.strip() else type(exc).__name__
    found: tuple[str, str] | None = None
    for line in raw.splitlines():
        m = _EXC_LINE.match(line.strip())
        if m and not m.group(1).startswith(_NOISE):
            found = (m.group(1), m.group(2).strip())  # the last one: the exception actually raised
    if found is not None:
        kind, msg = found
        # kappaflow's own errors read as their message; others keep their type (it says what failed).
        return msg if kind.startswith("kappaflow.") and msg else f"{kind}: {msg}" if msg else kind
    first = next((ln.strip() for ln in raw.splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


__all__ = [
    "SPARK_LOG_LEVELS",
    "check_spark_level",
    "describe",
    "log4j_config_file",
    "quiet_spark_python",
    "setup",
    "spark_log_conf",
]
