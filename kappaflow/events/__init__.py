"""The change-event model every part of kappaflow speaks (Debezium-compatible).

- ``ChangeEvent`` / ``SourceInfo`` / ``TransactionInfo`` / ``Op`` / ``Snapshot``: one row change.
- ``Position``: a total order within one source, used to drop duplicates; its kinds
  (``PgPosition``, ``BinlogPosition``, ``LedgerPosition``, ``KafkaPosition``) belong to their
  connectors (``connectors/<kind>/source_info.py``) and are importable from here too.
- ``TableSchema`` / ``Column`` / ``FieldType``: Kafka Connect / Debezium field types.
- ``EventCodec``: Debezium JsonConverter JSON, with or without the ``schema`` part.

Modules, each importing only those before it: ``types`` (field types), ``values`` (value codecs),
``schema`` (the table model), ``connect`` (Connect schemas: ``render_value_schema``,
``render_key_schema``, ``parse_value_schema``), ``sources`` (source blocks), ``json`` (the codec).
"""

import importlib
from typing import TYPE_CHECKING, Any

from kappaflow.events.json import (
    EventCodec,
    decode_row_values,
    encode_row_values,
    op_header,
    tombstone_for,
    topic_name,
)
from kappaflow.events.model import ChangeEvent, Op, Snapshot, SourceInfo, TransactionInfo
from kappaflow.events.position import Position
from kappaflow.events.schema import DECIMAL_MODES, Column, FieldType, TableSchema
from kappaflow.events.values import JSON_NULL

if TYPE_CHECKING:
    from kappaflow.connectors.debezium.sources.generic import KafkaPosition
    from kappaflow.connectors.ledger.source_info import LedgerPosition
    from kappaflow.connectors.mysql.source_info import BinlogPosition
    from kappaflow.connectors.postgres.source_info import PgPosition, lsn_from_str, lsn_to_str

# The position kinds live with their connectors; importable from here as before, loaded on first use
# (importing them here would import the connectors with the events package).
_MOVED = {
    "PgPosition": "kappaflow.connectors.postgres.source_info",
    "lsn_from_str": "kappaflow.connectors.postgres.source_info",
    "lsn_to_str": "kappaflow.connectors.postgres.source_info",
    "BinlogPosition": "kappaflow.connectors.mysql.source_info",
    "LedgerPosition": "kappaflow.connectors.ledger.source_info",
    "KafkaPosition": "kappaflow.connectors.debezium.sources.generic",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'kappaflow.events' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

__all__ = [
    "DECIMAL_MODES",
    "JSON_NULL",
    "BinlogPosition",
    "ChangeEvent",
    "Column",
    "EventCodec",
    "FieldType",
    "KafkaPosition",
    "LedgerPosition",
    "Op",
    "PgPosition",
    "Position",
    "Snapshot",
    "SourceInfo",
    "TableSchema",
    "TransactionInfo",
    "decode_row_values",
    "encode_row_values",
    "lsn_from_str",
    "lsn_to_str",
    "op_header",
    "tombstone_for",
    "topic_name",
]
