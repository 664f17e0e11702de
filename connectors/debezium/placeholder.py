"""Debezium's "unavailable value" placeholder -> kappaflow's unavailable marker, and the repair.

PostgreSQL does not resend an unchanged TOASTed value (a column larger than ~2 kB) in an
UPDATE, nor in the before image of a DELETE, unless it is part of the replica identity.
Debezium writes a placeholder for it, ``unavailable.value.placeholder`` (default
``__debezium_unavailable_value``), converted to something the column's type can hold
(``UnchangedToastedPlaceholder`` in Debezium's PostgreSQL connector):

=========================  ===========================================================
column type                placeholder as the JSON converter writes it
=========================  ===========================================================
text-like, json, jsonb     the placeholder string
bytea                      its bytes: base64 (binary.handling.mode=bytes/base64), URL-safe
                           base64, or hex
hstore                     ``{"<p>": "<p>"}`` (map mode) or that map as a JSON string
text[] / varchar[]         ``["<p>"]``; bytea[]: ``["<base64 of p>"]``
int[] / bigint[] / ...     one element per byte of the placeholder: ``[95, 95, 100, ...]``
uuid[]                     ``["<UUID v3 of the placeholder's bytes>"]``
geometry / geography       ``{"wkb": <SRID=4326;POINT(-99999999 -99999999)>, "srid": 4326}``
                           (geography: ``POINT(179.999999 89.999999)``)
point                      ``{"x": -99999999, "y": -99999999, ...}``
=========================  ===========================================================

None of these is a value: such a column becomes *unknown* (absent from the row, named in the
event's ``unavailable``), never the placeholder. :class:`ToastState` then repairs it the way
the PostgreSQL connector does: from the last value the key had in kappaflow's log (keyed
state, rebuilt from the log after a restart), so a projection keeps the previous value.
"""

from __future__ import annotations

import hashlib
import uuid
from base64 import b64encode, urlsafe_b64encode
from collections.abc import Iterable
from typing import Any

import orjson

from kappaflow.events import FieldType, TableSchema

__all__ = ["DEFAULT_PLACEHOLDER", "Placeholder", "ToastState", "screen_for"]

DEFAULT_PLACEHOLDER = "__debezium_unavailable_value"

# Debezium's geometry/geography placeholders (UnchangedToastedPlaceholder), WKB in hex
_GEOMETRY_WKB = bytes.fromhex("0101000020E6100000000000FC83D797C1000000FC83D797C1")
_GEOGRAPHY_WKB = bytes.fromhex("0101000020E61000000C21E7FDFF7F66401842CEFBFF7F5640")


def _java_name_uuid(data: bytes) -> str:
    """``java.util.UUID.nameUUIDFromBytes``: MD5 of the bytes, version 3, IETF variant."""
    return str(uuid.UUID(bytes=hashlib.md5(data).digest(), version=3))


class Placeholder:
    """Recognises every form of one placeholder text in a row as Debezium's JSON converter wrote it."""

    def __init__(self, text: str = DEFAULT_PLACEHOLDER) -> None:
        raw = text.encode()
        self.text = text
        b64 = b64encode(raw).decode()
        self._strings = frozenset({
            text, b64, urlsafe_b64encode(raw).decode(), raw.hex(), raw.hex().upper(),
            orjson.dumps({text: text}).decode(), f'{{"{text}" : "{text}"}}',  # hstore as JSON
        })
        uid = _java_name_uuid(raw)
        self._lists: tuple[list[Any], ...] = (
            [text], [b64], [raw], list(raw), [uid], [uuid.UUID(uid)],
        )
        self._wkb = frozenset({b64encode(_GEOMETRY_WKB).decode(), b64encode(_GEOGRAPHY_WKB).decode(),
                               _GEOMETRY_WKB.hex(), _GEOGRAPHY_WKB.hex(), _GEOMETRY_WKB, _GEOGRAPHY_WKB})
        self._raw = raw

    def matches(self, v: Any) -> bool:
        """A column value (as written on the wire, or decoded to Python) that is the placeholder."""
        t = type(v)
        if t is str:
            return v in self._strings
        if t is bytes:
            return v == self._raw
        if t is list:
            return bool(v) and any(v == p for p in self._lists)
        if t is dict:
            if len(v) == 1 and v.get(self.text) == self.text:  # hstore, map mode
                return True
            wkb = v.get("wkb")
            if (type(wkb) is str or type(wkb) is bytes) and wkb in self._wkb:
                return True
            return v.get("x") in (-99999999, -99999999.0) and v.get("y") in (-99999999, -99999999.0)
        return False

    def strip(self, row: dict[str, Any] | None) -> list[str]:
        """Remove the columns holding the placeholder from a row; returns their names."""
        if not row:
            return []
        strings = self._strings
        gone: list[str] = []
        for k, v in row.items():
            t = type(v)
            if t is str:
                if v in strings:
                    gone.append(k)
            elif (t is dict or t is list or t is bytes) and self.matches(v):
                gone.append(k)
        for k in gone:
            del row[k]
        return gone

    scan = strip

    def suspect(self, screen: tuple[tuple[str, int], ...], row: dict[str, Any]) -> bool:
        """A row as the message has it (JSON values) with a column that is, or may decode to, the
        placeholder; ``screen`` (``screen_for``) says how each column's JSON decodes. False: no
        column of the decoded row ``matches``, so there is nothing to ``scan``."""
        strings = self._strings
        for name, how in screen:
            v = row.get(name)
            if v is None:
                continue
            if how == _AS_TEXT:
                if type(v) is str and v in strings:
                    return True
            elif how == _AS_IS:
                if self.matches(v):
                    return True
            else:  # a json column's document: the placeholder is what it parses to
                if (type(v) is str and v[:1] == "{" and "\\" not in v and self.text not in v and '"wkb"' not in v
                        and '"x"' not in v):
                    continue  # an object, and none of the placeholder's (hstore, geometry, point)
                try:
                    if self.matches(orjson.loads(v)):
                        return True
                except (orjson.JSONDecodeError, TypeError):
                    return True  # (the decoder says what is wrong with it)
        return False


