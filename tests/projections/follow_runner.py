"""A follower in its own process with its own Spark (killed with -9 by test_follow.py).

usage: follow_runner.py LOG_URL DSN CHECKPOINT SOURCE KIND [MAX_RECORDS_PER_BATCH]

(for KIND "accounts", SOURCE is the accounts topic; MAX_RECORDS_PER_BATCH defaults to 60, 0 = no limit)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def main() -> None:
    log_url, dsn, checkpoint, source, kind = sys.argv[1:6]
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink
    from tests.projections import defs
    from tests.projections.join_helpers import order_docs

    spark = spark_session("local[1]", conf={"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})
    rt = Runtime(spark, log_url, PostgresSink(dsn), checkpoint_dir=Path(checkpoint))
    kinds = {"custom": defs.custom, "totals": defs.totals, "latest": defs.latest,
             "joins": lambda s: order_docs(s, name=f"{s}_docs"), "accounts": defs.accounts}
    proj = kinds[kind](source)
    limit = int(sys.argv[6]) if len(sys.argv) > 6 else 60
    f = Follower(proj, rt, trigger="0.2s", max_records_per_batch=limit or None, checkpoint=checkpoint).start()
    print("following", flush=True)
    f.run_forever()


if __name__ == "__main__":
    main()
