"""The whole flow in one function: source tables -> capture -> log -> replay -> view.

``run_demo()`` (what the README's quickstart runs):

1. PostgreSQL: the DSN given (or ``KAPPAFLOW_DEMO_DSN``); without one, a private
   throwaway server from the machine's binaries (``wal_level=logical``);
2. a ``kappaflow_demo`` database with the shop's tables: customers, a product catalogue, orders;
3. ``kappaflow source add shop ...`` (a ``kappaflow.toml`` in the work directory);
4. ``kappaflow capture shop --until-caught-up`` into the embedded log;
5. ``kappaflow replay examples.shop:CustomerTotals`` (and ``:Customers``) on Spark;
6. prints the customer totals; then moves an order to another customer and cancels
   one, captures and replays again, and prints the totals that moved.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

DEMO_DB = "kappaflow_demo"
SCHEMA_SQL = Path(__file__).with_name("schema.sql")
CITIES = ("Lisbon", "Oslo", "Lyon", "Graz", "Turku", "Porto")
SHOP_TABLES = ("public.customers", "public.products", "public.orders")  # what `source add shop --tables` lists
KEEP_HISTORY = ("public.products",)  # `--keep-history`: every version, for the as-of view CategoryHourlyRevenue
NAMES = ("Ada", "Brian", "Chen", "Dana", "Emil", "Farah", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")


@dataclass
class DemoResult:
    workdir: Path
    dsn: str
    totals: list[dict[str, Any]] = field(default_factory=list)
    totals_after: list[dict[str, Any]] = field(default_factory=list)
    captured: int = 0


def _with_db(dsn: str, db: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + db, parts.query, parts.fragment))


def _create_database(server_dsn: str) -> str:
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s AND NOT active",
            (DEMO_DB,),
        )
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DEMO_DB)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DB)))
    return _with_db(server_dsn, DEMO_DB)


# The catalogue the demo sells: (name, category, price, description). Descriptions are prose, so the
# product search index has something to search (`examples.shop.projections.ProductSearch`).
CATALOGUE: tuple[tuple[str, str, str, str], ...] = (
    ("Trail running shoes", "shoes", "89.90", "Lightweight shoes with a grippy sole for muddy mountain trails"),
    ("Leather boots", "shoes", "149.00", "Waterproof leather boots lined with wool for winter walks"),
    ("Rain jacket", "clothing", "119.50", "Breathable waterproof shell that packs into its own pocket"),
    ("Merino socks", "clothing", "24.00", "Soft merino wool socks with a cushioned heel, three pairs"),
    ("Camping stove", "camping", "59.00", "Compact gas stove that boils a litre of water in four minutes"),
    ("Two-person tent", "camping", "229.00", "Freestanding tent with two doors and an aluminium frame"),
    ("Headlamp", "accessories", "34.90", "Rechargeable LED headlamp with a red night mode"),
    ("Water bottle", "accessories", "19.90", "Insulated steel bottle that keeps drinks cold for a whole day"),
    ("Sleeping bag", "camping", "179.00", "Down sleeping bag rated to minus five degrees"),
    ("Trekking poles", "accessories", "74.50", "Adjustable carbon poles with cork grips"),
    ("Fleece pullover", "clothing", "49.00", "Warm recycled fleece for cold mornings by the lake"),
    ("Map case", "accessories", "12.00", "Clear case that keeps maps and phones dry"),
)


def product_rows(products: int) -> list[tuple[int, str, str, str, Decimal]]:
    """(id, name, description, category, price) of the first `products` catalogue entries; past the
    catalogue's end its entries repeat with the id in the name, so names stay unique."""
    out = []
    for i in range(1, products + 1):
        name, category, price, description = CATALOGUE[(i - 1) % len(CATALOGUE)]
        if i > len(CATALOGUE):
            name = f"{name} #{i}"
        out.append((i, name, description, category, Decimal(price)))
    return out


def seed(dsn: str, *, customers: int = 8, orders: int = 60, products: int = len(CATALOGUE),
         seed_value: int = 42) -> None:
    """Create the shop tables and fill them: customers, the product catalogue, orders of one product
    each (amount = price x quantity)."""
    import psycopg

    if customers < 1 or products < 1 or orders < 0:
        raise ValueError(f"seed: expected customers >= 1, products >= 1, orders >= 0, got customers={customers}, "
                         f"products={products}, orders={orders}")
    rnd = random.Random(seed_value)
    t0 = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)
    catalogue = product_rows(products)
    with psycopg.connect(dsn) as conn:
        conn.execute(SCHEMA_SQL.read_text())
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO public.customers (id, name, email, city) VALUES (%s, %s, %s, %s)",
                [
                    (
                        i,
                        NAMES[(i - 1) % len(NAMES)] + (f" {i}" if i > len(NAMES) else ""),
                        f"{NAMES[(i - 1) % len(NAMES)].lower()}{i}@example.{'com' if i % 2 else 'org'}",
                        CITIES[i % len(CITIES)],
                    )
                    for i in range(1, customers + 1)
                ],
            )
            cur.executemany(
                "INSERT INTO public.products (id, name, description, category, price) VALUES (%s, %s, %s, %s, %s)",
                catalogue,
            )
            rows = []
            for i in range(1, orders + 1):
                product = rnd.choice(catalogue)
                rows.append((
                    i,
                    rnd.randint(1, customers),
                    product[0],
                    product[4] * rnd.randint(1, 3),
                    rnd.choice(("new", "paid", "paid", "shipped")),
                    t0 + timedelta(hours=i),
                ))
            cur.executemany(
                "INSERT INTO public.orders (id, customer_id, product_id, amount, status, created_at) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                rows,
            )


