"""Lookups (many-to-one joins): replay, follow with fan-out, load-time errors, a differential test.

The views are compared with a plain-Python join of the tables' current rows
(``join_helpers.ref_docs`` / ``ref_revenue``), written from the semantics in the README's
"Joins" section, and with a fresh replay.
"""

from __future__ import annotations

import random
import sys
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.errors import ConfigError
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections import Lookup, Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.verify import verify
from tests._kill import KilledProcess, live_offsets, trial_count
from tests.projections.join_helpers import (
    DOC_COLS,
    REV_COLS,
    category_revenue,
    order_docs,
    ref_docs,
    ref_revenue,
    schemas,
)

pytestmark = pytest.mark.integration

T0 = datetime(2024, 1, 1, tzinfo=UTC)


@pytest.fixture
def jrt(spark: Any, pg_dsn: str, tmp_path: Path) -> Any:
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = Runtime(spark, str(log_dir), PostgresSink(pg_dsn), dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt")
    try:
        yield rt, log
    finally:
        rt.close()
        log.close()


class Shop:
    """Four tables written to the log, with their current rows for the reference."""

    def __init__(self, log: EmbeddedLog, source: str) -> None:
        self.w = {name: TableWriter(log, s, partitions=2) for name, s in schemas(source).items()}

    @property
    def rows(self) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
        return {n: w.rows for n, w in self.w.items()}

    def flush(self) -> int:
        return sum(w.flush() for w in self.w.values())


def _norm(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    return v


def _view(rt: Runtime, proj: type[Projection], cols: tuple[str, ...], sink_name: str | None = None,
          ) -> dict[tuple[Any, ...], Any]:
    spec = as_spec(proj)
    sink = rt.sinks[sink_name] if sink_name else rt.sink
    live = sink.live(prepare(spec, rt).view)
    assert live is not None, f"{spec.name}: no live view"
    return {tuple(r[k] for k in spec.key): {c: _norm(r.get(c)) for c in cols} for r in sink.scan(live)}


def _want(ref: dict[Any, Any], cols: tuple[str, ...]) -> dict[Any, Any]:
    return {k: {c: _norm(v[c]) for c in cols} for k, v in ref.items()}


def _diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want), key=repr)
    return "; ".join(f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k))


def _wait(f: Follower, timeout: float = 120) -> None:
    assert f.wait_for(lambda s: f.caught_up(), timeout), f"{f.name} did not catch up within {timeout}s"


def _seed(shop: Shop) -> None:
    w = shop.w
    for c in range(1, 4):
        w["customers"].insert({"id": c, "name": f"cust{c}", "city": "Oslo" if c % 2 else "Rome"})
    for g in range(1, 3):
        w["categories"].insert({"id": g, "name": f"cat{g}"})
    for p in range(1, 4):
        w["products"].insert({"id": p, "title": f"prod{p}", "category_id": 1 + p % 2,
                              "added": T0 + timedelta(microseconds=p * 1001)})
    for o in range(1, 7):
        w["orders"].insert({"id": o, "customer_id": 1 + o % 3, "product_id": 1 + o % 3,
                            "amount": Decimal(o * 10) / 4, "status": "new"})
    shop.flush()


