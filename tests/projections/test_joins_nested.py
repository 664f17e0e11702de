"""Nested collections (one-to-many): a customer document with the list of its orders, in search
(osmem, a ``nested`` field) and Redis (a JSON list).

* seeded random interleavings of child adds, changes, moves to another parent and deletes, and of
  parent inserts, updates and deletes (children arriving before their parent too), folded by the
  follow code path (``engine.apply_range``, what each follower micro-batch runs), equal a
  plain-Python reference (``ref_customers``, written from the README's "Nested collections") after
  every batch and a fresh replay at the end; beside it, product documents (Redis) with a lookup
  (the category's name, renamed: fan-out) and the product's orders nested (late products, products
  deleted, orders moved between products);
* a crash between the join state's commit and the store's write, with children moved away from a
  parent and deleted, converges when the batch is read again;
* bad definitions fail at load time with a ConfigError naming the projection and the attribute.
"""

from __future__ import annotations

import random
import uuid
from decimal import Decimal
from typing import Any

import pytest

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections import Count, Lookup, Nested, Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink
from tests.projections import test_joins_documents as documents
from tests.projections.test_joins import Shop, _diff, _view, _want
from tests.projections.test_joins_documents import DOC_SINKS, _crashing, _follow_to_end

drt = documents.drt  # the runtime with PostgreSQL, search and Redis sinks (the same fixture)

pytestmark = pytest.mark.integration

ORDER_COLS = ("id", "amount", "status", "product_id")
CUSTOMER_COLS = ("id", "name", "city", "orders")


def customer_docs(source: str, sinks: tuple[str, ...] = DOC_SINKS) -> type[Projection]:
    t = f"{source}.public."
    return type(
        "CustomerDocs",
        (Projection,),
        {
            "name": "jn_" + uuid.uuid4().hex[:8],
            "sources": [t + "customers"],
            "key": ["id"],
            "sinks": sinks,
            "nested": [
                Nested("orders", t + "orders", on={"id": "customer_id"}, columns=list(ORDER_COLS), order_by=["status"])
            ],
        },
    )


def product_docs(source: str) -> type[Projection]:
    """Products with their category's name (a lookup) and their orders nested (default order: the
    order's key; every column; an int32 foreign key into an int64 key), in Redis."""
    t = f"{source}.public."
    return type(
        "ProductDocs",
        (Projection,),
        {
            "name": "jp_" + uuid.uuid4().hex[:8],
            "sources": [t + "products"],
            "key": ["id"],
            "columns": list(PRODUCT_COLS),
            "sinks": ("redis",),
            "lookups": [Lookup("category", t + "categories", on={"category_id": "id"}, columns=["name"])],
            "nested": [Nested("orders", t + "orders", on={"id": "product_id"})],
        },
    )


PRODUCT_COLS = ("id", "title", "category_name", "orders")


def ref_products(rows: dict[str, dict[tuple[Any, ...], dict[str, Any]]]) -> dict[Any, Any]:
    out = {}
    for (pid,), p in rows["products"].items():
        cat = rows["categories"].get((p["category_id"],)) if p["category_id"] is not None else None
        kids = sorted((o for o in rows["orders"].values() if o["product_id"] == pid), key=lambda o: o["id"])
        out[(pid,)] = {
            "id": pid,
            "title": p["title"],
            "category_name": cat["name"] if cat else None,
            "orders": [dict(o) for o in kids],
        }
    return out


def _status_key(o: dict[str, Any]) -> tuple[Any, ...]:
    """Ascending by status, NULLs first, then by the order's key (the README's order)."""
    return (o["status"] is not None, o["status"] or "", o["id"])


def ref_customers(rows: dict[str, dict[tuple[Any, ...], dict[str, Any]]]) -> dict[Any, Any]:
    """One document per current customer with the current orders pointing at it."""
    out = {}
    for (cid,), c in rows["customers"].items():
        kids = [o for o in rows["orders"].values() if o["customer_id"] == cid]
        out[(cid,)] = {
            "id": cid,
            "name": c["name"],
            "city": c["city"],
            "orders": [{k: o[k] for k in ORDER_COLS} for o in sorted(kids, key=_status_key)],
        }
    return out


