"""Lookup declarations (many-to-one joins) and the checks that need no table schemas.

A projection driven by one table declares lookups into other captured tables::

    class OrderView(Projection):
        name = "order_view"
        sources = ["shop.public.orders"]
        key = ["id"]
        lookups = [
            Lookup("customer", "shop.public.customers", on={"customer_id": "id"}, columns=["name", "city"]),
            Lookup("product", "shop.public.products", on={"product_id": "id"}, columns=["title"]),
            Lookup("category", "shop.public.categories", on={"category_id": "id"}, via="product",
                   columns=["name"], how="inner"),
        ]

The view row is the driving row plus, per lookup, the looked-up row's ``columns`` named
``prefix + column`` (default prefix ``"<name>_"``), always from the CURRENT rows of every
table. ``on`` maps foreign key columns (of the driving table, or of the ``via`` lookup's
table for a chain) to the looked-up table's whole primary key. ``how="left"``: no matching
row (NULL foreign key, row deleted or not there yet) gives NULLs; ``how="inner"``: the view
row is absent then. Checks against the tables' schemas (columns exist, key types compare)
are in ``plan.py`` of this package, once the schemas are known.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kappaflow.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
HOWS = ("left", "inner")


@dataclass(frozen=True)
class Lookup:
    """One many-to-one lookup: the row of `topic` whose primary key equals the foreign key ``on``.

    ``name``: the lookup's name (chains refer to it with ``via``; the default prefix is ``name + "_"``).
    ``on``: foreign key column -> looked-up key column, covering the looked-up table's primary key.
    ``columns``: looked-up columns to bring (default: all but the key); ``prefix``: their name prefix.
    ``how``: ``"left"`` (NULLs when there is no matching row) or ``"inner"`` (no view row then).
    ``via``: the lookup whose table holds the foreign key (a chain); default: the driving table.
    """

    name: str
    topic: str
    on: Mapping[str, str]
    columns: Sequence[str] | None = None
    prefix: str | None = None
    how: str = "left"
    via: str | None = None

    @property
    def column_prefix(self) -> str:
        return self.name + "_" if self.prefix is None else self.prefix

    def describe(self) -> str:
        """Stable text for the projection's fingerprint."""
        return repr(
            (self.name, self.topic, sorted(self.on.items()), tuple(self.columns or ()) if self.columns is not None
             else None, self.column_prefix, self.how, self.via)
        )


def parse_lookups(where: str, raw: Any, source_topics: Sequence[str]) -> tuple[Lookup, ...]:
    """Validate ``Projection.lookups``: shape, names, ``via`` references and cycles.

    A cycle is a ``via`` chain that comes back to a lookup, or a chain that visits a table
    twice (the driving table included): the view row would depend on itself."""
    if raw is None or (isinstance(raw, (list, tuple)) and not raw):
        return ()
    if isinstance(raw, Lookup):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{where}: 'lookups': expected a list of Lookup(...), got {raw!r}")
    out: list[Lookup] = []
    seen: set[str] = set()
    for lk in raw:
        if not isinstance(lk, Lookup):
            raise ConfigError(f"{where}: 'lookups': expected Lookup(...) items, got {lk!r}")
        at = f"{where}: 'lookups'[{lk.name!r}]"
        if not isinstance(lk.name, str) or not _NAME_RE.match(lk.name):
            raise ConfigError(f"{where}: 'lookups': lookup name {lk.name!r} is not an identifier")
        if lk.name in seen:
            raise ConfigError(f"{at}: lookup name used twice")
        seen.add(lk.name)
        if not isinstance(lk.topic, str) or not lk.topic:
            raise ConfigError(f"{at}.topic: expected a topic name, got {lk.topic!r}")
        if (
            not isinstance(lk.on, Mapping)
            or not lk.on
            or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in lk.on.items())
        ):
            raise ConfigError(
                f"{at}.on: expected a dict of foreign key column -> looked-up key column, e.g. "
                f"{{'customer_id': 'id'}}, got {lk.on!r}"
            )
        if lk.columns is not None and (
            isinstance(lk.columns, str) or not all(isinstance(c, str) and c for c in lk.columns)
        ):
            raise ConfigError(f"{at}.columns: expected a list of column names, got {lk.columns!r}")
        if lk.prefix is not None and (not isinstance(lk.prefix, str) or (lk.prefix and not _NAME_RE.match(lk.prefix))):
            raise ConfigError(f"{at}.prefix: expected an identifier prefix like 'customer_', got {lk.prefix!r}")
        if lk.how not in HOWS:
            raise ConfigError(f"{at}.how: expected one of {list(HOWS)}, got {lk.how!r}")
        out.append(lk)
    if len(source_topics) != 1:
        raise ConfigError(
            f"{where}: 'lookups': a projection with lookups is driven by exactly one source table "
            f"(one view row per driving row), got sources {list(source_topics)}"
        )
    by_name = {lk.name: lk for lk in out}
    for lk in out:
        if lk.via is not None and lk.via not in by_name:
            raise ConfigError(
                f"{where}: 'lookups'[{lk.name!r}].via: no lookup named {lk.via!r} (have {sorted(by_name)})"
            )
    for lk in out:
        try:
            path = chain(lk, by_name)
        except ConfigError as exc:  # a via cycle
            raise ConfigError(f"{where}: {exc}") from None
        tables = [source_topics[0]] + [by_name[n].topic for n in path]
        if len(set(tables)) != len(tables):
            raise ConfigError(
                f"{where}: 'lookups'[{lk.name!r}]: lookup cycle: the chain {' -> '.join(tables)} visits a table "
                "twice (a view row would depend on itself)"
            )
    return tuple(sorted(out, key=lambda lk: len(chain(lk, by_name))))


