"""The MySQL/MariaDB connector's offset context (what the offsets topic stores per source).

``file``/``pos`` is the resume point: the start of the first transaction whose records are
not all durable yet (after a clean commit boundary: the next transaction). ``gtid`` is the
executed GTID set up to that point (MariaDB ``domain-server-seq`` list or MySQL
``uuid:interval`` set); streaming resumes from ``file``/``pos`` while the server still has
that file, else from ``gtid``. During the snapshot, ``snapshot`` says which table is being
read and the key of the last row written, so a crash resumes with the next chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kappaflow.connectors.base import OffsetContext
from kappaflow.errors import ValidationError

__all__ = ["MySQLOffset", "SnapshotProgress"]


@dataclass
class SnapshotProgress:
    """Chunked snapshot progress: tables in order, the current one, and its last key written."""

    tables: list[str]
    index: int = 0  # tables[index] is being read
    last_key: str | None = None  # JSON key (as EventCodec.encode_key writes it) of the last row written
    rows: int = 0  # snapshot rows written so far (= next snapshot row number)
    table_rows: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": list(self.tables), "index": self.index, "last_key": self.last_key, "rows": self.rows,
                "table_rows": dict(self.table_rows)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SnapshotProgress:
        return cls(list(d["tables"]), int(d.get("index", 0)), d.get("last_key"), int(d.get("rows", 0)),
                   {str(k): int(v) for k, v in (d.get("table_rows") or {}).items()})

    @property
    def done(self) -> bool:
        return self.index >= len(self.tables)


@dataclass
class MySQLOffset(OffsetContext):
    flavor: str  # "mariadb" | "mysql"
    file: str  # resume: binlog file of the next transaction to read
    pos: int  # resume: its start position
    gtid: str = ""  # executed GTID set up to file/pos
    phase: str = "streaming"  # "snapshot" | "streaming" | "done" (initial_only finished)
    snapshot: SnapshotProgress | None = None
    last_position: dict[str, Any] | None = None  # last change written (BinlogPosition dict), for status
    events: int = 0
    server_uuid: str = ""
    stream_start: dict[str, Any] | None = None  # where streaming began (file, pos, gtid), for status and audits
    # ``kappaflow capture --resnapshot`` in progress (``connectors/mysql/resnapshot.py``): the binlog position
    # (file, pos, gtid) it streams from; keys whose latest record is older get deletes after the snapshot
    resnapshot: dict[str, Any] | None = None
    # on-demand snapshot state (connectors/ondemand.py OnDemandState.to_dict), None when never used
    ondemand: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "kind": "mysql", "flavor": self.flavor, "file": self.file, "pos": self.pos, "gtid": self.gtid,
            "phase": self.phase, "snapshot": None if self.snapshot is None else self.snapshot.to_dict(),
            "last_position": self.last_position, "events": self.events, "server_uuid": self.server_uuid,
            "stream_start": self.stream_start,
            **({"ondemand": self.ondemand} if self.ondemand is not None else {}),
        }
        if self.resnapshot is not None:
            d["resnapshot"] = self.resnapshot
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MySQLOffset:
        try:
            if d.get("kind") != "mysql":
                raise ValueError(f"kind {d.get('kind')!r} is not 'mysql'")
            snap = d.get("snapshot")
            flavor = str(d["flavor"])
            if flavor not in ("mariadb", "mysql"):
                raise ValueError(f"flavor {flavor!r}")
            phase = str(d.get("phase", "streaming"))
            if phase not in ("snapshot", "streaming", "done"):
                raise ValueError(f"phase {phase!r}")
            return cls(
                flavor=flavor, file=str(d["file"]), pos=int(d["pos"]), gtid=str(d.get("gtid") or ""),
                phase=phase, snapshot=None if snap is None else SnapshotProgress.from_dict(snap),
                last_position=d.get("last_position"), events=int(d.get("events", 0)),
                server_uuid=str(d.get("server_uuid", "")), stream_start=d.get("stream_start"),
                resnapshot=d.get("resnapshot"),
                ondemand=dict(d["ondemand"]) if isinstance(d.get("ondemand"), dict) else None,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValidationError(f"mysql offset: malformed stored offset ({exc}); expected the dict written by "
                                  "MySQLOffset.to_dict") from None
