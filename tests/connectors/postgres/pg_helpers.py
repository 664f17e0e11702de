"""Helpers for the PostgreSQL connector tests: configs, runs, log state vs table state."""

from __future__ import annotations

import struct
from typing import Any

import orjson

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import record_position
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.connectors.postgres.decoder import UNCHANGED
from kappaflow.connectors.postgres.rows import TableCodec
from kappaflow.events import EventCodec, Position, TableSchema
from kappaflow.log.base import Log
from tests._kill import wait_for as wait_for  # one bounded polling wait for all capture tests

TRUNCATE_KEY = b"{}"


def tup(*values: bytes | object | None) -> bytes:
    """pgoutput TupleData: None -> 'n' (NULL), UNCHANGED -> 'u' (unchanged TOAST), bytes -> 't' (text)."""
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            assert isinstance(v, bytes)
            out += b"t" + struct.pack(">I", len(v)) + v
    return out


def config(dsn: str, name: str, tables: list[str], **kw: Any) -> PostgresSourceConfig:
    kw.setdefault("heartbeat_interval_s", 0.5)
    return PostgresSourceConfig(name=name, dsn=dsn, tables=tables, **kw)


def capture(cfg: PostgresSourceConfig, log: Log, **kw: Any) -> Any:
    """One run until the log holds everything committed when it started."""
    kw.setdefault("partitions", 3)
    kw.setdefault("progress", False)
    return PostgresConnector(cfg, log, **kw).run(until_caught_up=True)


def records(log: Log, topic: str) -> list[Any]:
    out = []
    for p in range(log.partitions(topic)):
        out.extend(log.iter_partition(topic, p))
    return out


def compacted(log: Log, topic: str) -> dict[bytes, dict[str, Any]]:
    """key -> last `after` row, as a consumer folding the topic sees it (tombstones delete)."""
    state: dict[bytes, dict[str, Any]] = {}
    for p in range(log.partitions(topic)):
        for rec in log.iter_partition(topic, p):
            if rec.key == TRUNCATE_KEY:
                continue
            if rec.value is None:
                state.pop(rec.key, None)
                continue
            after = orjson.loads(rec.value)["after"]
            if after is None:
                state.pop(rec.key, None)
            else:
                state[rec.key] = after
    return state


def table_state(dsn: str, table: str, source: str = "x") -> dict[bytes, dict[str, Any]]:
    """key -> row in the events' JSON encoding, read straight from the table."""
    schema, name = slots.split_table_name(table)
    conn = slots.connect(dsn)
    try:
        info = slots.load_table(conn, schema, name)
        tc = TableCodec.from_table_info(info, source=source, db=conn.info.dbname, codec=EventCodec(),
                                        lookup=slots.TypeCatalog(conn))
        cols = ", ".join(f'"{c}"' for c in tc.names)
        res = conn.pgconn.exec_(f'SELECT {cols} FROM "{schema}"."{name}"'.encode())
        out = {}
        for r in range(res.ntuples):
            raw = tuple(res.get_value(r, c) for c in range(res.nfields))
            row = tc.json_row(raw)
            out[tc.key_of(row)] = row
        return out
    finally:
        conn.close()


def schemas(log: Log, source: str) -> dict[str, TableSchema]:
    out = {}
    for rec in log.iter_partition(f"{source}.__schema", 0):
        if rec.value is not None:
            out[orjson.loads(rec.key)] = TableSchema.from_dict(orjson.loads(rec.value))
    return out


def positions(log: Log, topic: str) -> list[tuple[Position, bool]]:
    """(position, is_tombstone) of every record, partition by partition."""
    out = []
    for rec in records(log, topic):
        pos = record_position(rec)
        assert pos is not None, f"record without a position in {topic}: {rec}"
        out.append((pos, rec.value is None))
    return out
