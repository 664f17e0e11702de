"""Keyed TOAST state of the PostgreSQL connector: values an UPDATE may leave out.

Why: pgoutput does not resend a TOASTed (out-of-line) value an UPDATE leaves unchanged; it sends
'u' (:data:`~kappaflow.connectors.postgres.decoder.UNCHANGED`) and the change event would lack the
column. Debezium writes a placeholder there; kappaflow keeps, per table, the last values of the
columns that could be stored out of line, keyed by the row's key, and fills them in. Only values
long enough to be stored out of line are kept (a row whose text is shorter than ``TOAST_ROW_MIN``
keeps nothing), so the state stays small. After a restart the state is rebuilt from the table's
topic (`load_from_log`), which holds every earlier change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from kappaflow.connectors.postgres import types as t
from kappaflow.connectors.postgres.decoder import UNCHANGED
from kappaflow.connectors.truncate import TRUNCATE_KEY

__all__ = ["TOAST_ROW_MIN", "ToastState", "load_from_log", "toast_min"]

# Smallest text length a value must exceed before PostgreSQL could store it out of line
# (TOAST pointers are 18 bytes; values <= 24 stored bytes are never externalised). Values
# not longer than this never arrive as "unchanged TOAST", so they need no keyed state.
_TEXTLIKE_MIN = 24


# A row is stored out of line only when it exceeds TOAST_TUPLE_THRESHOLD (~2 kB). Text forms
# can be up to ~6x smaller than the stored binary form (small ints in arrays or jsonb), so a row
# whose text is shorter than this cannot hold an out-of-line value: no keyed state is needed.
TOAST_ROW_MIN = 340


def toast_min(oid: int, storage: str) -> int | None:
    """The text length a column's value must exceed before it could be stored out of line (None: never)."""
    if storage == "p":
        return None
    if oid == t.BYTEA:
        return 2 + 2 * _TEXTLIKE_MIN
    if oid == t.NUMERIC:
        return 2 * _TEXTLIKE_MIN
    return _TEXTLIKE_MIN


class ToastState:
    """The keyed TOAST state of one table (a base of ``rows.TableCodec``, which holds the columns).

    ``toast``: (column index, minimum length) of the columns that could be stored out of line;
    ``toast_state``: row key -> {column name: JSON value} (None when the table has no such column);
    ``toast_state_loaded``: rebuilt from the log in this run.
    """

    names: tuple[str, ...]
    toast: tuple[tuple[int, int], ...]
    toast_state: dict[bytes, dict[str, Any]] | None
    toast_state_loaded: bool
    _toast_names: tuple[str, ...]

    def init_toast_state(self, minimums: Sequence[int | None], track: bool) -> None:
        """Start empty, tracking the columns whose minimum length is not None (none unless ``track``)."""
        self.toast = tuple((i, mn) for i, mn in enumerate(minimums) if mn is not None) if track else ()
        # keyed state: key bytes -> {column name: JSON value} of toastable columns
        self.toast_state = {} if self.toast else None
        self.toast_state_loaded = False
        self._toast_names = tuple(self.names[i] for i, _ in self.toast)

    def remember(self, key: bytes, js: dict[str, Any], raw: Sequence[Any]) -> None:
        """Keep the values of this row's toastable columns that could be stored out of line.

        A later UPDATE that leaves such a value unchanged does not resend it (pgoutput
        sends 'u'); the value is then taken from here.
        """
        state = self.toast_state
        if state is None:
            return
        entry: dict[str, Any] | None = None
        names = self.names
        if UNCHANGED not in raw and sum(len(v) for v in raw if v is not None) < TOAST_ROW_MIN:
            state.pop(key, None)
            return
        for i, mn in self.toast:
            v = raw[i]
            if v is None:
                continue
            if v is UNCHANGED:
                name = names[i]
                if name in js:
                    if entry is None:
                        entry = {}
                    entry[name] = js[name]
            elif len(v) > mn:
                if entry is None:
                    entry = {}
                entry[names[i]] = js[names[i]]
        if entry is None:
            state.pop(key, None)
        else:
            state[key] = entry

    def remember_all(self, key: bytes, js: dict[str, Any]) -> None:
        """Fast-path variant of :meth:`remember`: keep every non-NULL toastable value."""
        state = self.toast_state
        if state is not None:
            entry = {n: js[n] for n in self._toast_names if js[n] is not None}
            if entry:
                state[key] = entry
            else:
                state.pop(key, None)

    def fill_unchanged(self, js: dict[str, Any], raw: Sequence[Any], old_key: bytes,
                       old_js: dict[str, Any] | None) -> list[str]:
        """Replace UNCHANGED values in ``js`` from the before-image or the keyed state.

        Returns the columns whose value is unknown (removed from ``js``: absent, not NULL).
        """
        state = self.toast_state.get(old_key) if self.toast_state is not None else None
        missing: list[str] = []
        for i, v in enumerate(raw):
            if v is not UNCHANGED:
                continue
            name = self.names[i]
            if old_js is not None and name in old_js and old_js[name] is not UNCHANGED:
                js[name] = old_js[name]
            elif state is not None and name in state:
                js[name] = state[name]
            else:
                del js[name]
                missing.append(name)
        return missing


def load_from_log(state_of: ToastState, log: Any, topic: str, partitions: int) -> None:
    """Fill the keyed state from the last values ``topic`` holds (once per run, after a restart).

    The caller makes sure the log holds everything decoded so far, or older values would
    overwrite newer ones.
    """
    state = state_of.toast_state
    assert state is not None
    toast_names = {state_of.names[i] for i, _ in state_of.toast}
    for p in range(partitions):
        for rec in log.iter_partition(topic, p):
            if rec.key is None or rec.key == TRUNCATE_KEY:
                continue
            if rec.value is None:
                state.pop(rec.key, None)
                continue
            doc = orjson.loads(rec.value)
            after = doc.get("after")
            if after is None:
                state.pop(rec.key, None)
                continue
            unknown = set(doc.get("kf_unavailable") or ())
            entry = {n: after[n] for n in toast_names if n in after and n not in unknown}
            if entry:
                state[rec.key] = entry
            else:
                state.pop(rec.key, None)
    state_of.toast_state_loaded = True
