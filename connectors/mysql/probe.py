"""The lag probe of a MySQL/MariaDB source: binlog files and bytes on the server after the capture."""

from __future__ import annotations

from typing import Any

from kappaflow.metrics.probes import SourceProbe, SourceReading, position_number

__all__ = ["MySQLProbe"]


class MySQLProbe(SourceProbe):
    """Binlog files and bytes on the server after the capture's position (``file:pos``)."""

    def __init__(self, src: Any) -> None:
        from kappaflow.connectors.mysql.server import parse_dsn

        self.args = parse_dsn(src.dsn, src.resolved_password())
        self.conn: Any = None

    def read(self, position: str | None) -> SourceReading:
        from kappaflow.connectors.mysql.server import connect

        if position is None or ":" not in position:
            return SourceReading()
        if self.conn is None or not self.conn.open:
            self.conn = connect(self.args, what="reading the binlog lag", autocommit=True)
        try:
            with self.conn.cursor() as cur:
                cur.execute("SHOW BINARY LOGS")
                files = [(str(r[0]), int(r[1])) for r in cur.fetchall()]
        except Exception:
            self.conn.close()
            raise
        at_file, _, rest = position.partition(":")
        at_pos = int(rest.split()[0])
        names = [f for f, _ in files]
        if at_file not in names:
            return SourceReading(confirmed_position=position_number(position))
        i = names.index(at_file)
        behind = max(0, files[i][1] - at_pos) + sum(size for _, size in files[i + 1:])
        return SourceReading(confirmed_position=position_number(position), binlog_files_behind=len(files) - i - 1,
                             binlog_bytes_behind=behind)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
