"""Kafka Connect schemas (JsonConverter ``schemas.enable=true``) for Debezium-shaped events.

Rendering follows JsonConverter.asJsonSchema's key order (type, fields/items,
optional, name, version, doc, parameters, default, field) and Debezium's
names: ``<topic>.Envelope`` / ``<topic>.Value`` / ``<topic>.Key``, the
connector's ``Source`` struct, ``event.block`` for the transaction, and the
``io.debezium.time.*`` / ``io.debezium.data.*`` / Connect ``Decimal`` logical
types. Parsing accepts what Debezium writes (including its millisecond and
nanosecond time types) so kappaflow can read Debezium topics.

A semantic name that is not kappaflow's default for the column's type is kept in
``Column.logical`` and written back: the time types in other units
(``io.debezium.time.Timestamp``, ``NanoTimestamp``, ``Time``, Connect's ``Date``/``Time``/
``Timestamp``), names on plain values (``io.debezium.data.Xml``, ``Ltree``,
``io.debezium.time.ZonedTime``, ``Interval``, ``IsoDate``/``IsoTime``/``IsoTimestamp``, a
custom converter's), arrays (``io.debezium.data.DoubleVector``/``FloatVector``), structs
(``io.debezium.data.geometry.Geometry``/``Geography``/``Point``, ``SparseDoubleVector``) and
maps (hstore with ``hstore.handling.mode=map``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kappaflow.errors import ValidationError
from kappaflow.events.schema import Column, TableSchema
from kappaflow.events.sources import layout_for_kind, layout_for_source
from kappaflow.events.types import FieldType, check_decimal_mode
from kappaflow.events.values import Wire, decode_default, encode_default

__all__ = [
    "connect_envelope_schema",
    "connect_field",
    "connect_key_schema",
    "connect_row_schema",
    "parse_value_schema",
    "render_key_schema",
    "render_value_schema",
    "source_schema",
    "table_from_connect",
]

DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
SNAPSHOT_ALLOWED = "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"

# FieldType -> (Connect type, Debezium/Connect logical name or None)
_LOGICAL: dict[FieldType, tuple[str, str | None]] = {
    FieldType.INT8: ("int8", None),
    FieldType.INT16: ("int16", None),
    FieldType.INT32: ("int32", None),
    FieldType.INT64: ("int64", None),
    FieldType.FLOAT32: ("float", None),
    FieldType.FLOAT64: ("double", None),
    FieldType.BOOLEAN: ("boolean", None),
    FieldType.STRING: ("string", None),
    FieldType.BYTES: ("bytes", None),
    FieldType.DATE: ("int32", "io.debezium.time.Date"),
    FieldType.TIME: ("int64", "io.debezium.time.MicroTime"),
    FieldType.TIMESTAMP: ("int64", "io.debezium.time.MicroTimestamp"),
    FieldType.TIMESTAMPTZ: ("string", "io.debezium.time.ZonedTimestamp"),
    FieldType.INTERVAL: ("int64", "io.debezium.time.MicroDuration"),
    FieldType.UUID: ("string", "io.debezium.data.Uuid"),
    FieldType.JSON: ("string", "io.debezium.data.Json"),
    FieldType.ENUM: ("string", "io.debezium.data.Enum"),
    FieldType.YEAR: ("int32", "io.debezium.time.Year"),
    FieldType.BITS: ("bytes", "io.debezium.data.Bits"),
    FieldType.SET: ("string", "io.debezium.data.EnumSet"),
}

# Logical name -> (expected Connect type, FieldType, time unit) for parsing.
_BY_NAME: dict[str, tuple[str, FieldType, str]] = {
    "io.debezium.time.Date": ("int32", FieldType.DATE, "us"),
    "org.apache.kafka.connect.data.Date": ("int32", FieldType.DATE, "us"),
    "io.debezium.time.Time": ("int32", FieldType.TIME, "ms"),
    "io.debezium.time.MicroTime": ("int64", FieldType.TIME, "us"),
    "io.debezium.time.NanoTime": ("int64", FieldType.TIME, "ns"),
    "org.apache.kafka.connect.data.Time": ("int32", FieldType.TIME, "ms"),
    "io.debezium.time.Timestamp": ("int64", FieldType.TIMESTAMP, "ms"),
    "io.debezium.time.MicroTimestamp": ("int64", FieldType.TIMESTAMP, "us"),
    "io.debezium.time.NanoTimestamp": ("int64", FieldType.TIMESTAMP, "ns"),
    "org.apache.kafka.connect.data.Timestamp": ("int64", FieldType.TIMESTAMP, "ms"),
    "io.debezium.time.ZonedTimestamp": ("string", FieldType.TIMESTAMPTZ, "us"),
    "io.debezium.time.MicroDuration": ("int64", FieldType.INTERVAL, "us"),
    "io.debezium.data.Uuid": ("string", FieldType.UUID, "us"),
    "io.debezium.data.Json": ("string", FieldType.JSON, "us"),
    "io.debezium.data.Enum": ("string", FieldType.ENUM, "us"),
    "io.debezium.data.EnumSet": ("string", FieldType.SET, "us"),
    "io.debezium.time.Year": ("int32", FieldType.YEAR, "us"),
    "io.debezium.data.Bits": ("bytes", FieldType.BITS, "us"),
}

# The ``doc`` Debezium gives some of its semantic types' schemas (io.debezium.data.geometry.*).
_DOCS = {"io.debezium.data.geometry.Geometry": "Geometry", "io.debezium.data.geometry.Geography": "Geography",
         "io.debezium.data.geometry.Point": "Geometry (POINT)"}

# Connect type of a column written with a non-default semantic name (``Column.logical``).
_CTYPE_BY_LOGICAL: dict[str, str] = {name: ctype for name, (ctype, _t, _u) in _BY_NAME.items()}

_PLAIN: dict[str, FieldType] = {
    "int8": FieldType.INT8,
    "int16": FieldType.INT16,
    "int32": FieldType.INT32,
    "int64": FieldType.INT64,
    "float": FieldType.FLOAT32,
    "double": FieldType.FLOAT64,
    "boolean": FieldType.BOOLEAN,
    "string": FieldType.STRING,
    "bytes": FieldType.BYTES,
}

_DBZ_DECIMAL_SOURCE_TYPES = {"NUMERIC", "DECIMAL", "MONEY"}


# -- rendering ------------------------------------------------------------------------------
def connect_field(col: Column, mode: str, *, field: bool = True, optional: bool | None = None) -> dict[str, Any]:
    """One column's Connect schema (with ``"field": name`` unless ``field=False``)."""
    t = col.type
    params: dict[str, str] = {}
    doc = None
    if t is FieldType.DECIMAL or t is FieldType.VARIABLE_DECIMAL:
        fixed = t is FieldType.DECIMAL
        if mode == "precise":
            ctype, name = ("bytes", DECIMAL) if fixed else ("struct", VARIABLE_SCALE_DECIMAL)
            if fixed:
                params["scale"] = str(col.scale)
                if col.precision is not None:
                    params["connect.decimal.precision"] = str(col.precision)
            else:
                doc = "Variable scaled decimal"
        else:
            ctype, name = ("double" if mode == "double" else "string"), None
            params["kf.type"] = t.value
            if col.scale is not None:
                params["kf.scale"] = str(col.scale)
            if col.precision is not None:
                params["kf.precision"] = str(col.precision)
    elif t is FieldType.ARRAY:
        ctype, name = "array", col.logical
    elif t is FieldType.STRUCT:
        ctype, name = "struct", col.logical
        doc = _DOCS.get(col.logical or "")
    elif t is FieldType.MAP:
        ctype, name = "map", col.logical
    elif col.logical is not None:
        ctype, name = _CTYPE_BY_LOGICAL.get(col.logical) or _LOGICAL[t][0], col.logical
    else:
        ctype, name = _LOGICAL[t]
        if t is FieldType.ENUM or t is FieldType.SET:
            if col.allowed is not None:
                params["allowed"] = ",".join(col.allowed)
        elif t is FieldType.BITS and col.length is not None:
            params["length"] = str(col.length)
    if col.native_type is not None:
        params["kf.native_type"] = col.native_type

    d: dict[str, Any] = {"type": ctype}
    if ctype == "array":
        assert col.items is not None
        d["items"] = connect_field(col.items, mode, field=False)
    elif t is FieldType.STRUCT:
        assert col.fields is not None
        d["fields"] = [connect_field(f, mode) for f in col.fields]
    elif t is FieldType.MAP:
        assert col.fields is not None
        d["keys"] = connect_field(col.fields[0], mode, field=False)
        d["values"] = connect_field(col.fields[1], mode, field=False)
    elif ctype == "struct":
        d["fields"] = [
            {"type": "int32", "optional": False, "field": "scale"},
            {"type": "bytes", "optional": False, "field": "value"},
        ]
    d["optional"] = col.optional if optional is None else optional
    if name is not None:
        d["name"] = name
        d["version"] = 1
    if doc is not None:
        d["doc"] = doc
    if params:
        d["parameters"] = params
    if col.default is not None:
        d["default"] = encode_default(col, col.default, mode, f"column {col.name!r}.default")
    if field:
        d["field"] = col.name
    return d


