"""The change-event model every part of kappaflow speaks (Debezium-compatible).

- ``ChangeEvent`` / ``SourceInfo`` / ``TransactionInfo`` / ``Op`` / ``Snapshot``: one row change.
- ``Position`` and its kinds (``PgPosition``, ``BinlogPosition``, ``LedgerPosition``): a total
  order within one source, used to drop duplicates.
- ``TableSchema`` / ``Column`` / ``FieldType``: Kafka Connect / Debezium field types.
- ``EventCodec``: Debezium JsonConverter JSON, with or without the ``schema`` part.

Modules, each importing only those before it: ``types`` (field types), ``values`` (value codecs),
``schema`` (the table model), ``connect`` (Connect schemas: ``render_value_schema``,
``render_key_schema``, ``parse_value_schema``), ``sources`` (source blocks), ``json`` (the codec).
"""

from kappaflow.events.json import (
    EventCodec,
    decode_row_values,
    encode_row_values,
    op_header,
    tombstone_for,
    topic_name,
)
from kappaflow.events.model import ChangeEvent, Op, Snapshot, SourceInfo, TransactionInfo
from kappaflow.events.position import (
    BinlogPosition,
    KafkaPosition,
    LedgerPosition,
    PgPosition,
    Position,
    lsn_from_str,
    lsn_to_str,
)
from kappaflow.events.schema import DECIMAL_MODES, Column, FieldType, TableSchema
from kappaflow.events.values import JSON_NULL

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
