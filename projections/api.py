"""The Projection API: a class declares a view and how the log folds into it.

Three kinds of fold, chosen by what the class declares::

    class Customers(Projection):               # latest row per key
        name = "customers"
        sources = ["shop.public.customers"]
        key = ["id"]                           # must be the source table's primary key
        columns = ["id", "name", "email"]      # optional: which source columns to keep
        derive = {"email_domain": "split_part(email, '@', 2)"}   # Spark SQL over the row
        where = "NOT deleted_flag"             # rows failing it are absent from the view

    class CustomerTotals(Projection):          # group by any column(s), retraction-aware
        name = "customer_totals"
        sources = ["shop.public.orders"]
        key = ["customer_id"]                  # the group columns
        where = "status <> 'cancelled'"
        aggregates = {"orders": Count(), "total": Sum("amount"), "last_order": Max("created_at"),
                      "statuses": CollectSet("status")}

    class Activity(Projection):                # custom fold: a Python method
        name = "activity"
        sources = [Source("shop.public.orders", key={"customer_id": "customer_id"})]
        key = ["customer_id"]
        schema = "customer_id bigint, events bigint, last_op string"
        def apply(self, row, event):           # row: current view row (dict) or None
            row = row or {"customer_id": event.row["customer_id"], "events": 0}
            return {**row, "events": row["events"] + 1, "last_op": event.op}   # None deletes

Targets: ``sinks`` names the stores that keep the view (default ``("postgres",)``), each
with its own positions, followed independently; ``sink_options`` gives per-sink view
options (search: the index alias, field mappings; Redis: value format, TTL)::

    class ProductSearch(Projection):
        name = "products"
        sources = ["shop.public.products"]
        key = ["id"]
        sinks = ("postgres", "search", "redis")
        sink_options = {"search": {"fields": {"name": "text"}},
                        "redis": {"ttl_s": 3600, "format": "hash"}}

A grouped projection's search/Redis views mirror its PostgreSQL view (so "postgres" must be
among its sinks): they are copied from it on replay and follow it group by group
(``kappaflow.projections.mirror``).

Declarative folds compile to native Spark expressions (``kappaflow.projections.plan``);
custom folds run once per Spark partition over events sorted by (view key, source
position) — never one Python call per key group. ``where`` / ``derive`` are Spark SQL
expressions over the source row's columns (the ``after`` image).

Retraction: grouped aggregates are computed over the CURRENT row of every source key
(latest event per key; deletes, tombstones and rows leaving ``where`` contribute
nothing), so an update that moves a row between groups moves its contribution and a
delete removes it, with or without before-images in the log. See ``folds/grouped.py``.

Event time: ``window = Tumbling("created_at", size="1h", ...)``, ``Hopping(...)`` or ``Session(...)`` with
``aggregates`` makes a windowed view (``WindowFold``, ``folds/windowed.py``): one row per
group and window, with a watermark derived from the log and a late-data policy.

Source schema changes: ``on_schema_change = "evolve" | "rebuild" | "fail"`` (default: evolve for a
latest-row view of every column, rebuild otherwise) and ``auto_rebuild`` say what a follower does
when a source table's schema changes (``kappaflow.projections.schema_watch``).

Room to grow: a fold kind is a ``FoldSpec`` subclass run by a ``FoldStrategy`` in its own
module of ``kappaflow.projections.folds`` (compile, replay, follow, mirrors, state); a stream
joined within a time bound is ``interval_join = IntervalJoin(...)`` (``folds/interval.py``), whose
fold names the extra topic it reads (``joined_topics``). The class attributes below are read only through
``ProjectionSpec.from_class``, so new attributes do not disturb old ones.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kappaflow.errors import ConfigError
from kappaflow.projections.joins.asof import AsOf, parse_as_of
from kappaflow.projections.joins.spec import Lookup, Nested, parse_lookups, parse_nested
from kappaflow.projections.sinks.registry import SINKS

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")

SINK_KINDS = tuple(SINKS)
"""Sink names a projection may declare in ``sinks`` (the sink registry's kinds)."""


# --- aggregates -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Aggregate:
    """One aggregate column of a grouped projection. ``column`` is a source column or
    ``derive`` name (None for ``Count()``)."""

    column: str | None = None
    func: ClassVar[str] = ""

    def describe(self) -> str:
        return f"{type(self).__name__}({self.column or ''})"


@dataclass(frozen=True)
class Count(Aggregate):
    """Rows in the group (``Count()``), or rows where ``column`` is not NULL."""

    func: ClassVar[str] = "count"


@dataclass(frozen=True)
class Sum(Aggregate):
    func: ClassVar[str] = "sum"


@dataclass(frozen=True)
class Min(Aggregate):
    """Smallest value; strings compare by code point (like Spark, ``COLLATE "C"`` in PostgreSQL)."""

    func: ClassVar[str] = "min"


@dataclass(frozen=True)
class Max(Aggregate):
    func: ClassVar[str] = "max"


@dataclass(frozen=True)
class Avg(Aggregate):
    """Exact sum / count as double (equal in replay and follow for integer and decimal input)."""

    func: ClassVar[str] = "avg"


@dataclass(frozen=True)
class CollectList(Aggregate):
    """All non-NULL values, sorted (so the result is deterministic)."""

    func: ClassVar[str] = "collect_list"


@dataclass(frozen=True)
class CollectSet(Aggregate):
    """Distinct non-NULL values, sorted."""

    func: ClassVar[str] = "collect_set"


# --- event-time windows ----------------------------------------------------------------------------
LATE_POLICIES = ("dead_letter", "drop", "update")
EMIT_MODES = ("updates", "final_only")


@dataclass(frozen=True)
class Window:
    """Base of window declarations (``Tumbling``, ``Hopping``): the event-time ``column`` (a source
    column or a ``derive`` name of type timestamp/timestamptz) and the watermark and late-data rules
    shared by every window shape. Durations: ``timedelta``, seconds (int/float) or text like
    ``"90s"``, ``"15m"``, ``"1h"``, ``"1d"``, ``"500ms"``. Checked when the class is loaded
    (``folds/windowed.py``), so errors name the projection and the attribute.

    ``delay``: the watermark trails the largest event time seen by this much;
    ``allowed_lateness``: a window stays open this long after the watermark passed its end;
    ``late``: what happens to an event that arrives for a window past that (``"dead_letter"``,
    ``"drop"``, ``"update"``); ``emit``: ``"updates"`` (every window row current, ``final``
    flips) or ``"final_only"`` (a window row appears when it is final); ``idle_timeout``: a
    partition whose largest event time is this far behind the most advanced partition's (or
    that has none) does not hold the watermark back (None: every partition holds it back).
    """

    column: str
    size: Any
    delay: Any = 0
    allowed_lateness: Any = 0
    late: str = "dead_letter"
    emit: str = "updates"
    idle_timeout: Any = None

    shape: ClassVar[str] = ""

    @property
    def slide(self) -> Any:
        return self.size


@dataclass(frozen=True)
class Tumbling(Window):
    """Fixed, non-overlapping windows of ``size``, aligned to the Unix epoch (UTC)."""

    shape: ClassVar[str] = "tumbling"


@dataclass(frozen=True)
class Hopping(Window):
    """Windows of ``size`` starting every ``slide`` (aligned to the Unix epoch, UTC): an event
    belongs to about ``size / slide`` windows. ``slide`` must be > 0 and at most ``size``."""

    hop: Any = None
    shape: ClassVar[str] = "hopping"

    def __init__(self, column: str, size: Any, slide: Any, **rules: Any) -> None:
        object.__setattr__(self, "hop", slide)
        super().__init__(column, size, **rules)

    @property
    def slide(self) -> Any:
        return self.hop


@dataclass(frozen=True, repr=False)
class Session(Window):
    """Session (gap) windows per group: events of one group whose event times are less than ``gap``
    apart form one session [first event time, last event time + gap); an event that bridges two
    sessions merges them, a retraction of the event that bridged them splits them. ``gap`` must be
    > 0. Lateness is judged on the event's own time (``folds/windowed.py``, README "Event time")."""

    shape: ClassVar[str] = "session"

    def __init__(self, column: str, gap: Any, **rules: Any) -> None:
        super().__init__(column, gap, **rules)

    @property
    def gap(self) -> Any:
        return self.size

    def __repr__(self) -> str:
        return (f"Session({self.column!r}, gap={self.size!r}, delay={self.delay!r}, "
                f"allowed_lateness={self.allowed_lateness!r}, late={self.late!r}, emit={self.emit!r}, "
                f"idle_timeout={self.idle_timeout!r})")


# --- stream-stream joins within a time bound --------------------------------------------------------
INTERVAL_HOWS = ("inner", "left")
INTERVAL_LATE_POLICIES = ("dead_letter", "drop", "update")


@dataclass(frozen=True)
class IntervalJoin:
    """Rows of the projection's source (the *left* stream) matched with rows of ``topic`` (the *right*
    stream, named ``name``: its columns come prefixed ``<name>_``) on ``on`` (left column -> right
    column) when ``left_time + lower <= right_time <= left_time + upper`` (``within=(lower, upper)``).
    ``how``: ``"inner"`` (one view row per matched pair) or ``"left"`` (also one row with NULL right
    columns per left row that no right row matched once the watermark passed ``left_time + upper +
    allowed_lateness``). ``delay``, ``allowed_lateness``, ``late`` (``"dead_letter"``, ``"drop"`` or
    ``"update"``) and
    ``idle_timeout`` are the windows' watermark rules (README "Event time": "Joins within a time
    bound"). Checked when the class is loaded (``folds/interval.py``)."""

    name: str
    topic: str
    on: Mapping[str, str]
    left_time: str
    right_time: str
    within: tuple[Any, Any]
    how: str = "inner"
    columns: Sequence[str] | None = None
    delay: Any = 0
    allowed_lateness: Any = 0
    late: str = "dead_letter"  # as for windows
    idle_timeout: Any = None


# --- sources --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """A source topic, and for custom folds how its rows map to the view key.

    ``key``: view key column -> source column (default: same names). The view key of
    an event is read from the record key when every mapped column is a key column of the
    source (so tombstones and key-only delete images route too), else from the row
    (``after``, or ``before`` for deletes).
    ``schema``: the topic's ``TableSchema`` when it is not on ``<source>.__schema``.
    ``events``: an event topic (e.g. the ledger's ``<source>.<stream_type>``): each record's
    value is one domain event as a JSON object, not a change envelope. Only custom folds
    read them: ``event.after`` is the event object, ``event.op`` is ``"c"``; the view key
    comes from the event's fields (``key`` maps view key columns to event fields), and
    events of one key are folded in the order of their ``position`` field (then offset).
    """

    topic: str
    key: Mapping[str, str] | None = None
    schema: Any = None  # kappaflow.events.TableSchema
    events: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigError(f"Source.topic: expected a topic name, got {self.topic!r}")


# --- events for custom folds ----------------------------------------------------------------------
@dataclass(slots=True)
class Event:
    """One change event as a custom fold sees it (values decoded to Python types).

    What ``apply`` gets, by what happened in the source table:

    - insert: ``op="c"`` (``"r"`` when read by the initial snapshot), ``after`` = the row,
      ``before`` None;
    - update: ``op="u"``, ``after`` = the new row; ``before`` = the old row when the source
      logs it (PostgreSQL ``REPLICA IDENTITY FULL``, MySQL ``binlog_row_image=FULL``), else
      None. An update that changes the table's primary key arrives as a delete of the old key
      and an insert of the new one;
    - delete: ``op="d"``, ``after`` None, ``before`` = the deleted row: the whole row with
      ``REPLICA IDENTITY FULL`` / MySQL's full row image, only the key columns under
      PostgreSQL's default replica identity (a fold keyed by other columns needs FULL);
    - TRUNCATE: one ``op="d"`` event per row it removed, ``before`` = the row as the log last
      held it (always the whole row), ``truncate`` True, ``position`` the truncate's; rows of
      one truncate come in key order. Logs written before kappaflow recorded these deletes
      hold only tombstones for a truncate, which reach no fold.

    Not delivered: tombstones (the delete before each one carried the change) and the
    truncate's own ``op="t"`` marker (its deletes carry the rows). Event topics
    (``Source(events=True)``): ``op="c"``, ``after`` = the domain event object.

    ``row`` is ``after`` (or ``before`` for a delete). ``position`` is the source position
    dict (``source.kf_pos``); (``topic``, ``partition``, ``offset``) is the log position;
    ``key`` the record key's columns.
    """

    topic: str
    partition: int
    offset: int
    op: str
    key: dict[str, Any] | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    ts_ms: int | None
    position: dict[str, Any] | None = None
    source: dict[str, Any] | None = None
    truncate: bool = False
    """True for the deletes a TRUNCATE produced (one per removed row)."""

    @property
    def row(self) -> dict[str, Any] | None:
        return self.after if self.after is not None else self.before


# --- the user-facing base class -------------------------------------------------------------------
class Projection:
    """Subclass and declare class attributes (see the module docstring).

    Required: ``name`` (view name, ``[A-Za-z_][A-Za-z0-9_]*``), ``sources`` (topic names
    or ``Source``), ``key`` (view key columns). Optional: ``columns``, ``derive``,
    ``where``, ``aggregates``, ``schema`` (Spark DDL of the output, required for custom
    folds), ``view`` (table name, default ``name``), ``namespace`` (PostgreSQL schema),
    ``apply`` (custom fold), ``sinks`` (where the view lives: any of "postgres", "search",
    "redis"; default postgres only), ``sink_options`` (per-sink view options, e.g.
    ``{"search": {"fields": {"name": "text"}}, "redis": {"ttl_s": 3600, "format": "hash"}}``),
    ``lookups`` (``Lookup``: many-to-one joins into other captured tables), ``nested`` (``Nested``:
    the child rows of each driving row as a list column, for search and Redis views; see
    ``kappaflow.projections.joins``),
    ``consistency`` (``"transactions"``, the default: follow micro-batches and replays end at a
    consistent cut of each source, so the view never shows part of a source transaction;
    ``"per_key"``: read to the log's end for the lowest latency, order per key only),
    ``on_schema_change`` (what a follower does when a source table's schema changes:
    ``"evolve"``, the default for a latest-row view of every column, adds new columns to the view
    and widens widened ones in place; ``"rebuild"``, the default otherwise, stops the follower
    with a message naming the change when the view would change, until ``kappaflow replay``;
    ``"fail"`` stops it on any change) and ``auto_rebuild`` (True: the follower rebuilds the
    view itself, blue/green, where it would stop for a rebuild, then follows on) and
    ``on_definition_change`` (what a follower does at start when this class changed since its view
    was built, i.e. its fingerprint differs: ``"fail"`` stops with a message to replay, ``"rebuild"``
    rebuilds the view itself, blue/green, then follows; None, the default: the runtime's
    ``[follow] on_definition_change``, itself ``"fail"`` unless set).
    """

    name: ClassVar[str]
    sources: ClassVar[Sequence[str | Source]]
    key: ClassVar[Sequence[str]]
    columns: ClassVar[Sequence[str] | None] = None
    derive: ClassVar[Mapping[str, str]] = {}
    where: ClassVar[str | None] = None
    aggregates: ClassVar[Mapping[str, Aggregate]] = {}
    schema: ClassVar[str | None] = None
    view: ClassVar[str | None] = None
    namespace: ClassVar[str | None] = None
    sinks: ClassVar[Sequence[str]] = ("postgres",)
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    consistency: ClassVar[str] = "transactions"
    lookups: ClassVar[Sequence[Lookup]] = ()
    as_of: ClassVar[Sequence[AsOf]] = ()  # each event enriched with a table's row as it was then
    nested: ClassVar[Sequence[Nested]] = ()
    window: ClassVar[Window | None] = None
    on_schema_change: ClassVar[str | None] = None  # None: the fold kind's default
    auto_rebuild: ClassVar[bool] = False
    on_definition_change: ClassVar[str | None] = None  # None: the runtime's ([follow] on_definition_change)

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        """Custom fold: the view row after `event` (None removes it). Override to use."""
        raise NotImplementedError


# --- the compiled, validated description ------------------------------------------------------------
@dataclass(frozen=True)
class FoldSpec:
    """Base of fold kinds: what a projection class declares. Each kind's ``FoldStrategy``
    (``kappaflow.projections.folds``, registered by fold class) runs it."""

    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class LatestFold(FoldSpec):
    columns: tuple[str, ...] | None = None
    kind: ClassVar[str] = "latest"


@dataclass(frozen=True)
class GroupFold(FoldSpec):
    aggregates: tuple[tuple[str, Aggregate], ...] = ()
    kind: ClassVar[str] = "grouped"


@dataclass(frozen=True)
class CustomFold(FoldSpec):
    kind: ClassVar[str] = "custom"


@dataclass(frozen=True)
class WindowFold(FoldSpec):
    """Aggregates per group and event-time window (``folds/windowed.py``); durations in microseconds,
    ``idle_us`` None when no partition is ever idle."""

    aggregates: tuple[tuple[str, Aggregate], ...] = ()
    column: str = ""
    shape: str = "tumbling"  # tumbling | hopping | session
    size_us: int = 0  # a session's gap
    slide_us: int = 0
    delay_us: int = 0
    lateness_us: int = 0
    late: str = "dead_letter"
    emit: str = "updates"
    idle_us: int | None = None
    kind: ClassVar[str] = "windowed"


@dataclass(frozen=True)
class IntervalJoinFold(FoldSpec):
    """A stream-stream join within a time bound (``folds/interval.py``); durations in microseconds."""

    name: str = ""
    topic: str = ""
    on: tuple[tuple[str, str], ...] = ()
    left_time: str = ""
    right_time: str = ""
    lower_us: int = 0
    upper_us: int = 0
    how: str = "inner"
    columns: tuple[str, ...] | None = None
    right_columns: tuple[str, ...] | None = None
    delay_us: int = 0
    lateness_us: int = 0
    late: str = "dead_letter"
    idle_us: int | None = None
    kind: ClassVar[str] = "interval_join"

    @property
    def joined_topics(self) -> tuple[str, ...]:
        """Topics the fold reads beside the sources (``ProjectionSpec.topics``)."""
        return (self.topic,)


@dataclass(frozen=True)
class Declaration:
    """What a projection class declares, read and checked once by ``ProjectionSpec.from_class``;
    each fold kind's strategy reads its fold from it (``FoldStrategy.claims`` / ``declare``)."""

    klass: type[Projection]
    where: str  # "projection class module.Name", for error messages
    sources: tuple[Source, ...]
    key: tuple[str, ...]
    derive: Mapping[str, str]
    where_sql: str | None
    schema: str | None
    aggregates: Mapping[str, Any]
    columns: Any

    @property
    def has_apply(self) -> bool:
        return self.klass.apply is not Projection.apply


@dataclass(frozen=True)
class ProjectionSpec:
    """A projection class, validated once (``from_class``); everything else reads this."""

    name: str
    view: str
    namespace: str | None
    sources: tuple[Source, ...]
    key: tuple[str, ...]
    fold: FoldSpec
    derive: tuple[tuple[str, str], ...] = ()
    where: str | None = None
    schema: str | None = None
    cls: type[Projection] | None = field(default=None, compare=False)
    class_path: str | None = None
    sinks: tuple[str, ...] = ("postgres",)
    sink_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)
    # where reads stop: "transactions" (at consistent cuts) or "per_key" (at the log's end); not part
    # of the fingerprint: it changes when the view is updated, never what it holds once caught up
    consistency: str = field(default="transactions", compare=False)
    lookups: tuple[Lookup, ...] = ()
    """Many-to-one joins into other tables (``kappaflow.projections.joins``)."""
    as_of: tuple[AsOf, ...] = ()
    """Stream-table enrichment: a table's row as it was at each event (``joins/asof.py``)."""
    nested: tuple[Nested, ...] = ()
    """One-to-many collections: the child rows of each driving row as a list column (``joins``)."""
    # what a follower does when a source table's schema changes (``schema_watch.py``): "evolve",
    # "rebuild" or "fail" (resolved: the fold's default when the class sets none), and whether it
    # rebuilds the view itself when one is needed. Not part of the fingerprint: they decide how the
    # view meets a change, never what a replay of the log gives.
    on_schema_change: str = field(default="rebuild", compare=False)
    auto_rebuild: bool = field(default=False, compare=False)
    # what a follower does when the definition changed since the view was built ("fail" / "rebuild";
    # None: the follower's own setting). Not part of the fingerprint, like the schema policy.
    on_definition_change: str | None = field(default=None, compare=False)

    def view_options(self) -> dict[str, Any]:
        """``ViewSpec.options`` for the sinks: ``{"search": {...}, "redis": {...}}`` (validated names).
        A nested collection is mapped as a search ``nested`` field unless ``fields`` says otherwise."""
        out = {k: dict(v) for k, v in self.sink_options.items() if v}
        shown = getattr(self.fold, "columns", None)  # a latest-row view's `columns` (None: every column)
        nested = [nc.name for nc in self.nested if shown is None or nc.name in shown]
        if nested and "search" in self.sinks:
            search = out.setdefault("search", {})
            fields = dict(search.get("fields") or {})
            for name in nested:
                fields.setdefault(name, "nested")
            search["fields"] = fields
        return out

    @property
    def joined(self) -> bool:
        """The view combines tables (lookups or nested collections): it runs through the join stage."""
        return bool(self.lookups or self.nested)

    @property
    def topics(self) -> list[str]:
        """Every topic the projection reads (its sources, then the tables its lookups and nested
        collections read)."""
        out = [s.topic for s in self.sources]
        joined = [*(lk.topic for lk in self.lookups), *(nc.topic for nc in self.nested), *(a.topic for a in self.as_of),
                  *getattr(self.fold, "joined_topics", ())]
        return out + [t for t in dict.fromkeys(joined) if t not in out]

    @property
    def source_topics(self) -> list[str]:
        """The topics whose rows or events the fold is driven by (``sources``; not joined tables)."""
        return [s.topic for s in self.sources]

    @property
    def change_topics(self) -> list[str]:
        """Topics of change events (with table schemas), i.e. not event topics."""
        out = [s.topic for s in self.sources if not s.events]
        return out + [t for t in self.topics if t not in out and t not in self.source_topics]

    @property
    def kind(self) -> str:
        return self.fold.kind

    @property
    def strategy(self) -> Any:
        """The fold's ``FoldStrategy`` (``kappaflow.projections.folds``: imported here, not at the top,
        because the strategies build on this module)."""
        from kappaflow.projections.folds import strategy_for

        return strategy_for(self.fold)

    def instance(self) -> Projection:
        if self.cls is None:
            raise ConfigError(f"projection {self.name!r}: no class to instantiate")
        return self.cls()

    def fingerprint(self) -> str:
        """Stable hash of the definition (sources, key, fold, expressions, schema, apply's code)."""
        import hashlib

        parts: list[str] = [
            self.name,
            self.view,
            str(self.namespace),
            repr(self.topics),
            repr(self.key),
            self.kind,
            repr(self.derive),
            repr(self.where),
            repr(self.schema),
        ]
        for s in self.sources:
            parts.append(repr(sorted((s.key or {}).items())) + ("events" if s.events else ""))
        strategy = self.strategy
        parts += strategy.fingerprint(self)
        shape = {
            # options that change the stored view's shape are part of the definition; the others
            # (TTLs, batch sizes, retries) only tune how it is written
            sink: {k: opts[k] for k in SINKS[sink].shape_options if k in opts}
            for sink, opts in sorted(self.sink_options.items())
        }
        shape = {k: v for k, v in shape.items() if v}
        if shape:  # only when set, so fingerprints of projections without options stay as they were
            import json

            parts.append("sink_options=" + json.dumps(shape, sort_keys=True, default=repr))
        if self.lookups:  # only when set, so fingerprints of projections without lookups stay as they were
            parts.append("lookups=" + ";".join(lk.describe() for lk in self.lookups))
        if self.as_of:  # only when set, as lookups
            parts.append("as_of=" + ";".join(a.describe() for a in self.as_of))
        if self.nested:  # likewise
            parts.append("nested=" + ";".join(nc.describe() for nc in self.nested))
        parts += strategy.code_fingerprint(self)  # last, as always: existing fingerprints stay the same
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]

    @classmethod
    def from_class(cls, proj: type[Projection] | Projection) -> ProjectionSpec:
        """Validate a projection class; errors name the class and the attribute."""
        klass = proj if isinstance(proj, type) else type(proj)
        where = f"projection class {klass.__module__}.{klass.__qualname__}"
        if not (isinstance(klass, type) and issubclass(klass, Projection)):
            raise ConfigError(f"{where}: expected a subclass of kappaflow.projections.Projection")

        def attr(name: str) -> Any:
            return getattr(klass, name, None)

        name = attr("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ConfigError(f"{where}: 'name': expected an identifier like 'customer_totals', got {name!r}")
        view = attr("view") or name
        if not isinstance(view, str) or not NAME_RE.match(view):
            raise ConfigError(f"{where}: 'view': expected a table name like 'customer_totals', got {view!r}")
        namespace = attr("namespace")
        if namespace is not None and (not isinstance(namespace, str) or not NAME_RE.match(namespace)):
            raise ConfigError(f"{where}: 'namespace': expected a schema name, got {namespace!r}")

        raw_sources = attr("sources")
        if isinstance(raw_sources, (str, Source)):
            raw_sources = [raw_sources]
        if not raw_sources or not isinstance(raw_sources, (list, tuple)):
            raise ConfigError(f"{where}: 'sources': expected a list of topic names, got {raw_sources!r}")
        sources = []
        for s in raw_sources:
            if isinstance(s, str):
                sources.append(Source(s))
            elif isinstance(s, Source):
                sources.append(s)
            else:
                raise ConfigError(f"{where}: 'sources': expected topic names or Source(...), got {s!r}")
        topics = [s.topic for s in sources]
        if len(set(topics)) != len(topics):
            raise ConfigError(f"{where}: 'sources': topic listed twice in {topics}")

        key = attr("key")
        if isinstance(key, str):
            key = [key]
        if not key or not isinstance(key, (list, tuple)) or not all(isinstance(k, str) and k for k in key):
            raise ConfigError(
                f"{where}: 'key': expected a non-empty list of view key column names (e.g. key = ['id']), got {key!r}"
            )
        key = tuple(key)
        if len(set(key)) != len(key):
            raise ConfigError(f"{where}: 'key': column listed twice in {list(key)}")

        derive = attr("derive") or {}
        if not isinstance(derive, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in derive.items()
        ):
            raise ConfigError(
                f"{where}: 'derive': expected a dict of column name -> Spark SQL expression, got {derive!r}"
            )
        cond = attr("where")
        if cond is not None and (not isinstance(cond, str) or not cond.strip()):
            raise ConfigError(f"{where}: 'where': expected a Spark SQL boolean expression, got {cond!r}")
        schema = attr("schema")
        if schema is not None and (not isinstance(schema, str) or not schema.strip()):
            raise ConfigError(
                f"{where}: 'schema': expected Spark DDL like 'id bigint, total decimal(18,2)', got {schema!r}"
            )

        aggregates = attr("aggregates") or {}
        if not isinstance(aggregates, Mapping):
            raise ConfigError(
                f"{where}: 'aggregates': expected a dict of column name -> Count()/Sum(col)/..., got {aggregates!r}"
            )
        decl = Declaration(
            klass=klass,
            where=where,
            sources=tuple(sources),
            key=key,
            derive=dict(derive),
            where_sql=cond,
            schema=schema,
            aggregates=aggregates,
            columns=attr("columns"),
        )
        from kappaflow.projections.folds import declared_fold

        fold = declared_fold(decl)

        sinks, sink_options = _validate_sinks(where, attr("sinks"), attr("sink_options"), fold)
        consistency = attr("consistency") or "transactions"
        if consistency not in ("transactions", "per_key"):
            raise ConfigError(f"{where}: 'consistency': expected 'transactions' (the default) or 'per_key', "
                              f"got {consistency!r}")
        lookups = parse_lookups(where, attr("lookups"), [s.topic for s in sources])
        from kappaflow.projections.folds import strategy_for

        as_of = parse_as_of(where, attr("as_of"), sources=sources, kind=fold.kind,
                            folds_events=strategy_for(fold).folds_events, sinks=sinks,
                            consistency=consistency, lookups=lookups)
        nested = parse_nested(where, attr("nested"), [s.topic for s in sources])
        policy, auto_rebuild = _schema_policy(where, attr("on_schema_change"), attr("auto_rebuild"), fold)
        on_definition_change = attr("on_definition_change")
        if on_definition_change is not None and on_definition_change not in ("fail", "rebuild"):
            raise ConfigError(f"{where}: 'on_definition_change': expected 'fail' or 'rebuild' (or None: the "
                              f"runtime's [follow] on_definition_change), got {on_definition_change!r}")

        module = getattr(klass, "__module__", None)
        spec = cls(
            name=name,
            view=view,
            namespace=namespace,
            sources=tuple(sources),
            key=key,
            fold=fold,
            derive=tuple(derive.items()),
            where=cond,
            schema=schema,
            cls=klass,
            class_path=f"{module}:{klass.__qualname__}" if module else None,
            sinks=sinks,
            sink_options=sink_options,
            consistency=consistency,
            lookups=lookups,
            as_of=as_of,
            nested=nested,
            on_schema_change=policy,
            auto_rebuild=auto_rebuild,
            on_definition_change=on_definition_change,
        )
        if lookups:
            strategy = spec.strategy
            if not strategy.reads_latest_per_key:
                advice = strategy.lookup_advice()
                hint = f"; {advice}" if advice else f"; a {spec.kind} fold over joined rows is not supported yet"
                raise ConfigError(
                    f"{where}: 'lookups': lookups feed the folds over current rows (latest-row and grouped "
                    f"views){hint}"
                )
        if nested:
            if not spec.strategy.holds_nested:
                raise ConfigError(
                    f"{where}: 'nested': a nested collection belongs to one document per driving row (a latest-row "
                    f"view); it cannot be combined with a {spec.kind} fold ({type(spec.fold).__name__})"
                )
            flat = [s for s in sinks if not SINKS[s].holds_nested]
            if flat:
                raise ConfigError(
                    f"{where}: 'nested': sink(s) {flat} cannot hold a nested collection (a list of rows in a view "
                    f"column); write the view to a document store: "
                    f"{[k for k, kind in SINKS.items() if kind.holds_nested]}"
                )
        return spec


SCHEMA_POLICIES = ("evolve", "rebuild", "fail")
"""Values of ``Projection.on_schema_change`` (see ``kappaflow.projections.schema_watch``)."""


def _schema_policy(where: str, raw: Any, raw_auto: Any, fold: FoldSpec) -> tuple[str, bool]:
    """``on_schema_change`` / ``auto_rebuild`` of a projection class: (policy, auto rebuild), the
    policy defaulting to the fold kind's (``FoldStrategy.default_schema_policy``)."""
    from kappaflow.projections.folds import strategy_for

    if raw is None:
        policy = strategy_for(fold).default_schema_policy(fold)
    elif isinstance(raw, str) and raw in SCHEMA_POLICIES:
        policy = raw
    else:
        raise ConfigError(f"{where}: 'on_schema_change': expected one of {list(SCHEMA_POLICIES)}, got {raw!r}")
    if raw_auto is None:
        auto = False
    elif isinstance(raw_auto, bool):
        auto = raw_auto
    else:
        raise ConfigError(f"{where}: 'auto_rebuild': expected True or False, got {raw_auto!r}")
    if auto and policy == "fail":
        raise ConfigError(f"{where}: 'auto_rebuild' = True contradicts on_schema_change = 'fail' (which stops "
                          "the follower on any source schema change); use 'rebuild' or 'evolve' with it")
    return policy, auto


def _validate_sinks(
    where: str, raw_sinks: Any, raw_options: Any, fold: FoldSpec
) -> tuple[tuple[str, ...], dict[str, dict[str, Any]]]:
    """``sinks`` / ``sink_options`` of a projection class, checked against what each sink accepts."""
    if raw_sinks is None:
        raw_sinks = ("postgres",)
    if isinstance(raw_sinks, str):
        raw_sinks = (raw_sinks,)
    if not isinstance(raw_sinks, (list, tuple)) or not raw_sinks:
        raise ConfigError(
            f"{where}: 'sinks': expected a non-empty list of sink names among {list(SINK_KINDS)}, got {raw_sinks!r}"
        )
    for s in raw_sinks:
        if s not in SINK_KINDS:
            raise ConfigError(f"{where}: 'sinks': unknown sink {s!r}; expected some of {list(SINK_KINDS)}")
    if len(set(raw_sinks)) != len(raw_sinks):
        raise ConfigError(f"{where}: 'sinks': sink listed twice in {list(raw_sinks)}")
    sinks = tuple(raw_sinks)
    from kappaflow.projections.folds import strategy_for

    strategy_for(fold).check_sinks(where, sinks)
    raw_options = raw_options or {}
    if not isinstance(raw_options, Mapping):
        raise ConfigError(
            f"{where}: 'sink_options': expected a dict of sink name -> options dict, got {raw_options!r}"
        )
    options: dict[str, dict[str, Any]] = {}
    for name, opts in raw_options.items():
        if name not in SINK_KINDS:
            raise ConfigError(f"{where}: 'sink_options': unknown sink {name!r}; expected some of {list(SINK_KINDS)}")
        if name not in sinks:
            raise ConfigError(
                f"{where}: 'sink_options'[{name!r}]: the projection does not write to {name!r} "
                f"(sinks = {list(sinks)})"
            )
        if not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
            raise ConfigError(f"{where}: 'sink_options'[{name!r}]: expected a dict of option -> value, got {opts!r}")
        if not opts:
            continue
        kind = SINKS[name]
        here = f"{where}: 'sink_options'[{name!r}]"
        mapped = kind.resolve_aliases(opts, here)
        kind.parse_options(mapped, here)  # the sink's own options model: errors name the option
        options[name] = mapped
    return sinks, options


def load_projection(path: str) -> ProjectionSpec:
    """Import ``module:Class`` (the project folder is on sys.path) and validate it."""
    import importlib

    if ":" not in path:
        raise ConfigError(f"projection {path!r}: expected module:Class, e.g. examples.shop:CustomerTotals")
    module_name, _, cls_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"projection {path!r}: cannot import module {module_name!r}: {exc}") from None
    obj: Any = module
    for part in cls_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"projection {path!r}: module {module_name!r} has no {cls_name!r}")
    from dataclasses import replace

    return replace(ProjectionSpec.from_class(obj), class_path=path)


