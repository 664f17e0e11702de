"""A projection's lookups bound to the tables' schemas, and the Spark expressions both stages share.

The join is an input stage in front of the folds: it turns the latest driving row of every
driving key into the *joined row* (driving columns + each lookup's prefixed columns) with the
same frame shape as ``Plan.latest`` (``_kf_topic, _kf_key, _kf_partition, _kf_offset, _kf_op,
_kf_deleted, _kf_row``), so ``derive``/``where`` and the latest-row and grouped folds consume it
unchanged. Keys are compared through a canonical text (``canonical``): the JSON array of the key
values cast to the looked-up key's type, then to text -- the same text in Spark (replay) and in
PostgreSQL's join state (follow), where it is the state tables' primary key and FK index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    ByteType,
    DataType,
    DecimalType,
    IntegerType,
    LongType,
    ShortType,
    StructField,
    StructType,
)

from kappaflow.errors import ConfigError
from kappaflow.events import TableSchema
from kappaflow.projections.joins.spec import Lookup, Nested, chain
from kappaflow.projections.schemas import converted_row, envelope_struct, key_struct, row_struct, spark_type

VALID_OPS = ("c", "u", "d", "r", "t")
JSON_OPTIONS = {
    # microseconds survive the round trip through the join state's row text
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
    "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
}
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


def comparable(fk: DataType, key: DataType) -> bool:
    """Can a foreign key of type `fk` be compared exactly with a key of type `key`?

    Equal types; integers of any width; an integer or decimal foreign key into a decimal key of
    at least its scale (the cast to the key's type is exact)."""
    if fk == key:
        return True
    if isinstance(fk, _INTEGRAL) and isinstance(key, _INTEGRAL):
        return True
    if isinstance(key, DecimalType):
        if isinstance(fk, _INTEGRAL):
            return True
        if isinstance(fk, DecimalType):
            return fk.scale <= key.scale
    return False


def canonical(values: list[SparkColumn]) -> SparkColumn:
    """The canonical text of a key (NULL when any part is NULL: a NULL foreign key matches nothing)."""
    present: SparkColumn = F.lit(True)
    for v in values:
        present = present & v.isNotNull()
    return F.when(present, F.to_json(F.array(*[v.cast("string") for v in values])))


@dataclass(frozen=True)
class TopicState:
    """One table of the join: which of its columns the state keeps, which lookups its rows point into."""

    topic: str
    index: int  # 0: the driving table
    schema: TableSchema
    columns: tuple[str, ...]  # kept in the state's row text (driving: all; lookups: the selected ones)
    children: tuple[int, ...]  # indexes (into JoinPlan.lookups) of the lookups whose FK is in this table
    nested: tuple[int, ...] = ()  # indexes (into JoinPlan.nested) of the collections of this table's rows

    @property
    def struct(self) -> StructType:
        return row_struct(self.schema, self.columns)


@dataclass(frozen=True)
class LookupPlan:
    lookup: Lookup
    index: int
    topic_index: int
    parent: int | None  # index of the `via` lookup; None: the driving table
    fk: tuple[str, ...]  # foreign key columns in the parent's table, in the looked-up key's order
    key_types: tuple[DataType, ...]
    columns: tuple[str, ...]
    out_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.lookup.name

    @property
    def inner(self) -> bool:
        return self.lookup.how == "inner"


@dataclass(frozen=True)
class NestedPlan:
    """One nested collection bound to the schemas: the child table's rows whose foreign key ``fk``
    (child columns, in the driving key's order, compared as the driving key's types) is a driving key."""

    nested: Nested
    index: int
    topic_index: int
    fk: tuple[str, ...]
    key_types: tuple[DataType, ...]
    columns: tuple[str, ...]  # the child columns of each element
    sort: tuple[str, ...]  # order_by, then the child key (a total order)
    element: StructType

    @property
    def name(self) -> str:
        return self.nested.name


@dataclass
class JoinPlan:
    """The validated lookups of one projection (``build``), and the Spark expressions of the join."""

    projection: str
    driving: TopicState
    topics: list[TopicState]
    lookups: list[LookupPlan]
    fields: list[StructField] = field(default_factory=list)  # the joined row's extra (prefixed) fields
    nested: list[NestedPlan] = field(default_factory=list)

    @property
    def extra_columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def row_struct(self) -> StructType:
        return StructType([*self.driving.struct.fields, *self.fields])

    def topic(self, name: str) -> TopicState:
        return next(t for t in self.topics if t.topic == name)

    # --- building -------------------------------------------------------------------------------
    @classmethod
    def build(cls, spec: Any, schemas: dict[str, TableSchema]) -> JoinPlan:
        where = f"projection {spec.name!r}"
        driving_topic = spec.source_topics[0]
        dschema = schemas[driving_topic]
        by_name = {lk.name: lk for lk in spec.lookups}
        order = {lk.name: i for i, lk in enumerate(spec.lookups)}
        joined = [*(lk.topic for lk in spec.lookups), *(nc.topic for nc in spec.nested)]
        topic_names = [driving_topic] + [t for t in dict.fromkeys(joined)]
        plans: list[LookupPlan] = []
        out_seen = {c: "the driving table" for c in dschema.column_names}
        for i, lk in enumerate(spec.lookups):
            at = f"{where}: 'lookups'[{lk.name!r}]"
            schema = schemas.get(lk.topic)
            if schema is None:
                raise ConfigError(f"{at}.topic: no table schema for topic {lk.topic!r} (is the table captured?)")
            if not schema.key:
                raise ConfigError(
                    f"{at}.topic: {lk.topic!r} has no primary key; a lookup finds one row by the looked-up "
                    "table's primary key"
                )
            parent = order[lk.via] if lk.via is not None else None
            pschema = dschema if lk.via is None else schemas[by_name[lk.via].topic]
            ptable = driving_topic if lk.via is None else by_name[lk.via].topic
            keycols = sorted(lk.on.values())
            if keycols != sorted(schema.key) or len(set(lk.on.values())) != len(lk.on):
                raise ConfigError(
                    f"{at}.on: must map foreign key columns to the whole primary key {list(schema.key)} of "
                    f"{lk.topic!r}, got {dict(lk.on)}"
                )
            inverse = {v: k for k, v in lk.on.items()}
            fk = tuple(inverse[k] for k in schema.key)
            missing = [c for c in fk if c not in pschema.column_names]
            if missing:
                raise ConfigError(
                    f"{at}.on: foreign key column(s) {missing} are not in {ptable!r} "
                    f"(columns: {list(pschema.column_names)})"
                )
            key_types = tuple(spark_type(schema.column(k)) for k in schema.key)
            for f, k, kt in zip(fk, schema.key, key_types, strict=True):
                ft = spark_type(pschema.column(f))
                if not comparable(ft, kt):
                    raise ConfigError(
                        f"{at}.on: {ptable}.{f} ({ft.simpleString()}) cannot be compared with "
                        f"{lk.topic}.{k} ({kt.simpleString()}): key types must be equal, both integers, or an "
                        "integer/decimal into a decimal of at least its scale"
                    )
            if lk.columns is None:
                columns = tuple(c for c in schema.column_names if c not in schema.key)
            else:
                unknown = [c for c in lk.columns if c not in schema.column_names]
                if unknown:
                    raise ConfigError(
                        f"{at}.columns: {unknown} not in the schema of {lk.topic!r} "
                        f"(columns: {list(schema.column_names)})"
                    )
                columns = tuple(dict.fromkeys(lk.columns))
            outs = tuple(lk.column_prefix + c for c in columns)
            for c, o in zip(columns, outs, strict=True):
                if o in out_seen:
                    raise ConfigError(
                        f"{at}.prefix: column {o!r} (from {lk.topic}.{c}) clashes with a column of "
                        f"{out_seen[o]}; choose another prefix"
                    )
                if o.startswith("_kf_"):
                    raise ConfigError(f"{at}.prefix: column {o!r}: names starting with '_kf_' are reserved")
                out_seen[o] = f"lookup {lk.name!r}"
            plans.append(LookupPlan(lk, i, topic_names.index(lk.topic), parent, fk, key_types, columns, outs))
        nplans = [cls._nested_plan(where, j, nc, dschema, schemas, topic_names, out_seen)
                   for j, nc in enumerate(spec.nested)]
        topics: list[TopicState] = []
        for ti, t in enumerate(topic_names):
            if ti == 0:
                cols = tuple(dschema.column_names)
            else:  # the key too: a row is never empty, so "there is a row" is "row is not NULL"
                kept = [c for lp in plans if lp.lookup.topic == t for c in lp.columns]
                kept += [c for np_ in nplans if np_.nested.topic == t for c in (*np_.columns, *np_.sort)]
                cols = tuple(dict.fromkeys([*schemas[t].key, *kept]))
            children = tuple(
                lp.index for lp in plans
                if (lp.parent is None and ti == 0) or (lp.parent is not None and plans[lp.parent].topic_index == ti)
            )
            nested = tuple(np_.index for np_ in nplans if np_.topic_index == ti)
            topics.append(TopicState(t, ti, schemas[t], cols, children, nested))
        fields = [
            StructField(o, spark_type(schemas[lp.lookup.topic].column(c)), True)
            for lp in plans
            for c, o in zip(lp.columns, lp.out_names, strict=True)
        ]
        fields += [StructField(np_.name, ArrayType(np_.element, False), False) for np_ in nplans]
        for lp in plans:  # chains were checked for cycles in the spec; check they resolve here too
            chain(lp.lookup, by_name)
        return cls(spec.name, topics[0], topics, plans, fields, nplans)

    @staticmethod
    def _nested_plan(
        where: str, j: int, nc: Nested, dschema: TableSchema, schemas: dict[str, TableSchema],
        topic_names: list[str], out_seen: dict[str, str],
    ) -> NestedPlan:
        at = f"{where}: 'nested'[{nc.name!r}]"
        schema = schemas.get(nc.topic)
        if schema is None:
            raise ConfigError(f"{at}.topic: no table schema for topic {nc.topic!r} (is the table captured?)")
        if not schema.key:
            raise ConfigError(
                f"{at}.topic: {nc.topic!r} has no primary key; a nested collection keeps the current row of every "
                "child key"
            )
        if sorted(nc.on) != sorted(dschema.key):
            raise ConfigError(
                f"{at}.on: must map the whole primary key {list(dschema.key)} of the driving table "
                f"{dschema.name!r} to child columns, got {dict(nc.on)}"
            )
        fk = tuple(nc.on[k] for k in dschema.key)
        missing = [c for c in fk if c not in schema.column_names]
        if missing:
            raise ConfigError(
                f"{at}.on: child column(s) {missing} are not in the schema of {nc.topic!r} "
                f"(columns: {list(schema.column_names)})"
            )
        key_types = tuple(spark_type(dschema.column(k)) for k in dschema.key)
        for f, k, kt in zip(fk, dschema.key, key_types, strict=True):
            ft = spark_type(schema.column(f))
            if not comparable(ft, kt):
                raise ConfigError(
                    f"{at}.on: {nc.topic}.{f} ({ft.simpleString()}) cannot be compared with "
                    f"{dschema.name}.{k} ({kt.simpleString()}): key types must be equal, both integers, or an "
                    "integer/decimal into a decimal of at least its scale"
                )
        for attr, names in (("columns", nc.columns or ()), ("order_by", nc.order_by)):
            unknown = [c for c in names if c not in schema.column_names]
            if unknown:
                raise ConfigError(
                    f"{at}.{attr}: {unknown} not in the schema of {nc.topic!r} (columns: {list(schema.column_names)})"
                )
        columns = tuple(schema.column_names) if nc.columns is None else tuple(dict.fromkeys(nc.columns))
        if not columns:
            raise ConfigError(f"{at}.columns: expected at least one child column")
        if nc.name in out_seen:
            raise ConfigError(f"{at}.name: column {nc.name!r} clashes with a column of {out_seen[nc.name]}; "
                              "choose another name")
        out_seen[nc.name] = f"nested collection {nc.name!r}"
        sort = tuple(dict.fromkeys([*nc.order_by, *schema.key]))
        element = StructType([StructField(c, spark_type(schema.column(c)), True) for c in columns])
        return NestedPlan(nc, j, topic_names.index(nc.topic), fk, key_types, columns, sort, element)

    # --- shared expressions ---------------------------------------------------------------------
    def fk_column(self, lp: LookupPlan | NestedPlan, row: SparkColumn) -> SparkColumn:
        """Canonical foreign key text of lookup `lp` from a parent row struct (of a nested collection:
        the parent's key from a child row struct)."""
        return canonical([row[f].try_cast(t) for f, t in zip(lp.fk, lp.key_types, strict=True)])

    def nested_list(self, np_: NestedPlan, rows: SparkColumn) -> SparkColumn:
        """The collection's value from an array of the child table's state row structs (or NULL: no
        children): sorted by ``sort`` ascending, NULLs first, projected to the element columns. Both
        stages gather the children in any order; this gives the one order."""
        arr = F.coalesce(rows, F.array().cast(ArrayType(self.topics[np_.topic_index].struct)))
        keyed = F.transform(arr, lambda x: F.struct(F.struct(*[x[c].alias(c) for c in np_.sort]).alias("s"),
                                                    x.alias("r")))
        return F.transform(F.sort_array(keyed), lambda y: F.struct(*[y["r"][c].alias(c) for c in np_.columns]))

    def parse_rows(self, text: SparkColumn, ts: TopicState) -> SparkColumn:
        """An array of state rows from a JSON array of row objects (the follow re-read)."""
        return F.from_json(text, ArrayType(ts.struct), JSON_OPTIONS)

    def key_text(self, ts: TopicState, key_bytes: SparkColumn) -> SparkColumn:
        """Canonical key text of a record key (JSON, with or without a schema envelope)."""
        schema = ts.schema
        kj = F.from_json(key_bytes.cast("string"), key_struct(schema))
        krow = converted_row(F.coalesce(kj["payload"], F.struct(*[kj[c].alias(c) for c in schema.key])),
                             schema.key_schema())
        return canonical([krow[c] for c in schema.key])

    def row_text(self, row: SparkColumn) -> SparkColumn:
        return F.to_json(row, JSON_OPTIONS)

    def parse_row(self, text: SparkColumn, ts: TopicState) -> SparkColumn:
        return F.from_json(text, ts.struct, JSON_OPTIONS)

    def needed(self, ts: TopicState) -> list[str]:
        """Columns to parse from a table's rows: the kept ones and the foreign keys of its children."""
        fks = [c for j in ts.children for c in self.lookups[j].fk]
        fks += [c for j in ts.nested for c in self.nested[j].fk]
        return list(dict.fromkeys([*ts.columns, *fks]))

    def _bad(self, ts: TopicState) -> SparkColumn:
        j = F.from_json(F.col("value").cast("string"), envelope_struct(ts.schema))
        op = F.coalesce(j["payload"]["op"], j["op"])
        return F.col("value").isNotNull() & (op.isNull() | ~op.isin(*VALID_OPS))

    def bad_records(self, ts: TopicState, raw: DataFrame) -> DataFrame:
        """A looked-up table's records whose value is not a change event (for the dead letters)."""
        return raw.where(self._bad(ts)).select("topic", "partition", "offset", "key")

    def table_latest(
        self, ts: TopicState, raw: DataFrame, *, deduped: bool, observe: Observation | None = None
    ) -> DataFrame:
        """Latest record per key of a looked-up table: ``k, kb, p, off, deleted, row`` (+ ``fk<j>``).

        Same rules as ``Plan.latest``: a tombstone, delete, missing row or malformed latest record
        means the row is absent; `observe` counts the malformed records (``bad``), which the
        caller sends to the dead letters (``bad_records``)."""
        schema = ts.schema
        j = F.from_json(F.col("value").cast("string"), envelope_struct(schema))
        after = F.coalesce(j["payload"]["after"], j["after"])
        op = F.coalesce(j["payload"]["op"], j["op"])
        tomb = F.col("value").isNull()
        bad = ~tomb & (op.isNull() | ~op.isin(*VALID_OPS))
        ev = raw.select(
            self.key_text(ts, F.col("key")).alias("k"),
            F.col("key").alias("kb"),
            F.col("partition").alias("p"),
            F.col("offset").alias("off"),
            (tomb | (op == "d") | after.isNull() | bad).alias("deleted"),
            bad.alias("bad"),
            converted_row(after, schema, self.needed(ts)).alias("full"),
        )
        if observe is not None:
            ev = ev.observe(observe, F.count(F.when(F.col("bad"), 1)).alias("bad"))
        ev = ev.where(F.col("k").isNotNull()).drop("bad")
        if not deduped:
            agg = ev.groupBy("k").agg(
                F.max_by(F.struct("kb", "p", "off", "deleted", "full"), "off").alias("_l")
            )
            ev = agg.select("k", "_l.*")
        return self._with_row(ts, ev, F.col("full")).drop("full")

    def _with_row(self, ts: TopicState, df: DataFrame, full: SparkColumn) -> DataFrame:
        cols = [F.when(~F.col("deleted"), F.struct(*[full[c].alias(c) for c in ts.columns])).alias("row")]
        fks = [F.when(~F.col("deleted"), self.fk_column(self.lookups[j], full)).alias(f"fk{j}") for j in ts.children]
        fks += [F.when(~F.col("deleted"), self.fk_column(self.nested[j], full)).alias(f"nfk{j}") for j in ts.nested]
        return df.select("*", *cols, *fks)

    def driving_latest(self, latest: DataFrame) -> DataFrame:
        """The driving table's latest records (``Plan.latest``) in the state shape."""
        ts = self.driving
        df = latest.select(
            self.key_text(ts, F.col("_kf_key")).alias("k"),
            F.col("_kf_key").alias("kb"),
            F.col("_kf_partition").alias("p"),
            F.col("_kf_offset").alias("off"),
            F.col("_kf_deleted").alias("deleted"),
            F.col("_kf_row").alias("full"),
        ).where(F.col("k").isNotNull())
        return self._with_row(ts, df, F.col("full")).drop("full")

    def assemble(
        self,
        df: DataFrame,
        driving_row: SparkColumn,
        rows: list[SparkColumn],
        present: list[SparkColumn],
        head: list[SparkColumn],
        deleted: SparkColumn,
        children: list[SparkColumn] | None = None,
    ) -> DataFrame:
        """The joined-row frame (``Plan.latest`` shape) from the driving row and each lookup's row.

        `rows[i]`/`present[i]`: lookup i's row struct and whether it matched; an inner lookup
        without a match deletes the view row, a left one gives NULLs. `children[j]`: the state rows
        of nested collection j's children (an array, in any order, or NULL for none)."""
        gone = deleted | driving_row.isNull()
        for lp in self.lookups:
            if lp.inner:
                gone = gone | ~present[lp.index]
        extra = [
            rows[lp.index][c].alias(o) for lp in self.lookups for c, o in zip(lp.columns, lp.out_names, strict=True)
        ]
        extra += [self.nested_list(np_, (children or [])[np_.index]).alias(np_.name) for np_ in self.nested]
        joined = F.struct(*[driving_row[f.name].alias(f.name) for f in self.driving.struct.fields], *extra)
        return df.select(*head, gone.alias("_kf_deleted"), F.when(~gone, joined).alias("_kf_row"))


__all__ = ["JSON_OPTIONS", "JoinPlan", "LookupPlan", "NestedPlan", "TopicState", "canonical", "comparable"]


def lookup_schemas(spec: Any, log: Any, have: dict[str, TableSchema]) -> dict[str, TableSchema]:
    """The joined tables' schemas (lookups, nested collections); a missing one is a ConfigError naming
    the lookup or collection."""
    from kappaflow.projections.schemas import load_table_schemas

    out: dict[str, TableSchema] = {}
    joined = [("lookups", j.name, j.topic) for j in spec.lookups] + [("nested", j.name, j.topic) for j in spec.nested]
    for attr, name, topic in joined:
        if topic in have or topic in out:
            continue
        try:
            out.update(load_table_schemas(log, [topic]))
        except ConfigError as exc:
            raise ConfigError(
                f"projection {spec.name!r}: {attr!r}[{name!r}].topic: source topic {topic!r} is missing "
                f"or was never captured ({exc})"
            ) from None
    return out
