"""As-of enrichment (stream-table): each event enriched with a table's row AS IT WAS at that event.

A ``Lookup`` joins the CURRENT looked-up row, so a renamed customer changes every view row that
points to it. An event stream needs the opposite: a statement line keeps the account holder's name
as it was when the money moved, and a replay a year later must give the line the follow wrote on
the day. ``AsOf`` declares that, for custom folds (``apply``) over an event topic (a ledger stream
type, ``Source(..., events=True)``) or a change topic used as a stream (an append-only table), and
for windowed views over a change topic (``window``: the enriched columns feed ``key``, ``derive``,
``where`` and the aggregates; ``folds/windowed.py``)::

    class Statement(Projection):
        name = "statement"
        sources = [Source("bank.account", events=True, key={"position": "position"})]
        key = ["position"]
        schema = "position bigint, holder_name string"
        as_of = [AsOf("holder", "crm.public.account_holders", on={"stream_id": "stream_id"},
                      columns=["name"])]

        def apply(self, row, event):
            return {"holder_name": event.after["holder_name"]}   # the name when the event happened

``apply`` sees ``event.after`` with ``prefix + column`` added per ``AsOf`` (default prefix
``"<name>_"``), NULL when the table had no row with that key at the event (not there yet, deleted,
NULL foreign key). What "at the event" means -- the clock, ties, the hold-back of events the
table's capture has not passed yet, and the state -- is in ``asof_stage.py`` and the README
("As-of enrichment"). This module holds the declaration and the checks that need no schemas.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kappaflow.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(frozen=True)
class AsOf:
    """One as-of enrichment: the row of table `topic` whose primary key equals the event's fields ``on``,
    as it was at the event.

    ``name``: the enrichment's name (default prefix ``name + "_"``). ``on``: event field (event
    topics: a top-level field of the event object; change topics: a column of the row) ->
    looked-up key column, covering the table's primary key. ``columns``: the table's columns to
    bring (default: all but the key); ``prefix``: their name prefix in ``event.after``.
    Same shape as ``Lookup`` (no ``how``/``via``: an event is never dropped for a missing row,
    and chains are not supported)."""

    name: str
    topic: str
    on: Mapping[str, str]
    columns: Sequence[str] | None = None
    prefix: str | None = None

    @property
    def column_prefix(self) -> str:
        return self.name + "_" if self.prefix is None else self.prefix

    def describe(self) -> str:
        """Stable text for the projection's fingerprint."""
        cols = tuple(self.columns) if self.columns is not None else None
        return repr(("asof", self.name, self.topic, sorted(self.on.items()), cols, self.column_prefix))


def parse_as_of(
    where: str,
    raw: Any,
    *,
    sources: Sequence[Any],
    kind: str,
    folds_events: bool,
    sinks: Sequence[str],
    consistency: str,
    lookups: Sequence[Any],
) -> tuple[AsOf, ...]:
    """Validate ``Projection.as_of``: shape, names, and what the projection around it must be.

    As-of enrichment feeds folds over events -- custom folds and windowed views (the fold sees each
    event once, in order: a latest-row or grouped view keeps current rows, which is what ``lookups``
    are for) -- over exactly one source topic, lives in PostgreSQL (its state commits with the view
    rows and positions), and reads at transaction cuts (``consistency = "transactions"``: the
    table's capture is known complete up to a cut, which the hold-back rule needs)."""
    if raw is None or (isinstance(raw, (list, tuple)) and not raw):
        return ()
    if isinstance(raw, AsOf):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{where}: 'as_of': expected a list of AsOf(...), got {raw!r}")
    out: list[AsOf] = []
    seen: set[str] = set()
    outs: dict[str, str] = {}
    for a in raw:
        if not isinstance(a, AsOf):
            raise ConfigError(f"{where}: 'as_of': expected AsOf(...) items, got {a!r}")
        if not isinstance(a.name, str) or not _NAME_RE.match(a.name):
            raise ConfigError(f"{where}: 'as_of': name {a.name!r} is not an identifier")
        at = f"{where}: 'as_of'[{a.name!r}]"
        if a.name in seen:
            raise ConfigError(f"{at}: name used twice")
        seen.add(a.name)
        if not isinstance(a.topic, str) or not a.topic:
            raise ConfigError(f"{at}.topic: expected a topic name, got {a.topic!r}")
        if (
            not isinstance(a.on, Mapping)
            or not a.on
            or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in a.on.items())
        ):
            raise ConfigError(
                f"{at}.on: expected a dict of event field -> looked-up key column, e.g. {{'stream_id': 'stream_id'}}, "
                f"got {a.on!r}"
            )
        if a.columns is not None and (
            isinstance(a.columns, str) or not a.columns or not all(isinstance(c, str) and c for c in a.columns)
        ):
            raise ConfigError(f"{at}.columns: expected a non-empty list of column names, got {a.columns!r}")
        if a.prefix is not None and (not isinstance(a.prefix, str) or (a.prefix and not _NAME_RE.match(a.prefix))):
            raise ConfigError(f"{at}.prefix: expected an identifier prefix like 'holder_', got {a.prefix!r}")
        if a.columns is not None:
            for c in a.columns:
                o = a.column_prefix + c
                if o in outs and outs[o] != a.name:
                    raise ConfigError(
                        f"{at}.prefix: column {o!r} clashes with as_of[{outs[o]!r}]; choose another prefix"
                    )
                outs[o] = a.name
        out.append(a)
    if not folds_events:  # the fold's strategy says so (custom folds), not its kind's name
        raise ConfigError(
            f"{where}: 'as_of': as-of enrichment feeds custom folds (def apply(self, row, event)) and windowed "
            f"views (window = Tumbling/Hopping/Session(...)) over events; this is a {kind} fold (for the current "
            f"looked-up row use 'lookups')"
        )
    if len(sources) != 1:
        raise ConfigError(
            f"{where}: 'as_of': a projection with as-of enrichment reads exactly one source topic (the event stream), "
            f"got {[s.topic for s in sources]}"
        )
    if lookups:
        raise ConfigError(f"{where}: 'as_of': 'lookups' and 'as_of' in one projection are not supported")
    if tuple(sinks) != ("postgres",):
        raise ConfigError(
            f"{where}: 'as_of': the as-of state commits with the view rows and positions in one PostgreSQL "
            f"transaction, so the view lives in PostgreSQL only (sinks = ('postgres',)), got sinks = {list(sinks)}"
        )
    if consistency != "transactions":
        raise ConfigError(
            f"{where}: 'as_of': needs consistency = 'transactions' (events are released when the table's capture "
            f"has passed them, which is known at transaction cuts), got {consistency!r}"
        )
    src = sources[0]
    for a in out:
        if a.topic == src.topic:
            raise ConfigError(f"{where}: 'as_of'[{a.name!r}].topic: the event topic itself cannot be looked up")
    return tuple(out)


__all__ = ["AsOf", "parse_as_of"]
