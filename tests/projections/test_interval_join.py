"""Joins within a time bound (``interval_join = IntervalJoin(...)``): the documented rule, checked
against a plain-Python reference that reads the log's records itself.

The reference is written from the README's "Joins within a time bound" (under "Event time"), not from
``folds/interval.py``: per input partition (both topics), in offset order, the partition watermark
before an event is the largest event time of the earlier inserts/updates minus ``delay``; an event
retracts its key's current version (late when ``its time + allowed_lateness < that watermark``: the
version stays, frozen) and inserts its new one (late: not applied, counted); ``update`` applies
everything. The view: a row per pair of live versions with equal join keys and ``l.t + lower <= r.t
<= l.t + upper``; ``how="left"``: a row per live left version without a pair once ``l.t + upper +
allowed_lateness < W`` (W = min over the non-idle partitions of both topics of their largest event
time - delay). Histories are seeded: out-of-order times, orders and payments moved in time, payments
moved to other orders, deletes, payments a day late, a partition that stops getting events (idle).
"""

from __future__ import annotations

import random
import re
import sys
import types
import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from kappaflow.errors import ConfigError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.log.partitioner import partition_for
from kappaflow.projections import IntervalJoin, Projection, ProjectionSpec
from kappaflow.projections.deadletter import read_dead_letters
from kappaflow.projections.engine import apply_range, prepare
from kappaflow.projections.folds.interval import interval_status
from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.status import projection_status
from tests._kill import KilledProcess, live_offsets, trial_count

T0 = datetime(2024, 3, 1, tzinfo=UTC)
ORDER_PARTS, PAY_PARTS = 3, 2


def orders_schema(source: str) -> TableSchema:
    return TableSchema(f"{source}.public.orders", (
        Column("id", FieldType.INT64, optional=False),
        Column("customer_id", FieldType.INT64),
        Column("amount", FieldType.INT64),
        Column("created_at", FieldType.TIMESTAMPTZ),
    ), ("id",))


def payments_schema(source: str) -> TableSchema:
    return TableSchema(f"{source}.public.payments", (
        Column("id", FieldType.INT64, optional=False),
        Column("order_id", FieldType.INT64),
        Column("amount", FieldType.INT64),
        Column("paid_at", FieldType.TIMESTAMPTZ),
    ), ("id",))


@dataclass(frozen=True)
class Cfg:
    how: str
    late: str
    lower: timedelta
    upper: timedelta
    delay: timedelta
    lateness: timedelta
    idle: timedelta | None


CONFIGS = {
    "left-drop": Cfg("left", "drop", timedelta(0), timedelta(hours=1), timedelta(minutes=10),
                     timedelta(minutes=20), None),
    "inner-deadletter-negative-lower-idle": Cfg("inner", "dead_letter", timedelta(minutes=-30),
                                                timedelta(minutes=45), timedelta(minutes=5), timedelta(0),
                                                timedelta(hours=3)),
    "left-update-idle": Cfg("left", "update", timedelta(0), timedelta(hours=1), timedelta(0),
                            timedelta(minutes=15), timedelta(hours=2)),
}


def projection(source: str, cfg: Cfg, name: str) -> type[Projection]:
    return type("OrdersPaid", (Projection,), {
        "name": name, "sources": [f"{source}.public.orders"], "key": ["id"],
        "columns": ["id", "customer_id", "amount", "created_at"],
        "interval_join": IntervalJoin(
            "payment", f"{source}.public.payments", on={"id": "order_id"}, left_time="created_at",
            right_time="paid_at", within=(cfg.lower, cfg.upper), how=cfg.how, columns=["id", "amount"],
            delay=cfg.delay, allowed_lateness=cfg.lateness, late=cfg.late, idle_timeout=cfg.idle),
    })


# --- the reference ---------------------------------------------------------------------------------
def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def reference(log: Any, orders: str, payments: str, cfg: Cfg,
              upto: dict[tuple[str, int], int] | None = None) -> tuple[dict[Any, Any], int]:
    """(view rows {(order id, created_at, payment key): (customer, amount, payment id, payment amount,
    paid_at)}, late events) over each partition's records below `upto`."""
    view, late = reference_and_late(log, orders, payments, cfg, upto)
    return view, len(late)


