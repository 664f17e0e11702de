"""Differential follow test: SMALL batches (1-3 changes, one key / group at a time).

Why: a grouped follow batch once deleted every group it did not touch (09e6989) and no test saw
it, because every follow test changed so many keys per batch that every group was recomputed.
Here a follower of each fold kind, in each sink that fold is allowed in, is driven through a
seeded history of tiny batches -- inserts, updates inside a group, moves between groups,
deletes (a group's last row included), rows leaving and re-entering ``where``, a delete then a
re-insert of the same key, an update there and back -- waiting for every follower to catch up
after each batch. Every few batches each view is compared with a plain-Python reference (from
``TableWriter.rows``, or the custom fold replayed in Python), mirrors also with PostgreSQL's
positions; at the end a fresh replay of each projection must equal what was followed.
"""

from __future__ import annotations

import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections import CollectSet, Count, Event, Max, Projection, Sum
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import FollowerGroup
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.base import Sink
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink
from tests.projections.pj_helpers import orders_schema

pytestmark = pytest.mark.integration

T0 = datetime(2024, 1, 1, tzinfo=UTC)
ALL = ("postgres", "search", "redis")
CHECK_EVERY = 3


# --- the projections under test (built in functions: Spark workers unpickle them by value) -----------
def _latest(source: str) -> type[Projection]:
    return type("Latest", (Projection,), {
        "name": "dl_" + uuid.uuid4().hex[:8], "sources": [f"{source}.public.orders"], "key": ["id"],
        "where": "status <> 'cancelled'", "derive": {"cents": "cast(amount * 100 as bigint)"}, "sinks": ALL,
    })


def _totals(source: str) -> type[Projection]:
    return type("Totals", (Projection,), {
        "name": "dt_" + uuid.uuid4().hex[:8], "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "where": "status <> 'cancelled'", "sinks": ALL,
        "aggregates": {"n": Count(), "total": Sum("amount"), "last": Max("created_at"),
                       "statuses": CollectSet("status")},
    })


