"""A windowed-view follower in its own process with its own Spark (killed with -9 by test_windows.py).

usage: window_runner.py LOG_URL DSN CHECKPOINT SOURCE [tumbling|session]
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from kappaflow.projections import Count, Max, Projection, Session, Sum, Tumbling


def hourly(source: str) -> type[Projection]:
    """The projection of test_windows.CONFIGS["tumbling-drop-updates"], named ``<source>_hourly``."""
    return type("Hourly", (Projection,), {
        "name": f"{source}_hourly", "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "where": "status <> 'cancelled'",
        "window": Tumbling("created_at", size="1h", delay=timedelta(minutes=10),
                           allowed_lateness=timedelta(minutes=30), late="drop", emit="updates"),
        "aggregates": {"orders": Count(), "revenue": Sum("amount"), "largest": Max("amount")},
    })


def sessions(source: str) -> type[Projection]:
    """The projection of test_session_windows.CONFIGS["session-drop-updates"], named ``<source>_sessions``."""
    return type("Sessions", (Projection,), {
        "name": f"{source}_sessions", "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "where": "status <> 'cancelled'",
        "window": Session("created_at", gap=timedelta(minutes=20), delay=timedelta(minutes=10),
                          allowed_lateness=timedelta(minutes=30), late="drop", emit="updates"),
        "aggregates": {"orders": Count(), "revenue": Sum("amount"), "largest": Max("amount")},
    })


PROJECTIONS = {"tumbling": hourly, "session": sessions}


def main() -> None:
    log_url, dsn, checkpoint, source = sys.argv[1:5]
    make = PROJECTIONS[sys.argv[5] if len(sys.argv) > 5 else "tumbling"]
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink

    spark = spark_session("local[1]", conf={"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})
    rt = Runtime(spark, log_url, PostgresSink(dsn), checkpoint_dir=Path(checkpoint))
    f = Follower(make(source), rt, trigger="0.2s", max_records_per_batch=40, checkpoint=checkpoint).start()
    print("following", flush=True)
    f.run_forever()


if __name__ == "__main__":
    main()