def connect_row_schema(table: TableSchema, mode: str, *, optional: bool, field: str | None = None) -> dict[str, Any]:
    """The ``<topic>.Value`` struct of a table's row."""
    d: dict[str, Any] = {
        "type": "struct",
        "fields": [connect_field(c, mode) for c in table.columns],
        "optional": optional,
        "name": f"{table.name}.Value",
    }
    if table.key:
        d["parameters"] = {"kf.key": orjson.dumps(list(table.key)).decode()}
    if field is not None:
        d["field"] = field
    return d


def connect_key_schema(table: TableSchema, mode: str) -> dict[str, Any]:
    return {
        "type": "struct",
        "fields": [connect_field(table.column(k), mode, optional=False) for k in table.key],
        "optional": False,
        "name": f"{table.name}.Key",
    }


def _f(ctype: str, name: str, optional: bool = False) -> dict[str, Any]:
    return {"type": ctype, "optional": optional, "field": name}


def source_schema(position_kind: str, source: Any = None) -> dict[str, Any]:
    """The ``source`` block's struct for a position kind, or for ``source`` (a ``SourceInfo``:
    its connector's layout) when given (``kappaflow.events.sources``)."""
    layout = layout_for_source(source) if source is not None else layout_for_kind(position_kind)
    return {"type": "struct", "fields": layout.connect_fields(source), "optional": False,
            "name": layout.schema_name, "version": 1, "field": "source"}


