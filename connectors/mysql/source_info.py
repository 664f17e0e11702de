"""MySQL and MariaDB source info: ``BinlogPosition``, the ``io.debezium.connector.mysql.Source`` block,
its Connect schema and its Spark ordering (registered with ``kappaflow.events.sources``).

Fields after the common ones: ``table, server_id, gtid, file, pos, row, thread, query``.
``thread`` is the id of the session that wrote the transaction (from its ``BEGIN`` query
event) and ``query`` the statement when the binlog carries it (MySQL
``binlog_rows_query_log_events`` / MariaDB ``binlog_annotate_row_events``); both null
otherwise, as in Debezium. kappaflow adds ``txId`` (the GTID; Debezium has the transaction id
only in the envelope's ``transaction`` block).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kappaflow.errors import ValidationError
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import Position, bool_field, int_field
from kappaflow.events.sources import SourceLayout, connect_field, register

__all__ = ["LAYOUT", "BinlogPosition", "binlog_file_sequence"]

_BINLOG_SUFFIX_RE = re.compile(r"^(.*?)\.?(\d+)$")


def binlog_file_sequence(file: str) -> tuple[int, str]:
    """(sequence number, base name) of a binlog file name like ``mysql-bin.000003``."""
    m = _BINLOG_SUFFIX_RE.match(file) if isinstance(file, str) else None
    if m is None:
        raise ValidationError(
            f"binlog file: expected a name ending in a sequence number like 'mysql-bin.000003', got {file!r}"
        )
    return int(m.group(2)), m.group(1)


@fast_frozen_init
@dataclass(frozen=True, slots=True, eq=False)
class BinlogPosition(Position):
    """MySQL/MariaDB binlog: file, position of the transaction (or rows event), row index.

    Ordered by (file sequence number, pos, row); the GTID and server id travel along
    for resuming and display but do not take part in the order. Snapshot rows carry
    the binlog position read at the start of the snapshot and order before every
    streaming position at or after it, like ``PgPosition``.
    """

    file: str
    pos: int
    row: int = 0
    gtid: str | None = None
    server_id: int | None = None
    snapshot: bool = False
    _file_key: tuple[int, str] = field(init=False, repr=False, compare=False)
    kind: ClassVar[str] = "binlog"

    def __post_init__(self) -> None:
        # Parsed once: positions are compared for every record a consumer reads.
        object.__setattr__(self, "_file_key", binlog_file_sequence(self.file))

    def sort_key(self) -> tuple[int, str, int, int, int]:
        seq, base = self._file_key
        return (seq, base, self.pos, 0 if self.snapshot else 1, self.row)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "binlog",
            "file": self.file,
            "pos": self.pos,
            "row": self.row,
            "gtid": self.gtid,
            "server_id": self.server_id,
            "snapshot": self.snapshot,
        }

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> BinlogPosition:
        file = d.get("file")
        if not isinstance(file, str):
            raise ValidationError(f"position (binlog).file: expected a binlog file name, got {file!r}")
        gtid = d.get("gtid")
        if gtid is not None and not isinstance(gtid, str):
            raise ValidationError(f"position (binlog).gtid: expected a string or null, got {gtid!r}")
        return cls(
            file,
            int_field(d, "binlog", "pos"),
            int_field(d, "binlog", "row"),
            gtid,
            int_field(d, "binlog", "server_id", optional=True),
            bool_field(d, "binlog", "snapshot"),
        )

    def __str__(self) -> str:
        s = f"{self.file}:{self.pos}:{self.row}"
        return s + ":snapshot" if self.snapshot else s

    def successor(self) -> BinlogPosition:
        return BinlogPosition(self.file, self.pos, self.row + 1, self.gtid, self.server_id, self.snapshot)


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


def _spark_order(pos: Any) -> tuple[Any, ...]:
    """The Spark ordering of a ``kf_pos`` struct column like ``BinlogPosition.sort_key`` (see
    ``kappaflow.projections.schemas.pos_order``): (file sequence, file base, pos, snapshot first, row)."""
    from pyspark.sql import functions as F

    return (F.regexp_extract(pos["file"], r"(\d+)$", 1).try_cast("bigint"),
            F.regexp_extract(pos["file"], r"^(.*?)\.?(\d+)$", 1), pos["pos"],
            F.when(pos["snapshot"], F.lit(0)).otherwise(F.lit(1)), pos["row"])


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
    spark_fields=("file", "pos", "row", "snapshot"),
    spark_order=_spark_order,
))
