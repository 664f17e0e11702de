"""Source schema changes meet a followed view by the projection's policy (issue 13 item 20, issue 22 item 4).

Capture writes a table's new schema to ``<source>.__schema`` before the first change in the
new shape (an ``ALTER TABLE ... ADD COLUMN`` included). A follower compiled its plan from the
schemas at its start; before each micro-batch it asks :class:`SchemaWatch` whether they are
still those (one end-offset read of the schema topics per batch; the schemas are re-read only
when those topics grew). When they changed, :func:`assess` says what changed (per source table:
columns added, dropped, widened, retyped incompatibly, the key) and what the follower does, by
the projection's ``on_schema_change``:

- ``"follow"``: the view keeps its shape (an added column an explicit ``columns`` list does not
  show, a widened column it does not show): the plan is recompiled with the new schemas and the
  batch goes on;
- ``"evolve"`` (policy ``evolve``): the view gains columns or widens some, which the sinks do in
  place (``Sink.evolve``: ``ALTER TABLE``, a mapping update, the Redis build's column list); the
  follower recompiles its plan and goes on with no replay, positions untouched;
- ``"rebuild"``: a change that cannot be applied in place (a dropped or renamed column the view
  uses, a narrowed or incompatible type, a changed key, a fold whose keyed state holds the
  widened column), or any view change under policy ``rebuild``: the follower stops with
  :class:`NeedsRebuild` naming the change, recorded in the registry so ``kappaflow status``
  reports "needs rebuild" until ``kappaflow replay`` rebuilds the view blue/green; with
  ``auto_rebuild = True`` the follower runs that rebuild itself and follows on;
- ``"fail"`` (policy ``fail``): any change stops the follower with :class:`SchemaChangeRefused`
  saying what changed.

Why a recompiled plan is exactly the replay's: events written before the change are parsed with
the new schema by both (a column added later reads NULL in old events, a widened type holds the
old values), so a view followed across the change equals a view replayed from the log after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kappaflow.errors import ConfigError, KappaflowError, Retry, UnknownTopicError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.projections.plan import Plan
from kappaflow.projections.schemas import load_table_schemas, schema_topic, spark_type
from kappaflow.projections.sinks.base import ViewEvolution, ViewSpec, evolution, widens

log = logging.getLogger("kappaflow.projections")


class NeedsRebuild(KappaflowError):
    """The view cannot take a change of its sources without being rebuilt (no retry helps).

    ``auto``: the projection rebuilds itself (``auto_rebuild``); the follower runs the rebuild."""

    def __init__(self, message: str, *, auto: bool = False) -> None:
        super().__init__(message, retry=Retry.TERMINAL)
        self.auto = auto


class SchemaChangeRefused(KappaflowError):
    """A source schema changed and the projection's ``on_schema_change = "fail"`` stops at any change."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry=Retry.TERMINAL)


def _shape(c: Column | None) -> tuple[Any, ...] | None:
    """What decides how a column's values are parsed (not its default, comment or text length)."""
    if c is None:
        return None
    return (c.type, c.scale, c.precision, _shape(c.items))


def type_text(c: Column) -> str:
    """A column's type as messages show it: the source's own name when known (``integer``,
    ``varchar(50)``), else kappaflow's type with its length or precision."""
    base = c.native_type or c.type.value.lower()
    if "(" not in base:
        if c.type is FieldType.DECIMAL and c.precision is not None:
            base += f"({c.precision},{c.scale or 0})"
        elif c.length is not None and c.type is not FieldType.DECIMAL:
            base += f"({c.length})"
    return base


@dataclass(frozen=True)
class ColumnChange:
    name: str
    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.name!r} {self.old} -> {self.new}"


@dataclass
class TableChange:
    """How one source table's schema changed."""

    topic: str
    added: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    widened: list[ColumnChange] = field(default_factory=list)
    """Types whose every old value is a value of the new one (int -> bigint, numeric(10,2) -> numeric(12,2))."""
    retyped: list[ColumnChange] = field(default_factory=list)
    """Narrowed or incompatible types (bigint -> int, text -> integer)."""
    other: list[ColumnChange] = field(default_factory=list)
    """Changes that do not change the values (a text length, a default)."""
    key: tuple[list[str], list[str]] | None = None

    def describe(self) -> str:
        parts = []
        if self.added:
            parts.append(f"column(s) {self.added} added")
        if self.dropped:
            parts.append(f"column(s) {self.dropped} dropped (or renamed)")
        if self.widened:
            parts.append("widened " + ", ".join(map(str, self.widened)))
        if self.retyped:
            parts.append("type changed " + ", ".join(map(str, self.retyped)))
        if self.other:
            parts.append("changed " + ", ".join(map(str, self.other)))
        if self.key is not None:
            parts.append(f"key changed from {self.key[0]} to {self.key[1]}")
        return f"source table {self.topic}: " + ("; ".join(parts) or "schema record changed")


