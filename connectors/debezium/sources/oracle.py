"""Oracle (read from Debezium topics): ``io.debezium.connector.oracle.Source``.

Fields after the common ones: ``schema, table, txId, scn, commit_scn, lcr_position, rs_id, ssn,
redo_thread, user_name`` (and, by version, ``redo_sql``, ``row_id``). The connector buffers each
transaction and emits it at commit, so changes come ordered by commit SCN, then by their own
SCN; snapshot rows carry the snapshot SCN and no commit SCN. SCNs are decimal text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kappaflow.connectors.debezium.sources.sqlserver import foreign_build, serial
from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.position import Position
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "OraclePosition"]

f = connect_field


def _scn(block: Mapping[str, Any], key: str) -> int | None:
    v = block.get(key)
    if v is None:
        return None
    if type(v) is int and v >= 0:
        return v
    if type(v) is str and v.strip().isdigit():
        return int(v)
    raise ValidationError(f"source.{key}: expected an SCN (decimal digits), got {v!r}")


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class OraclePosition(Position):
    commit_scn: int
    scn: int
    snapshot: bool = False
    seq: int = 0
    kind: ClassVar[str] = "oracle"

    def sort_key(self) -> tuple[int, int, int, int]:
        return (self.commit_scn, 0 if self.snapshot else 1, self.scn, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "oracle", "commit_scn": self.commit_scn, "scn": self.scn, "snapshot": self.snapshot,
                "seq": self.seq}

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> OraclePosition:
        commit, scn = _scn(d, "commit_scn"), _scn(d, "scn")
        if commit is None or scn is None:
            raise ValidationError(f"position (oracle): expected commit_scn and scn, got {dict(d)!r}")
        return cls(commit, scn, bool(d.get("snapshot")), serial(d, "seq"))

    def successor(self) -> OraclePosition:
        return OraclePosition(self.commit_scn, self.scn, self.snapshot, self.seq + 1)


def _position(block: Mapping[str, Any], in_snapshot: bool) -> Position | None:
    scn, commit = _scn(block, "scn"), _scn(block, "commit_scn")
    if scn is None and commit is None:
        return None
    c = commit if commit is not None else scn
    assert c is not None
    return OraclePosition(c, scn if scn is not None else c, in_snapshot)


LAYOUT = register(SourceLayout(
    connectors=("oracle",),
    kind="oracle",
    position_type=OraclePosition,
    schema_name="io.debezium.connector.oracle.Source",
    fields=(f("string", "schema"), f("string", "table"), f("string", "txId", True), f("string", "scn", True),
            f("string", "commit_scn", True), f("string", "lcr_position", True), f("string", "rs_id", True),
            f("int32", "ssn", True), f("int32", "redo_thread", True), f("string", "user_name", True)),
    build=foreign_build,
    position=_position,
    kf_pos_fields=(f("string", "kind"), f("int64", "commit_scn"), f("int64", "scn"), f("boolean", "snapshot"),
                   f("int64", "seq")),
    extra_keys=None,
))
