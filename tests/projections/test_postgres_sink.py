"""The PostgreSQL sink runs the shared sink contract suite, plus PostgreSQL specifics."""

from __future__ import annotations

from collections.abc import Iterator

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