def _seed(shop: Shop) -> None:
    w = shop.w
    for c in range(1, 5):
        w["customers"].insert({"id": c, "name": f"cust{c}", "city": "Oslo" if c % 2 else "Rome"})
    for o in range(1, 9):
        w["orders"].insert(
            {
                "id": o,
                "customer_id": 1 + o % 3,
                "product_id": 1 + o % 4,  # product 4 comes later
                "amount": Decimal(o * 10) / 4,
                "status": "new" if o % 2 else None,
            }
        )
    w["orders"].insert({"id": 9, "customer_id": 6, "product_id": 1, "amount": None, "status": "paid"})  # late parent
    for g in (1, 2):
        w["categories"].insert({"id": g, "name": f"cat{g}"})
    for p in (1, 2, 3):
        w["products"].insert({"id": p, "title": f"prod{p}", "category_id": 1 + p % 2, "added": None})
    shop.flush()


def _random_batch(shop: Shop, rnd: random.Random, step: int) -> str:
    """1-5 changes: orders added, changed, moved to another customer (or to none, or to one that comes
    later) and deleted; customers added (late parents), renamed and deleted."""
    w, rows = shop.w, shop.rows
    did = []
    for _ in range(rnd.randint(1, 5)):
        table = rnd.choice(["customers", "orders", "orders", "orders"])
        have = sorted(k[0] for k in rows[table])
        free = [i for i in (range(1, 8) if table == "customers" else range(1, 21)) if (i,) not in rows[table]]
        op = rnd.choice(["insert", "update", "update", "delete"]) if have else "insert"
        if op == "insert" and not free:
            op = "update"
        i = rnd.choice(free) if op == "insert" else rnd.choice(have)
        if table == "customers":
            if op == "insert":
                w[table].insert({"id": i, "name": f"c{i}s{step}", "city": rnd.choice(["Oslo", None])})
            elif op == "update":
                w[table].update((i,), {"name": f"c{i}s{step}"})
            else:
                w[table].delete((i,))
        else:
            cust = rnd.choice([*range(1, 9), None])  # 8 never exists
            if op == "insert":
                w[table].insert(
                    {
                        "id": i,
                        "customer_id": cust,
                        "product_id": rnd.choice([1, 2, 3, 4, None]),
                        "amount": Decimal(rnd.randint(1, 9999)) / 100,
                        "status": rnd.choice(["new", "paid", None]),
                    }
                )
            elif op == "update":
                w[table].update(
                    (i,),
                    rnd.choice(
                        [
                            {"customer_id": cust},
                            {"product_id": rnd.choice([1, 2, 3, 4, None])},
                            {"status": rnd.choice(["paid", "sent"])},
                            {"amount": Decimal(rnd.randint(1, 999)) / 10},
                        ]
                    ),
                )
            else:
                w[table].delete((i,))
        did.append(f"{op} {table}[{i}]")
    shop.flush()
    return ", ".join(did)


