"""A replay in its own process with its own Spark (killed with -9 by test_replay_kill.py).

usage: replay_runner.py LOG_DIR DSN SEARCH_URL REDIS_URL SOURCE VIEW HOLD SIGNAL_FILE

The projection is ``defs.latest(SOURCE, VIEW)`` writing to postgres, search and Redis. HOLD
names the moment the test kills the process at: the runner writes SIGNAL_FILE when it gets
there and then blocks (until killed), except for ``build``, where it goes on (the test kills
it after a seeded pause, somewhere inside the Spark build). ``none``: run to completion.

* ``build``      the first shadow build starts (postgres);
* ``build2``     postgres shadow built and its positions stored, search shadow empty;
* ``swap``       every shadow built and caught up, nothing swapped yet;
* ``mid_swap``   postgres swapped, search and Redis not;
* ``drop_old_search`` / ``drop_old_redis``  that sink's alias / pointer switched to the new
  build, the old index / build not dropped yet.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

SINKS = ("postgres", "search", "redis")
LOCK_TTL_S = 2.0  # search/Redis leases of a killed holder run out quickly (the rerun waits for them)


def projection(source: str, view: str) -> Any:
    from tests.projections import defs

    return type("LatestEverywhere", (defs.latest(source, view),), {"name": view, "view": view, "sinks": SINKS})


def main() -> None:
    log_dir, dsn, search_url, redis_url, source, view, hold, signal_file = sys.argv[1:9]
    from kappaflow.projections import replay as replay_mod
    from kappaflow.projections.runtime import Runtime, spark_session
    from kappaflow.projections.sinks.postgres import PostgresSink
    from kappaflow.projections.sinks.redis import RedisSink
    from kappaflow.projections.sinks.search import SearchSink

    def reached(block: bool = True) -> None:
        Path(signal_file).write_text(hold)
        if block:
            threading.Event().wait()  # until SIGKILL

    builds = 0
    real_build = replay_mod.build

    def build(*args: Any, **kwargs: Any) -> Any:
        nonlocal builds
        builds += 1
        if (hold, builds) in (("build", 1), ("build2", 2)):
            reached(block=hold == "build2")
        return real_build(*args, **kwargs)

    replay_mod.build = build

    def hold_before(cls: Any, method: str, when: str) -> None:
        real = getattr(cls, method)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if hold == when:
                reached()
            return real(self, *args, **kwargs)

        setattr(cls, method, wrapper)

    hold_before(PostgresSink, "swap", "swap")
    hold_before(SearchSink, "swap", "mid_swap")

    def hold_in_swap(cls: Any, dropper: str, when: str) -> None:
        """Block when `swap` starts dropping the old build (the switch is done)."""
        real_swap, real_drop = cls.swap, getattr(cls, dropper)
        swapping = threading.local()

        def swap(self: Any, *args: Any, **kwargs: Any) -> Any:
            swapping.on = True
            try:
                return real_swap(self, *args, **kwargs)
            finally:
                swapping.on = False

        def drop(self: Any, *args: Any, **kwargs: Any) -> Any:
            if hold == when and getattr(swapping, "on", False):
                reached()
            return real_drop(self, *args, **kwargs)

        cls.swap = swap
        setattr(cls, dropper, drop)

    hold_in_swap(SearchSink, "_drop_index", "drop_old_search")
    hold_in_swap(RedisSink, "_drop_build", "drop_old_redis")

    spark = spark_session("local[1]", conf={"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})
    pg = PostgresSink(dsn)
    sinks = {"postgres": pg, "search": SearchSink(search_url, options={"lock_ttl_s": LOCK_TTL_S}),
             "redis": RedisSink(redis_url, options={"lock_ttl_s": LOCK_TTL_S})}
    rt = Runtime(spark, log_dir, pg, dsn=dsn, sinks=sinks)
    try:
        res = replay_mod.replay(projection(source, view), rt, wait_lock_s=30.0)
    finally:
        rt.close()
    print("replayed", res.rows, flush=True)


if __name__ == "__main__":
    main()
