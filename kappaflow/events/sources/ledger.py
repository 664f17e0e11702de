"""kappaflow's ledger: ``io.kappaflow.connector.ledger.Source`` and ``LedgerPosition``.

Fields after the common ones: ``schema, table, txId`` (the ledger's own connector; Debezium
has no equivalent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kappaflow.events.model import SourceInfo
from kappaflow.events.position import LedgerPosition, Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT"]

f = connect_field


def _build(s: SourceInfo) -> dict[str, Any]:
    return {"schema": s.schema, "table": s.table, "txId": s.tx_id}


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    return None


LAYOUT = register(SourceLayout(
    connectors=("ledger",),
    kind="ledger",
    position_type=LedgerPosition,
    schema_name="io.kappaflow.connector.ledger.Source",
    fields=(f("string", "schema", True), f("string", "table"), f("string", "txId", True)),
    build=_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("int64", "position")),
))
