"""The shop example's search indexes and Redis caches, end to end on real servers.

PostgreSQL source tables -> capture (pgoutput) -> embedded log -> Spark -> search / Redis views:

* after a replay, the product and order indexes hold one document per source row with the
  same values, a full-text query on product descriptions finds the right product (English
  stemming, as the projection's search mapping declares), and category is an exact keyword;
* the customer cache (one Redis hash per customer) answers ``get(client, view, key)`` with
  the customer's row;
* after updates, inserts and deletes in PostgreSQL and another capture, a follow (products,
  customers) or a replay (orders) brings every view back to what the tables say.
"""

from __future__ import annotations

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
from examples.shop.projections import CustomerCache, OrderSearch, ProductSearch
from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.api import Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.base import VERSION, Sink, Target
from kappaflow.projections.sinks.redis import RedisSink, get, get_many
from kappaflow.projections.sinks.search import SearchSink

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
    """One test's world: the source database, its log, runtimes per sink and the projections."""

    source_dsn: str
    views_dsn: str
    log_dir: Path
    slot: str
    runtimes: dict[str, Runtime] = field(default_factory=dict)
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
        rt = self.runtimes[_sink_of(proj)]
        view = prepare(as_spec(proj), rt).view
        target = rt.sink.live(view)
        assert target is not None, f"{name}: no live view after replay"
        return rt.sink, target


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
    world = Shop(source_dsn, views_dsn, tmp_path / "log", slot=f"kf_shop_{suffix}")
    sinks: dict[str, Sink] = {"search": SearchSink(search_server.url), "redis": RedisSink(redis_server.url)}
    try:
        for kind, sink in sinks.items():
            world.runtimes[kind] = Runtime(spark, str(world.log_dir), sink, dsn=views_dsn,
                                           checkpoint_dir=tmp_path / f"ckpt-{kind}")
        for cls in (ProductSearch, OrderSearch, CustomerCache):
            world.projections[cls.__name__] = _unique(cls, suffix)
        yield world
    finally:
        for rt in world.runtimes.values():
            rt.close()
        pg_server.drop_database(source_db)
        pg_server.drop_database(views_db)


def _replay(shop: Shop, name: str, expected_rows: int | None = None) -> None:
    proj = shop.projections[name]
    res = replay(proj, shop.runtimes[_sink_of(proj)])
    if expected_rows is not None:
        assert res.rows == expected_rows, (name, res)


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
        Follower(shop.projections[n], shop.runtimes[_sink_of(shop.projections[n])], trigger="0.2s",
                 checkpoint=str(tmp_path / f"follow-{n}"))
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
