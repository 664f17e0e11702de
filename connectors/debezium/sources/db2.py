"""Db2 (read from Debezium topics): ``io.debezium.connector.db2.Source``.

Fields after the common ones: ``schema, table, change_lsn, commit_lsn``. Like SQL Server, the
changes come ordered by commit LSN then change LSN, as fixed-width hex text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.connectors.debezium.sources.sqlserver import foreign_build, lsn_text, serial
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.position import Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "Db2Position"]

f = connect_field


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class Db2Position(Position):
    commit_lsn: str
    change_lsn: str = ""
    snapshot: bool = False
    seq: int = 0
    kind: ClassVar[str] = "db2"

    def sort_key(self) -> tuple[str, int, str, int]:
        return (self.commit_lsn, 0 if self.snapshot else 1, self.change_lsn, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "db2", "commit_lsn": self.commit_lsn, "change_lsn": self.change_lsn,
                "snapshot": self.snapshot, "seq": self.seq}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> Db2Position:
        return cls(lsn_text(d, "commit_lsn", required=True) or "", lsn_text(d, "change_lsn") or "",
                   bool(d.get("snapshot")), serial(d, "seq"))

    def successor(self) -> Db2Position:
        return Db2Position(self.commit_lsn, self.change_lsn, self.snapshot, self.seq + 1)


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    commit = lsn_text(block, "commit_lsn")
    change = lsn_text(block, "change_lsn")
    if commit is None and change is None:
        return None
    return Db2Position(commit or change or "", change or "", in_snapshot)


LAYOUT = register(SourceLayout(
    connectors=("db2",),
    kind="db2",
    position_type=Db2Position,
    schema_name="io.debezium.connector.db2.Source",
    fields=(f("string", "schema"), f("string", "table"), f("string", "change_lsn", True),
            f("string", "commit_lsn", True)),
    build=foreign_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("string", "commit_lsn"), f("string", "change_lsn"),
                   f("boolean", "snapshot"), f("int64", "seq")),
    extra_keys=None,
))
