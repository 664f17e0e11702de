"""Any other connector (read from Debezium topics): its fields kept as they came, ordered by
their place in the Kafka topic (``KafkaPosition``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kappaflow.events.position import KafkaPosition, Position
from kappaflow.events.sources import SourceLayout, connect_field, register
from kappaflow.events.sources.sqlserver import foreign_build

__all__ = ["LAYOUT"]

f = connect_field


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    return None


LAYOUT = register(SourceLayout(
    connectors=(),
    kind="kafka",
    position_type=KafkaPosition,
    schema_name="io.debezium.connector.common.Source",
    fields=(),
    build=foreign_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("int64", "partition"), f("int64", "offset"), f("int64", "seq")),
    extra_keys=None,
), generic=True)