def _totals(dsn: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT t.customer_id, c.name, c.city, t.orders, t.total_amount, t.last_order_at "
            "FROM public.customer_totals t LEFT JOIN public.customers_view c ON c.id = t.customer_id "
            "ORDER BY t.total_amount DESC, t.customer_id"
        ).fetchall()


def _print_totals(rows: list[dict[str, Any]], title: str, out: Callable[..., None]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in ("customer", "name", "city", "orders", "total", "last order"):
        table.add_column(c, justify="right" if c in ("orders", "total") else "left")
    for r in rows:
        table.add_row(
            str(r["customer_id"]),
            r["name"] or "?",
            r["city"] or "",
            str(r["orders"]),
            f"{r['total_amount']:.2f}",
            r["last_order_at"].strftime("%Y-%m-%d %H:%M"),
        )
    if out is print:
        Console().print(table)
    else:
        out(table)


def run_demo(
    *,
    dsn: str | None = None,
    workdir: str | Path | None = None,
    spark: Any = None,
    spark_master: str = "local[*]",
    customers: int = 8,
    orders: int = 60,
    out: Callable[..., None] = print,
) -> DemoResult:
    """Run the whole flow (see the module docstring). Returns what it printed."""
    from examples.shop.projections import Customers, CustomerTotals
    from kappaflow.config import LogConfig, PostgresSourceConfig, Settings, SparkConfig, ViewsConfig
    from kappaflow.connectors.postgres import PostgresConnector
    from kappaflow.projections.replay import replay
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSettings

    dsn = dsn or os.environ.get("KAPPAFLOW_DEMO_DSN")
    server = None
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kappaflow-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if dsn is None:
            from kappaflow.testing.servers.postgres import PrivatePostgres

            out("no PostgreSQL configured: starting a private one (wal_level=logical) ...")
            server = PrivatePostgres(wal_level="logical").start()
            dsn = server.dsn()
        db = _create_database(dsn)
        seed(db, customers=customers, orders=orders)
        out(f"shop tables in {db}: {customers} customers, {len(CATALOGUE)} products, {orders} orders")

        # 1. register the source (what `kappaflow source add shop --postgres ... --tables ...` saves)
        settings = Settings(
            log=LogConfig(url=str(work / ".kappaflow" / "log")),
            spark=SparkConfig(master=spark_master, checkpoint_dir=str(work / ".kappaflow" / "checkpoints")),
            views=ViewsConfig(postgres=PostgresSettings(dsn=db)),
            sources={"shop": PostgresSourceConfig(name="shop", dsn=db, tables=list(SHOP_TABLES),
                                                  keep_history=list(KEEP_HISTORY))},
            base_dir=work,
        )
        settings.save(work / "kappaflow.toml")
        out(f"$ kappaflow source add shop --postgres {db} --tables {','.join(SHOP_TABLES)} "
            f"--keep-history {','.join(KEEP_HISTORY)}   (in {work})")

        # 2. capture until caught up
        result = DemoResult(work, db)
        result.captured = _capture(settings, PostgresConnector, out)

        # 3. replay the projections on Spark
        rt = Runtime.from_settings(settings, spark=spark)
        try:
            for proj in (Customers, CustomerTotals):
                res = replay(proj, rt)
                out(
                    f"$ kappaflow replay examples.shop:{proj.__name__}   -> {res.view}: {res.rows} rows from "
                    f"{res.events} events in {res.seconds:.1f}s"
                )
            result.totals = _totals(db)
            _print_totals(result.totals, "customer_totals", out)

            # 4. change the source: move an order to another customer, cancel one; capture, replay
            import psycopg

            with psycopg.connect(db) as conn:
                conn.execute(
                    "UPDATE public.orders SET customer_id = CASE WHEN customer_id = 1 THEN 2 ELSE 1 END WHERE id = 1"
                )
                conn.execute("UPDATE public.orders SET status = 'cancelled' WHERE id = 2")
            out("moved order 1 to another customer and cancelled order 2")
            result.captured += _capture(settings, PostgresConnector, out)
            res = replay(CustomerTotals, rt)
            out(f"$ kappaflow replay examples.shop:CustomerTotals   -> {res.rows} rows")
            result.totals_after = _totals(db)
            changed = [r for r in result.totals_after if r not in result.totals]
            _print_totals(changed, "customer_totals rows that changed", out)
        finally:
            rt.close()
            if spark is None:
                rt.spark.stop()
        return result
    finally:
        if server is not None:
            server.stop()


def _capture(settings: Any, connector_cls: Any, out: Callable[..., None]) -> int:
    log = settings.open_log()
    try:
        summary = connector_cls(settings.sources["shop"], log, progress=False).run(until_caught_up=True)
    finally:
        log.close()
    n = int(getattr(summary, "events", 0) or 0)
    out(
        f"$ kappaflow capture shop --until-caught-up   -> {n} change events captured "
        f"({getattr(summary, 'stopped_reason', '')}, position {getattr(summary, 'position', '?')})"
    )
    return n


if __name__ == "__main__":
    run_demo()
