"""PostgreSQL: ``io.debezium.connector.postgresql.Source`` and ``PgPosition``.

Fields after the common ones: ``schema, table, txId, lsn, xmin``. Debezium's ``lsn`` is the
change's own WAL position and ``sequence`` is ``["<last committed LSN>", "<this LSN>"]``;
``xmin`` is the slot's xmin when ``xmin.fetch.interval.ms`` is set, else null. A block without
an ``lsn`` (an incremental snapshot read) names no position.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kappaflow.errors import ValidationError
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import PgPosition, Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT"]

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
))