def chain(lk: Lookup, by_name: Mapping[str, Lookup]) -> list[str]:
    """Names of the lookups from the driving table to `lk` (``lk`` last)."""
    path = [lk.name]
    cur = lk
    while cur.via is not None:
        if cur.via in path:
            raise ConfigError(
                f"'lookups'[{lk.name!r}].via: lookup cycle: {' -> '.join(reversed([*path, cur.via]))}"
            )
        path.append(cur.via)
        cur = by_name[cur.via]
    return list(reversed(path))


@dataclass(frozen=True)
class Nested:
    """One one-to-many collection: the rows of `topic` whose foreign key ``on`` points at the driving row,
    as a list column ``name`` of the view row (a customer document with its orders).

    ``on``: driving key column -> child column, covering the driving table's whole primary key
    (``{"id": "customer_id"}``). ``columns``: child columns in each element (default: all).
    ``order_by``: child columns the list is sorted by, ascending, NULLs first; the child's primary
    key breaks ties (default order: the child key). Only a document store holds such a view
    (search: a ``nested`` field; Redis: a JSON list); it is a latest-row view of the driving table.
    """

    name: str
    topic: str
    on: Mapping[str, str]
    columns: Sequence[str] | None = None
    order_by: Sequence[str] = ()

    def describe(self) -> str:
        """Stable text for the projection's fingerprint."""
        return repr((self.name, self.topic, sorted(self.on.items()),
                     tuple(self.columns) if self.columns is not None else None, tuple(self.order_by)))


def parse_nested(where: str, raw: Any, source_topics: Sequence[str]) -> tuple[Nested, ...]:
    """Validate ``Projection.nested``: shape and names (schemas are checked in ``plan.py``)."""
    if raw is None or (isinstance(raw, (list, tuple)) and not raw):
        return ()
    if isinstance(raw, Nested):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{where}: 'nested': expected a list of Nested(...), got {raw!r}")
    out: list[Nested] = []
    seen: set[str] = set()
    for nc in raw:
        if not isinstance(nc, Nested):
            raise ConfigError(f"{where}: 'nested': expected Nested(...) items, got {nc!r}")
        if not isinstance(nc.name, str) or not _NAME_RE.match(nc.name) or nc.name.startswith("_kf_"):
            raise ConfigError(f"{where}: 'nested': collection name {nc.name!r} is not an identifier")
        at = f"{where}: 'nested'[{nc.name!r}]"
        if nc.name in seen:
            raise ConfigError(f"{at}: collection name used twice")
        seen.add(nc.name)
        if not isinstance(nc.topic, str) or not nc.topic:
            raise ConfigError(f"{at}.topic: expected a topic name, got {nc.topic!r}")
        if (
            not isinstance(nc.on, Mapping)
            or not nc.on
            or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in nc.on.items())
        ):
            raise ConfigError(
                f"{at}.on: expected a dict of driving key column -> child column, e.g. {{'id': 'customer_id'}}, "
                f"got {nc.on!r}"
            )
        for attr in ("columns", "order_by"):
            val = getattr(nc, attr)
            if val is None and attr == "columns":
                continue
            if isinstance(val, str) or not isinstance(val, (list, tuple)) or not all(
                isinstance(c, str) and c for c in val
            ):
                raise ConfigError(f"{at}.{attr}: expected a list of column names, got {val!r}")
        if nc.topic in source_topics:
            raise ConfigError(
                f"{at}.topic: {nc.topic!r} is the driving table; a collection of the driving table's own rows "
                "(a tree) is not supported"
            )
        out.append(nc)
    if len(source_topics) != 1:
        raise ConfigError(
            f"{where}: 'nested': a projection with nested collections is driven by exactly one source table "
            f"(one document per parent row), got sources {list(source_topics)}"
        )
    return tuple(out)


__all__ = ["HOWS", "Lookup", "Nested", "chain", "parse_lookups", "parse_nested"]
