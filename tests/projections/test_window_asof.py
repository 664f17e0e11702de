"""Windowed views over as-of enrichment (README "Event time", "As-of enrichment"): hourly revenue per
product category, where an order's category is the one its product had when the order changed.

Seeded histories of orders (out of order, a day late, moved in time and between products, deleted,
cancelled) interleaved with products moving between categories, written with commit times and
LSNs the test sets. Two clocks: products in the orders' source (position clock: nothing waits) and
in another source (time clock: orders wait until the products' capture has passed them, so a
follower cut where the products lag folds fewer events). A follower fed the log in batches at
transaction cuts, a replay, and a plain-Python reference of the documented rule (the as-of row per
event, then the windows' watermark rule over each partition's released events in offset order)
agree at a mid-log cut and at the end; the late decisions equal those of the same window without
the enrichment. A ``Lookup`` (current row) feeding a window is refused at load time.
"""

from __future__ import annotations

import random
import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
import pytest

from kappaflow.errors import ConfigError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.projections import AsOf, Count, Hopping, Lookup, Projection, ProjectionSpec, Session, Sum, Tumbling
from kappaflow.projections.engine import apply_range, prepare
from kappaflow.projections.folds.windowed import window_status
from kappaflow.projections.replay import replay
from tests.projections.test_asof import TimedWriter
from tests.projections.test_windows import late_offsets

T0 = datetime(2024, 3, 1, tzinfo=UTC)
H = timedelta(hours=1)
ORDER_PARTS, PRODUCT_PARTS = 3, 2
CATEGORIES = ("shoes", "camping", "clothing", "tools")


def orders_schema(source: str) -> TableSchema:
    return TableSchema(
        f"{source}.public.orders",
        (
            Column("id", FieldType.INT64, optional=False),
            Column("customer_id", FieldType.INT64),
            Column("product_id", FieldType.INT64),
            Column("amount", FieldType.INT64),
            Column("status", FieldType.STRING),
            Column("created_at", FieldType.TIMESTAMPTZ),
        ),
        ("id",),
    )


def products_schema(source: str) -> TableSchema:
    return TableSchema(
        f"{source}.public.products",
        (
            Column("id", FieldType.INT64, optional=False),
            Column("name", FieldType.STRING),
            Column("category", FieldType.STRING),
        ),
        ("id",),
    )


@dataclass(frozen=True)
class Cfg:
    clock: str  # position (products in the orders' source) | time (another source)
    shape: str  # tumbling | hopping
    late: str
    delay: timedelta
    lateness: timedelta

    @property
    def slide(self) -> timedelta:
        return H if self.shape == "tumbling" else timedelta(minutes=30)

    def window(self) -> Any:
        rules = {"delay": self.delay, "allowed_lateness": self.lateness, "late": self.late}
        if self.shape == "tumbling":
            return Tumbling("created_at", size="1h", **rules)
        return Hopping("created_at", size="1h", slide="30m", **rules)


CONFIGS = {
    "position-tumbling-dead_letter": Cfg("position", "tumbling", "dead_letter", timedelta(minutes=10),
                                         timedelta(minutes=30)),
    "time-hopping-drop": Cfg("time", "hopping", "drop", timedelta(minutes=5), timedelta(minutes=20)),
}


def category_hourly(orders: str, products: str, window: Any, name: str) -> type[Projection]:
    return type("CategoryHourly", (Projection,), {
        "name": name, "sources": [orders], "key": ["product_category"], "where": "status <> 'cancelled'",
        "as_of": [AsOf("product", products, on={"product_id": "id"}, columns=["category"])],
        "window": window, "aggregates": {"orders": Count(), "revenue": Sum("amount")},
    })


# --- the history -------------------------------------------------------------------------------------------
@dataclass
class Shop:
    orders: TimedWriter
    products: TimedWriter
    cuts: list[dict[str, dict[int, int]]]  # the log at each flush: every topic at its source's last cut


