"""Table schemas with Kafka Connect / Debezium-compatible field types.

A ``TableSchema`` describes one captured table: its columns (typed with
``FieldType``, from ``types``) and its key. ``kappaflow.events.connect`` renders the
Debezium value and key schemas exactly as Debezium's JsonConverter writes them
(``render_value_schema`` / ``render_key_schema``) and reads them back
(``parse_value_schema``), so kappaflow can consume topics written by Debezium and
Debezium consumers can read kappaflow's. The model imports no codec but the column
defaults' (``values``): ``types`` <- ``values`` <- ``schema`` <- ``connect``.

Debezium's schema carries no primary key and renders some types ambiguously
(a decimal in ``string`` mode is a plain string); kappaflow adds schema
``parameters`` prefixed ``kf.`` for those, which Connect ignores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from kappaflow.errors import ValidationError
from kappaflow.events.types import DECIMAL_MODES, FieldType
from kappaflow.events.values import decode_default, encode_default

__all__ = [
    "DECIMAL_MODES",
    "Column",
    "FieldType",
    "TableSchema",
]


@dataclass(frozen=True, slots=True)
class Column:
    """One column. ``default`` is a Python value of the column's type (or None).

    ``logical``: the Connect/Debezium semantic name the column's values are written with when it
    differs from kappaflow's default for the type -- a column read from Debezium keeps what
    Debezium wrote (``io.debezium.time.Timestamp`` stays milliseconds, ``io.debezium.data.Xml``
    stays an Xml string), so writing it back gives the same record. ``fields``: a STRUCT's
    fields; a MAP's (key column, value column).
    """

    name: str
    type: FieldType
    optional: bool = True
    scale: int | None = None
    precision: int | None = None
    items: Column | None = None
    allowed: tuple[str, ...] | None = None
    length: int | None = None
    default: Any = None
    native_type: str | None = None
    logical: str | None = None
    fields: tuple[Column, ...] | None = None

    def __post_init__(self) -> None:
        where = f"column {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError(f"column name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.type, FieldType):
            try:
                object.__setattr__(self, "type", FieldType(self.type))
            except ValueError:
                raise ValidationError(
                    f"{where}.type: expected one of {[t.value for t in FieldType]}, got {self.type!r}"
                ) from None
        if type(self.optional) is not bool:
            raise ValidationError(f"{where}.optional: expected true or false, got {self.optional!r}")
        for attr in ("scale", "precision", "length"):
            v = getattr(self, attr)
            if v is not None and (type(v) is not int or (attr != "scale" and v < 0)):
                raise ValidationError(f"{where}.{attr}: expected an integer, got {v!r}")
        if self.type is FieldType.DECIMAL and self.scale is None:
            raise ValidationError(f"{where}.scale: a DECIMAL column needs a scale (use VARIABLE_DECIMAL)")
        if self.type is FieldType.ARRAY:
            if not isinstance(self.items, Column):
                raise ValidationError(f"{where}.items: an ARRAY column needs an element Column, got {self.items!r}")
        elif self.items is not None:
            raise ValidationError(f"{where}.items: only ARRAY columns have items")
        if self.fields is not None:
            if not isinstance(self.fields, tuple):
                object.__setattr__(self, "fields", tuple(self.fields))
            assert self.fields is not None
            if not all(isinstance(f, Column) for f in self.fields):
                raise ValidationError(f"{where}.fields: expected Column objects, got {self.fields!r}")
        if self.type is FieldType.STRUCT and not self.fields:
            raise ValidationError(f"{where}.fields: a STRUCT column needs its field Columns")
        if self.type is FieldType.MAP and (self.fields is None or len(self.fields) != 2):
            raise ValidationError(f"{where}.fields: a MAP column needs (key Column, value Column)")
        if self.fields is not None and self.type not in (FieldType.STRUCT, FieldType.MAP):
            raise ValidationError(f"{where}.fields: only STRUCT and MAP columns have fields")
        if self.logical is not None and not isinstance(self.logical, str):
            raise ValidationError(f"{where}.logical: expected a Connect schema name, got {self.logical!r}")
        if self.allowed is not None:
            if isinstance(self.allowed, str) or not all(isinstance(a, str) for a in self.allowed):
                raise ValidationError(f"{where}.allowed: expected a sequence of strings, got {self.allowed!r}")
            if not isinstance(self.allowed, tuple):
                object.__setattr__(self, "allowed", tuple(self.allowed))
        if self.native_type is not None and not isinstance(self.native_type, str):
            raise ValidationError(f"{where}.native_type: expected a string, got {self.native_type!r}")
        if self.default is not None:  # a default must be a value of the column (fail early, not at encode)
            encode_default(self, self.default, "string", f"{where}.default")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "type": self.type.value, "optional": self.optional}
        if self.scale is not None:
            d["scale"] = self.scale
        if self.precision is not None:
            d["precision"] = self.precision
        if self.items is not None:
            d["items"] = self.items.to_dict()
        if self.allowed is not None:
            d["allowed"] = list(self.allowed)
        if self.length is not None:
            d["length"] = self.length
        if self.default is not None:
            d["default"] = encode_default(self, self.default, "string", f"column {self.name!r}.default")
        if self.native_type is not None:
            d["native_type"] = self.native_type
        if self.logical is not None:
            d["logical"] = self.logical
        if self.fields is not None:
            d["fields"] = [f.to_dict() for f in self.fields]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str = "column") -> Column:
        if not isinstance(d, Mapping):
            raise ValidationError(f"{path}: expected an object, got {type(d).__name__}")
        known = {"name", "type", "optional", "scale", "precision", "items", "allowed", "length", "default",
                 "native_type", "logical", "fields"}
        extra = set(d) - known
        if extra:
            raise ValidationError(f"{path}: unknown keys {sorted(extra)}")
        name = d.get("name")
        if not isinstance(name, str):
            raise ValidationError(f"{path}.name: expected a string, got {name!r}")
        items = d.get("items")
        allowed = d.get("allowed")
        fields = d.get("fields")
        if fields is not None and not isinstance(fields, list):
            raise ValidationError(f"{path}.fields: expected a list of columns, got {type(fields).__name__}")
        col = cls(
            name=name,
            type=d.get("type"),  # type: ignore[arg-type]
            optional=d.get("optional", True),
            scale=d.get("scale"),
            precision=d.get("precision"),
            items=None if items is None else cls.from_dict(items, f"{path}.items"),
            allowed=None if allowed is None else tuple(allowed),
            length=d.get("length"),
            native_type=d.get("native_type"),
            logical=d.get("logical"),
            fields=None if fields is None else tuple(
                cls.from_dict(f, f"{path}.fields[{i}]") for i, f in enumerate(fields)),
        )
        if d.get("default") is not None:
            default = decode_default(col, d["default"], f"{path}.default")
            object.__setattr__(col, "default", default)
        return col


@dataclass(frozen=True, slots=True)
class TableSchema:
    """One table: ``name`` is the topic name (``<source>.<schema>.<table>`` or
    ``<source>.<db>.<table>``), ``key`` the primary-key column names in key order."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()
    # Per-schema caches (codec plans, fingerprint); not part of the value.
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError(f"table schema name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.columns, tuple):
            object.__setattr__(self, "columns", tuple(self.columns))
        if isinstance(self.key, str):
            raise ValidationError(f"table {self.name!r} key: expected a sequence of column names, got a string")
        if not isinstance(self.key, tuple):
            object.__setattr__(self, "key", tuple(self.key))
        seen: set[str] = set()
        for c in self.columns:
            if not isinstance(c, Column):
                raise ValidationError(f"table {self.name!r} columns: expected Column objects, got {c!r}")
            if c.name in seen:
                raise ValidationError(f"table {self.name!r} columns: duplicate column {c.name!r}")
            seen.add(c.name)
        for k in self.key:
            if k not in seen:
                raise ValidationError(f"table {self.name!r} key: column {k!r} is not a column of the table")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle (Spark ships schemas to executors) without the per-process caches,
        # which hold generated functions and orjson fragments.
        return (TableSchema, (self.name, self.columns, self.key))

    # -- lookup --------------------------------------------------------------------
    def column(self, name: str) -> Column:
        by_name = self._cache.get("by_name")
        if by_name is None:
            by_name = self._cache["by_name"] = {c.name: c for c in self.columns}
        try:
            return by_name[name]
        except KeyError:
            raise KeyError(f"table {self.name!r} has no column {name!r}") from None

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def key_schema(self) -> TableSchema:
        """The key's own schema: the key columns (never optional), in key order."""
        cols = []
        for k in self.key:
            c = self.column(k)
            cols.append(c if not c.optional else _replace(c, optional=False))
        return TableSchema(self.name, tuple(cols), self.key)

    # -- Kafka Connect schemas -----------------------------------------------------
    # -- identity and storage ------------------------------------------------------
    def fingerprint(self) -> str:
        """Stable hash of the schema's content (hex sha256); equal schemas, equal prints."""
        fp = self._cache.get("fingerprint")
        if fp is None:
            fp = hashlib.sha256(orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)).hexdigest()
            self._cache["fingerprint"] = fp
        return fp

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "columns": [c.to_dict() for c in self.columns],
            "key": list(self.key),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TableSchema:
        if not isinstance(d, Mapping):
            raise ValidationError(f"table schema: expected an object, got {type(d).__name__}")
        name = d.get("name")
        cols = d.get("columns")
        key = d.get("key", [])
        if not isinstance(name, str):
            raise ValidationError(f"table schema.name: expected a string, got {name!r}")
        if not isinstance(cols, list):
            raise ValidationError(f"table schema {name!r}.columns: expected a list, got {type(cols).__name__}")
        if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
            raise ValidationError(f"table schema {name!r}.key: expected a list of column names, got {key!r}")
        columns = tuple(Column.from_dict(c, f"table schema {name!r}.columns[{i}]") for i, c in enumerate(cols))
        return cls(name, columns, tuple(key))


def _replace(c: Column, **changes: Any) -> Column:
    from dataclasses import replace

    return replace(c, **changes)
