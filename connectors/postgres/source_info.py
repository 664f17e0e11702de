"""PostgreSQL source info: ``PgPosition``, the ``io.debezium.connector.postgresql.Source`` block, its
Connect schema and its Spark ordering (registered with ``kappaflow.events.sources``).

Fields after the common ones: ``schema, table, txId, lsn, xmin``. Debezium's ``lsn`` is the
change's own WAL position and ``sequence`` is ``["<last committed LSN>", "<this LSN>"]``;
``xmin`` is the slot's xmin when ``xmin.fetch.interval.ms`` is set, else null. A block without
an ``lsn`` (an incremental snapshot read) names no position.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import Position, bool_field, int_field
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "PgPosition", "lsn_from_str", "lsn_to_str"]

_MAX_LSN = (1 << 64) - 1
_LSN_RE = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


def lsn_to_str(lsn: int) -> str:
    """PostgreSQL's text form of an LSN: high and low 32 bits in hex, e.g. ``0/16B3748``."""
    if not isinstance(lsn, int) or isinstance(lsn, bool) or not 0 <= lsn <= _MAX_LSN:
        raise ValidationError(f"lsn: expected an integer in 0..2^64-1, got {lsn!r}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_from_str(text: str) -> int:
    """Parse PostgreSQL's ``X/Y`` LSN text (as shown by ``pg_current_wal_lsn()``)."""
    m = _LSN_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValidationError(f"lsn: expected PostgreSQL LSN text like '0/16B3748', got {text!r}")
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class PgPosition(Position):
    """PostgreSQL: commit LSN of the transaction and the change's 0-based index in it.

    Snapshot rows carry the slot's consistent-point LSN with ``snapshot=True`` and a
    running row number as index; they order before every streaming position whose
    commit LSN is >= that consistent point (those changes were not in the snapshot).
    """

    lsn: int
    index: int = 0
    snapshot: bool = False
    kind: ClassVar[str] = "pg"

    def sort_key(self) -> tuple[int, int, int]:
        return (self.lsn, 0 if self.snapshot else 1, self.index)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "pg", "lsn": self.lsn, "index": self.index, "snapshot": self.snapshot}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> PgPosition:
        return cls(int_field(d, "pg", "lsn"), int_field(d, "pg", "index"), bool_field(d, "pg", "snapshot"))

    def successor(self) -> PgPosition:
        return PgPosition(self.lsn, self.index + 1, self.snapshot)

    def __str__(self) -> str:
        if self.snapshot:
            return f"{lsn_to_str(self.lsn)}:snapshot:{self.index}"
        return f"{lsn_to_str(self.lsn)}:{self.index}"


f = connect_field
_EMPTY: Mapping[str, Any] = {}


def _build(s: SourceInfo) -> dict[str, Any]:
    extra = s.extra or _EMPTY
    p = s.position
    return {
        "schema": s.schema,
        "table": s.table,
        "txId": s.tx_id,
        "lsn": extra["lsn"] if "lsn" in extra else getattr(p, "lsn", None),
        "xmin": extra.get("xmin"),
    }


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    lsn = block.get("lsn")
    if lsn is None:
        return None
    if type(lsn) is str and lsn.isdigit():
        lsn = int(lsn)
    if type(lsn) is not int or lsn < 0:
        raise ValidationError(f"source.lsn: expected a non-negative integer, got {lsn!r}")
    return PgPosition(lsn, 0, in_snapshot)


def _spark_order(pos: Any) -> tuple[Any, ...]:
    """The Spark ordering of a ``kf_pos`` struct column like ``PgPosition.sort_key`` (see
    ``kappaflow.projections.schemas.pos_order``): (lsn, "", 0, snapshot first, index)."""
    from pyspark.sql import functions as F

    return (pos["lsn"], F.lit(""), F.lit(0).cast("bigint"), F.when(pos["snapshot"], F.lit(0)).otherwise(F.lit(1)),
            pos["index"])


def _parse_position(d: dict[str, Any]) -> Position | None:
    """``kf_pos`` -> PgPosition on the decoder's hot path (None: anything odd, for the full checks)."""
    lsn, index, snap = d.get("lsn"), d.get("index"), d.get("snapshot")
    if type(lsn) is int and type(index) is int and type(snap) is bool and lsn >= 0 and index >= 0:
        return PgPosition(lsn, index, snap)
    return None


LAYOUT = register(SourceLayout(
    connectors=("postgresql",),
    kind="pg",
    position_type=PgPosition,
    schema_name="io.debezium.connector.postgresql.Source",
    fields=(f("string", "schema"), f("string", "table"), f("int64", "txId", True), f("int64", "lsn", True),
            f("int64", "xmin", True)),
    build=_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("int64", "lsn"), f("int64", "index"), f("boolean", "snapshot")),
    extra_keys=("lsn", "xmin"),
    spark_fields=("lsn", "index", "snapshot"),
    spark_order=_spark_order,
    parse_position=_parse_position,
))
