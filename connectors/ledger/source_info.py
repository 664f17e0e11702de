"""The ledger's source info: ``LedgerPosition``, the ``io.kappaflow.connector.ledger.Source`` block, its
Connect schema and its Spark ordering (registered with ``kappaflow.events.sources``).

Fields after the common ones: ``schema, table, txId`` (the ledger's own connector; Debezium
has no equivalent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import Position, int_field
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "LedgerPosition"]

@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class LedgerPosition(Position):
    """The ledger's global position (gap-free, assigned at append)."""

    position: int
    kind: ClassVar[str] = "ledger"

    def sort_key(self) -> tuple[int]:
        return (self.position,)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ledger", "position": self.position}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> LedgerPosition:
        return cls(int_field(d, "ledger", "position"))

    def __str__(self) -> str:
        return str(self.position)

    def successor(self) -> LedgerPosition:
        return LedgerPosition(self.position + 1)


f = connect_field


def _build(s: SourceInfo) -> dict[str, Any]:
    return {"schema": s.schema, "table": s.table, "txId": s.tx_id}


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    return None


def _spark_order(pos: Any) -> tuple[Any, ...]:
    """The Spark ordering of a ``kf_pos`` struct column like ``LedgerPosition.sort_key``: (position, ...)."""
    from pyspark.sql import functions as F

    return (pos["position"], F.lit(""), F.lit(0).cast("bigint"), F.lit(1), F.lit(0).cast("bigint"))


LAYOUT = register(SourceLayout(
    connectors=("ledger",),
    kind="ledger",
    position_type=LedgerPosition,
    schema_name="io.kappaflow.connector.ledger.Source",
    fields=(f("string", "schema", True), f("string", "table"), f("string", "txId", True)),
    build=_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("int64", "position")),
    spark_fields=("position",),
    spark_order=_spark_order,
))
