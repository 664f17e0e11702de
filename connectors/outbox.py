"""Outbox tables, routed the way Debezium's outbox event router (the ``EventRouter`` SMT) does.

Why: the outbox pattern is how a service publishes events without a dual write -- it inserts
the event into an *outbox table* in the same transaction as its state change, and the CDC
pipeline turns every inserted outbox row into a message on an event topic. Debezium does this
with a single message transform applied to the outbox table's change events; kappaflow does it
inside the PostgreSQL and MySQL/MariaDB capture, with Debezium's option names (dots become
underscores) and defaults, so a Debezium outbox setup moves over unchanged:

=====================================  ===============================  ==========================
Debezium option                        kappaflow ``[sources.X.outbox]``  default
=====================================  ===============================  ==========================
``table.field.event.id``               ``table_field_event_id``         ``id``
``table.field.event.key``              ``table_field_event_key``        ``aggregateid``
``table.field.event.payload``          ``table_field_event_payload``    ``payload``
``table.field.event.timestamp``        ``table_field_event_timestamp``  (none: the capture time)
``table.fields.additional.placement``  ``table_fields_additional_...``  ``type:header:type`` (*)
``table.expand.json.payload``          ``table_expand_json_payload``    ``false``
``table.op.invalid.behavior``          ``table_op_invalid_behavior``    ``warn``
``route.by.field``                     ``route_by_field``               ``aggregatetype``
``route.topic.regex``                  ``route_topic_regex``            ``(?<routedByValue>.*)``
``route.topic.replacement``            ``route_topic_replacement``      ``outbox.event.${routedByValue}``
``route.tombstone.on.empty.payload``   ``route_tombstone_on_empty_...`` ``false``
=====================================  ===============================  ==========================

(*) Debezium's default is empty; the ``type`` column is the one the documented outbox table
has, so kappaflow puts it in a ``type`` header unless told otherwise (set ``""`` for none).

What one outbox row becomes (an INSERT, or a row read by the initial snapshot):

* topic: ``route_topic_replacement`` with ``${routedByValue}`` (or any group of
  ``route_topic_regex``) filled from the ``route_by_field`` column, e.g. ``outbox.event.order``;
  these are *event topics* (cleanup policy ``delete``: every event stays, unlike the compacted
  table topics), which a custom-fold projection reads with ``Source(topic, events=True)``;
* key: the ``table_field_event_key`` value as a JSON string (``"1"``), what Debezium's
  ``JsonConverter`` writes for it, so every event of one aggregate lands in one partition in
  commit order;
* value: the payload column's bytes, unwrapped (Debezium with a string/binary value
  converter); ``table_expand_json_payload`` parses it as JSON and writes it compacted, and as
  Debezium does keeps a payload that does not parse as it is (a warning, and the header
  ``kf.outbox.payload: invalid-json``); a NULL payload (or an empty one with
  ``route_tombstone_on_empty_payload``) gives a record without a value; columns placed in the
  ``envelope`` make the value ``{"payload": ..., "<alias>": ...}``;
* headers: ``id`` (the event id), each ``header`` placement, plus kappaflow's own ``kf.pos``
  (the source position) and ``kf.outbox`` (the source's name).

DELETEs of outbox rows are skipped (the usual pattern deletes the row right after inserting
it, in the same transaction: only the INSERT produces an event), and so is a TRUNCATE of the
outbox table. An UPDATE is not expected (the table is a queue): by ``table_op_invalid_behavior``
it is skipped with a warning (``warn``), skipped with an error in the log (``error``) or stops the
capture (``fatal``), as in Debezium.

A row that cannot be routed -- a NULL ``route_by_field`` or ``table_field_event_key`` value, a
value that makes no legal topic name -- goes to the source's dead-letter topic
``kf.dead_letter.source.<source>`` (``kappaflow/deadletters.py``) with the reason, the table and
the row's source position; the capture goes on. A configured column the outbox table does not
have stops the capture at its start with an error naming the table and the column.

PostgreSQL only: ``message_prefix`` routes ``pg_logical_emit_message(transactional, prefix,
content)`` messages with that prefix as outbox events without a table: ``content`` is a JSON
object whose fields play the columns' part (``{"id": ..., "aggregatetype": "order",
"aggregateid": "7", "type": "OrderCreated", "payload": {...}}``). A transactional message is
an event of its transaction (at the transaction's commit position); a non-transactional one is
an event at its own WAL position.

Exactly once: every routed record carries its source position (``kf.pos``) and the source's name
(``kf.outbox``). At start the capture reads the last such record of every partition of the
topics this router writes (those matching ``route_topic_replacement``, and the dead-letter topic)
and skips what the log already holds -- the same argument as for table topics
(``connectors/base.py``). Known gap: an interrupted *snapshot* that is resumed can read an outbox
row that the stream delivers again (the snapshot's position is older than the row's commit); its
``id`` header is the same on both, which is what Debezium tells consumers to deduplicate on.
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from kappaflow.connectors.history import history_topic_names
from kappaflow.deadletters import dead_letter_topic
from kappaflow.errors import ConfigError, Retry, SourceError
from kappaflow.log.base import Record

if TYPE_CHECKING:
    from kappaflow.log.base import Log, LogRecord

__all__ = [
    "DEBEZIUM_OPTIONS",
    "MESSAGE_KEY",
    "OUTBOX_HEADER",
    "OutboxRouter",
    "OutboxSettings",
    "Routed",
    "append_only_topics",
    "as_bytes",
    "check_outbox_tables",
    "outbox_options",
]

_log = logging.getLogger("kappaflow.connectors.outbox")

OUTBOX_HEADER = "kf.outbox"  # the source that routed the record: tails are read per source
POSITION_HEADER = "kf.pos"  # as connectors/base.py (not imported: config.py imports this module)
PAYLOAD_HEADER = "kf.outbox.payload"
MESSAGE_KEY = "message:"  # PgCapture.mappers key of the logical-message router: "message:<prefix>"

# Debezium's option name -> kappaflow's field (the CLI's --outbox-option takes either spelling)
DEBEZIUM_OPTIONS: dict[str, str] = {
    "table.field.event.id": "table_field_event_id",
    "table.field.event.key": "table_field_event_key",
    "table.field.event.payload": "table_field_event_payload",
    "table.field.event.timestamp": "table_field_event_timestamp",
    "table.fields.additional.placement": "table_fields_additional_placement",
    "table.expand.json.payload": "table_expand_json_payload",
    "table.op.invalid.behavior": "table_op_invalid_behavior",
    "route.by.field": "route_by_field",
    "route.topic.regex": "route_topic_regex",
    "route.topic.replacement": "route_topic_replacement",
    "route.tombstone.on.empty.payload": "route_tombstone_on_empty_payload",
}

_TOPIC_OK = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's legal topic names
_JAVA_GROUP = re.compile(r"\(\?<([A-Za-z][A-Za-z0-9]*)>")  # (?<name>...) -> (?P<name>...)
_REPL_REF = re.compile(r"\\(.)|\$\{([A-Za-z][A-Za-z0-9]*)\}|\$(\d)")  # Java Matcher.replaceAll syntax


def _python_regex(java: str) -> str:
    return _JAVA_GROUP.sub(r"(?P<\1>", java)


class OutboxSettings(BaseModel):
    """``[sources.NAME.outbox]``: which tables are outboxes and how their rows are routed.

    Field names are Debezium's ``EventRouter`` options with ``_`` for ``.`` (see the module
    docstring for the table and the one different default).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tables: list[str] = []
    message_prefix: str | None = None  # PostgreSQL: pg_logical_emit_message prefix routed as outbox events
    table_field_event_id: str = "id"
    table_field_event_key: str = "aggregateid"
    table_field_event_payload: str = "payload"
    table_field_event_timestamp: str | None = None
    table_fields_additional_placement: str = "type:header:type"
    table_expand_json_payload: bool = False
    table_op_invalid_behavior: Literal["warn", "error", "fatal"] = "warn"
    route_by_field: str = "aggregatetype"
    route_topic_regex: str = "(?<routedByValue>.*)"
    route_topic_replacement: str = "outbox.event.${routedByValue}"
    route_tombstone_on_empty_payload: bool = False

    @field_validator("table_fields_additional_placement")
    @classmethod
    def _placement(cls, v: str) -> str:
        parse_placement(v)
        return v

    @field_validator("route_topic_regex")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(_python_regex(v))
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _routes(self) -> OutboxSettings:
        if not self.tables and not self.message_prefix:
            raise ValueError("names no outbox: give tables = [\"schema.table\"] and/or message_prefix")
        regex = re.compile(_python_regex(self.route_topic_regex))
        for m in _REPL_REF.finditer(self.route_topic_replacement):
            name, num = m.group(2), m.group(3)
            if name is not None and name not in regex.groupindex:
                raise ValueError(f"route_topic_replacement refers to ${{{name}}}, a group route_topic_regex "
                                 f"({self.route_topic_regex!r}) does not have")
            if num is not None and int(num) > regex.groups:
                raise ValueError(f"route_topic_replacement refers to group ${num}; route_topic_regex has "
                                 f"{regex.groups}")
        return self