def table_change(topic: str, old: TableSchema, new: TableSchema) -> TableChange:
    """What changed from `old` to `new` (see :class:`TableChange`)."""
    before = {c.name: c for c in old.columns}
    after = {c.name: c for c in new.columns}
    out = TableChange(topic)
    out.added = [n for n in after if n not in before]
    out.dropped = [n for n in before if n not in after]
    for n in before:
        if n not in after or before[n] == after[n]:
            continue
        a, b = before[n], after[n]
        change = ColumnChange(n, type_text(a), type_text(b))
        if _shape(a) == _shape(b):
            if change.old != change.new:
                out.other.append(change)
        elif widens(spark_type(a), spark_type(b)):
            out.widened.append(change)
        else:
            out.retyped.append(change)
    if tuple(old.key) != tuple(new.key):
        out.key = (list(old.key), list(new.key))
    return out


def _view_text(old: ViewSpec, evo: ViewEvolution) -> str:
    parts = []
    if evo.added:
        parts.append(f"gain column(s) {[c.name for c in evo.added]}")
    if evo.widened:
        parts.append("widen column(s) " + ", ".join(f"{o.name!r} {o.type.simpleString()} -> "
                                                    f"{n.type.simpleString()}" for o, n in evo.widened))
    parts += list(evo.problems)
    return ", ".join(parts) or "change shape"


@dataclass
class SchemaChange:
    """What changed in a followed projection's source schemas and what the follower does about it.

    ``action``: ``"follow"``, ``"evolve"``, ``"rebuild"`` or ``"fail"`` (see the module docstring);
    ``reason`` names the change; ``plan`` is the projection compiled with the new schemas (None when
    it no longer compiles); ``view`` how its view changes (None when it does not)."""

    tables: list[TableChange]
    action: str
    reason: str
    plan: Plan | None = None
    view: ViewEvolution | None = None
    ends: Any = None  # the schema topics' end offsets the change was read at (SchemaWatch)


def _lost_columns(old: ViewSpec, new: ViewSpec) -> list[str]:
    return [n for n in old.column_names if n not in new.column_names]


def assess(plan: Plan, spark: Any, schemas: dict[str, TableSchema]) -> SchemaChange | None:
    """How `plan`'s projection meets its sources' current `schemas` (None: they did not change)."""
    from kappaflow.projections.folds import strategy_for

    spec = plan.spec
    tables = []
    for topic in spec.change_topics:
        old, new = plan.schemas.get(topic), schemas.get(topic)
        if old is None or new is None or old == new:
            continue
        tables.append(table_change(topic, old, new))
    if not tables:
        return None
    what = "; ".join(t.describe() for t in tables)
    policy = spec.on_schema_change
    if policy == "fail":
        return SchemaChange(tables, "fail", what)
    strategy = strategy_for(spec)
    hard: list[str] = []  # why the change cannot be taken in place (each once)

    def why(text: str) -> None:
        if text not in hard:
            hard.append(text)

    for t in tables:
        if t.key is not None:
            why("a changed key needs a rebuild")
        if t.retyped:
            why("a narrowed or incompatible type (" + ", ".join(map(str, t.retyped)) + ") needs a rebuild "
                "(only widening applies in place)")
        if t.widened and not strategy.evolves_in_place:
            why(f"a {spec.kind} view keeps source columns in its state: a widened column needs a rebuild")
        if plan.whole_rows and t.dropped:
            why("its apply() fold receives whole rows: a dropped column needs a rebuild")
        elif plan.whole_rows and (t.added or t.widened) and policy != "evolve":
            why("its apply() fold receives whole rows (on_schema_change = 'evolve' lets added and widened "
                "columns reach it)")
    again: Plan | None = None
    try:
        again = Plan.build(spark, spec, {**plan.schemas, **schemas})
    except ConfigError as exc:
        why(f"the projection no longer compiles: {exc}")
    evo = evolution(plan.view.columns, plan.view.key, again.view) if again is not None else None
    if again is not None and evo is not None and evo.problems:
        lost = _lost_columns(plan.view, again.view)
        rest = tuple(p for p in evo.problems if "no longer produced" not in p)
        why("the view would " + "; ".join(
            ([f"lose column(s) {lost}"] if lost else [])
            + ([_view_text(plan.view, ViewEvolution(evo.added, evo.widened, rest))]
               if (evo.added or evo.widened or rest) else [])))
    if hard:
        return SchemaChange(tables, "rebuild", f"{what}: " + "; ".join(hard), again, evo)
    assert again is not None and evo is not None
    if evo.empty:
        return SchemaChange(tables, "follow", what, again)
    change = f"{what}: the view would {_view_text(plan.view, evo)}"
    if policy == "rebuild":
        return SchemaChange(tables, "rebuild", change + " (on_schema_change = 'rebuild')", again, evo)
    if spec.joined:
        return SchemaChange(tables, "rebuild", change + " (a joined view is rebuilt, not evolved in place)",
                            again, evo)
    return SchemaChange(tables, "evolve", change, again, evo)


