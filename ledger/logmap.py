"""How a ledger event becomes a log record (for the PostgreSQL connector or any relay).

The connector captures ``<schema>.events`` (insert-only, primary key = position) and, instead
of a generic change envelope, emits for each inserted row:

- topic ``<source>.<stream_type>`` (one topic per stream type; characters outside
  ``[A-Za-z0-9._-]`` become ``_``),
- key = the stream id as UTF-8 bytes (all events of a stream land in one partition, in order),
- value = the domain event as JSON (`event_value`), headers carry the position and event type,
  and one ``kf.ledger.tag`` header per tag of the event (``course:7``), so projections can route
  or filter on tags without parsing the value (the value carries them too, as ``tags``).

Duplicates after a connector restart carry the same ledger position (header
``kf.ledger.position``): a consumer drops positions <= the last one it processed.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from collections.abc import Mapping
from typing import Any

import orjson

from kappaflow.errors import ValidationError
from kappaflow.ledger.events import RecordedEvent
from kappaflow.ledger.query import parse_text_array
from kappaflow.log.base import Record

POSITION_HEADER = "kf.ledger.position"
EVENT_TYPE_HEADER = "kf.ledger.event_type"
TAG_HEADER = "kf.ledger.tag"
_TOPIC_BAD = re.compile(r"[^A-Za-z0-9._-]")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MS = dt.timedelta(milliseconds=1)


def ledger_topic(source: str, stream_type: str) -> str:
    return f"{source}.{_TOPIC_BAD.sub('_', stream_type)}"


def event_value(row: Mapping[str, Any]) -> dict[str, Any]:
    """The domain event (JSON-safe) from an events-table row as a connector decodes it.

    Accepts both the connector's JSON form (jsonb as JSON text, bytea as base64, timestamptz
    as ISO text) and plain driver values (dicts, bytes, datetimes).
    """
    try:
        data = row["payload"]
        meta = row.get("metadata") or {}
        return {
            "position": int(row["position"]),
            "stream_id": row["stream_id"],
            "stream_type": row["stream_type"],
            "stream_version": int(row["stream_version"]),
            "event_type": row["event_type"],
            "schema_version": int(row["schema_version"]),
            "data": orjson.loads(data) if isinstance(data, str | bytes) else data,
            "metadata": orjson.loads(meta) if isinstance(meta, str | bytes) else meta,
            "recorded_at": recorded_at_text(row["recorded_at"]),
            "idempotency_key": row.get("idempotency_key"),
            "hash": _hex(row.get("hash")),
            **_tags_entry(row.get("tags")),
        }
    except KeyError as exc:
        raise ValidationError(f"ledger event row: missing column {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise ValidationError(f"ledger event row at position {row.get('position')!r}: {exc}") from None


def _tags_entry(tags: Any) -> dict[str, list[str]]:
    """``{"tags": [...]}`` for a tagged event, ``{}`` otherwise (untagged records keep their bytes)."""
    if tags is None:
        return {}
    if isinstance(tags, bytes):
        tags = tags.decode()
    if isinstance(tags, str):
        tags = parse_text_array(tags)
    return {"tags": list(tags)} if tags else {}


def _headers(position: int, event_type: str, tags: Any) -> tuple[tuple[str, bytes], ...]:
    base = ((POSITION_HEADER, b"%d" % position), (EVENT_TYPE_HEADER, event_type.encode()))
    if not tags:
        return base
    return base + tuple((TAG_HEADER, t.encode()) for t in tags)


def record_tags(headers: Any) -> list[str]:
    """The tags of a ledger record, from its ``kf.ledger.tag`` headers."""
    return [v.decode() for k, v in headers if k == TAG_HEADER]


def recorded_at_text(at: Any) -> str:
    """The canonical text of a recording time: ISO 8601 in UTC (``...+00:00``).

    One form whatever the reading session's TimeZone, so every path into the log (the
    connector, which sees UTC text, and the relay, which sees driver datetimes) agrees.
    """
    return _utc(at).isoformat()


def _utc(at: Any) -> dt.datetime:
    if isinstance(at, str):
        at = dt.datetime.fromisoformat(at)
    if not isinstance(at, dt.datetime):
        raise ValidationError(f"ledger event recorded_at: expected a timestamp, got {at!r}")
    return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)


def _epoch_ms(at: dt.datetime) -> int:
    return (at - _EPOCH) // _MS


def _hex(value: Any) -> str | None:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, str):  # base64, as Debezium's JSON encodes bytes
        return base64.b64decode(value).hex()
    return None


def text_row_record(source: str, row: Mapping[str, bytes | None]) -> tuple[str, Record, int]:
    """(topic, record, position) from an events-table row in PostgreSQL's text output form (what
    the connector receives; TimeZone UTC, bytea as hex): the same bytes as `to_log_record`,
    converting each column once."""
    r: Any = row  # NULL in a NOT NULL column fails below (AttributeError/TypeError)
    try:
        position = int(r["position"])
        at = _utc(dt.datetime.fromisoformat(r["recorded_at"].decode()))
        key = r.get("idempotency_key")
        h = r.get("hash")
        value = {
            "position": position,
            "stream_id": r["stream_id"].decode(),
            "stream_type": r["stream_type"].decode(),
            "stream_version": int(r["stream_version"]),
            "event_type": r["event_type"].decode(),
            "schema_version": int(r["schema_version"]),
            "data": orjson.loads(r["payload"]),
            "metadata": orjson.loads(r["metadata"] or b"{}"),
            "recorded_at": at.isoformat(),
            "idempotency_key": None if key is None else key.decode(),
            "hash": h[2:].decode() if h is not None and h[:2] == b"\\x" else _hex(h),
            **_tags_entry(r.get("tags")),
        }
    except KeyError as exc:
        raise ValidationError(f"ledger event row: missing column {exc.args[0]!r}") from None
    except (AttributeError, TypeError, ValueError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise ValidationError(f"ledger event row at position {row.get('position')!r}: "
                              f"{type(exc).__name__}: {exc}") from None
    headers = _headers(position, value["event_type"], value.get("tags"))
    return ledger_topic(source, value["stream_type"]), Record(
        key=value["stream_id"].encode(), value=orjson.dumps(value), headers=headers,
        timestamp_ms=_epoch_ms(at)), position


class LogRedactor:
    """Replaces the personal-data envelopes of forgotten subjects by the marker in records about to
    be written to the log (the ledger source and the relay share it, so both write the same)."""

    def __init__(self, forgotten: Any) -> None:
        self.forgotten = forgotten  # a kappaflow.ledger.personal.ForgottenSubjects

    def redact(self, record: Record) -> Record:
        value = record.value
        if value is None:
            return record
        new = self.forgotten.redact_value(value)
        if new is value:
            return record
        return Record(key=record.key, value=new, headers=record.headers, timestamp_ms=record.timestamp_ms)


def to_log_record(source: str, row: Mapping[str, Any] | RecordedEvent) -> tuple[str, Record]:
    """(topic, record) for one ledger event; the same bytes from a `RecordedEvent` (relay) and
    from an events-table row (connector)."""
    if isinstance(row, RecordedEvent):
        if row.hash is None:
            raise ValidationError(f"ledger event at position {row.position}: read without its hash; a log record "
                                  "carries it (read with hashes=True)")
        value = row.to_dict()
        at = _utc(row.recorded_at)
        value["recorded_at"] = at.isoformat()
    else:
        value = event_value(row)
        at = _utc(value["recorded_at"])
    headers = _headers(int(value["position"]), str(value["event_type"]), value.get("tags"))
    return ledger_topic(source, value["stream_type"]), Record(
        key=str(value["stream_id"]).encode(), value=orjson.dumps(value), headers=headers,
        timestamp_ms=_epoch_ms(at))