@dataclass(frozen=True)
class Placement:
    column: str
    where: Literal["header", "envelope"]
    alias: str


def parse_placement(spec: str) -> list[Placement]:
    """``col:header[:alias],col:envelope[:alias]`` (Debezium's ``table.fields.additional.placement``)."""
    out: list[Placement] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        bits = part.split(":")
        if len(bits) not in (2, 3) or not bits[0] or bits[1] not in ("header", "envelope", "partition"):
            raise ValueError(f"{part!r}: expected column:header[:alias] or column:envelope[:alias]")
        if bits[1] == "partition":
            raise ValueError(f"{part!r}: the 'partition' placement is not supported (kappaflow partitions "
                             "by the record key, so all events of one aggregate stay in order)")
        out.append(Placement(bits[0], bits[1], bits[2] if len(bits) == 3 and bits[2] else bits[0]))  # type: ignore[arg-type]
    return out


def outbox_options(pairs: Iterable[str]) -> dict[str, str]:
    """CLI ``--outbox-option KEY=VALUE`` pairs -> settings fields (Debezium's dotted names accepted)."""
    out: dict[str, str] = {}
    fields = set(OutboxSettings.model_fields)
    for pair in pairs:
        k, sep, v = pair.partition("=")
        k = k.strip()
        name = DEBEZIUM_OPTIONS.get(k, k.replace(".", "_"))
        if not sep or name not in fields or name in ("tables", "message_prefix"):
            known = ", ".join(sorted(DEBEZIUM_OPTIONS))
            raise ConfigError(f"--outbox-option {pair!r}: expected KEY=VALUE with KEY one of {known} "
                              "(or the same with '_' for '.')")
        out[name] = v
    return out


