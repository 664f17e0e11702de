"""GTID sets in both flavours, as offsets store them.

- MariaDB: one ``domain-server-seq`` per replication domain, comma separated
  (``0-1-42,1-7-3``): the last transaction applied per domain, exactly what
  ``@@gtid_binlog_pos`` shows and ``SET @slave_connect_state`` accepts.
- MySQL: ``uuid:interval[:interval]`` per source server (``3E11FA47-...:1-42``),
  what ``@@gtid_executed`` shows and ``COM_BINLOG_DUMP_GTID`` accepts.
"""

from __future__ import annotations

import re

from kappaflow.errors import ValidationError

__all__ = ["GtidState"]

_MARIADB_RE = re.compile(r"^\d+-\d+-\d+$")


class GtidState:
    """The executed GTID set of a capture, advanced transaction by transaction."""

    __slots__ = ("_mariadb", "_mysql", "flavor")

    def __init__(self, flavor: str, text: str | None = None) -> None:
        if flavor not in ("mariadb", "mysql"):
            raise ValidationError(f"gtid flavor: expected 'mariadb' or 'mysql', got {flavor!r}")
        self.flavor = flavor
        self._mariadb: dict[int, tuple[int, int]] = {}
        self._mysql = None
        text = (text or "").strip()
        if flavor == "mariadb":
            for part in filter(None, (p.strip() for p in text.split(","))):
                if not _MARIADB_RE.match(part):
                    raise ValidationError(f"gtid: expected MariaDB 'domain-server-seq' items, got {part!r}")
                d, s, n = (int(x) for x in part.split("-"))
                self._mariadb[d] = (s, n)
        else:
            from pymysqlreplication.gtid import GtidSet

            try:
                self._mysql = GtidSet(text.replace("\n", "") or None)
            except ValueError as exc:
                raise ValidationError(f"gtid: expected a MySQL GTID set 'uuid:1-5,...', got {text!r} ({exc})") from None

    def add(self, gtid: str) -> None:
        """Record one applied transaction (the GTID event's text)."""
        if self.flavor == "mariadb":
            d, s, n = (int(x) for x in gtid.split("-"))
            self._mariadb[d] = (s, n)
        else:
            from pymysqlreplication.gtid import Gtid

            assert self._mysql is not None
            g = Gtid(gtid)
            if g not in self._mysql:
                self._mysql.merge_gtid(g)

    def copy(self) -> GtidState:
        return GtidState(self.flavor, str(self))

    def __str__(self) -> str:
        if self.flavor == "mariadb":
            return ",".join(f"{d}-{s}-{n}" for d, (s, n) in sorted(self._mariadb.items()))
        return str(self._mysql) if self._mysql is not None else ""

    def __bool__(self) -> bool:
        return bool(str(self))

    def __repr__(self) -> str:
        return f"GtidState({self.flavor!r}, {str(self)!r})"
