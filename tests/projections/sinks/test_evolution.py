"""Which view changes a sink may apply in place (``widens``, ``evolution``), and how a source column
change is classified (``table_change``): pure functions, no store."""

from __future__ import annotations

from pyspark.sql import types as T

from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.projections.schema_watch import table_change
from kappaflow.projections.sinks.base import ViewColumn, ViewSpec, evolution, widens


def test_widening_is_integer_rank_float_to_double_and_decimals_with_room() -> None:
    assert widens(T.IntegerType(), T.LongType()) and widens(T.ShortType(), T.IntegerType())
    assert not widens(T.LongType(), T.IntegerType())
    assert widens(T.FloatType(), T.DoubleType()) and not widens(T.DoubleType(), T.FloatType())
    assert widens(T.DecimalType(10, 2), T.DecimalType(12, 2))
    assert widens(T.DecimalType(10, 2), T.DecimalType(13, 3))  # 8 integer digits, 3 fraction digits
    assert not widens(T.DecimalType(10, 2), T.DecimalType(12, 6))  # 6 integer digits < 8
    assert not widens(T.DecimalType(10, 2), T.DecimalType(10, 1))
    assert not widens(T.IntegerType(), T.StringType()) and not widens(T.StringType(), T.LongType())
    assert not widens(T.IntegerType(), T.DoubleType())  # a double is not exact for every bigint: no
    assert widens(T.ArrayType(T.IntegerType()), T.ArrayType(T.LongType()))


def _view(*cols: ViewColumn, key: tuple[str, ...] = ("id",)) -> ViewSpec:
    return ViewSpec("v", "p", key, (ViewColumn("id", T.LongType(), False), *cols))


def test_evolution_adds_widens_and_names_what_needs_a_rebuild() -> None:
    stored = _view(ViewColumn("n", T.IntegerType()), ViewColumn("s", T.StringType()))
    evo = evolution(stored.columns, stored.key, _view(ViewColumn("n", T.LongType()), ViewColumn("s", T.StringType()),
                                                      ViewColumn("new", T.DateType())))
    assert [c.name for c in evo.added] == ["new"] and [n.name for _, n in evo.widened] == ["n"]
    assert not evo.problems and "add column 'new' date" in evo.describe() and "int -> bigint" in evo.describe()
    assert evolution(stored.columns, stored.key, stored).empty
    dropped = evolution(stored.columns, stored.key, _view(ViewColumn("n", T.IntegerType())))
    assert any("['s']" in p for p in dropped.problems)
    narrowed = evolution(stored.columns, stored.key, _view(ViewColumn("n", T.ShortType()), ViewColumn("s",
                                                                                                      T.StringType())))
    assert any("'n'" in p and "smallint" in p for p in narrowed.problems)
    rekeyed = evolution(stored.columns, ("id", "n"), stored)
    assert any("key" in p for p in rekeyed.problems)


def test_a_source_column_change_is_added_dropped_widened_retyped_or_other() -> None:
    old = TableSchema("s.public.t", (Column("id", FieldType.INT64, optional=False),
                                     Column("qty", FieldType.INT32, native_type="integer"),
                                     Column("label", FieldType.STRING, length=50, native_type="varchar"),
                                     Column("gone", FieldType.STRING),
                                     Column("flag", FieldType.STRING)), ("id",))
    new = TableSchema("s.public.t", (Column("id", FieldType.INT64, optional=False),
                                     Column("qty", FieldType.INT64, native_type="bigint"),
                                     Column("label", FieldType.STRING, length=200, native_type="varchar"),
                                     Column("flag", FieldType.BOOLEAN),
                                     Column("note", FieldType.STRING)), ("id",))
    ch = table_change("s.public.t", old, new)
    assert ch.added == ["note"] and ch.dropped == ["gone"]
    assert [str(c) for c in ch.widened] == ["'qty' integer -> bigint"]
    assert [c.name for c in ch.retyped] == ["flag"]
    assert [str(c) for c in ch.other] == ["'label' varchar(50) -> varchar(200)"]
    assert ch.key is None
    text = ch.describe()
    assert text.startswith("source table s.public.t:") and "['note'] added" in text and "['gone'] dropped" in text