def test_replay_then_follow_fan_out_deletes_and_late_rows(jrt: Any) -> None:
    rt, log = jrt
    source = "j" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    docs, rev = order_docs(source), category_revenue(source)
    for p in (docs, rev):
        replay(p, rt)
    assert _view(rt, docs, DOC_COLS) == _want(ref_docs(shop.rows), DOC_COLS)
    assert _view(rt, rev, REV_COLS) == _want(ref_revenue(shop.rows), REV_COLS)
    followers = [Follower(p, rt, trigger="0.2s").start() for p in (docs, rev)]
    try:
        w = shop.w
        steps = [
            lambda: w["customers"].update((1,), {"name": "renamed"}),  # fan-out to two orders
            lambda: w["categories"].update((2,), {"name": "cat2b"}),  # fan-out through the chain
            lambda: w["products"].update((2,), {"category_id": 1}),  # a product moves category
            lambda: w["orders"].update((1,), {"customer_id": 3, "product_id": 3}),  # a moved order
            lambda: w["customers"].delete((2,)),  # left: NULLs
            lambda: w["orders"].insert({"id": 9, "customer_id": 7, "product_id": 9, "amount": Decimal("1.5"),
                                        "status": "new"}),  # its customer and product come later
            lambda: w["orders"].update((2,), {"customer_id": None}),  # NULL foreign key
            lambda: (w["customers"].insert({"id": 7, "name": "late", "city": "Bern"}),
                     w["products"].insert({"id": 9, "title": "late product", "category_id": 2, "added": T0})),
            lambda: w["categories"].delete((1,)),
            lambda: w["orders"].delete((3,)),
        ]
        for i, step in enumerate(steps):
            step()
            shop.flush()
            for f in followers:
                _wait(f)
            got, want = _view(rt, docs, DOC_COLS), _want(ref_docs(shop.rows), DOC_COLS)
            assert got == want, f"step {i}: {_diff(got, want)}"
            got, want = _view(rt, rev, REV_COLS), _want(ref_revenue(shop.rows), REV_COLS)
            assert got == want, f"step {i} (revenue): {_diff(got, want)}"
    finally:
        for f in followers:
            f.stop()
    # verify compares the followed view with a fresh build, and sees drift in a joined column
    assert verify(docs, rt).drift_count == 0
    view = prepare(as_spec(docs), rt).view.name
    with psycopg.connect(rt.dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE public."{view}" SET customer_name = \'tampered\' WHERE id = 4')
        res = verify(docs, rt)
        assert res.drift_count == 1 and res.drift[0].key == (4,)
        leftover = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'kappaflow' "
                                "AND tablename LIKE %s", (f"join__public__{view}__kf_%",)).fetchone()
        assert leftover == (0,), "verify left its scratch join state behind"
    for p, cols in ((docs, DOC_COLS), (rev, REV_COLS)):
        followed = _view(rt, p, cols)
        replay(p, rt)
        got = _view(rt, p, cols)
        if p is docs:
            followed[(4,)]["customer_name"] = got[(4,)]["customer_name"]  # the replay repaired the tampering
        assert got == followed


# --- load-time errors ------------------------------------------------------------------------------
def _proj(source: str, **attrs: Any) -> type[Projection]:
    t = f"{source}.public."
    base = {"name": "je_" + uuid.uuid4().hex[:6], "sources": [t + "orders"], "key": ["id"]}
    return type("Bad", (Projection,), {**base, **attrs})


def test_bad_lookups_fail_at_load_time_naming_projection_and_attribute(jrt: Any) -> None:
    rt, log = jrt
    source = "j" + uuid.uuid4().hex[:7]
    Shop(log, source)
    t = f"{source}.public."

    def error(**attrs: Any) -> str:
        p = _proj(source, **attrs)
        with pytest.raises(ConfigError) as info:
            prepare(as_spec(p), rt)
        msg = str(info.value)
        assert repr(as_spec(p).name) in msg or "Bad" in msg, msg
        return msg

    msg = error(lookups=[Lookup("customer", t + "customers", on={"customer_id": "id"}, columns=["name", "nope"])])
    assert "'lookups'['customer'].columns" in msg and "nope" in msg
    msg = error(lookups=[Lookup("customer", t + "customers", on={"status": "id"})])
    assert "'lookups'['customer'].on" in msg and "status" in msg and "cannot be compared" in msg
    msg = error(lookups=[Lookup("missing", t + "suppliers", on={"customer_id": "id"})])
    assert "'lookups'['missing'].topic" in msg and "suppliers" in msg
    msg = error(lookups=[Lookup("customer", t + "customers", on={"customer_id": "name"})])
    assert "'lookups'['customer'].on" in msg and "primary key" in msg
    msg = error(lookups=[Lookup("customer", t + "customers", on={"nope_id": "id"})])
    assert "'lookups'['customer'].on" in msg and "nope_id" in msg
    msg = error(lookups=[Lookup("customer", t + "customers", on={"customer_id": "id"}, columns=["id", "name"],
                                prefix="")])
    assert "'lookups'['customer'].prefix" in msg and "'id'" in msg and "driving table" in msg

    def class_error(**attrs: Any) -> str:
        with pytest.raises(ConfigError) as info:
            as_spec(_proj(source, **attrs))
        assert "projection class" in str(info.value)
        return str(info.value)

    msg = class_error(lookups=[
        Lookup("a", t + "products", on={"product_id": "id"}, via="b"),
        Lookup("b", t + "categories", on={"category_id": "id"}, via="a"),
    ])
    assert "lookup cycle" in msg and "'lookups'" in msg
    msg = class_error(lookups=[
        Lookup("product", t + "products", on={"product_id": "id"}),
        Lookup("back", t + "orders", on={"id": "id"}, via="product"),
    ])
    assert "lookup cycle" in msg and "'lookups'['back']" in msg
    msg = class_error(lookups=[Lookup("x", t + "products", on={"product_id": "id"}, via="nobody")])
    assert "'lookups'['x'].via" in msg
    msg = class_error(lookups=[Lookup("x", t + "products", on={"product_id": "id"}, how="outer")])
    assert "'lookups'['x'].how" in msg
    # an apply() fold folds events: it is pointed to AsOf (rows as they were), not given current rows
    msg = class_error(lookups=[Lookup("product", t + "products", on={"product_id": "id"})],
                      schema="id int, n int", apply=lambda self, row, event: {"n": 1})
    assert "'lookups'" in msg and "as_of = [AsOf(...)]" in msg and "replay" in msg