def reference_and_late(log: Any, orders: str, payments: str, cfg: Cfg,
                       upto: dict[tuple[str, int], int] | None = None) -> tuple[dict[Any, Any], list[Any]]:
    """The reference's view and the positions (topic, partition, offset) of the late insertions."""
    live: dict[tuple[str, bytes, datetime], dict[str, Any]] = {}  # (topic, record key, time) -> row
    pmax: dict[tuple[str, int], datetime] = {}
    late: list[tuple[str, int, int]] = []
    parts = [(t, p) for t in (orders, payments) for p in range(log.partitions(t))]
    for topic, p in parts:
        tcol = "created_at" if topic == orders else "paid_at"
        current: dict[bytes, datetime] = {}
        for r in log.iter_partition(topic, p):
            if upto is not None and r.offset >= upto.get((topic, p), 0):
                break
            if r.value is None:
                continue  # tombstone: the delete before it carried the change
            after = orjson.loads(r.value)["after"]
            t = datetime.fromisoformat(after[tcol]) if after and after.get(tcol) else None
            wm = pmax[(topic, p)] - cfg.delay if (topic, p) in pmax and cfg.late != "update" else None
            old = current.pop(r.key, None)
            if old is not None and not (wm is not None and old + cfg.lateness < wm):
                del live[(topic, r.key, old)]  # on time: retracted (late: frozen, stays live)
            if after is not None and t is not None:
                if wm is not None and t + cfg.lateness < wm:
                    late.append((topic, p, r.offset))
                else:
                    live[(topic, r.key, t)] = after
                    current[r.key] = t
                if (topic, p) not in pmax or t > pmax[(topic, p)]:
                    pmax[(topic, p)] = t
    seen = [pmax[tp] for tp in parts if tp in pmax]
    if not seen or (cfg.idle is None and len(seen) < len(parts)):
        w = None
    elif cfg.idle is None:
        w = min(seen) - cfg.delay
    else:
        w = min(v for v in seen if v >= max(seen) - cfg.idle) - cfg.delay
    lefts = [(k, t, row) for (tp, k, t), row in live.items() if tp == orders]
    rights = [(k, t, row) for (tp, k, t), row in live.items() if tp == payments]
    view: dict[Any, Any] = {}
    for _lk, lt, lrow in lefts:
        matched = False
        for rk, rt_, rrow in rights:
            if rrow["order_id"] is not None and rrow["order_id"] == lrow["id"] and \
                    lt + cfg.lower <= rt_ <= lt + cfg.upper:
                matched = True
                view[(lrow["id"], lt, rk.decode() + "@" + _iso(rt_))] = (
                    lrow["customer_id"], lrow["amount"], rrow["id"], rrow["amount"], rt_)
        if not matched and cfg.how == "left" and w is not None and lt + cfg.upper + cfg.lateness < w:
            view[(lrow["id"], lt, "")] = (lrow["customer_id"], lrow["amount"], None, None, None)
    return view, late