def history(log: Any, cfg: Cfg, rnd: random.Random, steps: int) -> Shop:
    """One op per transaction (commit time and LSN strictly increasing across both tables). Position
    clock: both tables flushed together (one source's transaction cuts). Time clock: each source cut on
    its own, the products' less often (their capture lags the orders'), and a last product change
    (a heartbeat) releases every order at the end."""
    src = "a" + uuid.uuid4().hex[:7]
    orders = TimedWriter(log, orders_schema(src), partitions=ORDER_PARTS)
    products = TimedWriter(log, products_schema(src if cfg.clock == "position" else "c" + uuid.uuid4().hex[:7]),
                           partitions=PRODUCT_PARTS)
    shop = Shop(orders, products, [])
    tick = {"ts": int(T0.timestamp() * 1000), "lsn": 1_000}

    def at(w: TimedWriter) -> TimedWriter:
        tick["ts"] += rnd.randint(1, 3)
        tick["lsn"] += rnd.randint(1, 2)
        return w.at(tick["ts"], tick["lsn"])

    def cut(*writers: TimedWriter) -> None:
        for w in writers:
            w.flush()
        shop.cuts.append({w.topic: log.end_offsets(w.topic) for w in (orders, products)})

    for i in range(1, 6):
        at(products).insert({"id": i, "name": f"p{i}", "category": CATEGORIES[i % len(CATEGORIES)]})
    cut(products, orders)
    clock, next_id = T0, 1
    for _ in range(steps):
        clock += timedelta(minutes=rnd.randint(0, 9))
        r = rnd.random()
        live = list(orders.rows)
        if r < 0.14:
            p = rnd.randint(1, 5)
            now = products.rows[(p,)]["category"]
            at(products).update((p,), {"category": rnd.choice([c for c in CATEGORIES if c != now])})
        elif r < 0.62 or not live:
            t = clock - (timedelta(minutes=rnd.randint(1, 90)) if rnd.random() < 0.15 else timedelta(0))
            if rnd.random() < 0.04:
                t -= timedelta(days=1)
            at(orders).insert({"id": next_id, "customer_id": rnd.randint(1, 4), "product_id": rnd.randint(1, 5),
                               "amount": rnd.randint(1, 500), "status": "new", "created_at": t})
            next_id += 1
        elif r < 0.76:
            at(orders).update(rnd.choice(live), {"created_at": clock - timedelta(minutes=rnd.randint(0, 150))})
        elif r < 0.84:
            at(orders).update(rnd.choice(live), {"product_id": rnd.randint(1, 5), "amount": rnd.randint(1, 500)})
        elif r < 0.91:
            at(orders).delete(rnd.choice(live))
        else:
            at(orders).update(rnd.choice(live), {"status": rnd.choice(["cancelled", "paid"])})
        if cfg.clock == "position":
            if rnd.random() < 0.15:
                cut(orders, products)
        else:
            if rnd.random() < 0.2:
                cut(orders)
            if rnd.random() < 0.06:
                cut(products)
    at(products).update((1,), {"name": "p1 (heartbeat)"})
    cut(orders, products)
    return shop


# --- the reference -----------------------------------------------------------------------------------------
Rec = tuple[int, bytes, dict[str, Any] | None, int]


def _records(log: Any, topic: str, upto: dict[int, int]) -> dict[int, list[Rec]]:
    """Per partition, below `upto`: (offset, key, after, commit time ms); no tombstones."""
    out: dict[int, list[Rec]] = {}
    for p in range(log.partitions(topic)):
        out[p] = []
        for r in log.iter_partition(topic, p):
            if r.offset >= upto.get(p, 0):
                break
            if r.value is not None:
                v = orjson.loads(r.value)
                out[p].append((r.offset, r.key, v["after"], v["source"]["ts_ms"]))
    return out


