"""The projections registry (``kappaflow.projections`` in the views database).

One row per projection with a live view: where the view is, its key and columns, the
topics it reads, the definition's fingerprint and a generation number that changes
whenever a new live table appears (replay swap, or follow creating the view), so a
follower never resumes from a Spark checkpoint written against an older table; and
``needs_rebuild``, why the view must be rebuilt before it can be followed again (set by a
follower that met a source schema change the view cannot take, cleared by the next build).
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any

import orjson

from kappaflow.errors import SinkError
from kappaflow.projections.sinks.base import ViewSpec
from kappaflow.projections.sinks.postgres import ensure_migrated

TABLE = '"kappaflow"."projections"'


@dataclass(frozen=True)
class Registered:
    name: str
    kind: str
    view_schema: str
    view_table: str
    key_columns: list[str]
    columns: dict[str, Any]
    topics: list[str]
    class_path: str | None
    fingerprint: str
    generation: int
    replayed_at: Any
    updated_at: Any
    needs_rebuild: str | None = None

    @property
    def view(self) -> ViewSpec:
        return ViewSpec.from_dict(self.columns)


class Registry:
    def __init__(self, dsn: str) -> None:
        import psycopg

        ensure_migrated(dsn)
        try:
            self.conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            raise SinkError(f"registry: connecting to the views database failed: {exc}") from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    _COLS = (
        "name, kind, view_schema, view_table, key_columns, columns, topics, class_path, fingerprint, "
        "generation, replayed_at, updated_at, needs_rebuild"
    )

    def _row(self, r: tuple[Any, ...]) -> Registered:
        cols = r[5] if isinstance(r[5], dict) else orjson.loads(r[5])
        return Registered(r[0], r[1], r[2], r[3], list(r[4]), cols, list(r[6]), r[7], r[8], int(r[9]), r[10], r[11],
                          r[12])

    def get(self, name: str) -> Registered | None:
        r = self.conn.execute(f"SELECT {self._COLS} FROM {TABLE} WHERE name = %s", (name,)).fetchone()
        return self._row(r) if r else None

    def by_view(self, view: str) -> Registered | None:
        """A projection by its name, its view table, or ``schema.table``."""
        r = self.conn.execute(
            f"SELECT {self._COLS} FROM {TABLE} "
            "WHERE name = %s OR view_table = %s OR view_schema || '.' || view_table = %s "
            "ORDER BY (name = %s) DESC LIMIT 1",
            (view, view, view, view),
        ).fetchone()
        return self._row(r) if r else None

    def list(self) -> builtins.list[Registered]:
        return [self._row(r) for r in self.conn.execute(f"SELECT {self._COLS} FROM {TABLE} ORDER BY name").fetchall()]

    def record(
        self,
        *,
        name: str,
        kind: str,
        view: ViewSpec,
        schema: str,
        topics: builtins.list[str],
        class_path: str | None,
        fingerprint: str,
        new_generation: bool,
        replayed: bool,
    ) -> int:
        """Insert or update a projection's row; returns its generation. A new generation (a view built
        from the log as it is now) clears ``needs_rebuild``."""
        gen_expr = "p.generation + 1" if new_generation else "p.generation"
        rebuild_expr = "NULL" if new_generation else "p.needs_rebuild"
        r = self.conn.execute(
            f"""
            INSERT INTO {TABLE} AS p (name, kind, view_schema, view_table, key_columns, columns, topics, class_path,
                                      fingerprint, generation, replayed_at, updated_at)
            VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, 1, CASE WHEN %s THEN now() END, now())
            ON CONFLICT (name) DO UPDATE SET kind = excluded.kind, view_schema = excluded.view_schema,
                view_table = excluded.view_table, key_columns = excluded.key_columns, columns = excluded.columns,
                topics = excluded.topics, class_path = coalesce(excluded.class_path, p.class_path),
                fingerprint = excluded.fingerprint,
                generation = {gen_expr}, needs_rebuild = {rebuild_expr},
                replayed_at = coalesce(excluded.replayed_at, p.replayed_at), updated_at = now()
            RETURNING generation
            """,
            (
                name,
                kind,
                schema,
                view.name,
                list(view.key),
                orjson.dumps(view.to_dict()).decode(),
                topics,
                class_path,
                fingerprint,
                replayed,
            ),
        ).fetchone()
        return int(r[0]) if r else 1

    def mark_needs_rebuild(self, name: str, reason: str) -> None:
        """Record why `name`'s view must be rebuilt (``kappaflow status`` shows it until a replay)."""
        self.conn.execute(f"UPDATE {TABLE} SET needs_rebuild = %s, updated_at = now() WHERE name = %s", (reason, name))

    def forget(self, name: str) -> None:
        self.conn.execute(f"DELETE FROM {TABLE} WHERE name = %s", (name,))


__all__ = ["Registered", "Registry"]
