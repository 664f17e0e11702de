"""The README's Python examples run, and the Projection API examples give the views they describe.

Every ```python block of README.md is executed as written, in order, in one module (so Spark
workers can unpickle the classes it defines). The projections it defines are replayed from a shop
database captured by the PostgreSQL connector (the shop's schema, with updates, deletes and inserts
after the snapshot); each view is compared with the same result computed in SQL on the source tables.
"""

from __future__ import annotations

import re
import sys
import types
import uuid
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# blocks whose first line names one of these are run there (they need their own database)
OTHER_RUNNERS = ("tests/ledger/test_readme_ledger.py", "tests/projections/test_outbox_projection.py",
                 "tests/projections/test_interval_join.py")


def python_blocks() -> list[tuple[int, str]]:
    """Every ```python block but those whose first line names another test that runs them
    (the ledger's examples need a ledger database: tests/ledger/test_readme_ledger.py; the outbox
    example an outbox table: tests/projections/test_outbox_projection.py; the join within a time bound
    a payments table: tests/projections/test_interval_join.py)."""
    text = README.read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in BLOCK.finditer(text)
        if not any(other in m.group(1).splitlines()[0] for other in OTHER_RUNNERS)
    ]


def test_the_readme_has_python_examples_and_they_compile() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 5
    for line, code in blocks:
        compile(code, f"README.md:{line}", "exec")