_TRANSACTION_FIELD = {
    "type": "struct",
    "fields": [_f("string", "id"), _f("int64", "total_order"), _f("int64", "data_collection_order")],
    "optional": True,
    "name": "event.block",
    "version": 1,
    "field": "transaction",
}

_UNAVAILABLE_FIELD = {
    "type": "array",
    "items": {"type": "string", "optional": False},
    "optional": True,
    "field": "kf_unavailable",
}

ENVELOPE_VERSION = 2  # Debezium 2.6+: transaction after source, then op, ts_ms, ts_us, ts_ns


def connect_envelope_schema(table: TableSchema, mode: str, position_kind: str, source: Any = None) -> dict[str, Any]:
    return {
        "type": "struct",
        "fields": [
            connect_row_schema(table, mode, optional=True, field="before"),
            connect_row_schema(table, mode, optional=True, field="after"),
            source_schema(position_kind, source),
            _TRANSACTION_FIELD,
            _f("string", "op"),
            _f("int64", "ts_ms", True),
            _f("int64", "ts_us", True),
            _f("int64", "ts_ns", True),
            _UNAVAILABLE_FIELD,
        ],
        "optional": False,
        "name": f"{table.name}.Envelope",
        "version": ENVELOPE_VERSION,
    }


# -- parsing ----------------------------------------------------------------------------------
def _param_int(params: Mapping[str, Any], key: str, path: str, required: bool) -> int | None:
    v = params.get(key)
    if v is None:
        if required:
            raise ValidationError(f"{path}.parameters.{key}: missing (required for this field type)")
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValidationError(f"{path}.parameters.{key}: expected an integer string, got {v!r}") from None


