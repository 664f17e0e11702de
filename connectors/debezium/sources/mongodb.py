"""MongoDB (read from Debezium topics): ``io.debezium.connector.mongo.Source``.

Fields after the common ones: ``rs, collection, ord, lsid, txnNumber`` (3.x adds ``wallTime``).
A change's place in the oplog is its timestamp: seconds (``ts_ms`` / 1000) and ``ord``, the
ordinal within that second; change streams deliver in that order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.connectors.debezium.sources.sqlserver import serial
from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "MongoPosition"]

f = connect_field


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class MongoPosition(Position):
    ts: int  # seconds of the oplog timestamp
    ord: int
    snapshot: bool = False
    seq: int = 0
    kind: ClassVar[str] = "mongodb"

    def sort_key(self) -> tuple[int, int, int, int]:
        return (self.ts, 0 if self.snapshot else 1, self.ord, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "mongodb", "ts": self.ts, "ord": self.ord, "snapshot": self.snapshot, "seq": self.seq}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> MongoPosition:
        return cls(serial(d, "ts"), serial(d, "ord"), bool(d.get("snapshot")), serial(d, "seq"))

    def successor(self) -> MongoPosition:
        return MongoPosition(self.ts, self.ord, self.snapshot, self.seq + 1)


def _build(s: SourceInfo) -> dict[str, Any]:
    extra = s.extra
    if not extra:
        return {"collection": s.table}
    return {k: v for k, v in extra.items() if k != "sequence"}


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    ts_ms, ordinal = block.get("ts_ms"), block.get("ord")
    if ordinal is None:
        return None
    if type(ts_ms) is not int or type(ordinal) is not int:
        raise ValidationError(f"source.ts_ms/ord: expected integers, got {ts_ms!r}, {ordinal!r}")
    return MongoPosition(ts_ms // 1000, ordinal, in_snapshot)


LAYOUT = register(SourceLayout(
    connectors=("mongodb",),
    kind="mongodb",
    position_type=MongoPosition,
    schema_name="io.debezium.connector.mongo.Source",
    fields=(f("string", "rs"), f("string", "collection"), f("int32", "ord"), f("string", "lsid", True),
            f("int64", "txnNumber", True)),
    build=_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("int64", "ts"), f("int64", "ord"), f("boolean", "snapshot"),
                   f("int64", "seq")),
    extra_keys=None,
    table_key="collection",
    schema_key=None,
))
