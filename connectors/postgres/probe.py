"""The lag probe of a PostgreSQL (or ledger) source: its slot's retained and unconfirmed WAL."""

from __future__ import annotations

from typing import Any

from kappaflow.metrics.probes import SourceProbe, SourceReading

__all__ = ["PostgresProbe"]


class PostgresProbe(SourceProbe):
    """The slot's retained and unconfirmed WAL (the figures `source status` calls lag_bytes)."""

    def __init__(self, src: Any) -> None:
        self.slot = src.slot_name
        self.dsn = src.connect_dsn()
        self.conn: Any = None

    def read(self, position: str | None) -> SourceReading:
        from kappaflow.connectors.postgres import slots

        if self.conn is None or self.conn.closed:
            self.conn = slots.connect(self.dsn, what="reading the slot's WAL figures")
        try:
            info = slots.slot_info(self.conn, self.slot)
        except Exception:
            self.conn.close()
            raise
        if info is None:
            return SourceReading(slot=self.slot, slot_missing=True)
        retained = None if info.restart_lsn is None else max(0, info.current_lsn - info.restart_lsn)
        return SourceReading(
            slot=self.slot, retained_wal_bytes=retained,
            unconfirmed_wal_bytes=None if info.lag_bytes is None else max(0, info.lag_bytes),
            confirmed_position=info.confirmed_flush_lsn, slot_active=info.active,
        )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