def _windows(t: datetime, cfg: Cfg) -> list[datetime]:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    s = epoch + ((t - epoch) // cfg.slide) * cfg.slide
    out = []
    while s > t - H:
        out.append(s)
        s -= cfg.slide
    return sorted(out)


@dataclass
class Ref:
    view: dict[Any, Any]  # {(category, start, end): (orders, revenue, final)}
    late: list[int]  # offsets of the changes with a late window
    released: int  # order changes folded
    read: int  # order changes in the log at the cut
    categories: dict[int, set[str]]  # per product: the categories its folded orders got


def reference(log: Any, shop: Shop, cfg: Cfg, cut: dict[str, dict[int, int]]) -> Ref:
    """What the README's rules give for the log at `cut`. As-of: an order change sees the newest product
    change committed before it (commit times and LSNs both follow the one op order here); it is
    released when the products' capture has passed it (time clock: a product change read at or after
    its commit time; position clock: always, at a cut). Then the windows' rule over each partition's
    released changes in offset order."""
    changes = sorted(
        (ts, orjson.loads(key)["id"], after)
        for recs in _records(log, shop.products.topic, cut[shop.products.topic]).values()
        for _off, key, after, ts in recs
    )
    frontier = changes[-1][0] if changes else None

    def category(product: Any, ts: int) -> str | None:
        row = None
        for cts, pid, after in changes:
            if cts >= ts:
                break
            if pid == product:
                row = after
        return row["category"] if row else None

    pmax: dict[int, datetime] = {}
    contrib: dict[bytes, dict[datetime, tuple[str, int]]] = {}
    late: list[int] = []
    released = read = 0
    categories: dict[int, set[str]] = {}
    for p, recs in _records(log, shop.orders.topic, cut[shop.orders.topic]).items():
        read += len(recs)
        for off, key, after, ts in recs:
            if cfg.clock == "time" and (frontier is None or ts > frontier):
                break  # waits, and so does the rest of the partition (later commit times)
            released += 1
            t = datetime.fromisoformat(after["created_at"]) if after else None
            wm = pmax[p] - cfg.delay if p in pmax else None
            mine = contrib.setdefault(key, {})
            for ws in list(mine):
                if wm is not None and ws + H + cfg.lateness <= wm and cfg.late != "update":
                    continue
                del mine[ws]
            cat = category(after["product_id"], ts) if after else None
            if after is not None and t is not None and after["status"] != "cancelled" and cat is not None:
                categories.setdefault(after["product_id"], set()).add(cat)
                was_late = False
                for ws in _windows(t, cfg):
                    if wm is not None and ws + H + cfg.lateness <= wm:
                        was_late = True
                        if cfg.late != "update":
                            continue
                    mine[ws] = (cat, after["amount"])
                if was_late:
                    late.append(off)
            if t is not None and (p not in pmax or t > pmax[p]):
                pmax[p] = t
    w = min(pmax.values()) - cfg.delay if len(pmax) == ORDER_PARTS else None
    acc: dict[tuple[str, datetime], list[int]] = {}
    for mine in contrib.values():
        for ws, (cat, amount) in mine.items():
            acc.setdefault((cat, ws), []).append(amount)
    view = {(cat, ws, ws + H): (len(a), sum(a), w is not None and ws + H + cfg.lateness <= w)
            for (cat, ws), a in acc.items()}
    return Ref(view, sorted(late), released, read, categories)


def view(dsn: str, name: str) -> dict[Any, Any]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f'SELECT product_category, window_start, window_end, orders, revenue, final FROM public."{name}"'
        ).fetchall()
    return {(r[0], r[1], r[2]): (r[3], int(r[4]), r[5]) for r in rows}


def diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want), key=repr)
    bad = [f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k)]
    return f"{len(bad)} rows differ, e.g. " + "; ".join(bad[:6])


# --- tests -------------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("case", list(CONFIGS))
def test_windows_over_as_of_rows_replay_and_follow_equal_the_reference(rt: Any, embedded_log: Any, case: str) -> None:
    cfg = CONFIGS[case]
    rnd = random.Random(zlib.crc32(case.encode()))
    shop = history(embedded_log, cfg, rnd, 220)
    end = shop.cuts[-1]
    ref = reference(embedded_log, shop, cfg, end)
    want, want_late = ref.view, ref.late
    assert len(want) > 10 and want_late, "the history must make many windows and late events"
    assert ref.released == ref.read, "the last product change (a heartbeat) releases every order"
    assert sum(len(c) > 1 for c in ref.categories.values()) >= 2, "products must change category between orders"

    replayed = category_hourly(shop.orders.topic, shop.products.topic, cfg.window(), "cr_" + uuid.uuid4().hex[:8])
    replay(replayed, rt)
    assert view(rt.dsn, replayed.name) == want, "replay: " + diff(view(rt.dsn, replayed.name), want)
    if cfg.late == "dead_letter":
        assert late_offsets(rt, replayed.name) == want_late

    # a follower fed the log between random transaction cuts
    followed = category_hourly(shop.orders.topic, shop.products.topic, cfg.window(), "cf_" + uuid.uuid4().hex[:8])
    plan = prepare(ProjectionSpec.from_class(followed), rt)
    target = rt.sink.ensure(plan.view)
    picks = [*sorted(rnd.sample(range(1, len(shop.cuts) - 1), 5)), len(shop.cuts) - 1]
    start = {t: {p: 0 for p in range(embedded_log.partitions(t))} for t in end}
    held = 0
    for i in picks:
        apply_range(plan, rt, target, start, shop.cuts[i])
        start = shop.cuts[i]
        if i != picks[-1]:
            mid = reference(embedded_log, shop, cfg, start)
            held += mid.read - mid.released
            got = view(rt.dsn, followed.name)
            assert got == mid.view, f"follow at cut {i}: " + diff(got, mid.view)
    if cfg.clock == "time":
        assert held, "the products' capture must lag the orders at some cut (orders held back)"
    assert view(rt.dsn, followed.name) == want, "follow: " + diff(view(rt.dsn, followed.name), want)
    fstatus = window_status(rt.sink, target)
    rstatus = window_status(rt.sink, rt.sink.live(prepare(ProjectionSpec.from_class(replayed), rt).view))
    assert fstatus["watermark"] == rstatus["watermark"] and fstatus["late_events"] == rstatus["late_events"]
    assert fstatus["late_events"] == len(want_late)
    if cfg.late == "dead_letter":
        assert late_offsets(rt, followed.name) == want_late
        # the late decisions are the window's own: the same events as without the enrichment (every order's
        # product exists here, so each change with a late window counts in both)
        plain = type("Plain", (Projection,), {
            "name": "cp_" + uuid.uuid4().hex[:8], "sources": [shop.orders.topic], "key": ["customer_id"],
            "where": "status <> 'cancelled'", "window": cfg.window(), "aggregates": {"orders": Count()}})
        replay(plain, rt)
        assert late_offsets(rt, plain.name) == want_late


