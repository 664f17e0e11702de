"""A PostgreSQL capture process for the consistent-views kill test (killed with -9 by the test).

    python bank_capture_runner.py LOG_DIR DSN SOURCE

Captures ``public.accounts`` of DSN as source SOURCE (the slot and publication the test's bank
created, ``kf_<SOURCE>``) into the embedded log at LOG_DIR until killed.
"""

from __future__ import annotations

import sys

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog


def main(log_dir: str, dsn: str, source: str) -> None:
    cfg = PostgresSourceConfig(name=source, dsn=dsn, tables=["public.accounts"], heartbeat_interval_s=0.5,
                               slot=f"kf_{source}", publication=f"kf_{source}")
    log = EmbeddedLog(log_dir)
    try:
        PostgresConnector(cfg, log, partitions=3, progress=False, linger_s=0.005).run(StopSignal())
    finally:
        log.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
