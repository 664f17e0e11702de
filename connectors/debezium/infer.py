"""Table schemas for Debezium records written without one (``value.converter.schemas.enable=false``).

A schemaless record has only JSON values, so the table's schema is inferred from the records
seen so far and widened as they show more:

- a column seen only as NULL so far is kept as a nullable column of unknown type (``STRING``,
  ``native_type="json null"``): later records with NULL there are fine, and the first non-NULL
  value gives it its type;
- a column that appears in a later record is added;
- an integer column that later holds a fraction becomes a float column (a JSON number);
- ``{"scale": s, "value": base64}`` is a VariableScaleDecimal, other objects and arrays are JSON.

Each widening is a new schema version (an ``ALTER`` on ``<source>.__schema``); what was
written before stays valid under it (NULL is valid in any type, an integer is a valid
float). Two kinds of value in one column that neither contains (a string after a number)
cannot be written under one schema: that record is refused with both types named, as the
only way to keep what was accepted readable.
"""

from __future__ import annotations

from binascii import a2b_base64
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kappaflow.errors import ValidationError
from kappaflow.events import Column, FieldType, TableSchema

__all__ = ["InferredSchemas", "decode_schemaless_row"]

UNKNOWN = "json null"
_NATIVE = {FieldType.BOOLEAN: "json boolean", FieldType.INT64: "json integer", FieldType.FLOAT64: "json number",
           FieldType.STRING: "json string", FieldType.VARIABLE_DECIMAL: "json {scale, value}",
           FieldType.JSON: "json document"}


def _type_of(v: Any) -> FieldType:
    t = type(v)
    if t is bool:
        return FieldType.BOOLEAN
    if t is int:
        return FieldType.INT64
    if t is float:
        return FieldType.FLOAT64
    if t is str:
        return FieldType.STRING
    if t is Decimal:
        return FieldType.VARIABLE_DECIMAL
    return FieldType.JSON


def _column(name: str, t: FieldType) -> Column:
    return Column(name, t, native_type=_NATIVE[t])


def decode_schemaless_row(row: dict[str, Any], part: str) -> dict[str, Any]:
    """Schemaless values: ``{"scale": s, "value": base64}`` is a VariableScaleDecimal; other objects stay JSON."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if type(v) is dict and len(v) == 2 and "scale" in v and "value" in v:
            if type(v["scale"]) is not int or type(v["value"]) is not str:
                raise ValidationError(f"{part}.{k}: expected a variable-scale decimal {{scale: int, value: base64}}")
            out[k] = Decimal(int.from_bytes(a2b_base64(v["value"]), "big", signed=True)).scaleb(-v["scale"])
        elif type(v) is dict and "value" in v and "scale" not in v and len(v) <= 2:
            raise ValidationError(f"{part}.{k}: a decimal without its scale (expected {{scale, value}})")
        else:
            out[k] = v
    return out


class InferredSchemas:
    """The inferred schema of every schemaless topic, widened record by record."""

    def __init__(self) -> None:
        self.schemas: dict[str, TableSchema] = {}

    def restore(self, schema: TableSchema) -> None:
        """A schema read back from ``<source>.__schema`` after a restart."""
        self.schemas[schema.name] = schema

    def observe(self, topic: str, rows: list[dict[str, Any]], key: Mapping[str, Any] | None = None) -> TableSchema:
        """The topic's schema after seeing ``rows`` (and the record key's columns)."""
        known = self.schemas.get(topic)
        cols: dict[str, Column] = {c.name: c for c in known.columns} if known is not None else {}
        changed = known is None
        for row in rows:
            for name, v in row.items():
                col = cols.get(name)
                if v is None:
                    if col is None:
                        cols[name] = Column(name, FieldType.STRING, native_type=UNKNOWN)
                        changed = True
                    continue
                t = _type_of(v)
                if col is None or col.native_type == UNKNOWN:
                    cols[name] = _column(name, t)
                    changed = True
                elif col.type is not t:
                    if col.type is FieldType.INT64 and t is FieldType.FLOAT64:
                        cols[name] = _column(name, FieldType.FLOAT64)
                        changed = True
                    elif not (col.type is FieldType.FLOAT64 and t is FieldType.INT64):
                        raise ValidationError(
                            f"{name}: the schemaless topic's records so far hold {col.native_type} values here, "
                            f"this one holds a {_NATIVE[t]} ({v!r:.60}); one column needs one kind of value "
                            "(or enable schemas in the Debezium connector's JSON converter)")
        keycols = tuple(key) if key else (known.key if known is not None else ())
        for k in keycols:
            if k not in cols:
                v = key.get(k) if key else None
                cols[k] = _column(k, _type_of(v)) if v is not None else Column(k, FieldType.STRING,
                                                                              native_type=UNKNOWN)
                changed = True
        if known is not None and keycols != known.key:
            changed = True
        if changed:
            self.schemas[topic] = TableSchema(topic, tuple(cols.values()), keycols)
        return self.schemas[topic]