def column_from_connect(fs: Any, path: str, name: str | None = None) -> tuple[Column, Wire]:
    """One Connect field schema -> (Column, how its values are represented)."""
    if not isinstance(fs, Mapping):
        raise ValidationError(f"{path}: expected a field schema object, got {type(fs).__name__}")
    if name is None:
        name = fs.get("field")
        if not isinstance(name, str) or not name:
            raise ValidationError(f"{path}.field: expected the field's name, got {name!r}")
        path = f"{path}.{name}"
    ctype = fs.get("type")
    if not isinstance(ctype, str):
        raise ValidationError(f"{path}.type: expected a Connect type name, got {ctype!r}")
    lname = fs.get("name")
    params = fs.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise ValidationError(f"{path}.parameters: expected an object, got {type(params).__name__}")
    optional = fs.get("optional", False)
    if type(optional) is not bool:
        raise ValidationError(f"{path}.optional: expected true or false, got {optional!r}")
    native = params.get("kf.native_type")
    kf_type = params.get("kf.type")

    kw: dict[str, Any] = {}
    mode, unit, items_wire = "string", "us", None
    if lname == DECIMAL:
        _expect(ctype, "bytes", path, lname)
        ftype, mode = FieldType.DECIMAL, "precise"
        kw["scale"] = _param_int(params, "scale", path, True)
        kw["precision"] = _param_int(params, "connect.decimal.precision", path, False)
    elif lname == VARIABLE_SCALE_DECIMAL:
        _expect(ctype, "struct", path, lname)
        ftype, mode = FieldType.VARIABLE_DECIMAL, "precise"
    elif kf_type in ("decimal", "variable_decimal"):
        if ctype not in ("string", "double"):
            raise ValidationError(f"{path}.type: a kf.type={kf_type} field must be string or double, got {ctype!r}")
        ftype = FieldType(kf_type)
        mode = "double" if ctype == "double" else "string"
        kw["scale"] = _param_int(params, "kf.scale", path, ftype is FieldType.DECIMAL)
        kw["precision"] = _param_int(params, "kf.precision", path, False)
    elif (
        ctype in ("string", "double")
        and str(params.get("__debezium.source.column.type", "")).upper() in _DBZ_DECIMAL_SOURCE_TYPES
    ):
        # Debezium decimal.handling.mode=string/double with column.propagate.source.type
        mode = "double" if ctype == "double" else "string"
        scale = _param_int(params, "__debezium.source.column.scale", path, False)
        ftype = FieldType.DECIMAL if scale is not None else FieldType.VARIABLE_DECIMAL
        kw["scale"] = scale
        kw["precision"] = _param_int(params, "__debezium.source.column.length", path, False)
    elif isinstance(lname, str) and lname in _BY_NAME:
        want, ftype, unit = _BY_NAME[lname]
        if lname == "org.apache.kafka.connect.data.Time" and ctype == "int64":
            want = "int64"  # the PostgreSQL connector's documentation shows it as INT64
        _expect(ctype, want, path, lname)
        if _LOGICAL[ftype][1] != lname:
            kw["logical"] = lname
        if ftype is FieldType.ENUM or ftype is FieldType.SET:
            allowed = params.get("allowed")
            if allowed is not None:
                kw["allowed"] = tuple(str(allowed).split(",")) if allowed != "" else ()
        elif ftype is FieldType.BITS:
            kw["length"] = _param_int(params, "length", path, False)
    elif ctype == "array":
        items = fs.get("items")
        if items is None:
            raise ValidationError(f"{path}.items: an array schema needs its element schema")
        item_col, items_wire = column_from_connect(items, f"{path}[]", name="item")
        ftype = FieldType.ARRAY
        kw["items"] = item_col
        mode = items_wire.mode
        if isinstance(lname, str):
            kw["logical"] = lname  # io.debezium.data.DoubleVector / FloatVector
    elif ctype == "struct":
        # geometry/geography/point, sparse vectors, any other Connect struct: a dict of its fields
        sub = _struct_fields(fs, path)
        kw["fields"] = tuple(column_from_connect(x, path)[0] for x in sub)
        ftype = FieldType.STRUCT
        if isinstance(lname, str):
            kw["logical"] = lname
    elif ctype == "map":
        keys, values = fs.get("keys"), fs.get("values")
        if keys is None or values is None:
            raise ValidationError(f"{path}: a map schema needs its 'keys' and 'values' schemas")
        kw["fields"] = (column_from_connect(keys, f"{path}.keys", name="key")[0],
                        column_from_connect(values, f"{path}.values", name="value")[0])
        ftype = FieldType.MAP
        if isinstance(lname, str):
            kw["logical"] = lname
    elif ctype in _PLAIN:
        ftype = _PLAIN[ctype]
        if isinstance(lname, str):
            # a semantic name kappaflow has no other type for (Xml, Ltree, ZonedTime, Interval,
            # Iso*, a custom converter's): the plain value, the name kept for writing it back
            kw["logical"] = lname
    else:
        raise ValidationError(
            f"{path}.type: unsupported Connect type {ctype!r}"
            + (f" (logical type {lname!r})" if lname else "")
        )
    col = Column(name, ftype, optional=optional, native_type=native, **kw)
    wire = Wire(mode, unit, items_wire)
    if fs.get("default") is not None:
        object.__setattr__(col, "default", decode_default(col, fs["default"], f"{path}.default", wire))
    return col, wire


def _expect(ctype: str, want: str, path: str, lname: str) -> None:
    if ctype != want:
        raise ValidationError(f"{path}.type: logical type {lname} must be {want!r}, got {ctype!r}")