@pytest.mark.timeout(600)
def test_nested_collections_follow_equals_reference_and_fresh_replay(drt: Any) -> None:
    rt, log = drt
    source = "n" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    docs, products = customer_docs(source), product_docs(source)
    replay(docs, rt)
    replay(products, rt)
    plan, pplan = prepare(as_spec(docs), rt), prepare(as_spec(products), rt)
    want = _want(ref_customers(shop.rows), CUSTOMER_COLS)
    for s in DOC_SINKS:
        got = _view(rt, docs, CUSTOMER_COLS, s)
        assert got == want, f"{s} after the replay: {_diff(got, want)}"
    assert _view(rt, products, PRODUCT_COLS, "redis") == _want(ref_products(shop.rows), PRODUCT_COLS)
    mapping = rt.sinks["search"].mapping(plan.view)  # type: ignore[attr-defined]
    assert mapping["properties"]["orders"]["type"] == "nested", mapping
    w = shop.w
    steps = [
        lambda: w["orders"].update((1,), {"customer_id": 3}),  # moved: leaves customer 2, joins customer 3
        lambda: w["customers"].insert({"id": 6, "name": "late", "city": None}),  # its order 9 was there first
        lambda: (w["orders"].delete((4,)), w["orders"].update((7,), {"status": "a"})),  # deleted; re-sorted
        lambda: w["customers"].delete((2,)),  # the parent goes: so does its document
        lambda: (
            w["customers"].insert({"id": 2, "name": "back", "city": "Rome"}),  # back, with its children
            w["orders"].update((5,), {"customer_id": None}),
        ),  # to no parent
        lambda: (
            w["categories"].update((1,), {"name": "renamed"}),  # lookup fan-out beside the nested lists
            w["products"].insert({"id": 4, "title": "late", "category_id": 2, "added": None}),  # a late parent
            w["products"].delete((2,)),
        ),
    ]
    rnd = random.Random(1130)
    history: list[str] = []
    for step in range(1, len(steps) + 4):
        if step <= len(steps):
            steps[step - 1]()
            shop.flush()
            history.append(f"step {step}")
        else:
            history += [_random_batch(shop, rnd, 10 * step + i) for i in range(3)]
        for s in DOC_SINKS:
            _follow_to_end(rt, plan, rt.sinks[s])
        _follow_to_end(rt, pplan, rt.sinks["redis"])
        want = _want(ref_customers(shop.rows), CUSTOMER_COLS)
        for s in DOC_SINKS:
            got = _view(rt, docs, CUSTOMER_COLS, s)
            assert got == want, f"{s} after {history}: {_diff(got, want)}"
        got, want = _view(rt, products, PRODUCT_COLS, "redis"), _want(ref_products(shop.rows), PRODUCT_COLS)
        assert got == want, f"products after {history}: {_diff(got, want)}"
    followed = {s: _view(rt, docs, CUSTOMER_COLS, s) for s in DOC_SINKS}
    followed_products = _view(rt, products, PRODUCT_COLS, "redis")
    replay(docs, rt)
    replay(products, rt)
    for s, rows in followed.items():
        assert _view(rt, docs, CUSTOMER_COLS, s) == rows, f"{s}: a fresh replay differs from the followed view"
    assert _view(rt, products, PRODUCT_COLS, "redis") == followed_products


@pytest.mark.timeout(600)
def test_crash_after_the_state_commit_converges_for_moved_and_deleted_children(
    drt: Any, search_server: Any, redis_server: Any
) -> None:
    rt, log = drt
    source = "m" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    docs = customer_docs(source)
    spec = as_spec(docs)
    replay(docs, rt)
    plan = prepare(spec, rt)
    urls = {"search": (SearchSink, search_server.url), "redis": (RedisSink, redis_server.url)}
    w = shop.w
    for trial, (s, where) in enumerate([("redis", "rows"), ("search", "half")]):
        kids = sorted(k for k, o in shop.rows["orders"].items() if o["customer_id"] is not None)
        w["orders"].update(kids[0], {"customer_id": 4})  # moved away from its parent
        w["orders"].delete(kids[1])
        shop.flush()
        mid = rt.end_offsets(spec.topics)  # where the re-run's first batch stops
        w["orders"].update(kids[2], {"customer_id": 1 + trial})  # moved again after the crashed batch
        w["orders"].insert({"id": 30 + trial, "customer_id": 1, "product_id": 1, "amount": None, "status": "x"})
        shop.flush()
        want = _want(ref_customers(shop.rows), CUSTOMER_COLS)
        sink = rt.sinks[s]
        klass, url = urls[s]
        crashing = _crashing(klass, url, where)
        try:
            with pytest.raises(SinkError, match="injected crash"):
                _follow_to_end(rt, plan, crashing)
        finally:
            crashing.close()
        _follow_to_end(rt, plan, sink, mid)  # the state is ahead of this batch
        _follow_to_end(rt, plan, sink)
        got = _view(rt, docs, CUSTOMER_COLS, s)
        assert got == want, f"{s} after a crash at {where}: {_diff(got, want)}"
        other = "redis" if s == "search" else "search"
        _follow_to_end(rt, plan, rt.sinks[other])
        assert _view(rt, docs, CUSTOMER_COLS, other) == want, other


