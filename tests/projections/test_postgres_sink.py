"""The PostgreSQL sink runs the shared sink contract suite, plus PostgreSQL specifics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pyspark.sql import types as T

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.sinks.base import ViewColumn, ViewSchemaMismatch, ViewSpec, batch_from_rows
from kappaflow.projections.sinks.postgres import PostgresSink, csv_bytes, pg_type, physical_name
from kappaflow.projections.sinks.testing import SinkContract, contract_row, contract_view

pytestmark = pytest.mark.integration


class TestPostgresSinkContract(SinkContract):
    @pytest.fixture
    def sink(self, pg_dsn: str) -> Iterator[PostgresSink]:
        s = PostgresSink(pg_dsn)
        yield s
        s.close()


class TestPostgresSinkInOtherSchema(SinkContract):
    namespace = "views"

    @pytest.fixture
    def sink(self, pg_dsn: str) -> Iterator[PostgresSink]:
        s = PostgresSink(pg_dsn)
        yield s
        s.close()

    # the contract's full run is above; here only what differs with a schema
    test_values_round_trip = None  # type: ignore[assignment]
    test_readers_never_see_an_empty_view_during_swaps = None  # type: ignore[assignment]


def test_view_tables_have_quoted_identifiers_and_a_primary_key(pg_dsn: str) -> None:
    view = ViewSpec(
        "Odd View",
        "odd",
        ("Key Col",),
        (ViewColumn("Key Col", T.StringType(), False), ViewColumn('we"ird', T.LongType())),
    )
    with PostgresSink(pg_dsn) as sink:
        t = sink.ensure(view)
        sink.write(t, batch_from_rows(view, [{"Key Col": "a'b", 'we"ird': 1, "_kf_version": 1}]))
        with psycopg.connect(pg_dsn) as c:
            assert c.execute('SELECT "Key Col", "we""ird", _kf_version FROM public."Odd View"').fetchall() == [
                ("a'b", 1, 1)
            ]
            pk = c.execute(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
                "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = 'public.\"Odd View\"'::regclass AND i.indisprimary"
            ).fetchall()
            assert pk == [("Key Col",)]


def test_schema_mismatch_with_an_existing_table_names_the_columns(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE public.totals (customer_id bigint PRIMARY KEY, total text, _kf_version bigint)")
    view = ViewSpec(
        "totals",
        "totals",
        ("customer_id",),
        (
            ViewColumn("customer_id", T.LongType(), False),
            ViewColumn("total", T.DecimalType(18, 2)),
            ViewColumn("orders", T.LongType()),
        ),
    )
    with PostgresSink(pg_dsn) as sink, pytest.raises(ViewSchemaMismatch) as err:
        sink.ensure(view)
    msg = str(err.value)
    assert '"public"."totals"' in msg and "'total' is text in the table" in msg and "numeric(18,2)" in msg
    assert "'orders' is missing" in msg and "kappaflow replay" in msg


def test_positions_and_rows_commit_together(pg_dsn: str) -> None:
    """A failing write leaves neither rows nor positions behind."""
    view = contract_view("atomic")
    with PostgresSink(pg_dsn) as sink:
        t = sink.ensure(view)
        good = contract_row(1, 1)
        bad = contract_row(2, 1)
        bad["id"] = None  # NOT NULL key: the upsert fails after the COPY
        with pytest.raises(SinkError, match="null value"):
            sink.write(t, batch_from_rows(view, [good, bad]), {("t", 0): 9})
        assert sink.count(t) == 0 and sink.read_positions(t) == {}


def test_long_names_are_shortened_not_truncated() -> None:
    name = "v" * 60
    shadow = physical_name(name, "__kf_shadow")
    assert (
        len(shadow.encode()) <= 63
        and shadow.endswith("__kf_shadow")
        and shadow != physical_name("v" * 61, "__kf_shadow")
    )
    with pytest.raises(ConfigError):
        ViewSpec("x", "x", (), (ViewColumn("a", T.LongType()),))


def test_type_mapping_and_csv_rendering() -> None:
    assert pg_type(T.DecimalType(18, 2)) == "numeric(18,2)"
    assert pg_type(T.TimestampType()) == "timestamp with time zone"
    assert pg_type(T.TimestampNTZType()) == "timestamp without time zone"
    assert pg_type(T.ArrayType(T.StringType())) == "text[]"
    assert pg_type(T.MapType(T.StringType(), T.LongType())) == "jsonb"
    import pyarrow as pa

    t = pa.table(
        {"b": pa.array([b"\x00\x01", None]), "l": pa.array([["a", 'q"', None], None]), "s": pa.array(["", None])}
    )
    assert csv_bytes(t) == b'"\\x0001","{""a"",""q\\"""",NULL}",""\n,,\n'