@pytest.mark.integration
def test_session_windows_over_as_of_rows_follow_equals_replay(rt: Any, embedded_log: Any) -> None:
    """Session windows take the enriched rows too (late="update": late changes applied): a follower in
    batches equals a replay."""
    cfg = CONFIGS["time-hopping-drop"]
    rnd = random.Random(77)
    shop = history(embedded_log, cfg, rnd, 120)
    window = Session("created_at", gap="30m", delay="5m", allowed_lateness="1h", late="update")
    replayed = category_hourly(shop.orders.topic, shop.products.topic, window, "sr_" + uuid.uuid4().hex[:8])
    replay(replayed, rt)
    followed = category_hourly(shop.orders.topic, shop.products.topic, window, "sf_" + uuid.uuid4().hex[:8])
    plan = prepare(ProjectionSpec.from_class(followed), rt)
    target = rt.sink.ensure(plan.view)
    start = {t: {p: 0 for p in range(embedded_log.partitions(t))} for t in shop.cuts[-1]}
    for i in [*sorted(rnd.sample(range(1, len(shop.cuts) - 1), 3)), len(shop.cuts) - 1]:
        apply_range(plan, rt, target, start, shop.cuts[i])
        start = shop.cuts[i]
    got, want = view(rt.dsn, followed.name), view(rt.dsn, replayed.name)
    assert got == want and len(want) >= 4, diff(got, want)


def test_a_lookup_feeding_a_window_is_refused_at_load_naming_the_attribute() -> None:
    base = {"name": "cat_hourly", "sources": ["s.public.orders"], "key": ["product_category"],
            "window": Tumbling("created_at", size="1h"), "aggregates": {"n": Count()}}
    lookup = Lookup("product", "s.public.products", on={"product_id": "id"}, columns=["category"])
    with pytest.raises(ConfigError) as info:
        ProjectionSpec.from_class(type("CatHourly", (Projection,), {**base, "lookups": [lookup]}))
    msg = str(info.value)
    assert "CatHourly" in msg and "'lookups'" in msg and "as_of = [AsOf(...)]" in msg
    assert "closed" in msg and "replay would differ" in msg
    # the same with AsOf loads; AsOf stays refused where current rows are folded (grouped views)
    asof = AsOf("product", "s.public.products", on={"product_id": "id"}, columns=["category"])
    spec = ProjectionSpec.from_class(type("CatHourly", (Projection,), {**base, "as_of": [asof]}))
    assert spec.kind == "windowed" and spec.as_of == (asof,)
    with pytest.raises(ConfigError, match=r"'as_of': as-of enrichment feeds custom folds .* and windowed views"):
        ProjectionSpec.from_class(type("CatTotals", (Projection,), {
            "name": "cat_totals", "sources": ["s.public.orders"], "key": ["product_category"],
            "aggregates": {"n": Count()}, "as_of": [asof]}))


def test_copy_csv_of_a_table_with_leading_empty_chunks() -> None:
    """A windowed batch whose events all wait writes only the watermark row, concatenated after empty
    chunks: the COPY text holds that row and nothing else (pyarrow's CSV writer emitted stale bytes)."""
    import pyarrow as pa

    from kappaflow.projections.sinks.postgres import csv_bytes

    def rows(n: int, topic: str) -> pa.Table:
        return pa.table({"t": pa.array([topic] * n, pa.string()), "k": pa.array([b"W"] * n, pa.binary()),
                         "d": pa.array([False] * n, pa.bool_())})

    csv_bytes(rows(500, "some.public.orders"))  # leaves bytes in the memory pool
    assert csv_bytes(pa.concat_tables([rows(0, "x"), rows(0, "x"), rows(1, "kf:watermark")])) == (
        b'"kf:watermark","\\x57",false\n'
    )
    assert csv_bytes(pa.concat_tables([rows(0, "x"), rows(0, "x")])) == b""