# --- load-time errors ------------------------------------------------------------------------------
def test_bad_nested_collections_fail_at_load_time_naming_projection_and_attribute(drt: Any) -> None:
    rt, log = drt
    source = "e" + uuid.uuid4().hex[:7]
    Shop(log, source)
    t = f"{source}.public."

    def error(**attrs: Any) -> str:
        base = {"name": "ne_" + uuid.uuid4().hex[:6], "sources": [t + "customers"], "key": ["id"], "sinks": ("search",)}
        p = type("BadNested", (Projection,), {**base, **attrs})
        with pytest.raises(ConfigError) as info:
            prepare(as_spec(p), rt)
        msg = str(info.value)
        assert "BadNested" in msg or repr(base["name"]) in msg, msg
        return msg

    orders = t + "orders"
    msg = error(sinks=("postgres",), nested=[Nested("orders", orders, on={"id": "customer_id"})])
    assert "'nested'" in msg and "postgres" in msg
    msg = error(
        sinks=("postgres", "search"),
        key=["city"],
        aggregates={"n": Count()},
        nested=[Nested("orders", orders, on={"id": "customer_id"})],
    )
    assert "'nested'" in msg and "grouped" in msg
    msg = error(nested=[Nested("orders", orders, on={"id": "customer_id"}, columns=["amount", "nope"])])
    assert "'nested'['orders'].columns" in msg and "nope" in msg
    msg = error(nested=[Nested("orders", orders, on={"id": "customer_id"}, order_by=["when"])])
    assert "'nested'['orders'].order_by" in msg and "when" in msg
    msg = error(nested=[Nested("orders", orders, on={"id": "customer"})])
    assert "'nested'['orders'].on" in msg and "customer" in msg
    msg = error(nested=[Nested("orders", orders, on={"id": "status"})])
    assert "'nested'['orders'].on" in msg and "cannot be compared" in msg
    msg = error(nested=[Nested("orders", t + "missing", on={"id": "customer_id"})])
    assert "'nested'['orders'].topic" in msg and "missing" in msg
    msg = error(nested=[Nested("name", orders, on={"id": "customer_id"})])
    assert "'nested'['name']" in msg and "clashes" in msg
    msg = error(nested=[Nested("orders", t + "customers", on={"id": "id"})])
    assert "'nested'['orders'].topic" in msg and "driving table" in msg


def test_search_mapping_of_a_nested_collection_and_its_view_options() -> None:
    from pyspark.sql.types import ArrayType, DecimalType, LongType, StringType, StructField, StructType

    from kappaflow.projections.sinks.base import ViewColumn, ViewSpec
    from kappaflow.projections.sinks.search import derive_mapping

    element = StructType(
        [StructField("id", LongType()), StructField("amount", DecimalType(12, 2)), StructField("status", StringType())]
    )
    view = ViewSpec("v", "v", ("id",), (ViewColumn("id", LongType(), False), ViewColumn("orders", ArrayType(element))))
    props = derive_mapping(view, overrides={"orders": "nested", "orders.status": "keyword"})["properties"]
    assert props["orders"] == {
        "type": "nested",
        "properties": {
            "id": {"type": "long"},
            "amount": {"type": "scaled_float", "scaling_factor": 100},
            "status": {"type": "keyword"},
        },
    }
    assert "type" not in derive_mapping(view)["properties"]["orders"]  # without it: plain objects, as before
    with pytest.raises(ConfigError, match="'nested' needs a list of rows"):
        derive_mapping(view, overrides={"id": "nested"})

    docs = customer_docs("x")
    assert as_spec(docs).view_options()["search"]["fields"] == {"orders": "nested"}
    hidden = type("Hidden", (docs,), {"columns": ["id", "name"]})  # the collection is not shown: no field
    assert "search" not in as_spec(hidden).view_options()
    own = type("Own", (docs,), {"sink_options": {"search": {"fields": {"orders": {"type": "object"}}}}})
    assert as_spec(own).view_options()["search"]["fields"] == {"orders": {"type": "object"}}
    other = type("Other", (docs,), {"nested": [Nested("orders", "x.public.orders", on={"id": "customer_id"})]})
    assert as_spec(other).fingerprint() != as_spec(docs).fingerprint()