def test_copy_csv_round_trip_through_postgres(pg_dsn: str) -> None:
    """``csv_bytes`` in and ``arrow_from_csv`` out (the join state's COPY paths): NULL and empty
    strings stay apart, and quotes, commas, backslashes, newlines (``json_agg`` writes them), non-ASCII
    text, bytea given as its ``\\x`` text and integers come back as they went in."""
    import pyarrow as pa

    from kappaflow.projections.sinks.postgres import arrow_from_csv

    texts = [None, "", 'q"uo,te', "back\\slash", "line\nbreak\r\n", "ünï €", '[{"a": 1}, \n {"a": "x,y"}]',
             "x" * 70_000]
    n = len(texts)
    src = pa.table({"t": pa.array(texts, pa.string()),
                    "b": pa.array([None if i % 3 == 0 else "\\x" + bytes([i, 255 - i]).hex() for i in range(n)]),
                    "i": pa.array([None if i == 2 else i - 3 for i in range(n)], pa.int32())})
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TEMP TABLE csv_rt (n serial, t text, b bytea, i integer)")
        with conn.cursor() as cur, cur.copy("COPY csv_rt (t, b, i) FROM STDIN WITH (FORMAT csv)") as cp:
            cp.write(csv_bytes(src))
        assert conn.execute("SELECT t FROM csv_rt ORDER BY n").fetchall() == [(t,) for t in texts]
        out = bytearray()
        with conn.cursor() as cur, cur.copy(
            "COPY (SELECT t, encode(b, 'hex'), i FROM csv_rt ORDER BY n) TO STDOUT WITH (FORMAT csv)"
        ) as cp:
            for chunk in cp:
                out += chunk
        got = arrow_from_csv(bytes(out), {"t": pa.string(), "b": pa.string(), "i": pa.int32()})
        assert got.column("t").to_pylist() == texts
        assert got.column("b").to_pylist() == [None if v is None else v[2:] for v in src.column("b").to_pylist()]
        assert got.column("i").to_pylist() == src.column("i").to_pylist()
    empty = arrow_from_csv(b"", {"t": pa.string(), "i": pa.int32()})
    assert empty.num_rows == 0 and empty.schema == pa.schema([("t", pa.string()), ("i", pa.int32())])


def _lock_timeout_once(pg_dsn: str, sink: PostgresSink, table: str, write: Any) -> None:
    """`write()` fails on a lock timeout (transient) while another session holds `table`."""
    sink.conn.execute("SET lock_timeout = '200ms'")
    with psycopg.connect(pg_dsn) as other:
        other.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(SinkError, match="lock timeout") as err:
            write()
        assert err.value.transient


def test_a_transient_failure_in_a_connections_first_write_does_not_break_the_next(pg_dsn: str) -> None:
    """Regression: the first write on a connection creates its staging table; when that
    transaction failed (here a lock timeout) the table was rolled back but stayed cached, so
    every later write failed with 'schema "pg_temp" does not exist' (terminal: a follower gave up)."""
    view = contract_view("stg_retry")
    with PostgresSink(pg_dsn) as sink:
        t = sink.ensure(view)
        _lock_timeout_once(pg_dsn, sink, 'public."stg_retry"',
                           lambda: sink.write(t, batch_from_rows(view, [contract_row(1, 1)]), {("t", 0): 1}))
        sink.write(t, batch_from_rows(view, [contract_row(1, 1), contract_row(2, 1)]), {("t", 0): 2})
        assert sink.count(t) == 2 and sink.read_positions(t) == {("t", 0): 2}