# --- the history -----------------------------------------------------------------------------------
def history(orders: TableWriter, payments: TableWriter, rnd: random.Random, steps: int,
            idle_after: int | None, at: dict[str, Any] | None = None) -> None:
    """Orders in slowly advancing event time (15% out of order by up to 30 minutes, 3% a day late);
    payments paid about now (up to 10 minutes back, 3% a day late) for one of the last 10 orders
    (most within the hour, some not, some before the order: a negative bound matches those); recent
    rows mostly (1 in 5: any row) moved in time, changed, moved to another order and deleted: a change
    to an old row is late. From `idle_after` on, payments partition 0 gets no events (idle). `at`
    carries the clock and the next ids from one call to the next."""
    at = at if at is not None else {}
    clock = at.get("clock", T0)
    next_order, next_pay = at.get("next_order", 1), at.get("next_pay", 1)

    def pay_ok(i: int, step: int) -> bool:
        return idle_after is None or step < idle_after or partition_for(orjson.dumps({"id": i}), PAY_PARTS) != 0

    for step in range(steps):
        clock += timedelta(minutes=rnd.randint(0, 8))
        r = rnd.random()
        live_pays = [k for k in payments.rows if pay_ok(k[0], step)]
        some_pays = live_pays if rnd.random() < 0.2 else sorted(live_pays)[-10:]
        some_orders = sorted(orders.rows) if rnd.random() < 0.2 else sorted(orders.rows)[-10:]
        if r < 0.35 or not orders.rows:
            t = clock - (timedelta(minutes=rnd.randint(1, 30)) if rnd.random() < 0.15 else timedelta(0))
            if rnd.random() < 0.03:
                t -= timedelta(days=1)
            orders.insert({"id": next_order, "customer_id": rnd.randint(1, 4), "amount": rnd.randint(1, 500),
                           "created_at": t})
            next_order += 1
        elif r < 0.65:
            oid = rnd.choice(sorted(orders.rows)[-10:])[0]
            paid = clock - timedelta(minutes=rnd.randint(0, 10))
            if rnd.random() < 0.03:
                paid -= timedelta(days=1)
            while not pay_ok(next_pay, step):
                next_pay += 1
            payments.insert({"id": next_pay, "order_id": oid, "amount": rnd.randint(1, 500), "paid_at": paid})
            next_pay += 1
        elif r < 0.73:
            k = rnd.choice(some_orders)
            orders.update(k, {"created_at": clock - timedelta(minutes=rnd.randint(0, 40))})
        elif r < 0.78:
            orders.update(rnd.choice(some_orders), {"amount": rnd.randint(1, 500)})
        elif r < 0.86 and live_pays:
            k = rnd.choice(some_pays)
            payments.update(k, {"paid_at": payments.rows[k]["paid_at"] + timedelta(minutes=rnd.randint(-15, 15))})
        elif r < 0.91 and live_pays:
            k = rnd.choice(some_pays)
            payments.update(k, {"order_id": rnd.choice(sorted(orders.rows)[-6:])[0]})
        elif r < 0.95:
            orders.delete(rnd.choice(some_orders))
        elif live_pays:
            payments.delete(rnd.choice(some_pays))
        if rnd.random() < 0.25:
            orders.flush()
        if rnd.random() < 0.25:
            payments.flush()
    orders.flush()
    payments.flush()
    at.update(clock=clock, next_order=next_order, next_pay=next_pay)


# --- reading the views -----------------------------------------------------------------------------
def view(dsn: str, name: str) -> dict[Any, Any]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f'SELECT id, created_at, payment_key, customer_id, amount, payment_id, payment_amount, payment_paid_at '
            f'FROM public."{name}"').fetchall()
    return {(r[0], r[1], r[2]): tuple(r[3:]) for r in rows}


def late_letters(rt: Any, name: str) -> list[tuple[str, int, int]]:
    rows = read_dead_letters(rt.log_url, rt.log_options, name)
    assert all(r["reason"] == "late" and r["event_time"] and r["watermark"] for r in rows), rows[:3]
    return sorted((r["topic"], r["partition"], r["offset"]) for r in rows)


def diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want), key=repr)
    bad = [f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k)]
    return f"{len(bad)} rows differ, e.g. " + "; ".join(bad[:6])


