"""Notice, while following, a source schema change the view cannot take (issue 13, item 20).

Capture writes a table's new schema to ``<source>.__schema`` before the first change in the
new shape (an ``ALTER TABLE ... ADD COLUMN`` included). A follower compiled its plan from the
schemas at its start; before each micro-batch it asks :class:`SchemaWatch` whether they are
still those (one end-offset read of the schema topics per batch; the schemas are re-read only
when those topics grew). A change the view can take is let through; one it cannot take stops
the follower with :class:`NeedsRebuild`, recorded in the registry so ``kappaflow status``
reports the projection as "needs rebuild" (never as following), until a replay rebuilds the
view from the log as it is now.

What a view can take, until schema-change policies exist (a later issue): columns added to
or dropped from a source table when the recompiled view keeps exactly its columns and types
(a latest-row view with an explicit ``columns`` list, a grouped view that does not use them),
since the running plan then reads the same values a rebuild would. It cannot take: a changed
key, a column whose type changed (the running plan would parse it with the old type), any
added or dropped column when the fold receives whole rows (custom ``apply`` folds), or a
change after which the view would have other columns (a latest-row view of every column gains
the new one).
"""

from __future__ import annotations

import logging
from typing import Any

from kappaflow.errors import ConfigError, KappaflowError, Retry, UnknownTopicError
from kappaflow.events import Column, TableSchema
from kappaflow.projections.plan import Plan
from kappaflow.projections.schemas import load_table_schemas, schema_topic

log = logging.getLogger("kappaflow.projections")


class NeedsRebuild(KappaflowError):
    """The view cannot take a change of its sources without being rebuilt (no retry helps)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry=Retry.TERMINAL)


def _shape(c: Column | None) -> tuple[Any, ...] | None:
    """What decides how a column's values are parsed (not its default, comment or text length)."""
    if c is None:
        return None
    return (c.type, c.scale, c.precision, _shape(c.items))


def _difference(old: TableSchema, new: TableSchema) -> tuple[list[str], list[str], list[str]]:
    """(added, dropped, retyped) column names."""
    before = {c.name: c for c in old.columns}
    after = {c.name: c for c in new.columns}
    added = [n for n in after if n not in before]
    dropped = [n for n in before if n not in after]
    retyped = [n for n in before if n in after and _shape(before[n]) != _shape(after[n])]
    return added, dropped, retyped


def rebuild_reason(plan: Plan, spark: Any, schemas: dict[str, TableSchema]) -> str | None:
    """Why `plan`'s view cannot take its sources' `schemas` without a rebuild; None when it can."""
    spec = plan.spec
    hard: list[str] = []  # changes no view can take
    soft: list[str] = []  # added/dropped columns: taken when the recompiled view is the same
    for topic in spec.change_topics:
        old, new = plan.schemas.get(topic), schemas.get(topic)
        if old is None or new is None or old == new:
            continue
        added, dropped, retyped = _difference(old, new)
        what = "; ".join(
            f"{label} {names}" for label, names in (("added", added), ("dropped", dropped), ("type changed", retyped))
            if names
        )
        if tuple(old.key) != tuple(new.key):
            hard.append(f"source table {topic}: key changed from {list(old.key)} to {list(new.key)}")
        elif retyped:
            hard.append(f"source table {topic}: column(s) {what}")
        elif (added or dropped) and plan.whole_rows:
            hard.append(f"source table {topic}: column(s) {what}, and its apply() fold receives whole rows")
        elif added or dropped:
            soft.append(f"source table {topic}: column(s) {what}")
    if hard:
        return "; ".join(hard + soft)
    if not soft:
        return None
    try:
        again = Plan.build(spark, spec, {**plan.schemas, **schemas})
    except ConfigError as exc:
        return "; ".join(soft) + f", and the projection no longer compiles: {exc}"
    if again.view == plan.view:
        return None
    have = {c.name: c.type.simpleString() for c in plan.view.columns}
    want = {c.name: c.type.simpleString() for c in again.view.columns}
    parts = [
        f"gain column(s) {[n for n in want if n not in have]}" if any(n not in have for n in want) else "",
        f"lose column(s) {[n for n in have if n not in want]}" if any(n not in want for n in have) else "",
        f"change the type of {[n for n in want if n in have and want[n] != have[n]]}"
        if any(n in have and want[n] != have[n] for n in want) else "",
    ]
    return "; ".join(soft) + ": the view would " + (", ".join(p for p in parts if p) or "change shape")


class SchemaWatch:
    """Per follower: ``check()`` before each batch raises :class:`NeedsRebuild` (after recording it
    in the registry) once a source schema changed in a way the view cannot take."""

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

    def check(self) -> None:
        ends = self._schema_ends()
        if ends == self._ends:
            return
        spec = self.plan.spec
        watched = [t for t in spec.change_topics if t not in self.given]
        schemas = load_table_schemas(self.rt.reader(), watched, self.given)
        reason = rebuild_reason(self.plan, self.rt.spark, schemas)
        if reason is None:
            self._ends = ends
            return
        path = spec.class_path or spec.name
        message = (f"projection {spec.name!r} needs a rebuild: {reason}. The follower stopped before writing "
                   f"anything of the new shape; rebuild the view with `kappaflow replay {path}` (built beside "
                   "the live view and swapped in), then follow again")
        mark_needs_rebuild(self.rt, spec.name, reason)
        raise NeedsRebuild(message)


def mark_needs_rebuild(rt: Any, name: str, reason: str) -> None:
    """Record in the registry (when there is one) that `name`'s view needs a rebuild, and why."""
    if not getattr(rt, "dsn", None):
        return
    try:
        with rt.registry() as reg:
            reg.mark_needs_rebuild(name, reason)
    except KappaflowError as exc:  # the follower stops anyway; status then shows it stopped
        log.warning("projection %s: could not record that it needs a rebuild: %s", name, exc)


__all__ = ["NeedsRebuild", "SchemaWatch", "mark_needs_rebuild", "rebuild_reason"]
