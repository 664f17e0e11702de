"""Source schema changes reach followed views by each projection's ``on_schema_change`` (issue 22, item 4).

Real ``ALTER TABLE`` on a PostgreSQL source while ``kappaflow capture`` runs in its own process
and followers run in this one:

- ``evolve`` (the default of a latest-row view of every column): a column added upstream appears
  in the PostgreSQL view, the search documents and the Redis values on the next batch, and
  int -> bigint / varchar(50) -> varchar(200) widen the view, with no replay (``rebuilds == 0``)
  and the view equal to the source after; a dropped column the view shows stops the follower
  with a message naming it;
- ``rebuild``: the follower stops naming the change (table, column, old -> new type);
  ``auto_rebuild = True``: the follower rebuilds the view itself and follows on;
- ``fail``: any change stops the follower, saying which.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.config import LogConfig, PostgresSourceConfig, Settings, SparkConfig, ViewsConfig
from kappaflow.projections import Projection
from kappaflow.projections.follow import Follower, follow
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.schema_watch import NeedsRebuild, SchemaChangeRefused
from kappaflow.projections.status import projection_status
from tests._kill import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = "id, qty, amount, label"
WIDENED = re.compile(r"'qty' (integer|int4) -> (bigint|int8)")  # the source's type names (catalog or pgoutput)


@pytest.fixture
def world(
    pg_server: Any, spark: Any, search_server: Any, redis_server: Any, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    src_db, views_db = f"se_src_{tag}", f"se_views_{tag}"
    src = pg_server.create_database(src_db)
    views = pg_server.create_database(views_db)
    source = f"se{tag}"
    slot = f"kf_se_{tag}"
    settings = Settings(
        log=LogConfig(url=str(tmp_path / "log")),
        views=ViewsConfig(postgres_dsn=views, search_url=search_server.url, redis_url=redis_server.url),
        sources={source: PostgresSourceConfig(name=source, dsn=src, tables=["public.orders"], slot=slot,
                                              publication=slot, heartbeat_interval_s=0.5)},
        spark=SparkConfig(checkpoint_dir=str(tmp_path / "ckpt")),
        base_dir=tmp_path,
    )
    cfg = tmp_path / "kappaflow.toml"
    settings.save(cfg)
    with psycopg.connect(src, autocommit=True) as c:
        c.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, qty int, amount numeric(10,2), "
                  "label varchar(50))")
        c.execute("INSERT INTO public.orders SELECT g, g * 10, g, 'row ' || g FROM generate_series(1, 20) g")
    capture = subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", source, "--config", str(cfg)],
                               cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rt = Runtime.from_settings(settings, spark=spark)
    topic = f"{source}.public.orders"

    def captured(n: int) -> bool:
        assert capture.poll() is None, capture.stdout.read().decode()[-2000:] if capture.stdout else ""
        try:
            return sum(rt.end_offsets([topic])[topic].values()) >= n
        except Exception:
            return False

    try:
        yield {"src": src, "views": views, "rt": rt, "tag": tag, "topic": topic, "captured": captured}
    finally:
        rt.close()
        capture.terminate()
        try:
            capture.wait(30)
        except subprocess.TimeoutExpired:
            capture.kill()
            capture.wait(10)
        with psycopg.connect(src, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                      (slot,))
        pg_server.drop_database(src_db)
        pg_server.drop_database(views_db)


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn) as conn:
        for s in statements:
            conn.execute(s)


def _rows(dsn: str, table: str, columns: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return sorted(conn.execute(f'SELECT {columns} FROM public."{table}"').fetchall())  # test constants


def _pg_type(dsn: str, table: str, column: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a JOIN pg_class c "
                           "ON c.oid = a.attrelid WHERE c.relname = %s AND a.attname = %s AND NOT a.attisdropped",
                           (table, column)).fetchone()
    return row[0] if row else None


def _quiet(cond: Any) -> Any:
    """`cond` for a bounded wait that reads a view being swapped (a rebuild drops the old table under a
    reader waiting on its lock): an error reads as "not yet"."""
    def check() -> Any:
        try:
            return cond()
        except psycopg.Error:
            return False
    return check


def _doc(rt: Runtime, f: Follower, key: int) -> dict[str, Any] | None:
    """The row of `key` as the follower's store holds it (search document, Redis value, table row)."""
    sink = rt.sink_for(f.spec.name, f.sink_name)
    live = sink.live(f.plan.view)
    return None if live is None else sink.fetch(live, [(key,)]).get((key,))