def load_projections(target: str) -> list[ProjectionSpec]:
    """``module:Class`` -> that projection; ``module`` -> every projection class the module
    offers: the ``Projection`` subclasses in its namespace that are defined in it or, for a
    package, in its submodules (what ``from module import *`` style re-exports expose), in
    the order they appear. A subclass without ``sources`` is a base for others, not a
    projection, and is skipped. A module with none is an error, not an empty runtime."""
    import importlib

    if ":" in target:
        return [load_projection(target)]
    if not target or not all(part.isidentifier() for part in target.split(".")):
        raise ConfigError(f"projection {target!r}: expected module:Class or a module, e.g. examples.shop")
    try:
        module = importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"projection {target!r}: cannot import module {target!r}: {exc}") from None
    from dataclasses import replace

    out: list[ProjectionSpec] = []
    seen: set[int] = set()
    for attr, obj in vars(module).items():
        if attr.startswith("_") or not isinstance(obj, type) or obj is Projection or id(obj) in seen:
            continue
        if not issubclass(obj, Projection) or not getattr(obj, "sources", None):
            continue
        defined_in = obj.__module__
        if defined_in != target and not defined_in.startswith(target + "."):
            continue  # imported from elsewhere (a base class, another application's projection)
        seen.add(id(obj))
        out.append(replace(ProjectionSpec.from_class(obj), class_path=f"{target}:{attr}"))
    if not out:
        raise ConfigError(f"projection module {target!r} defines no Projection class with sources")
    return out


__all__ = [
    "SCHEMA_POLICIES",
    "SINK_KINDS",
    "Aggregate",
    "AsOf",
    "Avg",
    "CollectList",
    "CollectSet",
    "Count",
    "CustomFold",
    "Declaration",
    "Event",
    "FoldSpec",
    "GroupFold",
    "Hopping",
    "LatestFold",
    "Lookup",
    "Max",
    "Min",
    "Nested",
    "Projection",
    "ProjectionSpec",
    "Session",
    "Source",
    "Sum",
    "Tumbling",
    "Window",
    "WindowFold",
    "load_projection",
    "load_projections",
]
