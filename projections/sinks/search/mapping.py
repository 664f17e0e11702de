"""Search mappings derived from the view's Spark schema: strict, with per-field overrides (text vs
keyword, analyzers) from the sink options or ``view.options["search"]["fields"]``; ``"nested"`` maps a
list of rows (a nested collection) as a ``nested`` field, so a query matches within one element."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.base import (
    ViewSpec,
)

StringDefault = Literal["text+keyword", "keyword", "text"]


def _norm_type(t: Any) -> Any:
    """A Spark type as a small tree: 'long', ('decimal', p, s), ('array', T),
    ('struct', [(name, T), ...]), ('map', K, V)."""
    from pyspark.sql import types as st

    if isinstance(t, st.StructType):
        return ("struct", [(f.name, _norm_type(f.dataType)) for f in t.fields])
    if isinstance(t, st.ArrayType):
        return ("array", _norm_type(t.elementType))
    if isinstance(t, st.MapType):
        return ("map", _norm_type(t.keyType), _norm_type(t.valueType))
    if isinstance(t, st.DecimalType):
        return ("decimal", t.precision, t.scale)
    if isinstance(t, st.CharType | st.VarcharType | st.StringType):
        return "string"
    if isinstance(t, st.DayTimeIntervalType | st.YearMonthIntervalType):
        return "interval"
    if isinstance(t, st.TimestampNTZType | st.TimestampType):
        return "timestamp"
    if isinstance(t, st.NullType):
        return "void"
    if isinstance(t, st.DataType):
        return t.typeName()
    raise ConfigError(f"search mapping: expected a Spark DataType, got {t!r}")


def _string_mapping(default: str) -> dict[str, Any]:
    if default == "keyword":
        return {"type": "keyword"}
    if default == "text":
        return {"type": "text"}
    # What Elasticsearch's dynamic mapping gives a string: full text plus an exact sub-field.
    return {"type": "text", "fields": {"keyword": {"type": "keyword", "ignore_above": 256}}}


def _field_mapping(path: str, t: Any, overrides: Mapping[str, Any], string_default: str) -> dict[str, Any]:
    if path in overrides:
        o = overrides[path]
        if o == "nested":  # a list of rows, each searched as its own object (Projection.nested)
            inner = t[1] if isinstance(t, tuple) and t[0] == "array" else t
            if not (isinstance(inner, tuple) and inner[0] == "struct"):
                raise ConfigError(f"search field override {path!r}: 'nested' needs a list of rows (array of "
                                  f"struct), the field has type {t!r}")
            sub = {k: v for k, v in overrides.items() if k != path}
            return {"type": "nested", **_field_mapping(path, inner, sub, string_default)}
        if isinstance(o, str):
            return _string_mapping(o) if o in ("text", "keyword", "text+keyword") else {"type": o}
        if not isinstance(o, Mapping):
            raise ConfigError(f"search field override {path!r}: expected 'text', 'keyword', 'text+keyword', a type "
                              f"name or a mapping dict, got {o!r}")
        return dict(o)
    if t == "string":
        return _string_mapping(string_default)
    if isinstance(t, str):
        if t not in _SCALAR_MAPPINGS:
            raise ConfigError(f"search mapping: field {path!r} has type {t!r} with no default mapping; give one "
                              f"in the field overrides (options 'fields')")
        return dict(_SCALAR_MAPPINGS[t])
    kind = t[0]
    if kind == "decimal":
        _, precision, scale = t
        if precision <= 18:
            return {"type": "scaled_float", "scaling_factor": 10 ** scale}
        return {"type": "double"}  # _source keeps the exact decimal string
    if kind == "array":
        return _field_mapping(path, t[1], overrides, string_default)  # fields are multi-valued
    if kind == "struct":
        return {"properties": {n: _field_mapping(f"{path}.{n}", ft, overrides, string_default) for n, ft in t[1]}}
    if kind == "map":
        return {"type": "object", "enabled": False}  # stored, not indexed: map keys are data, not fields
    raise ConfigError(f"search mapping: field {path!r} has unsupported type {t!r}")


def derive_mapping(view: ViewSpec, *, overrides: Mapping[str, Any] | None = None,
                   string_default: StringDefault = "text+keyword") -> dict[str, Any]:
    """The index mapping for a view, from its Spark schema.

    Strict (``dynamic: strict``): a document with a field the view does not declare is
    rejected (dead-lettered) instead of silently widening the mapping. String key columns
    are ``keyword`` (exact, sortable). ``overrides`` maps a field path (``"name"``,
    ``"address.city"``) to ``"text"``, ``"keyword"``, ``"text+keyword"``, ``"nested"`` (a list
    of rows as a ``nested`` field), a type name or a full mapping (``{"type": "text", "analyzer": "english"}``).
    """
    overrides = dict(overrides or {})
    names = set(view.column_names)
    unknown = [p for p in overrides if p.split(".")[0] not in names]
    if unknown:
        raise ConfigError(f"view {view.name!r}: search field overrides name unknown fields {unknown}; the view has "
                          f"{sorted(names)}")
    props: dict[str, Any] = {}
    for col in view.columns:
        t = _norm_type(col.type)
        if col.name in view.key:
            if col.name in overrides:
                o = overrides[col.name]
                kind = o if isinstance(o, str) else o.get("type")
                if kind in ("text", "text+keyword"):
                    raise ConfigError(f"view {view.name!r}: key column {col.name!r} cannot be mapped as text "
                                      f"(keys must be exact and sortable); use keyword")
            if t == "string" and col.name not in overrides:
                props[col.name] = {"type": "keyword"}
                continue
        props[col.name] = _field_mapping(col.name, t, overrides, string_default)
    return {"dynamic": "strict", "properties": props}


_SCALAR_MAPPINGS: dict[str, dict[str, Any]] = {
    "byte": {"type": "byte"}, "short": {"type": "short"}, "integer": {"type": "integer"},
    "long": {"type": "long"}, "float": {"type": "float"}, "double": {"type": "double"},
    "boolean": {"type": "boolean"}, "binary": {"type": "binary"},
    "date": {"type": "date", "format": "strict_date||epoch_millis"},
    "timestamp": {"type": "date", "format": "strict_date_optional_time||epoch_millis"},
    "interval": {"type": "long"},  # microseconds
    "void": {"type": "keyword"},
}