def _activity(row: dict[str, Any] | None, op: str, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The custom fold (also the Python reference): changes since the order (re)entered the view;
    a cancelled order leaves the view."""
    if op == "d" or after is None or after["status"] == "cancelled":
        return None
    return {"customer_id": after["customer_id"], "changes": (row["changes"] if row else 0) + 1, "last_op": op}


def _custom(source: str) -> type[Projection]:
    def apply(self: Any, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        return _activity(row, event.op, event.after)

    return type("Activity", (Projection,), {
        "name": "dc_" + uuid.uuid4().hex[:8], "sources": [f"{source}.public.orders"], "key": ["id"],
        "schema": "id bigint, customer_id bigint, changes bigint, last_op string", "sinks": ALL, "apply": apply,
    })


# --- references in plain Python ------------------------------------------------------------------------
def _ref_latest(w: TableWriter) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(r["id"],): {**r, "cents": None if r["amount"] is None else int(r["amount"] * 100)}
            for r in w.rows.values() if r["status"] != "cancelled"}


def _ref_totals(w: TableWriter) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in w.rows.values():
        if r["status"] == "cancelled":
            continue
        g = out.setdefault((r["customer_id"],), {"customer_id": r["customer_id"], "n": 0, "total": None,
                                                 "last": r["created_at"], "statuses": set()})
        g["n"] += 1
        if r["amount"] is not None:  # SQL's sum: NULLs ignored, NULL when all are
            g["total"] = (g["total"] or 0) + r["amount"]
        g["last"] = max(g["last"], r["created_at"])
        g["statuses"].add(r["status"])
    for g in out.values():
        g["statuses"] = sorted(g["statuses"])
    return out


class _History:
    """TableWriter plus the custom fold's reference, one change at a time."""

    def __init__(self, w: TableWriter) -> None:
        self.w = w
        self.activity: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.minute = 0

    def _fold(self, key: tuple[Any, ...], op: str) -> None:
        new = _activity(self.activity.get(key), op, self.w.rows.get(key))
        if new is None:
            self.activity.pop(key, None)
        else:
            self.activity[key] = {"id": key[0], **new}

    def insert(self, i: int, customer: int, status: str = "new", amount: int | None = None) -> None:
        self.minute += 1
        self.w.insert({"id": i, "customer_id": customer, "amount": Decimal(amount or 100 * i + self.minute) / 100,
                       "status": status, "created_at": T0 + timedelta(minutes=self.minute)})
        self._fold((i,), "c")

    def update(self, i: int, **changes: Any) -> None:
        self.w.update((i,), changes)
        self._fold((i,), "u")

    def delete(self, i: int) -> None:
        self.w.delete((i,))
        self._fold((i,), "d")


KINDS = ("insert", "insert", "amount", "move", "delete", "leave", "enter", "reinsert", "there_and_back",
         "older_max", "null_amount", "cancelled_edit", "empty_group")


def _small_batch(h: _History, rnd: random.Random, kind: str) -> str:
    """One batch of 1-3 changes of `kind` touching one key (or moving one key between two groups), flushed."""
    rows = h.w.rows
    present = sorted(k[0] for k in rows)
    absent = [i for i in range(1, 21) if (i,) not in rows]
    if not present or (kind == "insert" and absent):
        kind = "insert"
    i = rnd.choice(present) if present else 0
    r = rows.get((i,))
    if kind == "insert":
        h.insert(rnd.choice(absent), rnd.randint(1, 5), rnd.choice(["new", "paid"]))
    elif kind == "amount" and r is not None:
        h.update(i, amount=(r["amount"] or 0) + Decimal("0.01") * rnd.randint(1, 99))
    elif kind == "move" and r is not None:
        h.update(i, customer_id=rnd.choice([c for c in range(1, 6) if c != r["customer_id"]]))
    elif kind == "delete":
        h.delete(i)
    elif kind == "leave" and r is not None:
        h.update(i, status="cancelled")
    elif kind == "enter":
        cancelled = [k[0] for k, v in rows.items() if v["status"] == "cancelled"]
        if cancelled:
            i = rnd.choice(cancelled)
        h.update(i, status="paid")
    elif kind == "reinsert" and r is not None:
        c = r["customer_id"]
        h.delete(i)
        h.insert(i, c if rnd.random() < 0.5 else rnd.randint(1, 5), "new")
    elif kind == "there_and_back" and r is not None:
        c, amount = r["customer_id"], r["amount"]
        h.update(i, customer_id=c % 5 + 1, amount=(amount or 0) + 1)
        h.update(i, customer_id=c, amount=amount)
    elif kind == "null_amount" and r is not None:  # Sum/derive over NULLs (replay: Spark, follow: SQL)
        h.update(i, amount=None)
    elif kind == "older_max" and r is not None:  # Max must be recomputed, not only raised
        h.update(i, created_at=T0 - timedelta(days=rnd.randint(1, 9)))
    elif kind == "cancelled_edit":  # a row outside `where` changes: nothing visible changes
        cancelled = [k[0] for k, v in rows.items() if v["status"] == "cancelled"]
        if cancelled:
            h.update(rnd.choice(cancelled), amount=Decimal(rnd.randint(1, 999)))
        else:
            h.update(i, status="cancelled")
    elif kind == "empty_group" and r is not None:  # a group loses (up to 3 of) its rows, often all
        c = r["customer_id"]
        for k in [k[0] for k, v in rows.items() if v["customer_id"] == c][:3]:
            h.delete(k)
    assert h.w.flush() > 0, kind
    return f"{kind}({i})"


# --- reading the views --------------------------------------------------------------------------------
def _norm(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    if isinstance(v, (list, tuple)):
        return sorted(v)
    if isinstance(v, float):
        return Decimal(str(v))
    return v


def _view(rt: Runtime, proj: type[Projection], sink: str, cols: tuple[str, ...]) -> dict[tuple[Any, ...], Any]:
    spec = as_spec(proj)
    view = prepare(spec, rt).view
    s: Sink = rt.sinks[sink]
    live = s.live(view)
    assert live is not None, f"{spec.name}/{sink}: no live view"
    return {tuple(r[k] for k in spec.key): {c: _norm(r.get(c)) for c in cols} for r in s.scan(live)}


def _versions(rt: Runtime, proj: type[Projection], sink: str) -> dict[tuple[Any, ...], Any]:
    spec = as_spec(proj)
    s: Sink = rt.sinks[sink]
    live = s.live(prepare(spec, rt).view)
    assert live is not None
    return {tuple(r[k] for k in spec.key): r["_kf_version"] for r in s.scan(live)}


def _positions(rt: Runtime, proj: type[Projection], sink: str) -> dict[tuple[str, int], int]:
    s: Sink = rt.sinks[sink]
    live = s.live(prepare(as_spec(proj), rt).view)
    return s.read_positions(live) if live is not None else {}


COLS = {
    "latest": ("id", "customer_id", "amount", "status", "created_at", "cents"),
    "totals": ("customer_id", "n", "total", "last", "statuses"),
    "custom": ("id", "customer_id", "changes", "last_op"),
}


def _expected(kind: str, h: _History) -> dict[tuple[Any, ...], Any]:
    ref = {"latest": _ref_latest, "totals": _ref_totals}[kind](h.w) if kind != "custom" else h.activity
    return {k: {c: _norm(v[c]) for c in COLS[kind]} for k, v in ref.items()}


def _diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want))
    return "; ".join(f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k))


