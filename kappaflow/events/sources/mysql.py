"""MySQL and MariaDB: ``io.debezium.connector.mysql.Source`` and ``BinlogPosition``.

Fields after the common ones: ``table, server_id, gtid, file, pos, row, thread, query``.
``thread`` is the id of the session that wrote the transaction (from its ``BEGIN`` query
event) and ``query`` the statement when the binlog carries it (MySQL
``binlog_rows_query_log_events`` / MariaDB ``binlog_annotate_row_events``); both null
otherwise, as in Debezium. kappaflow adds ``txId`` (the GTID; Debezium has the transaction id
only in the envelope's ``transaction`` block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kappaflow.errors import ValidationError
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import BinlogPosition, Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT"]

f = connect_field
_EMPTY: Mapping[str, Any] = {}


def _build(s: SourceInfo) -> dict[str, Any]:
    p = s.position if isinstance(s.position, BinlogPosition) else None  # None: placed by ordering, no binlog
    extra = s.extra or _EMPTY

    def get(key: str, default: Any) -> Any:
        return extra.get(key, default)

    return {
        "table": s.table,
        "server_id": get("server_id", p.server_id if p is not None and p.server_id is not None else 0),
        "gtid": get("gtid", p.gtid if p is not None else None),
        "file": get("file", p.file if p is not None else None),
        "pos": get("pos", p.pos if p is not None else None),
        "row": get("row", p.row if p is not None else None),
        "thread": extra.get("thread"),
        "query": extra.get("query"),
        "txId": s.tx_id,
    }


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    file = block.get("file")
    if file is None or file == "":
        return None
    pos, row = block.get("pos"), block.get("row", 0)
    if row is None:
        row = 0
    if type(pos) is not int or type(row) is not int:
        raise ValidationError(f"source.pos/row: expected integers, got {pos!r}, {row!r}")
    server_id = block.get("server_id")
    gtid = block.get("gtid")
    try:
        return BinlogPosition(file, pos, row, gtid if isinstance(gtid, str) else None,
                              server_id if type(server_id) is int else None, in_snapshot)
    except ValidationError as e:
        raise ValidationError(f"source.file: {e}") from None


LAYOUT = register(SourceLayout(
    connectors=("mysql", "mariadb"),
    kind="binlog",
    position_type=BinlogPosition,
    schema_name="io.debezium.connector.mysql.Source",
    fields=(f("string", "table", True), f("int64", "server_id"), f("string", "gtid", True), f("string", "file"),
            f("int64", "pos"), f("int32", "row"), f("int64", "thread", True), f("string", "query", True),
            f("string", "txId", True)),
    build=_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("string", "file"), f("int64", "pos"), f("int64", "row"),
                   f("string", "gtid", True), f("int64", "server_id", True), f("boolean", "snapshot")),
    extra_keys=("pos", "row", "thread", "query", "file", "gtid", "server_id"),
))