# --- differential: seeded random interleavings on every table --------------------------------------
def _random_batch(shop: Shop, rnd: random.Random, step: int) -> str:
    """1-4 changes over the four tables: renames (fan-out), moved rows, deletes and re-inserts on
    either side, rows pointing at rows that come later, NULL foreign keys."""
    w, rows = shop.w, shop.rows
    did = []
    for _ in range(rnd.randint(1, 4)):
        table = rnd.choice(["customers", "categories", "products", "orders", "orders"])
        have = sorted(k[0] for k in rows[table])
        ids = {"customers": range(1, 7), "categories": range(1, 4), "products": range(1, 7), "orders": range(1, 16)}
        free = [i for i in ids[table] if (i,) not in rows[table]]
        op = rnd.choice(["insert", "update", "update", "delete"]) if have else "insert"
        if op == "insert" and not free:
            op = "update"
        i = rnd.choice(free) if op == "insert" else rnd.choice(have)
        if table == "customers":
            if op == "insert":
                w[table].insert({"id": i, "name": f"c{i}s{step}", "city": rnd.choice(["Oslo", "Rome", None])})
            elif op == "update":
                w[table].update((i,), {"name": f"c{i}s{step}"} if rnd.random() < 0.7 else {"city": "Lima"})
            else:
                w[table].delete((i,))
        elif table == "categories":
            if op == "insert":
                w[table].insert({"id": i, "name": f"g{i}s{step}"})
            elif op == "update":
                w[table].update((i,), {"name": f"g{i}s{step}"})
            else:
                w[table].delete((i,))
        elif table == "products":
            cat = rnd.choice([1, 2, 3, 4, None])  # 4 never exists: a dangling chain
            if op == "insert":
                w[table].insert({"id": i, "title": f"p{i}s{step}", "category_id": cat,
                                 "added": T0 + timedelta(seconds=step, microseconds=i)})
            elif op == "update":
                w[table].update((i,), {"category_id": cat} if rnd.random() < 0.5 else {"title": f"p{i}s{step}"})
            else:
                w[table].delete((i,))
        else:
            cust, prod = rnd.choice([*range(1, 8), None]), rnd.choice([*range(1, 8), None])
            if op == "insert":
                w[table].insert({"id": i, "customer_id": cust, "product_id": prod,
                                 "amount": Decimal(rnd.randint(1, 9999)) / 100, "status": "new"})
            elif op == "update":
                change = rnd.choice([{"customer_id": cust}, {"product_id": prod}, {"status": "cancelled"},
                                     {"status": "paid", "amount": Decimal(rnd.randint(1, 999)) / 10}])
                w[table].update((i,), change)
            else:
                w[table].delete((i,))
        did.append(f"{op} {table}[{i}]")
    shop.flush()
    return ", ".join(did)