# --- tests -----------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("case", list(CONFIGS))
def test_replay_and_follow_in_batches_equal_the_reference(rt: Any, embedded_log: Any, case: str) -> None:
    """Replay, and a follower fed the same log of both topics in batches cut anywhere, give the
    reference's pairs, unmatched rows and late counts, at intermediate cuts and at the end."""
    cfg = CONFIGS[case]
    source = "ij" + uuid.uuid4().hex[:8]
    rnd = random.Random(zlib.crc32(case.encode()))  # not hash(): str hashes differ per process
    ow = TableWriter(embedded_log, orders_schema(source), partitions=ORDER_PARTS)
    pw = TableWriter(embedded_log, payments_schema(source), partitions=PAY_PARTS)
    history(ow, pw, rnd, 240, idle_after=150 if cfg.idle is not None else None)
    end = {ow.topic: embedded_log.end_offsets(ow.topic), pw.topic: embedded_log.end_offsets(pw.topic)}
    want, late = reference_and_late(embedded_log, ow.topic, pw.topic, cfg)
    want_late = len(late)
    pairs = [k for k in want if k[2]]
    assert len(pairs) > 15, "the history must produce many pairs"
    assert (want_late > 0) == (cfg.late != "update"), "late events exactly when a policy makes events late"
    if cfg.how == "left":
        assert any(not k[2] for k in want), "the history must leave orders unpaid"

    replayed = projection(source, cfg, "ijr_" + uuid.uuid4().hex[:8])
    replay(replayed, rt)
    assert view(rt.dsn, replayed.name) == want, "replay: " + diff(view(rt.dsn, replayed.name), want)
    (status,) = [st.details for st in projection_status(rt, replayed.name)[0].sinks]  # as `kappaflow status`
    assert status["late_events"] == want_late and status["state_rows"] > 0
    assert late_letters(rt, replayed.name) == (sorted(late) if cfg.late == "dead_letter" else [])

    followed = projection(source, cfg, "ijf_" + uuid.uuid4().hex[:8])
    plan = prepare(ProjectionSpec.from_class(followed), rt)
    target = rt.sink.ensure(plan.view)
    pos = {t: {p: 0 for p in parts} for t, parts in end.items()}
    cut = random.Random(7)
    for step in range(12):  # 12 batches of 0 to 120 records per partition: every batch costs Spark jobs
        nxt = {t: {p: min(end[t][p], o + cut.choice([0, 1, 4, 15, 40, 120])) for p, o in parts.items()}
               for t, parts in pos.items()}
        if step == 11:
            nxt = {t: dict(parts) for t, parts in end.items()}
        apply_range(plan, rt, target, pos, nxt)
        pos = nxt
        if step in (3, 7):
            upto = {(t, p): o for t, parts in pos.items() for p, o in parts.items()}
            mid, _ = reference(embedded_log, ow.topic, pw.topic, cfg, upto=upto)
            got = view(rt.dsn, followed.name)
            assert got == mid, f"follow (cut {step}): " + diff(got, mid)
    got = view(rt.dsn, followed.name)
    assert got == want, "follow: " + diff(got, want)
    fstatus = interval_status(rt.sink, target)
    assert fstatus["late_events"] == want_late and fstatus["watermark"] == status["watermark"]
    assert late_letters(rt, followed.name) == (sorted(late) if cfg.late == "dead_letter" else [])
    if cfg.late != "update":  # versions every partition has passed leave the state
        versions = sum(1 for _ in ow.rows) + sum(1 for _ in pw.rows)
        assert fstatus["state_rows"] < versions, (fstatus, versions)


def test_bad_interval_join_definitions_fail_at_load_naming_the_attribute() -> None:
    base = {"name": "paid", "sources": ["s.public.orders"], "key": ["id"]}

    def load(**attrs: Any) -> ProjectionSpec:
        return ProjectionSpec.from_class(type("Paid", (Projection,), {**base, **attrs}))

    def join(**kw: Any) -> IntervalJoin:
        args: dict[str, Any] = {"name": "payment", "topic": "s.public.payments", "on": {"id": "order_id"},
                                "left_time": "created_at", "right_time": "paid_at", "within": ("0s", "1h")}
        return IntervalJoin(**{**args, **kw})

    cases = [
        (join(within=("1h", "0s")), r"'interval_join'.within: the lower bound '1h' is above the upper bound '0s'"),
        (join(within=("0s",)), r"'interval_join'.within: expected \(lower, upper\)"),
        (join(within=("0s", "an hour")), r"'interval_join'.within\[1\]: expected a duration"),
        (join(delay="-5m"), r"'interval_join'.delay: must be >= 0"),
        (join(allowed_lateness=-1), r"'interval_join'.allowed_lateness: must be >= 0"),
        (join(how="outer"), r"'interval_join'.how: expected one of \['inner', 'left'\], got 'outer'"),
        (join(late="ignore"), r"'interval_join'.late: expected one of \['dead_letter', 'drop', 'update'\]"),
        (join(on={}), r"'interval_join'.on: expected a non-empty dict"),
        (join(name="1x"), r"'interval_join'.name: expected an identifier"),
        (join(topic="s.public.orders"), r"'interval_join'.topic: 's.public.orders' is the projection's source"),
        (join(idle_timeout=0), r"'interval_join'.idle_timeout: must be > 0"),
        (join(columns="amount"), r"'interval_join'.columns: expected a list of column names"),
        ("payments", r"'interval_join': expected IntervalJoin"),
    ]
    for ij, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            load(interval_join=ij)
        assert "Paid" in str(info.value)
    with pytest.raises(ConfigError, match="'sinks': a join within a time bound"):
        load(interval_join=join(), sinks=("postgres", "search"))
    spec = load(interval_join=join(within=("-10m", "1h"), delay="5m"))
    assert spec.kind == "interval_join" and "s.public.payments" in spec.topics
    assert spec.fold.lower_us == -600_000_000  # type: ignore[attr-defined]


