"""Shared by the search / Redis / multi-sink tests: a view, a change history, a tiny runner."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from pyspark.sql import types as T

from kappaflow.projections.sinks.base import Sink, Target, ViewColumn, ViewSpec, batch_from_rows
from kappaflow.projections.sinks.errors import SinkStateLostError

TOPIC = "shop.public.customers"


def customer_view(name: str = "customers", **options: Any) -> ViewSpec:
    return ViewSpec(
        name=name, projection=f"Test_{name}", key=("id",),
        columns=(ViewColumn("id", T.LongType(), False), ViewColumn("name", T.StringType()),
                 ViewColumn("total", T.DecimalType(12, 2)), ViewColumn("gen", T.IntegerType()),
                 ViewColumn("tags", T.ArrayType(T.StringType()))),
        options=options,
    )


def row(i: int, version: int, *, gen: int = 1, name: str | None = None, deleted: bool = False) -> dict[str, Any]:
    return {"id": i, "name": name if name is not None else f"customer {i}", "total": Decimal(f"{i}.{gen:02d}"),
            "gen": gen, "tags": ["a", f"t{i % 3}"], "_kf_version": version, "_kf_deleted": deleted}


def history(n_events: int, n_keys: int, seed: int = 7) -> list[dict[str, Any]]:
    """A change log of one partition: offset = index; upserts and deletes (then re-inserts)."""
    rnd = random.Random(seed)
    out = []
    for offset in range(n_events):
        k = rnd.randrange(n_keys)
        deleted = rnd.random() < 0.1
        out.append(row(k, offset, gen=offset % 97, name=f"c{k}@{offset}", deleted=deleted))
    return out


def final_state(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    state: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["_kf_deleted"]:
            state.pop(e["id"], None)
        else:
            state[e["id"]] = {k: v for k, v in e.items() if k != "_kf_deleted"}
    return state


def drive(sink: Sink, view: ViewSpec, events: list[dict[str, Any]], *, batch: int = 300,
          max_losses: int = 3) -> int:
    """What a runner does: resume from the sink's positions, write batches with positions; when the
    sink reports lost state, re-ensure and resume from what it now reports (a replay from 0)."""
    target = sink.ensure(view)
    losses = 0
    while True:
        pos = sink.read_positions(target).get((TOPIC, 0), 0)
        if pos >= len(events):
            return losses
        chunk = events[pos:pos + batch]
        try:
            sink.write(target, batch_from_rows(view, chunk), positions={(TOPIC, 0): pos + len(chunk)})
        except SinkStateLostError:
            losses += 1
            assert losses <= max_losses, "the sink keeps losing its state"
            target = sink.ensure(view)


def rows_by_key(sink: Sink, target: Target) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in sink.scan(target)}


def wait_for(check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def live_positions(sink: Sink, view: ViewSpec) -> dict[tuple[str, int], int]:
    """The positions stored with the view's live target ({} when there is none)."""
    live = sink.live(view)
    return sink.read_positions(live) if live is not None else {}


def redis_outage_and_empty_restart(group: Any, rt: Any, view: ViewSpec, server: Any, end: Callable[[], Any],
                                   write: Callable[[], None]) -> Any:
    """Stop the private Redis `server` under a following `group`, `write()` more changes: PostgreSQL and
    search reach the log end `end()` without waiting for Redis; restart Redis empty (no persistence): its
    follower rebuilds, restarts and catches up. Returns the Redis follower."""
    from kappaflow.errors import KappaflowError

    server.stop()
    write()
    stop_end = end()
    for k in ("postgres", "search"):
        f = group[k]
        assert f.wait_for(lambda _s, f=f: f.caught_up(), timeout=90), f"{k} blocked by the Redis outage"
        assert live_positions(rt.sinks[k], view) == stop_end
    assert group["redis"].failed is None

    server.start()  # same port, no persistence: the view is gone
    redis_f = group["redis"]

    def redis_caught_up() -> bool:
        try:
            return bool(redis_f.caught_up())
        except KappaflowError:
            return False

    wait_for(lambda: redis_f.restarts >= 1 and redis_caught_up(), timeout=120,
             what="the Redis follower to rebuild, restart and catch up", interval=0.2)
    return redis_f