_REFS = {"orders": {"customer_id": "customers", "product_id": "products"}, "products": {"category_id": "categories"}}
_NAMES = {"customers": "name", "categories": "name", "products": "title"}
# every case kind the random interleavings must reach (a smaller seed or fewer steps must not drop one)
CASE_KINDS = frozenset(
    {"re-insert", "orders deleted", "NULL foreign key", "dangling reference"}
    | {f"{t} {what}" for t in _NAMES for what in ("arrives late", "deleted under referrers", "renamed (fan-out)")}
    | {f"{t}.{c} moved" for t, cols in _REFS.items() for c in cols}
)


def _referenced(rows: dict[str, dict[Any, dict[str, Any]]], table: str, i: Any) -> bool:
    return any(r.get(c) == i for t, cols in _REFS.items() for c, dim in cols.items() if dim == table
               for r in rows[t].values())


def _case_kinds(before: dict[str, dict[Any, dict[str, Any]]], after: dict[str, dict[Any, dict[str, Any]]],
                gone: dict[str, set[Any]]) -> set[str]:
    """The case kinds (names in CASE_KINDS) one batch took the rows through, from the rows before
    and after it; `gone` collects every key deleted so far (to recognise re-inserts)."""
    kinds = set()
    for table, a in after.items():
        b = before[table]
        for k in a.keys() - b.keys():
            kinds |= {"re-insert"} if k in gone[table] else set()
            if table != "orders" and _referenced(before, table, k[0]):
                kinds.add(f"{table} arrives late")  # rows pointing at it were there first
        for k in b.keys() - a.keys():
            gone[table].add(k)
            if table == "orders":
                kinds.add("orders deleted")
            elif _referenced(after, table, k[0]):
                kinds.add(f"{table} deleted under referrers")
        for k in a.keys() & b.keys():
            kinds |= {f"{table}.{c} moved" for c in _REFS.get(table, {}) if a[k][c] != b[k][c]}
            n = _NAMES.get(table)
            if n and a[k][n] != b[k][n] and _referenced(after, table, k[0]):
                kinds.add(f"{table} renamed (fan-out)")
    for t, cols in _REFS.items():
        for r in after[t].values():
            for c, dim in cols.items():
                if r[c] is None:
                    kinds.add("NULL foreign key")
                elif (r[c],) not in after[dim]:
                    kinds.add("dangling reference")
    return kinds


def test_random_interleavings_follow_equals_reference_and_fresh_replay(jrt: Any) -> None:
    rt, log = jrt
    source = "j" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    projs = {"docs": (order_docs(source), DOC_COLS, lambda r: ref_docs(r)),
             "inner": (order_docs(source, how="inner"), DOC_COLS, lambda r: ref_docs(r, "inner")),
             "revenue": (category_revenue(source), REV_COLS, ref_revenue)}
    for p, _, _ in projs.values():
        replay(p, rt)
    followers = {n: Follower(p, rt, trigger="0.2s").start() for n, (p, _, _) in projs.items()}
    # seed 113 reaches every kind in CASE_KINDS within 13 steps (the former 24 steps of seed
    # 20261125 never had a customer arrive late); each step is a micro-batch of its own
    rnd = random.Random(113)
    history: list[str] = []
    covered: set[str] = set()
    gone: dict[str, set[Any]] = {t: set() for t in shop.rows}
    try:
        for step in range(1, 14):
            before = {t: {k: dict(r) for k, r in rows.items()} for t, rows in shop.rows.items()}
            history.append(_random_batch(shop, rnd, step))
            covered |= _case_kinds(before, shop.rows, gone)
            for f in followers.values():
                _wait(f)
            for n, (p, cols, ref) in projs.items():
                got, want = _view(rt, p, cols), _want(ref(shop.rows), cols)
                assert got == want, f"{n} after {history}: {_diff(got, want)}"
    finally:
        for f in followers.values():
            f.stop()
    assert covered == CASE_KINDS, f"the seeded history missed {sorted(CASE_KINDS - covered)}: {history}"
    for n, (p, cols, ref) in projs.items():
        followed = _view(rt, p, cols)
        assert followed == _want(ref(shop.rows), cols), n
        replay(p, rt)
        assert _view(rt, p, cols) == followed, f"{n}: a fresh replay differs from the followed view"