@pytest.mark.integration
def test_bad_columns_fail_when_the_projection_is_compiled(rt: Any, embedded_log: Any) -> None:
    source = "ij" + uuid.uuid4().hex[:8]
    TableWriter(embedded_log, orders_schema(source), partitions=1).flush()
    TableWriter(embedded_log, payments_schema(source), partitions=1).flush()

    def compile_(**kw: Any) -> Any:
        args: dict[str, Any] = {"name": "payment", "topic": f"{source}.public.payments", "on": {"id": "order_id"},
                                "left_time": "created_at", "right_time": "paid_at", "within": ("0s", "1h")}
        proj = type("Paid", (Projection,), {"name": "ijbad", "sources": [f"{source}.public.orders"], "key": ["id"],
                                            "interval_join": IntervalJoin(**{**args, **kw})})
        return prepare(ProjectionSpec.from_class(proj), rt)

    with pytest.raises(ConfigError, match=r"'interval_join'\.left_time: the event-time column 'amount' is bigint"):
        compile_(left_time="amount")
    with pytest.raises(ConfigError, match=r"'interval_join'\.right_time: 'when' is not a column"):
        compile_(right_time="when")
    with pytest.raises(ConfigError, match=r"'interval_join'\.on: 'nope' is not a column"):
        compile_(on={"id": "nope"})
    with pytest.raises(ConfigError, match=r"'interval_join'.columns: \['x'\] are not columns"):
        compile_(columns=["x"])
    view = compile_().view
    assert view.key == ("id", "created_at", "payment_key")
    assert "payment_paid_at" in view.column_names and "payment_order_id" in view.column_names


# --- the README's example ----------------------------------------------------------------------------
README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "tests/projections/test_interval_join.py"


def readme_block() -> str:
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
              if MARK in b.splitlines()[0]]
    assert len(blocks) == 1, f"README.md: expected one ```python block marked {MARK!r}, found {len(blocks)}"
    return blocks[0]