def test_a_transient_failure_in_a_connections_first_grouped_apply_does_not_break_the_next(
        rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    """The same for ``apply_grouped`` (its keyed-state staging table)."""
    import pyarrow as pa

    from kappaflow.projections.engine import prepare
    from kappaflow.projections.replay import as_spec, replay
    from kappaflow.projections.simulate import TableWriter
    from kappaflow.projections.sinks.base import DELETED, VERSION
    from tests.projections import defs
    from tests.projections.pj_helpers import orders_schema, totals_reference, view_rows
    from tests.projections.test_replay import order

    w = TableWriter(embedded_log, orders_schema("stgg"), partitions=2)
    for i in range(1, 7):
        w.insert(order(i, 1 + i % 3, 100 * i, "new", i))
    w.flush()
    totals = defs.totals("stgg", name="stgg_totals")
    replay(totals, rt)
    with PostgresSink(pg_dsn) as sink:
        t = sink.live(prepare(as_spec(totals), rt).view)
        assert t is not None
        state = f'"kappaflow"."{sink.state_table(t)}"'
        with psycopg.connect(pg_dsn) as c:
            cur = c.execute(f"SELECT * FROM {state} ORDER BY 1, 2 LIMIT 1")
            names = [d.name for d in cur.description or ()]
            row = dict(zip(names, cur.fetchone() or (), strict=True))
        row.update({VERSION: row[VERSION] + 1000, "amount": row["amount"] + 1, DELETED: False})
        changes = pa.Table.from_pylist([row])
        # the view (not the state) is locked: the staging table is created before the failure
        _lock_timeout_once(pg_dsn, sink, f'public."{totals.name}"', lambda: sink.apply_grouped(t, changes, 10**6, None))
        sink.apply_grouped(t, changes, 10**6, None)
    # the change applied: the order of that state row is one unit more
    (k,) = [k for k, r in w.rows.items() if r["created_at"] == row["created_at"]]
    w.rows[k]["amount"] += 1
    assert view_rows(pg_dsn, totals.name, "customer_id, n, total, last, statuses") == totals_reference(w.rows)


def _deleted_keys(dsn: str, sink: PostgresSink, target: Any) -> dict[int, int]:
    with psycopg.connect(dsn) as c:
        rows = c.execute(f'SELECT id, _kf_version FROM kappaflow."{sink.deleted_table(target)}"').fetchall()
    return dict(rows)


def test_deleted_keys_are_kept_until_a_newer_upsert_or_the_retention_and_move_with_a_swap(pg_dsn: str) -> None:
    """How the PostgreSQL sink keeps a delete's version (the contract case is in SinkContract)."""
    from kappaflow.projections.sinks import postgres as pgmod

    view = contract_view("kf_deleted_keys")
    with PostgresSink(pg_dsn) as sink:
        t = sink.ensure(view)
        sink.write(t, batch_from_rows(view, [contract_row(i, 10) for i in range(1, 4)]))
        sink.write(t, batch_from_rows(view, [contract_row(1, 11, deleted=True), contract_row(2, 11, deleted=True),
                                             contract_row(3, 9, deleted=True)]))  # 3: a stale delete
        assert _deleted_keys(pg_dsn, sink, t) == {1: 11, 2: 11}
        sink.write(t, batch_from_rows(view, [contract_row(1, 12)]))  # newer: key 1 is back, unguarded
        assert _deleted_keys(pg_dsn, sink, t) == {2: 11}
        # past the retention the delete guards no more (pruned at the next write)
        with psycopg.connect(pg_dsn) as c:
            c.execute(f'UPDATE kappaflow."{sink.deleted_table(t)}" SET _kf_deleted_at = now() - '
                      f"make_interval(secs => {pgmod.TOMBSTONE_RETENTION_S + 60})")
        sink._pruned.clear()
        sink.write(t, batch_from_rows(view, [contract_row(9, 1)]))
        assert _deleted_keys(pg_dsn, sink, t) == {}
        # a rebuild: the shadow's deleted keys become the live ones at the swap
        shadow = sink.begin_shadow(view)
        sink.load(shadow, [batch_from_rows(view, [contract_row(5, 20)])])
        sink.write(shadow, batch_from_rows(view, [contract_row(5, 21, deleted=True)]))
        live = sink.swap(shadow)
        assert _deleted_keys(pg_dsn, sink, live) == {5: 21}
        sink.write(live, batch_from_rows(view, [contract_row(5, 20, name="old")]))
        assert sink.fetch(live, [(5,)]) == {}
        sink.drop(live)
        with psycopg.connect(pg_dsn) as c:
            assert c.execute("SELECT to_regclass(%s)", (f'kappaflow."{sink.deleted_table(live)}"',)).fetchone() == (
                None,
            )


def test_a_view_built_before_deleted_keys_were_kept_gets_them_at_ensure(pg_dsn: str) -> None:
    view = contract_view("kf_old_view")
    with PostgresSink(pg_dsn) as sink:
        t = sink.ensure(view)
        sink.write(t, batch_from_rows(view, [contract_row(1, 10)]))
        with psycopg.connect(pg_dsn) as c:  # what a view made by an earlier version looks like
            c.execute(f'DROP TABLE kappaflow."{sink.deleted_table(t)}"')
    with PostgresSink(pg_dsn) as sink:
        t = sink.ensure(view)
        sink.write(t, batch_from_rows(view, [contract_row(1, 12, deleted=True)]))
        sink.write(t, batch_from_rows(view, [contract_row(1, 11)]))
        assert sink.fetch(t, [(1,)]) == {}