def _rows(dsn: str, query: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(query).fetchall()  # type: ignore[arg-type]


@pytest.fixture
def readme_module(redis_server: Any) -> Iterator[types.ModuleType]:
    """The README's blocks executed as one module (the Redis URL pointed at the test's server)."""
    module = types.ModuleType(f"readme_examples_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    try:
        for line, code in python_blocks():
            code = code.replace("redis://localhost:6379/0", redis_server.url)
            exec(compile(code, f"README.md:{line}", "exec"), module.__dict__)  # the README's own code
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


@pytest.mark.integration
def test_the_projection_api_examples_equal_sql_on_the_captured_source(
    readme_module: types.ModuleType, pg_server: Any, spark: Any, search_server: Any, redis_server: Any,
    tmp_path: Path,
) -> None:
    from examples.shop.demo import SHOP_TABLES, seed
    from kappaflow.config import LogConfig, PostgresSourceConfig, Settings, SparkConfig, ViewsConfig
    from kappaflow.connectors.postgres import PostgresConnector
    from kappaflow.projections import Projection
    from kappaflow.projections.engine import prepare
    from kappaflow.projections.replay import as_spec, replay
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.redis import get

    suffix = uuid.uuid4().hex[:8]
    db, views_db = f"readme_{suffix}", f"readme_views_{suffix}"
    dsn = pg_server.create_database(db)
    views_dsn = pg_server.create_database(views_db)  # as in the README: views apart from the source tables
    settings = Settings(
        log=LogConfig(url=str(tmp_path / "log"), partitions=2),
        views=ViewsConfig(postgres_dsn=views_dsn, search_url=search_server.url, redis_url=redis_server.url),
        spark=SparkConfig(checkpoint_dir=str(tmp_path / "ckpt")),
        sources={"shop": PostgresSourceConfig(name="shop", dsn=dsn, tables=list(SHOP_TABLES),
                                              slot=f"kf_readme_{suffix}")},
        base_dir=tmp_path,
    )

    def capture() -> None:
        log = settings.open_log()
        try:
            PostgresConnector(settings.sources["shop"], log, progress=False).run(until_caught_up=True)
        finally:
            log.close()

    rt = Runtime.from_settings(settings, spark=spark)
    try:
        seed(dsn, customers=12, orders=80)
        first_status = {r["id"]: r["status"] for r in _rows(dsn, "SELECT id, status FROM public.orders")}
        first_city = {r["id"]: r["city"] for r in _rows(dsn, "SELECT id, city FROM public.customers")}
        capture()  # the snapshot
        updates: dict[int, int] = {}
        with psycopg.connect(dsn) as conn:
            conn.execute("UPDATE public.customers SET city = NULL WHERE id IN (2, 5)")
            conn.execute("UPDATE public.customers SET email = 'ada@Example.NET' WHERE id = 1")
            for i, (customer, status) in enumerate([(3, "paid"), (3, "cancelled"), (7, "shipped"), (1, "paid")]):
                order = 5 + i * 7
                conn.execute("UPDATE public.orders SET customer_id = %s, status = %s WHERE id = %s",
                             (customer, status, order))
                updates[order] = updates.get(order, 0) + 1
            conn.execute("UPDATE public.orders SET amount = amount + 100 WHERE id = 12")
            updates[12] = updates.get(12, 0) + 1
            conn.execute("UPDATE public.orders SET product_id = NULL WHERE id IN (20, 21)")
            for o in (20, 21):
                updates[o] = updates.get(o, 0) + 1
            conn.execute("DELETE FROM public.orders WHERE id IN (30, 31, 32)")
            conn.execute("INSERT INTO public.orders (id, customer_id, product_id, amount, status, created_at) "
                         "VALUES (81, 4, 2, 149.00, 'new', '2024-06-01 10:00+00'), "
                         "(82, 12, NULL, 19.90, 'paid', '2024-06-02 10:00+00')")
            conn.execute("UPDATE public.products SET price = 99.00 WHERE id = 1")
            conn.execute("DELETE FROM public.products WHERE id = 12 AND NOT EXISTS "
                         "(SELECT 1 FROM public.orders WHERE product_id = 12)")
        capture()  # streaming: the changes above

        classes = {c.name: c for c in vars(readme_module).values()
                   if isinstance(c, type) and issubclass(c, Projection) and c is not Projection}
        assert {"customer_directory", "customer_orders", "order_history", "product_catalogue", "order_details",
                "category_revenue", "hourly_revenue", "customer_sessions", "category_hourly_revenue",
                "customer_city_cache", "customer_cards", "customer_city_list", "customer_with_orders"} <= set(classes)
        assert classes["customer_cards"].on_schema_change == "evolve"
        for proj in classes.values():
            replay(proj, rt)

        def view(name: str, key: str) -> list[dict[str, Any]]:
            rows = _rows(views_dsn, f'SELECT * FROM public."{name}" ORDER BY {key}')
            for r in rows:
                r.pop("_kf_version", None)
            return rows

        # schema-change policies (the views themselves: every column / the columns listed)
        assert view("customer_cards", "id") == _rows(dsn, "SELECT * FROM public.customers ORDER BY id")
        assert view("customer_city_list", "id") == _rows(dsn, "SELECT id, city FROM public.customers ORDER BY id")

        # latest row: columns, derive, where
        directory = view("customer_directory", "id")
        assert directory == _rows(dsn, """
            SELECT id, name, city, lower(split_part(email, '@', 2)) AS email_domain
            FROM public.customers WHERE city IS NOT NULL ORDER BY id""")
        assert len(directory) == 10 and directory[0]["email_domain"] == "example.net"

        # grouped: every aggregate of the README's table, over the current rows only
        got = view("customer_orders", "customer_id")
        want = _rows(dsn, """
            SELECT customer_id, count(*) AS orders, count(product_id) AS with_product, sum(amount) AS total,
                   min(amount) AS smallest, max(created_at) AS last_order_at,
                   sum(amount)::double precision / count(amount) AS average,
                   array_agg(amount ORDER BY amount) AS amounts, array_agg(DISTINCT size ORDER BY size) AS sizes
            FROM (SELECT *, CASE WHEN amount >= 100 THEN 'large' ELSE 'small' END AS size
                  FROM public.orders WHERE status <> 'cancelled') o
            GROUP BY customer_id ORDER BY customer_id""")
        for g, w in zip(got, want, strict=True):
            assert g.pop("average") == pytest.approx(w.pop("average"))
        assert got == want and len(got) >= 10
        assert any(len(g["sizes"]) == 2 for g in got) and any(g["with_product"] < g["orders"] for g in got)
        types_ = {r["column_name"]: (r["data_type"], r["numeric_precision"], r["numeric_scale"]) for r in _rows(
            views_dsn, "SELECT column_name, data_type, numeric_precision, numeric_scale "
                       "FROM information_schema.columns WHERE table_name = 'customer_orders'")}
        # the README's table: Sum of numeric(12,2) is numeric(22,2); Min keeps numeric(12,2)
        assert types_["orders"][0] == "bigint" and types_["average"][0] == "double precision"
        assert types_["total"] == ("numeric", 22, 2) and types_["smallest"] == ("numeric", 12, 2)
        assert types_["amounts"][0] == "ARRAY"
        types_ = {k: v[0] for k, v in types_.items()}
        assert types_["last_order_at"] == "timestamp with time zone"  # created_at is a timestamptz

        # custom fold: one row per order with its history; deleted orders gone
        current = _rows(dsn, "SELECT id, customer_id, status, created_at FROM public.orders ORDER BY id")
        assert len(current) == 79 and max(updates.values()) == 2  # order 12: moved, then its amount
        assert view("order_history", "id") == [
            {"id": r["id"], "customer_id": r["customer_id"], "changes": 1 + updates.get(r["id"], 0),
             "first_status": first_status.get(r["id"], r["status"]), "last_status": r["status"],
             "created_at": r["created_at"]}
            for r in current
        ]

        # joins: lookups into customers and products (left), grouped over an inner lookup
        assert view("order_details", "id") == _rows(dsn, """
            SELECT o.id, o.status, o.amount, c.name AS customer_name, c.city AS customer_city,
                   p.name AS product_name, p.category AS product_category
            FROM public.orders o LEFT JOIN public.customers c ON c.id = o.customer_id
            LEFT JOIN public.products p ON p.id = o.product_id ORDER BY o.id""")
        revenue = view("category_revenue", "product_category")
        assert revenue == _rows(dsn, """
            SELECT p.category AS product_category, count(*) AS orders, sum(o.amount) AS revenue
            FROM public.orders o JOIN public.products p ON p.id = o.product_id
            WHERE o.status <> 'cancelled' GROUP BY p.category ORDER BY 1""")
        assert len(revenue) >= 2

        # as-of enrichment: an order keeps its customer's city as of its last change -- the snapshot's for
        # orders not changed since (customers 2 and 5 lost their city later), the current one for orders
        # changed after the cities were (same transaction, later statements)
        cities = {r["id"]: r["city"] for r in _rows(dsn, "SELECT id, city FROM public.customers")}
        changed = set(updates) | {81, 82}
        assert view("order_cities", "id") == [
            {"id": r["id"], "customer_id": r["customer_id"], "status": r["status"],
             "customer_city": (cities if r["id"] in changed else first_city)[r["customer_id"]]}
            for r in current
        ]
        assert any(first_city[r["customer_id"]] != cities[r["customer_id"]] and r["id"] not in changed
                   for r in current), "some order must show a city its customer no longer has"
        # nested collections: one search document per customer with its current orders, by status then id
        nested_view = prepare(as_spec(classes["customer_with_orders"]), rt).view
        docs_live = rt.sinks["search"].live(nested_view)
        assert docs_live is not None
        want_docs = {c["id"]: {**c, "orders": []} for c in _rows(dsn, "SELECT id, name, city FROM public.customers")}
        for o in _rows(dsn, 'SELECT id, customer_id, amount, status FROM public.orders '
                            'ORDER BY status COLLATE "C", id'):
            want_docs[o.pop("customer_id")]["orders"].append(o)
        got_docs = {r["id"]: {k: r[k] for k in ("id", "name", "city", "orders")}
                    for r in rt.sinks["search"].scan(docs_live)}
        assert got_docs == want_docs and sum(len(d["orders"]) for d in got_docs.values()) == 79

        # event time: hourly windows per customer = SQL's hours over the current rows (nothing is later
        # than the 7 days of allowed lateness here, so no change was refused)
        hourly = view("hourly_revenue", "customer_id, window_start")
        assert [{k: r[k] for k in ("customer_id", "window_start", "orders", "revenue")} for r in hourly] == _rows(
            dsn, """
            SELECT customer_id, date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS window_start,
                   count(*) AS orders, sum(amount) AS revenue
            FROM public.orders WHERE status <> 'cancelled' GROUP BY 1, 2 ORDER BY 1, 2""")
        assert len(hourly) >= 60 and all(r["window_end"] - r["window_start"] == timedelta(hours=1) for r in hourly)
        assert {r["final"] for r in hourly} <= {True, False}
        # session windows: SQL's gaps and islands (a new session where the previous order of the customer
        # is 30 minutes or more earlier) over the current rows
        sessions = view("customer_sessions", "customer_id, window_start")
        assert [{k: r[k] for k in ("customer_id", "window_start", "window_end", "orders", "revenue")}
                for r in sessions] == _rows(dsn, """
            WITH o AS (SELECT customer_id, created_at, amount,
                              CASE WHEN created_at - lag(created_at) OVER w < interval '30 minutes' THEN 0 ELSE 1 END
                                AS fresh
                       FROM public.orders WHERE status <> 'cancelled'
                       WINDOW w AS (PARTITION BY customer_id ORDER BY created_at)),
                 s AS (SELECT *, sum(fresh) OVER (PARTITION BY customer_id ORDER BY created_at) AS sid
                       FROM o)  -- (the default frame takes equal times together)
            SELECT customer_id, min(created_at) AS window_start, max(created_at) + interval '30 minutes' AS window_end,
                   count(*) AS orders, sum(amount) AS revenue
            FROM s GROUP BY customer_id, sid ORDER BY 1, 2""")
        assert len(sessions) >= 60
        # windows over as-of rows: each order in the category its product had at the order's last change;
        # no product changed category here, so SQL's join with the current products gives the same hours
        # (orders 20 and 21 lost their product: a NULL category is in no window)
        by_category = view("category_hourly_revenue", "product_category, window_start")
        assert [{k: r[k] for k in ("product_category", "window_start", "orders", "revenue")}
                for r in by_category] == _rows(dsn, """
            SELECT p.category AS product_category,
                   date_trunc('hour', o.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS window_start,
                   count(*) AS orders, sum(o.amount) AS revenue
            FROM public.orders o JOIN public.products p ON p.id = o.product_id
            WHERE o.status <> 'cancelled' GROUP BY 1, 2 ORDER BY 1, 2""")
        assert len(by_category) >= 60 and {r["product_category"] for r in by_category} >= {"shoes", "camping"}

        # sinks and sink_options: the same catalogue in PostgreSQL, the search index and Redis hashes
        products = _rows(dsn, "SELECT * FROM public.products ORDER BY id")
        assert view("product_catalogue", "id") == products
        search = rt.sinks["search"]
        live = search.live(prepare(as_spec(classes["product_catalogue"]), rt).view)
        assert live is not None and search.count(live) == len(products)
        import redis

        cached = get(redis.Redis.from_url(redis_server.url), "product_catalogue", 1)
        assert cached is not None and cached["name"] == products[0]["name"]
        assert Decimal(cached["price"]) == products[0]["price"] == Decimal("99.00")
        # transactionally consistent views: the Redis reader of whole transactions
        customers = _rows(dsn, "SELECT id, city FROM public.customers ORDER BY id")
        got_cities = readme_module.cities(redis.Redis.from_url(redis_server.url), [c["id"] for c in customers])
        assert got_cities == {c["id"]: c["city"] for c in customers}
    finally:
        rt.close()
        pg_server.drop_database(db)
        pg_server.drop_database(views_db)

