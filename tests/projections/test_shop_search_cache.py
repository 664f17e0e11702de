"""The shop example's search indexes and Redis caches, end to end on real servers.

PostgreSQL source tables -> capture (pgoutput) -> embedded log -> Spark -> search / Redis views:

* after a replay, the product and order indexes hold one document per source row with the
  same values, a full-text query on product descriptions finds the right product (English
  stemming, as the projection's search mapping declares), and category is an exact keyword;
* the customer cache (one Redis hash per customer) answers ``get(client, view, key)`` with
  the customer's row;
* after updates, inserts and deletes in PostgreSQL and another capture, a follow (products,
  customers) or a replay (orders) brings every view back to what the tables say;
* the customers' order totals (a grouped fold) reach Redis as a mirror of their PostgreSQL
  view, after a replay and after a follow with moved, cancelled and deleted orders.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from examples.shop.demo import SHOP_TABLES, seed
from examples.shop.projections import (
    CategoryRevenue,
    CustomerCache,
    CustomerDocuments,
    CustomerTotalsCache,
    OrderDocuments,
    OrderSearch,
    ProductSearch,
)
from kappaflow.config import LogConfig, PostgresSourceConfig, Settings, SparkConfig, ViewsConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.api import Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower, FollowerGroup
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.base import VERSION, Sink, Target
from kappaflow.projections.sinks.redis import get, get_many

pytestmark = pytest.mark.integration

PRODUCT_COLUMNS = ("id", "name", "description", "category", "price")
ORDER_COLUMNS = ("id", "customer_id", "product_id", "amount", "status", "created_at")
CUSTOMER_COLUMNS = ("id", "name", "email", "city")


def _unique(cls: type[Projection], suffix: str) -> type[Projection]:
    """The example projection under its own names: the search and Redis servers are shared by the
    test session, so views (aliases, key namespaces) and projections (locks) get a suffix."""
    view = cls.view or cls.name
    return type(cls.__name__, (cls,), {"name": f"{cls.name}_{suffix}", "view": f"{view}_{suffix}",
                                       "__module__": cls.__module__})


@dataclass
class Shop:
    """One test's world: the source database, its log, the runtime (every sink configured, as
    ``kappaflow.toml``'s ``[views]`` would) and the projections."""

    source_dsn: str
    log_dir: Path
    slot: str
    rt: Runtime
    config: Path
    projections: dict[str, type[Projection]] = field(default_factory=dict)

    def capture(self) -> int:
        cfg = PostgresSourceConfig(name="shop", dsn=self.source_dsn, tables=list(SHOP_TABLES), slot=self.slot,
                                   publication=self.slot)
        with EmbeddedLog(self.log_dir) as log:
            summary = PostgresConnector(cfg, log, partitions=2, progress=False).run(StopSignal(),
                                                                                  until_caught_up=True)
        return int(summary.events)

    def source_rows(self, table: str, columns: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
        with psycopg.connect(self.source_dsn, row_factory=dict_row) as conn:
            rows = conn.execute(f"SELECT {', '.join(columns)} FROM public.{table}").fetchall()  # test constants
        return {r["id"]: r for r in rows}

    def live(self, name: str) -> tuple[Sink, Target]:
        proj = self.projections[name]
        sink = self.rt.sinks[_sink_of(proj)]
        target = sink.live(prepare(as_spec(proj), self.rt).view)
        assert target is not None, f"{name}: no live view after replay"
        return sink, target


def _sink_of(proj: type[Projection]) -> str:
    declared = tuple(getattr(proj, "sinks", ()))
    assert len(declared) == 1, f"{proj.__name__}: expected one declared sink, got {declared}"
    return declared[0]


def _view_rows(sink: Sink, target: Target, key: str = "id") -> dict[Any, dict[str, Any]]:
    out = {}
    for r in sink.scan(target):
        r = dict(r)
        r.pop(VERSION, None)
        out[r[key]] = r
    return out


@pytest.fixture
def shop(pg_server: Any, spark: Any, search_server: Any, redis_server: Any, tmp_path: Path) -> Iterator[Shop]:
    suffix = uuid.uuid4().hex[:8]
    source_db, views_db = f"shop_src_{suffix}", f"shop_views_{suffix}"
    source_dsn = pg_server.create_database(source_db)
    views_dsn = pg_server.create_database(views_db)
    settings = Settings(
        log=LogConfig(url=str(tmp_path / "log")),
        views=ViewsConfig(postgres_dsn=views_dsn, search_url=search_server.url, redis_url=redis_server.url),
        spark=SparkConfig(checkpoint_dir=str(tmp_path / "ckpt")),
        base_dir=tmp_path,
    )
    settings.save(tmp_path / "kappaflow.toml")
    rt = Runtime.from_settings(settings, spark=spark)
    world = Shop(source_dsn, tmp_path / "log", slot=f"kf_shop_{suffix}", rt=rt, config=tmp_path / "kappaflow.toml")
    try:
        assert sorted(rt.sinks) == ["postgres", "redis", "search"]
        for cls in (ProductSearch, OrderSearch, CustomerCache, CustomerTotalsCache, OrderDocuments, CategoryRevenue,
                    CustomerDocuments):
            world.projections[cls.__name__] = _unique(cls, suffix)
        yield world
    finally:
        rt.close()
        pg_server.drop_database(source_db)
        pg_server.drop_database(views_db)


def _replay(shop: Shop, name: str) -> None:
    proj = shop.projections[name]
    res = replay(proj, shop.rt)
    assert list(res.sinks) == [_sink_of(proj)], res  # only the store the projection declares


def _check_products(shop: Shop) -> dict[Any, dict[str, Any]]:
    sink, target = shop.live("ProductSearch")
    expected = shop.source_rows("products", PRODUCT_COLUMNS)
    assert sink.count(target) == len(expected)
    assert _view_rows(sink, target) == expected
    return expected


def _check_orders(shop: Shop) -> None:
    sink, target = shop.live("OrderSearch")
    expected = shop.source_rows("orders", ORDER_COLUMNS)
    assert sink.count(target) == len(expected)
    assert _view_rows(sink, target) == expected


def _check_customers(shop: Shop, redis_server: Any) -> None:
    import redis

    sink, target = shop.live("CustomerCache")
    expected = shop.source_rows("customers", CUSTOMER_COLUMNS)
    assert sink.count(target) == len(expected)
    assert _view_rows(sink, target) == expected
    # what an application reads: a hash per customer, every field as text (NULLs left out)
    view = shop.projections["CustomerCache"].view
    assert view is not None
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = sorted(expected)
        got = get_many(client, view, keys)
        assert got == [{k: str(v) for k, v in expected[i].items() if v is not None} for i in keys]
        assert get(client, view, max(keys) + 1000) is None
    finally:
        client.close()


def _search(search_server: Any, alias: str, query: dict[str, Any]) -> list[dict[str, Any]]:
    from opensearchpy import OpenSearch

    client = OpenSearch(search_server.url)
    try:
        hits = client.search(index=alias, body={"query": query, "size": 100})["hits"]["hits"]
    finally:
        client.close()
    return [h["_source"] for h in hits]


def _query(shop: Shop, view: str, key: str, sink: str) -> dict[str, Any] | None:
    """`kappaflow query VIEW KEY --sink SINK` as the README shows it: the row as JSON, or None (exit 1)."""
    from typer.testing import CliRunner

    from kappaflow.cli.app import app

    out = CliRunner().invoke(app, ["--config", str(shop.config), "query", view, key, "--sink", sink])
    if out.exit_code == 1 and "no row with key" in out.output:
        return None
    assert out.exit_code == 0, out.output
    row = json.loads(out.stdout)
    assert isinstance(row, dict)
    return row


def _alias(shop: Shop, name: str) -> str:
    view = shop.projections[name].view
    assert view is not None
    return view.lower()


def test_shop_search_indexes_and_caches_follow_the_source_tables(shop: Shop, search_server: Any,
                                                                 redis_server: Any, tmp_path: Path) -> None:
    seed(shop.source_dsn, customers=6, orders=40)
    assert shop.capture() >= 6 + 12 + 40

    for name in ("ProductSearch", "OrderSearch", "CustomerCache"):
        _replay(shop, name)
    products = _check_products(shop)
    _check_orders(shop)
    _check_customers(shop, redis_server)

    # full text with the declared English analyzer: "boot" matches "Waterproof leather boots ..."
    products_alias = _alias(shop, "ProductSearch")
    boots = [p for p in products.values() if p["name"] == "Leather boots"]
    hits = _search(search_server, products_alias, {"match": {"description": "boot"}})
    assert [h["id"] for h in hits] == [boots[0]["id"]]
    camping = _search(search_server, products_alias, {"term": {"category": "camping"}})
    assert sorted(h["id"] for h in camping) == sorted(p["id"] for p in products.values() if p["category"] == "camping")
    assert _search(search_server, products_alias, {"term": {"category": "Camping"}}) == []  # keyword: exact
    customers_view = _alias(shop, "CustomerCache")
    assert _query(shop, customers_view, "1", "redis") == {"id": "1", "name": "Ada", "email": "ada1@example.com",
                                                          "city": "Oslo"}
    found = _query(shop, products_alias, str(boots[0]["id"]), "search")
    assert found is not None and (found["name"], found["price"]) == ("Leather boots", "149.00")

    # change the source: update, insert and delete rows of every table, capture again
    with psycopg.connect(shop.source_dsn) as conn:
        conn.execute("UPDATE public.products SET description = description || ', resoled with a vibram sole', "
                     "price = price + 10 WHERE id = %s", (boots[0]["id"],))
        gone_product = next(p["id"] for p in products.values() if p["category"] == "accessories")
        conn.execute("DELETE FROM public.orders WHERE product_id = %s", (gone_product,))
        conn.execute("DELETE FROM public.products WHERE id = %s", (gone_product,))
        conn.execute("INSERT INTO public.products (id, name, description, category, price) "
                     "VALUES (100, 'Bivy sack', 'Ultralight emergency shelter for one', 'camping', 89.00)")
        conn.execute("UPDATE public.orders SET status = 'cancelled' WHERE id IN (SELECT min(id) FROM public.orders)")
        conn.execute("UPDATE public.orders SET product_id = 100, amount = 89.00 "
                     "WHERE id IN (SELECT max(id) FROM public.orders)")
        conn.execute("UPDATE public.customers SET city = 'Bergen', email = 'ada.new@example.com' WHERE id = 1")
        conn.execute("DELETE FROM public.orders WHERE customer_id = 2")
        conn.execute("DELETE FROM public.customers WHERE id = 2")
        conn.execute("INSERT INTO public.customers (id, name, email, city) VALUES (7, 'Mo', 'mo@example.org', NULL)")
    assert shop.capture() > 0

    # follow: products (search) and customers (Redis); replay: orders
    followers = [
        Follower(shop.projections[n], shop.rt, trigger="0.2s", checkpoint=str(tmp_path / f"follow-{n}"))
        for n in ("ProductSearch", "CustomerCache")
    ]
    try:
        for f in followers:
            f.start()
        for f in followers:
            assert f.wait_for(lambda _s, f=f: f.caught_up(), timeout=120), f"{f.spec.name}: not caught up in 120 s"
    finally:
        for f in followers:
            f.stop()
    _replay(shop, "OrderSearch")

    products = _check_products(shop)
    assert gone_product not in products and 100 in products
    _check_orders(shop)
    _check_customers(shop, redis_server)
    hits = _search(search_server, products_alias, {"match": {"description": "vibram"}})
    assert [(h["id"], Decimal(str(h["price"]))) for h in hits] == [(boots[0]["id"], boots[0]["price"] + 10)]
    assert _search(search_server, products_alias, {"match": {"name": "bivy"}})[0]["id"] == 100
    orders_alias = _alias(shop, "OrderSearch")
    cancelled = _search(search_server, orders_alias, {"term": {"status": "cancelled"}})
    assert len(cancelled) == 1
    assert _search(search_server, orders_alias, {"term": {"customer_id": 2}}) == []
    assert _query(shop, customers_view, "2", "redis") is None
    assert _query(shop, customers_view, "1", "redis") == {"id": "1", "name": "Ada", "email": "ada.new@example.com",
                                                          "city": "Bergen"}


def _source_totals(shop: Shop) -> dict[Any, dict[str, Any]]:
    with psycopg.connect(shop.source_dsn, row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT customer_id, count(*) AS orders, sum(amount) AS total_amount, max(created_at) AS last_order_at "
            "FROM public.orders WHERE status <> 'cancelled' AND customer_id IS NOT NULL GROUP BY customer_id"
        ).fetchall()
    return {r["customer_id"]: r for r in rows}


def _check_totals(shop: Shop, redis_server: Any) -> dict[Any, dict[str, Any]]:
    import redis

    proj = shop.projections["CustomerTotalsCache"]
    view = prepare(as_spec(proj), shop.rt).view
    expected = _source_totals(shop)
    pg, rd = shop.rt.sinks["postgres"], shop.rt.sinks["redis"]
    pg_live, rd_live = pg.live(view), rd.live(view)
    assert pg_live is not None and rd_live is not None
    assert _view_rows(pg, pg_live, "customer_id") == expected
    assert _view_rows(rd, rd_live, "customer_id") == expected
    assert rd.read_positions(rd_live) == pg.read_positions(pg_live)
    client = redis.Redis.from_url(redis_server.url)
    try:  # what a service reads next to the customer cache
        one = min(expected)
        got = get(client, view.name, one)
        assert got is not None and got["orders"] == str(expected[one]["orders"])
        assert Decimal(got["total_amount"]) == expected[one]["total_amount"]
    finally:
        client.close()
    return expected


def test_shop_customer_totals_reach_redis(shop: Shop, redis_server: Any, tmp_path: Path) -> None:
    seed(shop.source_dsn, customers=6, orders=40)
    shop.capture()
    proj = shop.projections["CustomerTotalsCache"]
    res = replay(proj, shop.rt)
    assert set(res.sinks) == {"postgres", "redis"}
    before = _check_totals(shop, redis_server)

    with psycopg.connect(shop.source_dsn) as conn:
        # move an order to another customer, cancel one, delete all of customer 2's, change an amount
        moved = conn.execute("SELECT min(id) FROM public.orders WHERE customer_id = 3").fetchone()
        assert moved is not None and moved[0] is not None
        conn.execute("UPDATE public.orders SET customer_id = 4 WHERE id = %s", (moved[0],))
        conn.execute("UPDATE public.orders SET status = 'cancelled' WHERE id IN "
                     "(SELECT max(id) FROM public.orders WHERE customer_id = 1)")
        conn.execute("DELETE FROM public.orders WHERE customer_id = 2")
        conn.execute("UPDATE public.orders SET amount = amount + 5 WHERE id IN "
                     "(SELECT max(id) FROM public.orders WHERE customer_id = 5)")
    assert shop.capture() > 0
    group = FollowerGroup(proj, shop.rt, trigger="0.2s", checkpoint=str(tmp_path / "follow-totals")).start()
    try:
        assert group.wait_for(lambda g: g.caught_up(), timeout=120), "totals followers not caught up in 120 s"
    finally:
        group.stop()
    after = _check_totals(shop, redis_server)
    assert 2 in before and 2 not in after
    assert after[4]["orders"] == before[4]["orders"] + 1


DOC_COLUMNS = ("id", "status", "amount", "created_at", "customer_id", "customer_name", "customer_city", "product_id",
               "product_name", "product_category")


def _check_joins(shop: Shop) -> None:
    """OrderDocuments (search), CategoryRevenue (PostgreSQL) and CustomerDocuments (Redis, nested orders)
    equal SQL joins of the source tables."""
    with psycopg.connect(shop.source_dsn, row_factory=dict_row) as conn:
        customers = {r["id"]: {**r, "orders": []} for r in conn.execute(
            "SELECT id, name, email, city FROM public.customers").fetchall()}
        for o in conn.execute("SELECT id, customer_id, product_id, amount, status, created_at FROM public.orders "
                              "ORDER BY created_at, id").fetchall():
            customers[o.pop("customer_id")]["orders"].append(o)
        docs = {r["id"]: r for r in conn.execute(
            "SELECT o.id, o.status, o.amount, o.created_at, o.customer_id, c.name AS customer_name, "
            "c.city AS customer_city, o.product_id, p.name AS product_name, p.category AS product_category "
            "FROM public.orders o LEFT JOIN public.customers c ON c.id = o.customer_id "
            "LEFT JOIN public.products p ON p.id = o.product_id").fetchall()}
        revenue = {r["product_category"]: r for r in conn.execute(
            "SELECT p.category AS product_category, count(*) AS orders, sum(o.amount) AS revenue "
            "FROM public.orders o JOIN public.products p ON p.id = o.product_id WHERE o.status <> 'cancelled' "
            "GROUP BY p.category").fetchall()}
    sink, target = shop.live("OrderDocuments")
    assert _view_rows(sink, target) == docs
    pg = shop.rt.sinks["postgres"]
    view = prepare(as_spec(shop.projections["CategoryRevenue"]), shop.rt).view
    live = pg.live(view)
    assert live is not None
    assert _view_rows(pg, live, "product_category") == revenue
    sink, target = shop.live("CustomerDocuments")
    assert _view_rows(sink, target) == customers


def test_shop_order_documents_and_category_revenue_join_the_tables(shop: Shop, search_server: Any,
                                                                   tmp_path: Path) -> None:
    seed(shop.source_dsn, customers=6, orders=40)
    with psycopg.connect(shop.source_dsn) as conn:  # at least one order of the boots
        conn.execute("INSERT INTO public.orders (id, customer_id, product_id, amount) "
                     "SELECT 1000, 3, id, price FROM public.products WHERE name = 'Leather boots'")
    shop.capture()
    for name in ("OrderDocuments", "CategoryRevenue", "CustomerDocuments"):
        replay(shop.projections[name], shop.rt)
    _check_joins(shop)
    alias = _alias(shop, "OrderDocuments")
    boots = _search(search_server, alias, {"match": {"product_name": "boots"}})  # full text on the product name
    assert boots and {h["product_name"] for h in boots} == {"Leather boots"}

    with psycopg.connect(shop.source_dsn) as conn:
        conn.execute("UPDATE public.customers SET name = 'Ada Lovelace', city = 'London' WHERE id = 1")  # fan-out
        conn.execute("UPDATE public.products SET name = 'Leather hiking boots', category = 'footwear' "
                     "WHERE name = 'Leather boots'")  # fan-out; revenue moves category
        conn.execute("UPDATE public.orders SET customer_id = 1 WHERE id IN (SELECT max(id) FROM public.orders)")
        conn.execute("DELETE FROM public.orders WHERE customer_id = 2")
        conn.execute("DELETE FROM public.customers WHERE id = 2")
    assert shop.capture() > 0
    group = [Follower(shop.projections[n], shop.rt, trigger="0.2s", checkpoint=str(tmp_path / f"follow-{n}"))
             for n in ("OrderDocuments", "CategoryRevenue", "CustomerDocuments")]
    try:
        for f in group:
            f.start()
        for f in group:
            assert f.wait_for(lambda _s, f=f: f.caught_up(), timeout=180), f"{f.spec.name}: not caught up in 180 s"
    finally:
        for f in group:
            f.stop()
    _check_joins(shop)
    hits = _search(search_server, alias, {"match": {"product_name": "hiking"}})
    assert hits and {(h["product_name"], h["product_category"]) for h in hits} == {
        ("Leather hiking boots", "footwear")}
    ada = _search(search_server, alias, {"term": {"customer_city": "London"}})
    assert ada and {h["customer_name"] for h in ada} == {"Ada Lovelace"}