@pytest.mark.integration
def test_the_readme_example_reports_unpaid_orders_and_replay_equals_follow(rt: Any, embedded_log: Any) -> None:
    """The README's ``OrdersPayments`` over a small shop history, replayed and followed record by
    record: paid orders get their pair, an order paid too late or never is reported unpaid once W
    passes created_at + 1h + 10m, an order still within its hour is not reported, a late payment
    changes nothing (counted), a deleted payment retracts its pair."""
    module = types.ModuleType(f"readme_ij_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(readme_block(), "README.md", "exec"), module.__dict__)  # the README's own code
        _readme_example(rt, embedded_log, module.OrdersPayments)
    finally:
        sys.modules.pop(module.__name__, None)


def _readme_example(rt: Any, embedded_log: Any, readme_cls: type[Projection]) -> None:
    ow = TableWriter(embedded_log, orders_schema("shop"), partitions=1)
    pw = TableWriter(embedded_log, payments_schema("shop"), partitions=1)

    def at(hh: int, mm: int) -> datetime:
        return T0.replace(hour=hh, minute=mm)

    for i, (hh, mm) in enumerate([(10, 0), (10, 5), (10, 10), (10, 20)], start=1):
        ow.insert({"id": i, "customer_id": i, "amount": 10 * i, "created_at": at(hh, mm)})
    ow.flush()
    pw.insert({"id": 1, "order_id": 1, "amount": 10, "paid_at": at(10, 20)})   # order 1: paid in its hour
    pw.insert({"id": 3, "order_id": 4, "amount": 40, "paid_at": at(10, 50)})   # order 4: paid, then deleted
    pw.flush()
    pw.delete((3,))  # on time (10:50 + 10m >= 10:50 - 5m): the pair goes
    pw.insert({"id": 2, "order_id": 3, "amount": 30, "paid_at": at(11, 30)})   # order 3: paid after its hour
    pw.flush()
    ow.insert({"id": 5, "customer_id": 5, "amount": 50, "created_at": at(11, 40)})  # moves the orders' clock
    ow.flush()
    pw.insert({"id": 4, "order_id": 2, "amount": 20, "paid_at": at(11, 0)})  # order 2: late (11:10 < 11:25)
    pw.flush()
    # W = min(orders 11:40, payments 11:30) - 5m = 11:25; unpaid once created_at + 1h + 10m < 11:25
    want = {
        (1, at(10, 0), '{"id":1}@' + _iso(at(10, 20))): (1, 10, 1, 10, at(10, 20)),
        (2, at(10, 5), ""): (2, 20, None, None, None),  # its payment came late: 11:00 + 10m < 11:25
        (3, at(10, 10), ""): (3, 30, None, None, None),  # paid at 11:30, after its hour
    }  # order 4 (10:20): its payment deleted, but 11:30 is not < W yet: not reported
    cfg = Cfg("left", "drop", timedelta(0), timedelta(hours=1), timedelta(minutes=5), timedelta(minutes=10), None)
    assert reference(embedded_log, ow.topic, pw.topic, cfg)[0] == want
    name = "orders_payments"
    replay(readme_cls, rt)
    assert view(rt.dsn, name) == want, "replay: " + diff(view(rt.dsn, name), want)
    followed = type("OrdersPaymentsFollowed", (readme_cls,), {"name": "orders_payments_f"})
    plan = prepare(ProjectionSpec.from_class(followed), rt)
    target = rt.sink.ensure(plan.view)
    end = {ow.topic: embedded_log.end_offsets(ow.topic), pw.topic: embedded_log.end_offsets(pw.topic)}
    pos = {t: {p: 0 for p in parts} for t, parts in end.items()}
    while pos != end:  # one record of each topic per batch
        nxt = {t: {p: min(end[t][p], o + 1) for p, o in parts.items()} for t, parts in pos.items()}
        apply_range(plan, rt, target, pos, nxt)
        pos = nxt
    assert view(rt.dsn, "orders_payments_f") == want
    assert interval_status(rt.sink, target)["late_events"] == 1


# --- kill -9 of a follower ---------------------------------------------------------------------------
RUNNER = Path(__file__).with_name("interval_runner.py")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)  # three follower processes start their own Spark
def test_follower_killed_with_sigkill_equals_the_reference(rt: Any, embedded_log: Any, tmp_path: Path) -> None:
    """A follower process (batches of at most 40 records) is killed with -9 while orders and payments
    arrive, then restarted: the same pairs, unmatched rows and late decisions, nothing twice -- the
    view equals the reference."""
    cfg = CONFIGS["left-drop"]
    source = "k" + uuid.uuid4().hex[:7]
    name = f"{source}_paid"
    ow = TableWriter(embedded_log, orders_schema(source), partitions=ORDER_PARTS)
    pw = TableWriter(embedded_log, payments_schema(source), partitions=PAY_PARTS)
    rnd = random.Random(4243)
    at: dict[str, Any] = {}
    history(ow, pw, rnd, 100, None, at)
    argv = [sys.executable, str(RUNNER), str(embedded_log.path), rt.dsn, str(tmp_path / "ckpt"), source]
    proc = KilledProcess(argv, tmp_path / "runner.log", "the follower")
    try:
        proc.kill_after_progress(lambda: live_offsets(rt.dsn, name), lambda _: history(ow, pw, rnd, 70, None, at),
                                 trial_count(1, 2), rnd, 1.0)
        end = sum(embedded_log.end_offsets(ow.topic).values()) + sum(embedded_log.end_offsets(pw.topic).values())
        proc.wait(lambda: live_offsets(rt.dsn, name) >= end, 300, "the restarted follower to reach the log end")
    finally:
        proc.kill()
    want, want_late = reference(embedded_log, ow.topic, pw.topic, cfg)
    assert view(rt.dsn, name) == want, "after kill -9: " + diff(view(rt.dsn, name), want)
    from tests.projections.interval_runner import unpaid

    spec = ProjectionSpec.from_class(unpaid(source))
    assert interval_status(rt.sink, rt.sink.live(prepare(spec, rt).view))["late_events"] == want_late
