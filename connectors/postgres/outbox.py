"""The outbox router (``connectors/outbox.py``) on the PostgreSQL connector: a record mapper.

Why a mapper: ``mapping.py`` already lets a captured table's inserted rows become records of
someone else's choosing, with the snapshot, the stream, the offsets and the duplicate check
left to the connector. An outbox table is such a table, with two differences the mapper hooks
carry: its order is the source position itself (``(lsn, phase, index)`` packed into one
integer, the same order as ``PgPosition.sort_key``), and its DELETEs (and TRUNCATEs) are
skipped instead of refused, its UPDATEs handled by ``table_op_invalid_behavior``.

``pg_logical_emit_message`` messages with the configured prefix go through the same router
(:meth:`PgOutboxMapper.map_message`): the capture registers the mapper under the key
``message:<prefix>`` of ``PgCapture.mappers`` and the streaming source hands it the messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from kappaflow.connectors.outbox import MESSAGE_KEY, OutboxRouter, Routed, router_for
from kappaflow.connectors.postgres.mapping import MappedRecord, RecordMapper
from kappaflow.connectors.postgres.slots import split_table_name
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import Retry, SourceError
from kappaflow.log.base import CleanupPolicy, LogRecord

if TYPE_CHECKING:
    from kappaflow.connectors.postgres.slots import TableInfo

__all__ = ["PgOutboxMapper", "outbox_mappers", "position_order"]


def position_order(lsn: int, snapshot: bool, index: int) -> int:
    """``PgPosition.sort_key`` as one integer: the mapper order of an outbox record."""
    return (lsn << 33) | ((0 if snapshot else 1) << 32) | index


class PgOutboxMapper(RecordMapper):
    """Maps one outbox table's inserted rows (``table``) or the logical messages (``table=None``)."""

    cleanup_policy = CleanupPolicy.DELETE

    def __init__(self, router: OutboxRouter, table: str | None) -> None:
        self.router = router
        self.table = table
        self.bytea: frozenset[str] = frozenset()

    def bind_table(self, info: TableInfo) -> None:
        self.router.check_columns(info.qualified, [c.name for c in info.columns])
        self.bytea = frozenset(c.name for c in info.columns if c.type_name == "bytea")

    def _decode(self, column: str, v: Any) -> bytes | None:
        if v is None:
            return None
        if column in self.bytea and isinstance(v, bytes) and v.startswith(b"\\x"):
            return bytes.fromhex(v[2:].decode())  # bytea's hex text output
        return v if isinstance(v, bytes) else str(v).encode()

    def _mapped(self, routed: Routed, position: PgPosition) -> MappedRecord:
        return MappedRecord(routed.topic, routed.record,
                            position_order(position.lsn, position.snapshot, position.index))

    def map_insert(self, row: Mapping[str, bytes | None], where: str) -> MappedRecord:
        raise SourceError(f"outbox table {self.table}: a row at {where} without its source position",
                          retry=Retry.TERMINAL)  # pragma: no cover - the connector always passes one

    def map_insert_at(self, row: Mapping[str, bytes | None], where: str,
                      position: PgPosition | None) -> MappedRecord:
        if position is None:
            return self.map_insert(row, where)
        routed = self.router.route(row, position=position.to_dict(), where=f"{where} (position {position})",
                                   table=self.table, decode=self._decode)
        return self._mapped(routed, position)

    def map_message(self, content: bytes, position: PgPosition, where: str) -> MappedRecord:
        """A logical message's content: a JSON object whose fields stand for the outbox columns."""
        where = f"{where} (position {position})"
        try:
            row = orjson.loads(content)
        except orjson.JSONDecodeError:
            row = None
        if type(row) is not dict:
            routed = self.router.dead_letter("the message content is not a JSON object", {"content": content},
                                             None, where, position.to_dict())
        else:
            routed = self.router.route(row, position=position.to_dict(), where=where, table=None)
        return self._mapped(routed, position)

    def skip_change(self, table: str, op: str, where: str) -> bool:
        return self.router.skip_change(table, op, where)

    def owns_topic(self, topic: str) -> bool:
        return self.router.owns_topic(topic)

    def order_of(self, rec: LogRecord) -> int | None:
        if not self.router.is_ours(rec.headers):
            return None
        pos = self.router.position_of(rec)
        if pos is None or pos.get("kind") != "pg":
            return None
        return position_order(int(pos["lsn"]), bool(pos.get("snapshot")), int(pos["index"]))


def outbox_mappers(config: Any) -> dict[str, RecordMapper]:
    """``PgCapture.mappers`` entries for a PostgreSQL source's ``outbox`` settings ({} without)."""
    router = router_for(config)
    if router is None:
        return {}
    out: dict[str, RecordMapper] = {}
    for t in router.settings.tables:
        schema, name = split_table_name(t)
        qualified = f"{schema}.{name}"
        out[qualified] = PgOutboxMapper(router, qualified)
    prefix = router.settings.message_prefix
    if prefix:
        out[MESSAGE_KEY + prefix] = PgOutboxMapper(router, None)
    return out