def test_evolve_adds_and_widens_columns_in_every_store_without_a_replay(world: dict[str, Any]) -> None:
    src, views, rt, tag = world["src"], world["views"], world["rt"], world["tag"]

    class Orders(Projection):  # every column: on_schema_change defaults to "evolve"
        name = f"se_orders_{tag}"
        sources = [world["topic"]]
        key = ["id"]
        sinks = ("postgres", "search", "redis")
        # an index maps int as `integer` and bigint as `long`, which an existing index cannot change:
        # mapped as long from the start, the field widens in place too
        sink_options = {"search": {"fields": {"qty": "long"}}}

    wait_for(lambda: world["captured"](20), 120, "the capture's snapshot of 20 rows")
    group = follow(Orders, rt, trigger="0.3s")
    try:
        wait_for(group.caught_up, 240, "the followers to catch up")
        assert _rows(views, Orders.name, COLUMNS) == _rows(src, "orders", COLUMNS)

        # 1. a column added upstream appears in every store on the next batch
        _sql(src, "ALTER TABLE public.orders ADD COLUMN note text",
             "INSERT INTO public.orders VALUES (100, 5, 5.00, 'after the alter', 'hello')",
             "UPDATE public.orders SET note = 'changed' WHERE id = 1")
        for name, f in group.followers.items():
            wait_for(lambda f=f: (d := _doc(rt, f, 100)) is not None and d.get("note") == "hello", 240,
                     f"the new column in the {name} view")
            assert (_doc(rt, f, 1) or {}).get("note") == "changed", name
            assert f.failed is None and f.rebuilds == 0 and f.schema_changes, (name, f.failed)
        assert _pg_type(views, Orders.name, "note") == "text"
        with_note = f"{COLUMNS}, note"
        wait_for(group.caught_up, 120, "the followers to catch up after the ALTER")
        assert _rows(views, Orders.name, with_note) == _rows(src, "orders", with_note)

        # 2. widened types: int -> bigint, varchar(50) -> varchar(200)
        big = 2**40
        _sql(src, "ALTER TABLE public.orders ALTER COLUMN qty TYPE bigint",
             "ALTER TABLE public.orders ALTER COLUMN label TYPE varchar(200)",
             f"UPDATE public.orders SET qty = {big}, label = repeat('x', 150) WHERE id = 2")
        for name, f in group.followers.items():
            wait_for(lambda f=f: (_doc(rt, f, 2) or {}).get("qty") == big, 240, f"the widened qty in the {name} view")
            assert (_doc(rt, f, 2) or {}).get("label") == "x" * 150, name
            assert f.failed is None and f.rebuilds == 0, (name, f.failed)
        assert _pg_type(views, Orders.name, "qty") == "bigint"
        wait_for(group.caught_up, 120, "the followers to catch up after the widening")
        assert _rows(views, Orders.name, with_note) == _rows(src, "orders", with_note)
        state = {s.name: s for s in projection_status(rt)}[Orders.name]
        assert state.needs_rebuild is None, state

        # 3. a dropped column the view shows cannot be evolved in place: the follower stops, naming it
        _sql(src, "ALTER TABLE public.orders DROP COLUMN label",
             "UPDATE public.orders SET qty = 3 WHERE id = 3")
        pg = group.followers["postgres"]
        wait_for(lambda: pg.failed is not None, 240, "the postgres follower to stop on the dropped column")
        err = pg.failed
        assert isinstance(err, NeedsRebuild) and not err.auto, err
        text = str(err)
        assert "'label'" in text and "dropped" in text and "lose column(s) ['label']" in text, text
        assert "kappaflow replay" in text and "orders" in text, text
        assert _rows(views, Orders.name, "id, qty")[2] == (3, 30), "nothing of the new shape was written"
        assert {s.name: s for s in projection_status(rt)}[Orders.name].state == "needs rebuild"
    finally:
        group.stop()