def _struct_fields(s: Mapping[str, Any], path: str) -> list[Any]:
    fields = s.get("fields")
    if not isinstance(fields, list):
        raise ValidationError(f"{path}.fields: expected a list of field schemas, got {type(fields).__name__}")
    return fields


def table_from_connect(schema: Any, key: Sequence[str] | None = None) -> tuple[TableSchema, dict[str, Wire]]:
    """A Debezium Envelope (or Value) struct schema -> (TableSchema, wire per column)."""
    path = "schema"
    if not isinstance(schema, Mapping):
        raise ValidationError(f"{path}: expected a Connect schema object, got {type(schema).__name__}")
    if schema.get("type") != "struct":
        raise ValidationError(f"{path}.type: expected 'struct', got {schema.get('type')!r}")
    sname = schema.get("name")
    fields = _struct_fields(schema, path)
    by_field = {f.get("field"): f for f in fields if isinstance(f, Mapping)}
    row: Any = schema
    topic: str | None = None
    if "after" in by_field or "before" in by_field or (isinstance(sname, str) and sname.endswith(".Envelope")):
        row = by_field.get("after") or by_field.get("before")
        path = "schema.after" if "after" in by_field else "schema.before"
        if not isinstance(row, Mapping) or row.get("type") != "struct":
            raise ValidationError(f"{path}: expected the row's struct schema, got {row!r:.80}")
        if isinstance(sname, str) and sname.endswith(".Envelope"):
            topic = sname[: -len(".Envelope")]
    rname = row.get("name")
    if topic is None and isinstance(rname, str):
        for suffix in (".Value", ".Key"):
            if rname.endswith(suffix):
                topic = rname[: -len(suffix)]
                break
        else:
            topic = rname
    if not topic:
        raise ValidationError(f"schema.name: expected '<topic>.Envelope' or '<topic>.Value', got {sname!r}")
    columns: list[Column] = []
    wires: dict[str, Wire] = {}
    for i, f in enumerate(_struct_fields(row, path)):
        col, wire = column_from_connect(f, f"{path}.fields[{i}]" if not isinstance(f, Mapping) else path)
        columns.append(col)
        wires[col.name] = wire
    if key is None:
        params = row.get("parameters") or {}
        raw = params.get("kf.key") if isinstance(params, Mapping) else None
        if raw is not None:
            try:
                key = orjson.loads(raw)
            except orjson.JSONDecodeError:
                key = None
            if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
                raise ValidationError(f"{path}.parameters.kf.key: expected a JSON list of column names, got {raw!r}")
    return TableSchema(topic, tuple(columns), tuple(key or ())), wires


def render_value_schema(table: TableSchema, envelope: bool = True, *, decimal_mode: str = "precise",
                        position_kind: str = "pg") -> dict[str, Any]:
    """The Debezium value schema of ``table`` as JsonConverter writes it (a fresh copy; cached per table).

    ``envelope=True``: the ``<name>.Envelope`` struct (before/after/source/op/ts_ms/
    transaction); the source block's layout follows ``position_kind`` ("pg": the
    PostgreSQL connector's, "binlog": MySQL's, "ledger": kappaflow's ledger).
    ``envelope=False``: only the ``<name>.Value`` row struct.
    ``decimal_mode`` is Debezium's ``decimal.handling.mode`` (default "precise").
    """
    check_decimal_mode(decimal_mode)
    key = ("connect", envelope, decimal_mode, position_kind)
    cached = table._cache.get(key)
    if cached is None:
        if envelope:
            cached = connect_envelope_schema(table, decimal_mode, position_kind)
        else:
            cached = connect_row_schema(table, decimal_mode, optional=False)
        table._cache[key] = cached
    return _deep_copy(cached)


def render_key_schema(table: TableSchema, *, decimal_mode: str = "precise") -> dict[str, Any]:
    """The Debezium key schema of ``table``: the ``<name>.Key`` struct of its key columns."""
    check_decimal_mode(decimal_mode)
    if not table.key:
        raise ValidationError(f"table {table.name!r} has no key columns: its events have a null key")
    return connect_key_schema(table, decimal_mode)


def parse_value_schema(schema: Mapping[str, Any], key: Sequence[str] | None = None) -> TableSchema:
    """Read a Debezium value schema (Envelope or Value struct) back into a TableSchema.

    The key comes from ``key`` or, for kappaflow-written schemas, the ``kf.key``
    parameter; Debezium-written schemas carry none (the key is in the key schema).
    """
    table, _wires = table_from_connect(schema, key)
    return table


def _deep_copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deep_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_copy(v) for v in obj]
    return obj
