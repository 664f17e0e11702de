"""Source positions: a total order within one source, and a JSON-safe dict form.

A position is what a consumer compares to drop duplicates: it keeps the last
position per source and ignores records whose position is <= it. Records
re-captured after a crash carry the same position as before, so the order must
be total and the dict form must round-trip exactly (it travels in every event
as ``source.kf_pos``).

The position kinds live with their connectors (``SOURCE_INFO_MODULES``); this module holds the
base class, the kind registry and the field checks every kind's ``_from_dict`` uses.

Equality and hashing follow the order key, so ``a == b`` exactly when neither
``a < b`` nor ``a > b``. Comparing positions of different kinds raises
``TypeError``: they come from different sources and have no common order.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

from kappaflow.errors import ValidationError

__all__ = ["SOURCE_INFO_MODULES", "Position", "bool_field", "int_field", "load_source_info"]

#: The modules that define the source positions and the Debezium source block layouts, one per
#: connector (``connectors/<kind>/source_info.py``) plus the connectors kappaflow only reads from
#: Debezium (``connectors/debezium/sources``). Each registers its position kind (``Position``
#: subclasses register themselves) and its layout (``kappaflow.events.sources.register``).
#: Imported on first need -- a position kind or a connector not seen yet -- so the events package
#: never imports a connector when it is imported itself.
SOURCE_INFO_MODULES = (
    "kappaflow.connectors.postgres.source_info",
    "kappaflow.connectors.mysql.source_info",
    "kappaflow.connectors.ledger.source_info",
    "kappaflow.connectors.debezium.sources",
)
_loaded: list[bool] = []


def load_source_info() -> None:
    """Import every module of ``SOURCE_INFO_MODULES`` (once)."""
    if not _loaded:
        _loaded.append(True)
        for name in SOURCE_INFO_MODULES:
            importlib.import_module(name)


def int_field(d: Mapping[str, Any], kind: str, name: str, *, minimum: int = 0, optional: bool = False) -> Any:
    """``d[name]`` as an integer >= ``minimum`` (None when ``optional`` and absent); ValidationError naming it."""
    v = d.get(name)
    if v is None and optional:
        return None
    if type(v) is not int or v < minimum:
        what = "missing" if name not in d else f"got {v!r}"
        raise ValidationError(f"position ({kind}).{name}: expected an integer >= {minimum}, {what}")
    return v


def bool_field(d: Mapping[str, Any], kind: str, name: str) -> bool:
    """``d[name]`` as a boolean (False when absent); ValidationError naming it."""
    v = d.get(name, False)
    if type(v) is not bool:
        raise ValidationError(f"position ({kind}).{name}: expected true or false, got {v!r}")
    return v


class Position:
    """Base of all source positions (abstract). Subclasses are frozen dataclasses."""

    __slots__ = ()
    kind: ClassVar[str] = ""
    _kinds: ClassVar[dict[str, type[Position]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            Position._kinds[cls.kind] = cls

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Position:
        """Rebuild a position from ``to_dict()`` output; dispatches on ``d["kind"]``."""
        if not isinstance(d, Mapping):
            raise ValidationError(f"position: expected an object with a 'kind', got {type(d).__name__}")
        kind = d.get("kind")
        sub = Position._kinds.get(kind) if isinstance(kind, str) else None
        if sub is None and not _loaded:
            load_source_info()
            sub = Position._kinds.get(kind) if isinstance(kind, str) else None
        if sub is None:
            raise ValidationError(
                f"position.kind: expected one of {sorted(Position._kinds)}, got {kind!r}"
            )
        if cls is not Position and sub is not cls:
            raise ValidationError(f"position.kind: expected {cls.kind!r}, got {kind!r}")
        return sub._from_dict(d)

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> Position:
        raise NotImplementedError

    # -- order ---------------------------------------------------------------------
    def sort_key(self) -> tuple[Any, ...]:
        """The tuple positions of one kind are ordered by."""
        raise NotImplementedError

    def successor(self) -> Position:
        """The smallest position of the same kind ordered after this one and before every other
        position greater than it that a source could assign (used for records that carry no
        position of their own, see ``kappaflow.connectors.debezium.ordering``)."""
        raise NotImplementedError(f"{type(self).__name__} has no successor")

    def _other_key(self, other: object) -> tuple[Any, ...]:
        if type(other) is not type(self):
            if isinstance(other, Position):
                raise TypeError(
                    f"cannot order a {type(self).__name__} against a {type(other).__name__}: "
                    "positions of different sources have no common order"
                )
            raise TypeError(f"cannot order a {type(self).__name__} against {type(other).__name__}")
        return other.sort_key()

    def __lt__(self, other: object) -> bool:
        return self.sort_key() < self._other_key(other)

    def __le__(self, other: object) -> bool:
        return self.sort_key() <= self._other_key(other)

    def __gt__(self, other: object) -> bool:
        return self.sort_key() > self._other_key(other)

    def __ge__(self, other: object) -> bool:
        return self.sort_key() >= self._other_key(other)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.sort_key() == other.sort_key()

    def __hash__(self) -> int:
        return hash((self.kind, self.sort_key()))
