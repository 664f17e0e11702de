"""The outbox router (``connectors/outbox.py``) on the MySQL/MariaDB connector.

The binlog reader and the snapshot hand every row of a captured table to the batch builder
(``writer.ChangeBatcher``); for an outbox table the builder hands them here instead
(``ChangeBatcher.outbox``). Inserted (and snapshot-read) rows become routed records at their
binlog position, deletes and truncates are skipped, updates handled by
``table_op_invalid_behavior``. The duplicate check is the builder's own: the tails of the
router's topics (records of this source only, ``kf.outbox``) join the builder's tails at start,
and a record at or below its partition's tail is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kappaflow.connectors.outbox import OutboxRouter, Routed, as_bytes, b64_or_bytes, router_for
from kappaflow.errors import ConfigError
from kappaflow.events import ChangeEvent, FieldType, Op, Position
from kappaflow.log.base import CleanupPolicy, TopicConfig

if TYPE_CHECKING:
    from kappaflow.connectors.mysql.schema_tracking import TableState
    from kappaflow.connectors.mysql.writer import ChangeBatcher
    from kappaflow.log.base import Log

__all__ = ["MySQLOutbox", "attach_outbox", "mysql_outbox"]


class MySQLOutbox:
    """Routes the rows of the outbox tables (``"db.table"``) of one MySQL/MariaDB source."""

    def __init__(self, router: OutboxRouter, tables: set[str]) -> None:
        self.router = router
        self.tables = tables
        self.routed = 0
        self.dead_letters = 0

    # -- start -----------------------------------------------------------------------------
    def check(self, state: TableState) -> None:
        """ConfigError when the outbox table lacks a configured column."""
        self.router.check_columns(state.qualified, [c.name for c in state.schema.columns])

    def load_tails(self, batcher: ChangeBatcher, log: Log) -> None:
        """Join the positions of what this source already routed to the builder's duplicate check."""
        for (topic, p), d in self.router.tails(log).items():
            batcher.tails[(topic, p)] = Position.from_dict(d)
            self._topic(batcher, topic)
        if batcher.tails:
            batcher._max_tail = max(batcher.tails.values())

    # -- rows ------------------------------------------------------------------------------
    def _topic(self, batcher: ChangeBatcher, topic: str) -> int:
        """An event topic (cleanup policy delete), created when missing; its partition count."""
        n = batcher._topic_parts.get(topic)
        if n is None:
            existing = batcher.log.list_topics().get(topic)
            if existing is None:
                existing = batcher.log.create_topic(topic, TopicConfig(partitions=batcher.partitions,
                                                                       cleanup_policy=CleanupPolicy.DELETE),
                                                    exist_ok=True)
            n = batcher._topic_parts[topic] = existing.partitions
        return n

    def _decoder(self, state: TableState, json_form: bool) -> Any:
        binary = {c.name for c in state.schema.columns if c.type is FieldType.BYTES} if json_form else set()

        def decode(column: str, v: Any) -> bytes | None:
            if column in binary:
                return b64_or_bytes(v)
            return as_bytes(v)

        return decode

    def _emit(self, batcher: ChangeBatcher, routed: Routed, pos: Position) -> None:
        self._topic(batcher, routed.topic)
        rec = routed.record
        if batcher._max_tail is not None and batcher._already_written(routed.topic, rec.key, pos, None):
            batcher.skipped += 1
            return
        batcher._add(routed.topic, None, rec)
        batcher.events += 1
        batcher.last_position = pos
        if routed.dead:
            self.dead_letters += 1
        else:
            self.routed += 1

    def add_rows(self, batcher: ChangeBatcher, state: TableState, op: Op, rows: Sequence[Any], file: str,
                 tpos: int, index: int, gtid: str | None, server_id: int, json_rows: bool,
                 touched: set[tuple[Any, ...]] | None) -> int:
        """One binlog rows event of an outbox table; returns the next row index of the transaction."""
        from kappaflow.connectors.mysql.source_info import BinlogPosition
        from kappaflow.connectors.mysql.writer import _library_rows_to_json

        where = f"binlog {file}:{tpos}"
        if op is not Op.CREATE:
            self.router.skip_change(state.qualified, "DELETE" if op is Op.DELETE else "UPDATE", where)
            return index + len(rows)
        if not json_rows:
            rows = _library_rows_to_json(state.json_converter(batcher.codec.decimal_mode), op, rows)
        decode = self._decoder(state, True)
        for row in rows:
            pos = BinlogPosition(file, tpos, index, gtid, server_id)
            index += 1
            if touched is not None:  # the watermark snapshot must not read this row again
                touched.add(tuple(row[k] for k in state.key))
            routed = self.router.route(row, position=pos.to_dict(), where=f"{where} row {pos.row}",
                                       table=state.qualified, decode=decode)
            self._emit(batcher, routed, pos)
        return index

    def add_event(self, batcher: ChangeBatcher, state: TableState, event: ChangeEvent, pos: Position) -> None:
        """A snapshot-read row (``op=r``) of an outbox table."""
        if event.op not in (Op.READ, Op.CREATE) or event.after is None:
            return
        routed = self.router.route(event.after, position=pos.to_dict(), where=f"snapshot of {state.qualified} "
                                   f"(position {pos})", table=state.qualified, decode=self._decoder(state, False))
        self._emit(batcher, routed, pos)


def mysql_outbox(config: Any, default_db: str | None) -> MySQLOutbox | None:
    """The outbox of a MySQL/MariaDB source config (None without ``outbox``); bare names take ``default_db``."""
    router = router_for(config)
    if router is None:
        return None
    tables = set()
    for t in router.settings.tables:
        tables.add(t if "." in t else f"{default_db}.{t}")
    return MySQLOutbox(router, tables)


def attach_outbox(engine: Any, config: Any, default_db: str | None, tables: Sequence[tuple[str, str]]) -> MySQLOutbox:
    """Route the outbox tables of ``config`` in ``engine`` (``connectors/mysql/engine.CaptureEngine``).

    At capture start: each outbox table must be captured and have every configured column
    (ConfigError naming the table and the column), and the tails of the router's topics join
    the duplicate check.
    """
    outbox = mysql_outbox(config, default_db)
    assert outbox is not None
    captured = {f"{db}.{t}" for db, t in tables}
    for qualified in sorted(outbox.tables):
        if qualified not in captured:
            raise ConfigError(f"source {config.name!r}: outbox table {qualified} is not among the captured tables "
                              f"{sorted(captured)}")
        db, _, name = qualified.partition(".")
        state = engine.tracker.load(engine.ctl, db, name)
        if state is None:
            raise ConfigError(f"source {config.name!r}: outbox table {qualified} does not exist")
        outbox.check(state)
    engine.writer.outbox = outbox
    outbox.load_tails(engine.writer, engine.log)
    return outbox
