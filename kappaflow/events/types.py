"""Column types: `FieldType` (each maps to one Kafka Connect type plus a Debezium semantic name) and the
decimal modes. The bottom of the events package: the model (`schema`), the value codecs (`values`)
and the Connect schemas (`connect`) all build on it, and it imports none of them."""

from __future__ import annotations

from enum import Enum

from kappaflow.errors import ValidationError

__all__ = ["DECIMAL_MODES", "FieldType", "check_decimal_mode"]

DECIMAL_MODES = ("string", "precise", "double")


class FieldType(str, Enum):
    """Column types; each maps to one Kafka Connect type plus a Debezium semantic name."""

    INT8 = "int8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BOOLEAN = "boolean"
    STRING = "string"
    BYTES = "bytes"
    DECIMAL = "decimal"  # fixed scale: numeric(p, s)
    VARIABLE_DECIMAL = "variable_decimal"  # numeric without a scale
    DATE = "date"
    TIME = "time"  # micros since midnight
    TIMESTAMP = "timestamp"  # naive, micros
    TIMESTAMPTZ = "timestamptz"  # zoned
    INTERVAL = "interval"  # micro duration
    UUID = "uuid"
    JSON = "json"
    ENUM = "enum"
    ARRAY = "array"
    YEAR = "year"
    BITS = "bits"
    SET = "set"  # MySQL SET
    STRUCT = "struct"  # Connect struct: geometry, point, sparse vectors ... (Python dict of field -> value)
    MAP = "map"  # Connect map: hstore (map mode), sparse vector entries (Python dict)


def check_decimal_mode(mode: str) -> None:
    """ValidationError unless ``mode`` is one of Debezium's ``decimal.handling.mode`` values."""
    if mode not in DECIMAL_MODES:
        raise ValidationError(f"decimal_mode: expected one of {list(DECIMAL_MODES)}, got {mode!r}")
