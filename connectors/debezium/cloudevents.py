"""Records written by Debezium's ``CloudEventsConverter`` -> the change event envelope they carry.

Structured mode, JSON envelope (https://debezium.io/documentation/reference/stable/integrations/cloudevents.html):
``data`` holds the row images (``before``/``after``, with a ``schema`` part when the data
converter writes one); ``iodebeziumop`` is the op; every source field is an extension
attribute ``iodebezium<field>`` (``iodebeziumtsms`` for ``ts_ms``) and the transaction's
``iodebeziumtxid``/``iodebeziumtxtotalorder``/``iodebeziumtxdatacollectionorder``; the
attributes' values are text. Rebuilding the envelope from them lets every other rule
(types, positions, ordering) apply unchanged. A record whose ``data`` is Avro
(``datacontenttype: application/avro``) cannot be read without its schema registry: it is
refused with a message that names the format, never read as a flattened row.
"""

from __future__ import annotations

from typing import Any

from kappaflow.errors import ValidationError

__all__ = ["envelope_from_cloudevent", "is_cloudevent"]

_PREFIX = "iodebezium"
# CloudEvents attribute names are lower-case letters and digits: Debezium drops the underscores
_SOURCE_NAMES = {
    "tsms": "ts_ms", "tsus": "ts_us", "tsns": "ts_ns", "serverid": "server_id", "changelsn": "change_lsn",
    "commitlsn": "commit_lsn", "eventserialno": "event_serial_no", "commitscn": "commit_scn",
    "lcrposition": "lcr_position", "rsid": "rs_id", "redothread": "redo_thread", "username": "user_name",
    "txnnumber": "txnNumber", "walltime": "wallTime",
}
_INT_FIELDS = {"ts_ms", "ts_us", "ts_ns", "lsn", "xmin", "txId", "pos", "row", "server_id", "thread", "event_serial_no",
               "ord", "txnNumber", "ssn", "redo_thread"}
_TX = {"iodebeziumtxid": "id", "iodebeziumtxtotalorder": "total_order",
       "iodebeziumtxdatacollectionorder": "data_collection_order"}


def is_cloudevent(doc: dict[str, Any]) -> bool:
    return "specversion" in doc and ("data" in doc or "data_base64" in doc) and "type" in doc


def _value(field: str, v: Any) -> Any:
    if field in _INT_FIELDS and type(v) is str and v.lstrip("-").isdigit():
        return int(v)
    if field == "snapshot" and v in ("true", "false", "last", "first", "incremental"):
        return v
    return v


def envelope_from_cloudevent(doc: dict[str, Any]) -> dict[str, Any]:
    """The Debezium envelope (possibly ``{"schema", "payload"}``) a CloudEvents record carries."""
    ctype = doc.get("datacontenttype") or "application/json"
    if "json" not in str(ctype).lower() or "data_base64" in doc or not isinstance(doc.get("data"), dict):
        raise ValidationError(
            f"value: a CloudEvents record (type {doc.get('type')!r}) with {ctype} data"
            + (f" (dataschema {doc['dataschema']})" if doc.get("dataschema") else "")
            + ": kappaflow reads CloudEvents whose data is JSON; configure the CloudEventsConverter with "
              "data.serializer.type=json")
    ev_type = str(doc.get("type", ""))
    if not ev_type.startswith("io.debezium.") or not ev_type.endswith(".datachangeevent"):
        raise ValidationError(f"type: expected io.debezium.<connector>.datachangeevent, got {ev_type!r}")
    op = doc.get(f"{_PREFIX}op")
    if op is None:
        raise ValidationError("iodebeziumop: missing (the CloudEvents record names no operation)")
    source: dict[str, Any] = {}
    tx: dict[str, Any] = {}
    for k, v in doc.items():
        if k in _TX:
            tx[_TX[k]] = int(v) if _TX[k] != "id" and type(v) is str and v.isdigit() else v
        elif k.startswith(_PREFIX) and k != f"{_PREFIX}op":
            name = k[len(_PREFIX):]
            field = _SOURCE_NAMES.get(name, name)
            source[field] = _value(field, v)
    data = doc["data"]
    schema = None
    if len(data) == 2 and "schema" in data and "payload" in data:
        schema, data = data["schema"], data["payload"]
    if type(data) is not dict:
        raise ValidationError(f"data: expected the row images as an object, got {type(data).__name__}")
    payload = {
        "before": data.get("before"),
        "after": data.get("after"),
        "source": source,
        "transaction": tx or None,
        "op": op,
        "ts_ms": source.get("ts_ms"),
    }
    if schema is None:
        return payload
    # the data schema describes before/after only: give the codec an envelope schema around it
    fields = [f for f in schema.get("fields", []) if f.get("field") in ("before", "after")] if isinstance(
        schema, dict) else []
    return {"schema": {"type": "struct", "fields": fields, "optional": False,
                       "name": str(schema.get("name", "cloudevent.data")).removesuffix(".Data") + ".Envelope"},
            "payload": payload}