def test_rebuild_auto_rebuild_and_fail_policies(world: dict[str, Any]) -> None:
    src, views, rt, tag = world["src"], world["views"], world["rt"], world["tag"]

    def make(kind: str, **attrs: Any) -> type[Projection]:
        return type(kind.title(), (Projection,), {"name": f"se_{kind}_{tag}", "sources": [world["topic"]],
                                                  "key": ["id"], **attrs})

    projections = {
        "rebuild": make("rebuild", on_schema_change="rebuild"),
        "auto": make("auto", on_schema_change="rebuild", auto_rebuild=True),
        "fail": make("fail", on_schema_change="fail", columns=["id", "qty"]),  # fails even on a change it could take
    }
    wait_for(lambda: world["captured"](20), 120, "the capture's snapshot of 20 rows")
    followers = {k: Follower(p, rt, trigger="0.3s").start() for k, p in projections.items()}
    try:
        wait_for(lambda: all(f.caught_up() for f in followers.values()), 240, "the followers to catch up")

        _sql(src, "ALTER TABLE public.orders ALTER COLUMN qty TYPE bigint",
             f"UPDATE public.orders SET qty = {2**40} WHERE id = 1")
        wait_for(lambda: followers["rebuild"].failed and followers["fail"].failed, 240,
                 "the rebuild and fail followers to stop")
        err = followers["rebuild"].failed
        assert isinstance(err, NeedsRebuild), err
        text = str(err)  # names the table, the column and old -> new type
        assert "public.orders" in text and WIDENED.search(text), text
        assert "on_schema_change = 'rebuild'" in text and "kappaflow replay" in text, text
        refused = followers["fail"].failed
        assert isinstance(refused, SchemaChangeRefused), refused
        assert WIDENED.search(str(refused)) and "on_schema_change = 'fail'" in str(refused), str(refused)
        state = {s.name: s for s in projection_status(rt)}
        assert state[projections["rebuild"].name].state == "needs rebuild"
        assert state[projections["fail"].name].needs_rebuild is None

        auto = followers["auto"]
        name = projections["auto"].name
        wait_for(_quiet(lambda: auto.rebuilds >= 1 and _rows(views, name, "id, qty")[0] == (1, 2**40)), 300,
                 "the auto_rebuild follower to rebuild the view with the widened column")
        assert _pg_type(views, name, "qty") == "bigint"
        _sql(src, "ALTER TABLE public.orders ADD COLUMN note text", "UPDATE public.orders SET note = 'n' WHERE id = 4")
        wait_for(_quiet(lambda: auto.rebuilds >= 2 and _pg_type(views, name, "note") == "text"
                        and (4, "n") in _rows(views, name, "id, note")), 300,
                 "the second automatic rebuild (added column)")
        wait_for(auto.caught_up, 120, "the rebuilt follower to catch up")
        every = f"{COLUMNS}, note"
        assert _rows(views, name, every) == _rows(src, "orders", every)
        assert auto.failed is None
        assert {s.name: s for s in projection_status(rt)}[name].needs_rebuild is None
        _sql(src, "UPDATE public.orders SET label = 'followed' WHERE id = 5")
        wait_for(_quiet(lambda: (5, "followed") in _rows(views, name, "id, label")), 120,
                 "the rebuilt view to follow on")
    finally:
        for f in followers.values():
            f.stop()


