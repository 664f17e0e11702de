"""Debezium's MongoDB connector: documents as JSON strings -> rows of (id, document).

A MongoDB change event carries the document as a string of MongoDB extended JSON in
``after`` (and ``before`` with pre-images), keyed by ``{"id": "<the _id as extended JSON>"}``
(https://debezium.io/documentation/reference/stable/connectors/mongodb.html). kappaflow keeps
a collection as a table of two columns: ``id`` (the key, that string) and ``document`` (the
document, a JSON column, extended JSON as MongoDB wrote it: nothing is lost or guessed).

An update in the default ``change_streams`` capture mode has no ``after``, only an
``updateDescription`` (``updatedFields`` as a JSON string of dotted paths, ``removedFields``,
``truncatedArrays``). Such an event's ``document`` is unavailable, and the source repairs it
from the key's last document with :func:`apply_update` -- the same keyed state that fills
unchanged TOAST columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kappaflow.errors import ValidationError
from kappaflow.events import Column, FieldType, TableSchema

__all__ = ["apply_update", "document_row", "is_mongodb", "mongodb_schema"]


def is_mongodb(payload: Mapping[str, Any]) -> bool:
    src = payload.get("source")
    return type(src) is dict and src.get("connector") == "mongodb"


def mongodb_schema(topic: str) -> TableSchema:
    return TableSchema(topic, (Column("id", FieldType.STRING, optional=False, native_type="mongodb _id"),
                               Column("document", FieldType.JSON, native_type="mongodb document")), ("id",))


def _parse(v: Any, part: str) -> Any:
    if v is None:
        return None
    if type(v) is not str:
        raise ValidationError(f"{part}: expected the document as a string of extended JSON, got {type(v).__name__}")
    try:
        return orjson.loads(v)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"{part}: not JSON ({exc})") from None


def document_row(key_id: str, v: Any, part: str) -> dict[str, Any] | None:
    doc = _parse(v, part)
    return None if doc is None else {"id": key_id, "document": doc}


def apply_update(document: dict[str, Any], description: Mapping[str, Any]) -> dict[str, Any]:
    """A change stream's ``updateDescription`` applied to the previous document (dotted paths)."""
    out = orjson.loads(orjson.dumps(document))
    updated = _parse(description.get("updatedFields"), "updateDescription.updatedFields") or {}
    for path, value in updated.items():
        _set(out, path.split("."), value)
    for path in description.get("removedFields") or ():
        _remove(out, str(path).split("."))
    for t in description.get("truncatedArrays") or ():
        arr = _get(out, str(t.get("field", "")).split("."))
        if isinstance(arr, list):
            del arr[int(t.get("size", t.get("newSize", len(arr)))):]
    return out


def _get(d: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(d, dict):
            d = d.get(p)
        elif isinstance(d, list) and p.isdigit() and int(p) < len(d):
            d = d[int(p)]
        else:
            return None
    return d


def _set(d: Any, parts: list[str], value: Any) -> None:
    for p in parts[:-1]:
        nxt = d.get(p) if isinstance(d, dict) else (d[int(p)] if isinstance(d, list) and p.isdigit() else None)
        if nxt is None and isinstance(d, dict):
            nxt = d[p] = {}
        d = nxt
    last = parts[-1]
    if isinstance(d, dict):
        d[last] = value
    elif isinstance(d, list) and last.isdigit():
        i = int(last)
        d.extend([None] * (i + 1 - len(d)))
        d[i] = value


def _remove(d: Any, parts: list[str]) -> None:
    parent = _get(d, parts[:-1]) if len(parts) > 1 else d
    if isinstance(parent, dict):
        parent.pop(parts[-1], None)
