"""An interval-join follower in its own process with its own Spark (killed with -9 by
test_interval_join.py).

usage: interval_runner.py LOG_URL DSN CHECKPOINT SOURCE
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from kappaflow.projections import IntervalJoin, Projection


def unpaid(source: str) -> type[Projection]:
    """The projection of test_interval_join.CONFIGS["left-drop"], named ``<source>_paid``."""
    return type("OrdersPaid", (Projection,), {
        "name": f"{source}_paid", "sources": [f"{source}.public.orders"], "key": ["id"],
        "columns": ["id", "customer_id", "amount", "created_at"],
        "interval_join": IntervalJoin(
            "payment", f"{source}.public.payments", on={"id": "order_id"}, left_time="created_at",
            right_time="paid_at", within=(timedelta(0), timedelta(hours=1)), how="left", columns=["id", "amount"],
            delay=timedelta(minutes=10), allowed_lateness=timedelta(minutes=20), late="drop"),
    })


def main() -> None:
    log_url, dsn, checkpoint, source = sys.argv[1:5]
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink

    spark = spark_session("local[1]", conf={"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})
    rt = Runtime(spark, log_url, PostgresSink(dsn), checkpoint_dir=Path(checkpoint))
    f = Follower(unpaid(source), rt, trigger="0.2s", max_records_per_batch=40, checkpoint=checkpoint).start()
    print("following", flush=True)
    f.run_forever()


if __name__ == "__main__":
    main()