@pytest.fixture
def maria_world(mariadb_server: Any, mariadb_db: str, pg_server: Any, spark: Any,
                tmp_path: Path) -> Iterator[dict[str, Any]]:
    import os

    from kappaflow.config import MySQLSourceConfig

    db = mariadb_db
    source = "m" + db.replace("_", "")
    views_db = f"se_mviews_{uuid.uuid4().hex[:8]}"
    views = pg_server.create_database(views_db)
    mariadb_server.execute(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, qty INT, amount DECIMAL(10,2), label VARCHAR(50)) ENGINE=InnoDB",
        *(f"INSERT INTO orders VALUES ({i}, {i * 10}, {i}.00, 'row {i}')" for i in range(1, 21)), db=db)
    settings = Settings(
        log=LogConfig(url=str(tmp_path / "log")),
        views=ViewsConfig(postgres_dsn=views),
        sources={source: MySQLSourceConfig(name=source, dsn=mariadb_server.dsn(db), tables=[f"{db}.orders"],
                                           server_id=6000 + os.getpid() % 1000)},
        spark=SparkConfig(checkpoint_dir=str(tmp_path / "ckpt")),
        base_dir=tmp_path,
    )
    cfg = tmp_path / "kappaflow.toml"
    settings.save(cfg)
    capture = subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", source, "--config", str(cfg)],
                               cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rt = Runtime.from_settings(settings, spark=spark)
    topic = f"{source}.{db}.orders"

    def captured(n: int) -> bool:
        assert capture.poll() is None, capture.stdout.read().decode()[-2000:] if capture.stdout else ""
        try:
            return sum(rt.end_offsets([topic])[topic].values()) >= n
        except Exception:
            return False

    try:
        yield {"maria": mariadb_server, "db": db, "views": views, "rt": rt, "topic": topic, "captured": captured}
    finally:
        rt.close()
        capture.terminate()
        try:
            capture.wait(30)
        except subprocess.TimeoutExpired:
            capture.kill()
            capture.wait(10)
        pg_server.drop_database(views_db)


def test_evolve_on_mariadb_add_and_widen(maria_world: dict[str, Any]) -> None:
    """The same on a MariaDB source (binlog row metadata carries each change's column types): a column
    added, INT -> BIGINT, DECIMAL(10,2) -> DECIMAL(14,2), VARCHAR(50) -> VARCHAR(200), then a dropped
    column the view shows stops the follower."""
    maria, db, views, rt = maria_world["maria"], maria_world["db"], maria_world["views"], maria_world["rt"]

    class MariaOrders(Projection):
        name = f"se_maria_{uuid.uuid4().hex[:8]}"
        sources = [maria_world["topic"]]
        key = ["id"]

    def source_rows(columns: str) -> list[tuple[Any, ...]]:
        return sorted(tuple(r) for r in maria.execute(f"SELECT {columns} FROM orders", db=db))

    wait_for(lambda: maria_world["captured"](20), 120, "the capture's snapshot of 20 rows")
    f = Follower(MariaOrders, rt, trigger="0.3s").start()
    try:
        wait_for(f.caught_up, 240, "the follower to catch up")
        assert _rows(views, MariaOrders.name, COLUMNS) == source_rows(COLUMNS)
        maria.execute("ALTER TABLE orders ADD COLUMN note TEXT",
                      "INSERT INTO orders VALUES (100, 5, 5.00, 'after the alter', 'hello')", db=db)
        wait_for(lambda: (100, "hello") in _rows(views, MariaOrders.name, "id, note") if _pg_type(
            views, MariaOrders.name, "note") else False, 240, "the added column in the view")
        maria.execute("ALTER TABLE orders MODIFY qty BIGINT, MODIFY amount DECIMAL(14,2), MODIFY label VARCHAR(200)",
                      f"UPDATE orders SET qty = {2**40}, amount = 123456789012.34, label = REPEAT('x', 150) "
                      "WHERE id = 2", db=db)
        wait_for(lambda: _rows(views, MariaOrders.name, "id, qty")[1] == (2, 2**40), 240,
                 "the widened values in the view")
        assert _pg_type(views, MariaOrders.name, "qty") == "bigint"
        assert _pg_type(views, MariaOrders.name, "amount") == "numeric(14,2)"
        assert f.failed is None and f.rebuilds == 0 and len(f.schema_changes) >= 2, (f.failed, f.schema_changes)
        wait_for(f.caught_up, 120, "the follower to catch up after the widening")
        every = f"{COLUMNS}, note"
        assert _rows(views, MariaOrders.name, every) == source_rows(every)
        maria.execute("ALTER TABLE orders DROP COLUMN label", "UPDATE orders SET qty = 3 WHERE id = 3", db=db)
        wait_for(lambda: f.failed is not None, 240, "the follower to stop on the dropped column")
        assert isinstance(f.failed, NeedsRebuild) and "'label'" in str(f.failed), f.failed
    finally:
        f.stop()