def _wait_all(groups: dict[str, FollowerGroup], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for name, g in groups.items():
        if not g.wait_for(lambda g: g.caught_up(), max(deadline - time.monotonic(), 1)):
            behind = [f.name for f in g.followers.values() if not f.caught_up()]
            raise AssertionError(f"{name}: followers {behind} did not catch up within {timeout}s")


@pytest.fixture
def multi_rt(spark: Any, pg_dsn: str, search_server: Any, redis_server: Any, tmp_path: Path) -> Any:
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    sinks: dict[str, Sink] = {"postgres": PostgresSink(pg_dsn), "search": SearchSink(search_server.url),
                              "redis": RedisSink(redis_server.url)}
    rt = Runtime(spark, str(log_dir), sinks["postgres"], dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt", sinks=sinks)
    try:
        yield rt, log
    finally:
        rt.close()


def test_small_batches_keep_every_view_of_every_fold_equal_to_a_reference(multi_rt: Any) -> None:
    rt, log = multi_rt
    source = "d" + uuid.uuid4().hex[:7]
    h = _History(TableWriter(log, orders_schema(source), partitions=2))
    for i in range(1, 13):  # 5 groups, one order outside `where`
        h.insert(i, 1 + i % 5, "cancelled" if i == 12 else ("paid" if i % 3 else "new"))
    h.w.flush()
    projs = {"latest": _latest(source), "totals": _totals(source), "custom": _custom(source)}
    for p in projs.values():
        replay(p, rt)

    def check(when: str) -> None:
        for kind, p in projs.items():
            want = _expected(kind, h)
            for sink in ALL:
                got = _view(rt, p, sink, COLS[kind])
                assert got == want, f"{when}: {kind}/{sink}: {_diff(got, want)}"
            pg_versions = _versions(rt, p, "postgres")
            for sink in ("search", "redis"):
                assert _versions(rt, p, sink) == pg_versions, f"{when}: {kind}/{sink}: versions differ from postgres"
            if kind == "totals":  # mirrors never store positions other than PostgreSQL's once caught up
                for sink in ("search", "redis"):
                    assert _positions(rt, p, sink) == _positions(rt, p, "postgres"), f"{when}: {kind}/{sink}"

    check("after replay")
    groups = {kind: FollowerGroup(p, rt, trigger="0.2s").start() for kind, p in projs.items()}
    try:
        rnd = random.Random(20261122)
        history: list[str] = []
        kinds = rnd.sample(KINDS, len(KINDS))  # every kind at least once, in a seeded order
        for step in range(1, 16):
            history.append(_small_batch(h, rnd, kinds[(step - 1) % len(kinds)]))
            _wait_all(groups)
            if step % CHECK_EVERY == 0:
                check(f"after batches {history}")
    finally:
        for g in groups.values():
            g.stop()
    followed = {kind: {s: (_view(rt, p, s, COLS[kind]), _versions(rt, p, s)) for s in ALL}
                for kind, p in projs.items()}
    for kind, p in projs.items():
        replay(p, rt)
        for s in ALL:
            view, versions = followed[kind][s]
            assert _view(rt, p, s, COLS[kind]) == view, f"{kind}/{s}: a fresh replay differs from the followed view"
            if kind == "latest":  # grouped and custom-fold versions are batch watermarks, not offsets
                assert _versions(rt, p, s) == versions, f"{kind}/{s}: replayed versions differ"