# --- kill -9 during fan-out ---------------------------------------------------------------------------
RUNNER = Path(__file__).with_name("follow_runner.py")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a follower process starts its own Spark after every kill
def test_follower_killed_with_sigkill_during_fan_out_equals_a_fresh_replay(jrt: Any, tmp_path: Path) -> None:
    """A follower process (batches of at most 60 records) is killed with -9 at random moments while
    renames of a customer with 300 orders fan out, and restarted: join state, view rows and positions
    commit together, so the view ends equal to the reference and to a fresh replay."""
    rt, log = jrt
    source = "k" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    for o in range(100, 400):
        shop.w["orders"].insert({"id": o, "customer_id": 1, "product_id": 1 + o % 3, "amount": Decimal(o),
                                 "status": "new"})
    shop.flush()
    proj = order_docs(source, name=f"{source}_docs")
    rnd = random.Random(915)
    topics = [w.topic for w in shop.w.values()]

    def more(trial: int) -> None:
        shop.w["customers"].update((1,), {"name": f"hub{trial}"})  # 300+ view rows to rewrite
        for o in rnd.sample(range(100, 400), 40):
            shop.w["orders"].update((o,), {"amount": Decimal(rnd.randint(1, 999))})
        shop.w["products"].update((1 + trial % 3,), {"title": f"t{trial}"})
        shop.flush()

    argv = [sys.executable, str(RUNNER), str(log.path), rt.dsn, str(tmp_path / "kill_ckpt"), source, "joins"]
    proc = KilledProcess(argv, tmp_path / "runner.log", "the follower")
    try:
        proc.kill_after_progress(lambda: live_offsets(rt.dsn, proj.name), more, trial_count(2, 3), rnd, 1.5)
        end = sum(sum(log.end_offsets(t).values()) for t in topics)
        proc.wait(lambda: live_offsets(rt.dsn, proj.name) >= end, 300, "the follower to catch up")
    finally:
        proc.kill()
    followed = _view(rt, proj, DOC_COLS)
    assert followed == _want(ref_docs(shop.rows), DOC_COLS), _diff(followed, _want(ref_docs(shop.rows), DOC_COLS))
    replay(proj, rt)
    assert _view(rt, proj, DOC_COLS) == followed


# --- malformed records of looked-up tables -------------------------------------------------------------
def test_malformed_looked_up_records_go_to_the_dead_letters_with_their_position(jrt: Any) -> None:
    """A looked-up table's record that is not a change event counts as a delete of its row (the rule of
    the driving table) and goes to the dead-letter topic with the reason and its position, in replay
    and in follow."""
    from kappaflow.log.base import Record
    from kappaflow.projections.deadletter import read_dead_letters
    from kappaflow.projections.engine import apply_range, nest

    rt, log = jrt
    source = "m" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    cw = shop.w["customers"]

    def malformed(cid: int) -> None:
        kb = cw.codec.encode_key({"id": cid}, cw.schema)
        log.append(cw.topic, [Record(kb, b'{"op": "x", "after": {"id": 1}}')])
        cw.rows.pop((cid,))  # the join counts it as a delete

    malformed(1)
    docs = order_docs(source)
    res = replay(docs, rt)
    assert res.dead_letters == 1
    assert _view(rt, docs, DOC_COLS) == _want(ref_docs(shop.rows), DOC_COLS)
    malformed(2)
    shop.w["orders"].update((1,), {"status": "paid"})
    shop.flush()
    spec = as_spec(docs)
    plan = prepare(spec, rt)
    live = rt.sink.live(plan.view)
    assert live is not None
    parts = {t: log.partitions(t) for t in spec.topics}
    batch = apply_range(plan, rt, live, nest(rt.sink.read_positions(live), spec.topics, parts),
                        rt.end_offsets(spec.topics))
    assert batch.dead_letters == 1
    assert _view(rt, docs, DOC_COLS) == _want(ref_docs(shop.rows), DOC_COLS)
    dead = read_dead_letters(rt.log_url, {}, spec.name)
    assert len(dead) == 2, dead
    keys = set()
    for d in dead:
        assert d["topic"] == cw.topic and "not a change event" in d["reason"] and "['customer']" in d["reason"], d
        rec = log.read(cw.topic, d["partition"], d["offset"], 1)[0]  # the position names the record exactly
        assert rec.offset == d["offset"] and rec.value.startswith(b'{"op": "x"')
        keys.add(rec.key)
    assert keys == {cw.codec.encode_key({"id": cid}, cw.schema) for cid in (1, 2)}