# How a column's JSON value relates to its decoded value, for Placeholder.suspect: a string decoded to
# the same string or to the bytes it encodes (base64: one of the placeholder's strings), a list or dict
# that matches where the decoded one does, a json document. Columns of other types decode to values
# that never match (numbers, decimals, times, UUIDs, sets).
_AS_TEXT, _AS_IS, _AS_JSON = 0, 1, 2
_SCREEN = {FieldType.STRING: _AS_TEXT, FieldType.ENUM: _AS_TEXT, FieldType.BYTES: _AS_TEXT,
           FieldType.BITS: _AS_TEXT, FieldType.ARRAY: _AS_IS, FieldType.STRUCT: _AS_IS, FieldType.MAP: _AS_IS,
           FieldType.JSON: _AS_JSON}


def screen_for(schema: TableSchema) -> tuple[tuple[str, int], ...]:
    """The columns of ``schema`` whose decoded values can be the placeholder, with how to tell from
    their JSON (``Placeholder.suspect``); cached with the schema."""
    screen = schema._cache.get("kf.placeholder_screen")
    if screen is None:
        screen = schema._cache["kf.placeholder_screen"] = tuple(
            (c.name, _SCREEN[c.type]) for c in schema.columns if c.type in _SCREEN)
    return screen


class ToastState:
    """Per topic: the last known values of the columns Debezium has sent as unavailable, by key.

    Only columns seen unavailable at least once are kept (those are the TOASTable ones in
    practice), so the state is small. After a restart it is rebuilt from the log the first
    time a topic needs it (``loaded``), like the PostgreSQL connector's keyed TOAST state.
    """

    def __init__(self) -> None:
        self.columns: dict[str, set[str]] = {}
        self.values: dict[str, dict[bytes, dict[str, Any]]] = {}
        self.loaded: set[str] = set()

    def tracked(self, topic: str) -> set[str] | None:
        return self.columns.get(topic)

    def learn(self, topic: str, names: Iterable[str]) -> bool:
        """Track these columns of ``topic``; True when one is new (the state must be reloaded)."""
        cols = self.columns.setdefault(topic, set())
        new = not cols.issuperset(names)
        cols.update(names)
        if new:
            self.loaded.discard(topic)
        return new

    def remember(self, topic: str, key: bytes, row: dict[str, Any] | None, unknown: Iterable[str] = ()) -> None:
        cols = self.columns.get(topic)
        if not cols:
            return
        per_key = self.values.setdefault(topic, {})
        if row is None:
            per_key.pop(key, None)
            return
        skip = set(unknown)
        entry = per_key.get(key) or {}
        entry = {**entry, **{c: row[c] for c in cols if c in row and c not in skip}}
        if entry:
            per_key[key] = entry
        else:
            per_key.pop(key, None)

    def lookup(self, topic: str, key: bytes) -> dict[str, Any]:
        return self.values.get(topic, {}).get(key) or {}

    def clear(self, topic: str) -> None:
        self.values.pop(topic, None)
