"""SQL Server (read from Debezium topics): ``io.debezium.connector.sqlserver.Source``.

Fields after the common ones: ``schema, table, change_lsn, commit_lsn, event_serial_no``.
Debezium replays a capture table's changes ordered by commit LSN, then change LSN;
``event_serial_no`` tells apart the events of one change (an update's or a primary-key
change's two rows). The LSNs are fixed-width hex text (``00000027:00000758:0005``), so they
order as text. Snapshot rows carry the snapshot's commit LSN and no change LSN.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "SqlServerPosition"]

f = connect_field
_LSN_RE = re.compile(r"^[0-9A-Fa-f]{8}:[0-9A-Fa-f]{8}:[0-9A-Fa-f]{4}$")


def lsn_text(block: Mapping[str, Any], key: str, required: bool = False) -> str | None:
    """A SQL Server / Db2 LSN field: fixed-width hex text (lower-cased so it orders as text)."""
    v = block.get(key)
    if v is None:
        if required:
            raise ValidationError(f"source.{key}: expected an LSN like '00000027:00000758:0005', got null")
        return None
    if type(v) is not str or not v or any(c not in "0123456789abcdefABCDEF:" for c in v):
        raise ValidationError(f"source.{key}: expected an LSN like '00000027:00000758:0005', got {v!r}")
    return v.lower()


def serial(block: Mapping[str, Any], key: str) -> int:
    v = block.get(key)
    if v is None:
        return 0
    if type(v) is str and v.isdigit():  # Debezium's documentation shows it quoted
        return int(v)
    if type(v) is not int or v < 0:
        raise ValidationError(f"source.{key}: expected a non-negative integer, got {v!r}")
    return v


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class SqlServerPosition(Position):
    commit_lsn: str
    change_lsn: str = ""
    event_serial_no: int = 0
    snapshot: bool = False
    seq: int = 0  # records ordered after this one without a position of their own
    kind: ClassVar[str] = "sqlserver"

    def sort_key(self) -> tuple[str, int, str, int, int]:
        return (self.commit_lsn, 0 if self.snapshot else 1, self.change_lsn, self.event_serial_no, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "sqlserver", "commit_lsn": self.commit_lsn, "change_lsn": self.change_lsn,
                "event_serial_no": self.event_serial_no, "snapshot": self.snapshot, "seq": self.seq}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> SqlServerPosition:
        c = lsn_text(d, "commit_lsn", required=True)
        assert c is not None
        return cls(c, lsn_text(d, "change_lsn") or "", serial(d, "event_serial_no"), bool(d.get("snapshot")),
                   serial(d, "seq"))

    def successor(self) -> SqlServerPosition:
        return SqlServerPosition(self.commit_lsn, self.change_lsn, self.event_serial_no, self.snapshot, self.seq + 1)

    def __str__(self) -> str:
        return f"{self.commit_lsn}/{self.change_lsn}/{self.event_serial_no}"


def foreign_build(s: SourceInfo) -> dict[str, Any]:
    """Connectors read from Debezium only: every field after the common ones, as it came."""
    extra = s.extra
    if not extra:
        return {"schema": s.schema, "table": s.table}
    return {k: v for k, v in extra.items() if k != "sequence"}


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    commit = lsn_text(block, "commit_lsn")
    change = lsn_text(block, "change_lsn")
    if commit is None and change is None:
        return None
    return SqlServerPosition(commit or change or "", change or "", serial(block, "event_serial_no"), in_snapshot)


LAYOUT = register(SourceLayout(
    connectors=("sqlserver",),
    kind="sqlserver",
    position_type=SqlServerPosition,
    schema_name="io.debezium.connector.sqlserver.Source",
    fields=(f("string", "schema"), f("string", "table"), f("string", "change_lsn", True),
            f("string", "commit_lsn", True), f("int64", "event_serial_no", True)),
    build=foreign_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("string", "commit_lsn"), f("string", "change_lsn"),
                   f("int64", "event_serial_no"), f("boolean", "snapshot"), f("int64", "seq")),
    extra_keys=None,
))
