"""Write a table's change history into a log the way a connector does (tests, benchmarks, demos).

``TableWriter`` keeps the table's current rows, turns inserts/updates/deletes into
Debezium-shaped events with increasing PostgreSQL positions, and appends them (a delete
followed by its tombstone) with the schema record on ``<source>.__schema``. Its ``rows``
are the reference state a projection must reproduce.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.events import ChangeEvent, EventCodec, Op, SourceInfo, TableSchema
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig


class TableWriter:
    def __init__(
        self, log: Log, schema: TableSchema, *, partitions: int = 4, lsn: int = 1_000, codec: EventCodec | None = None
    ) -> None:
        self.log = log
        self.schema = schema
        self.codec = codec or EventCodec()
        self.topic = schema.name
        parts = schema.name.split(".")
        if len(parts) != 3:
            raise ValueError(f"table schema name {schema.name!r}: expected <source>.<schema>.<table>")
        self.source, self.pg_schema, self.table = parts
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.lsn = lsn
        self.pending: list[Record] = []
        log.create_topic(self.topic, TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.COMPACT))
        st = f"{self.source}.__schema"
        log.create_topic(st, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
        log.append(st, [Record(f"{self.pg_schema}.{self.table}".encode(), orjson.dumps(schema.to_dict()))])

    def _key(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(row[k] for k in self.schema.key)

    def _event(self, op: Op, before: dict[str, Any] | None, after: dict[str, Any] | None, key: dict[str, Any]) -> None:
        self.lsn += 1
        src = SourceInfo(
            "postgresql",
            self.source,
            "db",
            self.pg_schema,
            self.table,
            PgPosition(self.lsn, 0),
            ts_ms=int(time.time() * 1000),
            tx_id=self.lsn,
        )
        ev = ChangeEvent(op, key, before, after, src, ts_ms=int(time.time() * 1000))
        kb = self.codec.encode_key(key, self.schema)
        self.pending.append(Record(kb, self.codec.encode_value(ev, self.schema), (("kf.op", op.value.encode()),)))
        if op is Op.DELETE:
            self.pending.append(Record(kb, None))

    def insert(self, row: Mapping[str, Any], *, snapshot: bool = False) -> None:
        row = dict(row)
        k = self._key(row)
        if k in self.rows:
            raise KeyError(f"insert: key {k} exists")
        self.rows[k] = row
        self._event(Op.READ if snapshot else Op.CREATE, None, row, dict(zip(self.schema.key, k, strict=True)))

    def update(self, key: tuple[Any, ...], changes: Mapping[str, Any], *, before_image: bool = False) -> None:
        old = self.rows[key]
        new = {**old, **changes}
        if self._key(new) != key:
            raise ValueError("update: changing the key is a delete + insert")
        self.rows[key] = new
        self._event(Op.UPDATE, dict(old) if before_image else None, new, dict(zip(self.schema.key, key, strict=True)))

    def delete(self, key: tuple[Any, ...], *, full_before: bool = False) -> None:
        old = self.rows.pop(key)
        kd = dict(zip(self.schema.key, key, strict=True))
        self._event(Op.DELETE, dict(old) if full_before else dict(kd), None, kd)

    def upsert(self, row: Mapping[str, Any]) -> None:
        k = self._key(row)
        if k in self.rows:
            self.update(k, {c: v for c, v in row.items() if c not in self.schema.key})
        else:
            self.insert(row)

    def flush(self) -> int:
        n = len(self.pending)
        if n:
            self.log.append(self.topic, self.pending)
            self.pending = []
        return n

    def apply(self, ops: Iterable[tuple[str, Any]]) -> None:
        """Apply ('insert', row) / ('update', (key, changes)) / ('delete', key) steps."""
        for op, arg in ops:
            if op == "insert":
                self.insert(arg)
            elif op == "update":
                self.update(arg[0], arg[1])
            elif op == "delete":
                self.delete(arg)
            else:
                raise ValueError(f"unknown op {op!r}")
        self.flush()


__all__ = ["TableWriter"]