def check_outbox_tables(name: str, tables: list[str], outbox: OutboxSettings | None) -> None:
    """An outbox table must be captured: with an explicit table list it must be on it."""
    if outbox is None or not tables:
        return
    missing = [t for t in outbox.tables if t not in tables]
    if missing:
        raise ValueError(f"outbox.tables: {missing} not among the source's tables {tables}; add them to "
                         "tables (`kappaflow source add --outbox-table` does)")


# -- values ----------------------------------------------------------------------------------
def as_bytes(v: Any) -> bytes | None:
    """A column value as the bytes a string converter would write (JSON for structured values)."""
    if v is None:
        return None
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bool):
        return b"true" if v else b"false"
    if isinstance(v, (dict, list)):
        return orjson.dumps(v)
    if isinstance(v, datetime):
        return v.isoformat().encode()
    return str(v).encode()


def _timestamp_ms(v: Any) -> int | None:
    """An event timestamp column's value -> epoch ms (integers are taken as ms; text as ISO 8601, naive = UTC)."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError(f"expected a timestamp, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, datetime):
        dt = v
    else:
        s = (v.decode() if isinstance(v, bytes) else str(v)).strip()
        if s.lstrip("-").isdigit():
            return int(s)
        if re.search(r"[+-]\d\d$", s):
            s += ":00"  # PostgreSQL's "+00" offset
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class Routed:
    """What one outbox row or message became: a record for ``topic`` (``dead``: a dead letter)."""

    topic: str
    record: Record
    dead: bool = False


class OutboxRouter:
    """Routes outbox rows of one source (database-neutral: rows are column -> value mappings).

    Values may be what PostgreSQL's text output gives (bytes), JSON-form values (str, int,
    dict, ...) or Python values; ``decode`` turns a column's raw value into bytes where the
    database needs it (PostgreSQL ``bytea`` hex text, MySQL BLOBs as base64 in JSON form).
    """

    def __init__(self, settings: OutboxSettings, source: str) -> None:
        self.settings = settings
        self.source = source
        self.placements = parse_placement(settings.table_fields_additional_placement)
        self.envelope = [p for p in self.placements if p.where == "envelope"]
        self.headers = [p for p in self.placements if p.where == "header"]
        self.regex = re.compile(_python_regex(settings.route_topic_regex))
        self.dead_letter_topic = dead_letter_topic("source", source)
        self.source_header = (OUTBOX_HEADER, source.encode())
        # the topics the replacement can produce: its literal text around ".*" per group reference
        parts: list[str] = []
        last = 0
        for m in _REPL_REF.finditer(settings.route_topic_replacement):
            parts.append(re.escape(settings.route_topic_replacement[last:m.start()]))
            parts.append(re.escape(m.group(1)) if m.group(1) is not None else ".*")
            last = m.end()
        parts.append(re.escape(settings.route_topic_replacement[last:]))
        self._topic_pattern = re.compile("".join(parts))
        self.invalid_json = 0  # payloads kept as they were (table_expand_json_payload)
        self.skipped_updates = 0

    # -- configuration checks ---------------------------------------------------------------
    def required_columns(self) -> list[tuple[str, str]]:
        """(column, the option naming it) for every column a routed row is read from."""
        s = self.settings
        cols = [(s.table_field_event_id, "table_field_event_id"), (s.table_field_event_key, "table_field_event_key"),
                (s.table_field_event_payload, "table_field_event_payload"), (s.route_by_field, "route_by_field")]
        if s.table_field_event_timestamp:
            cols.append((s.table_field_event_timestamp, "table_field_event_timestamp"))
        cols += [(p.column, "table_fields_additional_placement") for p in self.placements]
        return cols

    def check_columns(self, table: str, columns: Iterable[str]) -> None:
        """ConfigError naming the table and the first configured column it lacks."""
        have = list(columns)
        for col, option in self.required_columns():
            if col not in have:
                debezium = next((k for k, v in DEBEZIUM_OPTIONS.items() if v == option), option)
                raise ConfigError(f"source {self.source!r}: outbox table {table} has no column {col!r} (named by "
                                  f"outbox.{option}, Debezium's {debezium}); its columns are {have}",
                                  retry=Retry.TERMINAL)

    # -- topics ---------------------------------------------------------------------------
    def owns_topic(self, topic: str) -> bool:
        """True for topics this router writes (their tails are read at start)."""
        return topic == self.dead_letter_topic or self._topic_pattern.fullmatch(topic) is not None

    def is_ours(self, headers: Iterable[tuple[str, bytes]]) -> bool:
        return any(h == self.source_header for h in headers)

    @staticmethod
    def position_of(rec: LogRecord) -> dict[str, Any] | None:
        for name, value in rec.headers:
            if name == POSITION_HEADER:
                d: dict[str, Any] = orjson.loads(value)
                return d
        return None

    def topic_for(self, value: str) -> str | None:
        """The topic a routed-by value goes to (None: the regex does not match it)."""
        m = self.regex.fullmatch(value)
        if m is None:
            return None

        def ref(r: re.Match[str]) -> str:
            if r.group(1) is not None:
                return r.group(1)
            g = r.group(2) if r.group(2) is not None else int(r.group(3))
            return m.group(g) or ""

        return _REPL_REF.sub(ref, self.settings.route_topic_replacement)

    # -- changes other than inserts -------------------------------------------------------
    def skip_change(self, table: str, op: str, where: str) -> bool:
        """True: skip this DELETE/TRUNCATE/UPDATE of an outbox table; raises for ``fatal`` updates."""
        if op in ("DELETE", "TRUNCATE"):
            return True  # Debezium's router filters deletes out: outbox rows are deleted right after insert
        behavior = self.settings.table_op_invalid_behavior
        msg = (f"source {self.source!r}: {op} of outbox table {table} at {where}: an outbox table takes "
               "INSERTs only (table_op_invalid_behavior)")
        if behavior == "fatal":
            raise SourceError(msg + "; the capture stops (table_op_invalid_behavior = 'fatal')", retry=Retry.TERMINAL)
        self.skipped_updates += 1
        (_log.error if behavior == "error" else _log.warning)("%s; skipped", msg)
        return True

    # -- routing ---------------------------------------------------------------------------
    def route(self, row: Mapping[str, Any], *, position: Mapping[str, Any], where: str, table: str | None,
              decode: Callable[[str, Any], bytes | None] | None = None, now_ms: int | None = None) -> Routed:
        """The record for one inserted outbox row (or message), or a dead letter saying why not."""
        s = self.settings
        text = decode or (lambda _c, v: as_bytes(v))
        pos = orjson.dumps(dict(position))
        base_headers: tuple[tuple[str, bytes], ...] = ((POSITION_HEADER, pos), self.source_header)
        routed_by = text(s.route_by_field, row.get(s.route_by_field))
        if routed_by is None:
            return self.dead_letter(f"{s.route_by_field} (route_by_field) is NULL", row, table, where, position,
                                    text)
        key_value = text(s.table_field_event_key, row.get(s.table_field_event_key))
        if key_value is None:
            return self.dead_letter(f"{s.table_field_event_key} (table_field_event_key) is NULL", row, table, where,
                                    position, text)
        try:
            routed_str = routed_by.decode()
            key_str = key_value.decode()
        except UnicodeDecodeError:
            return self.dead_letter("the routed-by or key value is not UTF-8 text", row, table, where, position,
                                    text)
        topic = self.topic_for(routed_str)
        if topic is None:
            return self.dead_letter(f"{s.route_by_field} value {routed_str!r} does not match route_topic_regex "
                                    f"{s.route_topic_regex!r}", row, table, where, position, text)
        if not _TOPIC_OK.match(topic) or topic.startswith("kf.") or topic.startswith(f"{self.source}."):
            return self.dead_letter(
                f"{s.route_by_field} value {routed_str!r} gives topic {topic!r}, not a legal event topic (letters, "
                f"digits, '.', '_', '-'; not kf.* nor under {self.source}., where the source's table topics live)",
                row, table, where, position, text)
        headers: list[tuple[str, bytes]] = []
        event_id = text(s.table_field_event_id, row.get(s.table_field_event_id))
        if event_id is not None:
            headers.append(("id", event_id))
        for p in self.headers:
            v = text(p.column, row.get(p.column))
            if v is not None:
                headers.append((p.alias, v))
        payload = text(s.table_field_event_payload, row.get(s.table_field_event_payload))
        value: bytes | None = payload
        if payload is not None and s.table_expand_json_payload:
            value = self._expand(payload, where, headers)
        if payload is None or (s.route_tombstone_on_empty_payload and not payload.strip()):
            value = None
        elif self.envelope:
            env: dict[str, Any] = {"payload": self._json_or_text(value)}
            for p in self.envelope:
                v = row.get(p.column)
                env[p.alias] = v.decode(errors="replace") if isinstance(v, bytes) else v
            value = orjson.dumps(env, default=str)
        ts: int | None = now_ms
        if s.table_field_event_timestamp:
            try:
                ts = _timestamp_ms(row.get(s.table_field_event_timestamp)) or now_ms
            except (ValueError, TypeError) as exc:
                return self.dead_letter(f"{s.table_field_event_timestamp} (table_field_event_timestamp): {exc}", row,
                                  table, where, position, text)
        return Routed(topic, Record(orjson.dumps(key_str), value, (*headers, *base_headers), ts))

    def _expand(self, payload: bytes, where: str, headers: list[tuple[str, bytes]]) -> bytes:
        """Debezium's table.expand.json.payload: JSON compacted; what does not parse stays as it is."""
        stripped = payload.lstrip()
        if stripped[:1] in (b"{", b"["):
            try:
                return orjson.dumps(orjson.loads(payload))
            except orjson.JSONDecodeError:
                pass
        self.invalid_json += 1
        _log.warning("source %r: outbox payload at %s is not a JSON object or array; kept as it is",
                     self.source, where)
        headers.append((PAYLOAD_HEADER, b"invalid-json"))
        return payload

    @staticmethod
    def _json_or_text(value: bytes | None) -> Any:
        if value is None:
            return None
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value.decode(errors="replace")

    def dead_letter(self, reason: str, row: Mapping[str, Any], table: str | None, where: str,
                    position: Mapping[str, Any], text: Callable[[str, Any], bytes | None] | None = None) -> Routed:
        """A dead letter for a row (or message) that cannot be routed: the reason, where, the row as text."""
        text = text or (lambda _c, v: as_bytes(v))
        base_headers = ((POSITION_HEADER, orjson.dumps(dict(position))), self.source_header)
        what = f"outbox table {table}" if table else "outbox message"
        full = f"{what} row at {where}: {reason}"
        doc = {
            "reason": full,
            "source": self.source,
            "table": table,
            "where": where,
            "position": dict(position),
            "row": {k: (None if (b := text(k, v)) is None else b.decode(errors="replace")) for k, v in row.items()},
        }
        _log.warning("source %r: %s; sent to %s", self.source, full, self.dead_letter_topic)
        return Routed(self.dead_letter_topic,
                      Record(None, orjson.dumps(doc), (("kf.error", full.encode()[:500]), *base_headers)), dead=True)

    # -- start: what the log already holds -----------------------------------------------------
    def tails(self, log: Log) -> dict[tuple[str, int], dict[str, Any]]:
        """The ``kf.pos`` of the last record this source routed in every partition of its topics."""
        from kappaflow.connectors.offsets import find_last

        out: dict[tuple[str, int], dict[str, Any]] = {}
        for topic, cfg in log.list_topics().items():
            if not self.owns_topic(topic):
                continue
            for p in range(cfg.partitions):
                rec = find_last(log, topic, p, lambda r: self.is_ours(r.headers))
                if rec is not None:
                    pos = self.position_of(rec)
                    if pos is not None:
                        out[(topic, p)] = pos
        return out


# -- registry hooks ------------------------------------------------------------------------------
def router_for(config: Any) -> OutboxRouter | None:
    outbox = getattr(config, "outbox", None)
    return None if outbox is None else OutboxRouter(outbox, config.name)


def append_only_topics(config: Any, log: Log, topics: Mapping[str, Any]) -> set[str]:
    """The transaction topic, the keep_history tables' topics, plus the outbox's event topics and
    dead-letter topic (cleanup ``delete``)."""
    out = {f"{config.name}.transaction"} | set(history_topic_names(config).values())  # keep_history tables
    router = router_for(config)
    if router is not None:
        out |= {t for t in topics if router.owns_topic(t)} | {router.dead_letter_topic}
    return out


def b64_or_bytes(v: Any) -> bytes | None:
    """A binary column in JSON form (base64 text, Debezium's binary.handling.mode=bytes) -> bytes."""
    if v is None or isinstance(v, bytes):
        return v
    try:
        return base64.b64decode(v, validate=True)
    except (ValueError, TypeError):
        return as_bytes(v)
