"""Any other connector (read from Debezium topics): its fields kept as they came, ordered by
their place in the Kafka topic (``KafkaPosition``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.connectors.debezium.sources.sqlserver import foreign_build
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.position import Position, int_field
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "KafkaPosition"]

@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class KafkaPosition(Position):
    """A record's place in the Kafka topic kappaflow read it from (partition, offset).

    For records that carry no source position kappaflow knows (a connector it has no layout
    for, a flattened record without metadata fields): unique, and increasing within a
    partition, which is where all changes of one key are. ``seq`` orders records derived
    from one Kafka record (a tombstone's delete) after it.
    """

    partition: int
    offset: int
    seq: int = 0
    kind: ClassVar[str] = "kafka"

    def sort_key(self) -> tuple[int, int, int]:
        return (self.partition, self.offset, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "kafka", "partition": self.partition, "offset": self.offset, "seq": self.seq}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> KafkaPosition:
        seq = int_field(d, "kafka", "seq", optional=True)
        return cls(int_field(d, "kafka", "partition"), int_field(d, "kafka", "offset"), seq or 0)

    def successor(self) -> KafkaPosition:
        return KafkaPosition(self.partition, self.offset, self.seq + 1)

    def __str__(self) -> str:
        return f"kafka:{self.partition}/{self.offset}" + (f"+{self.seq}" if self.seq else "")


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