def rebuild_reason(plan: Plan, spark: Any, schemas: dict[str, TableSchema]) -> str | None:
    """Why `plan`'s view cannot take its sources' `schemas` as it is now (None when it can: no change,
    a change the view does not show, or one ``on_schema_change = "evolve"`` applies in place)."""
    change = assess(plan, spark, schemas)
    if change is None or change.action in ("follow", "evolve"):
        return None
    return change.reason


class SchemaWatch:
    """Per follower: ``check()`` before each batch returns the :class:`SchemaChange` to act on, once
    a source schema changed (None otherwise); ``accept`` it once the follower took it."""

    def __init__(self, plan: Plan, rt: Any) -> None:
        self.plan = plan
        self.rt = rt
        self.topics = sorted({schema_topic(t) for t in plan.spec.change_topics})
        self.given = {s.topic: s.schema for s in plan.spec.sources if s.schema is not None}
        self._ends: dict[str, dict[int, int]] | None = None  # None: compare at the first check

    def _schema_ends(self) -> dict[str, dict[int, int]]:
        reader = self.rt.reader()
        out: dict[str, dict[int, int]] = {}
        for t in self.topics:
            try:
                out[t] = dict(reader.end_offsets(t))
            except UnknownTopicError:
                out[t] = {}
        return out

    def check(self) -> SchemaChange | None:
        ends = self._schema_ends()
        if ends == self._ends:
            return None
        spec = self.plan.spec
        watched = [t for t in spec.change_topics if t not in self.given]
        schemas = load_table_schemas(self.rt.reader(), watched, self.given)
        change = assess(self.plan, self.rt.spark, schemas)
        if change is None:
            self._ends = ends
            return None
        change.ends = ends
        return change

    def accept(self, change: SchemaChange) -> None:
        """The follower runs `change.plan` from now on."""
        assert change.plan is not None
        self.plan = change.plan
        self._ends = change.ends


def needs_rebuild_message(spec: Any, reason: str, sink: str | None = None) -> str:
    path = spec.class_path or spec.name
    where = f" in the {sink} sink" if sink else ""
    return (f"projection {spec.name!r} needs a rebuild{where}: {reason}. The follower stopped before writing "
            f"anything of the new shape; rebuild the view with `kappaflow replay {path}` (built beside the live "
            "view and swapped in), then follow again (or set auto_rebuild = True on the projection to have the "
            "follower do it)")


def refused_message(spec: Any, reason: str) -> str:
    path = spec.class_path or spec.name
    return (f"projection {spec.name!r} stopped on a source schema change (on_schema_change = 'fail'): {reason}. "
            f"Nothing of the new shape was written. Following again takes the change as far as the view can "
            f"take it as it is; `kappaflow replay {path}` rebuilds the view with the new schema")


def mark_needs_rebuild(rt: Any, name: str, reason: str) -> None:
    """Record in the registry (when there is one) that `name`'s view needs a rebuild, and why."""
    if not getattr(rt, "dsn", None):
        return
    try:
        with rt.registry() as reg:
            reg.mark_needs_rebuild(name, reason)
    except KappaflowError as exc:  # the follower stops anyway; status then shows it stopped
        log.warning("projection %s: could not record that it needs a rebuild: %s", name, exc)


__all__ = [
    "ColumnChange",
    "NeedsRebuild",
    "SchemaChange",
    "SchemaChangeRefused",
    "SchemaWatch",
    "TableChange",
    "assess",
    "mark_needs_rebuild",
    "needs_rebuild_message",
    "rebuild_reason",
    "refused_message",
    "table_change",
    "type_text",
]
