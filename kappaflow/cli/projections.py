"""CLI for projections: replay, follow, verify, `projection list|status`, query.

Wiring (in ``kappaflow/cli/app.py``)::

    from kappaflow.cli import projections as projections_cli
    app.command("replay")(projections_cli.replay)
    app.command("follow")(projections_cli.follow)
    app.command("verify")(projections_cli.verify)
    app.command("query")(projections_cli.query)
    app.add_typer(projections_cli.app, name="projection")   # list, status
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kappaflow.cli.common import console, err_console, settings

app = typer.Typer(help="Inspect projections (views built from the log).", no_args_is_help=True)


def _cwd_importable() -> None:
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def _runtime(ctx: typer.Context, *, spark: bool = True) -> Any:
    from kappaflow.projections.runtime import Runtime

    s = settings(ctx)
    if not spark:
        from kappaflow.projections.sinks.postgres import PostgresSink

        dsn = s.views.postgres_connect_dsn()
        log_url = s.log.url
        if not s.log.is_kafka:
            p = Path(log_url.removeprefix("file:"))
            log_url = str(p if p.is_absolute() else s.base_dir / p)

        class _NoSpark:
            sparkContext = None

        rt = Runtime.__new__(Runtime)
        rt.spark = _NoSpark()
        rt.log_url, rt.sink, rt.dsn = log_url, PostgresSink(dsn), dsn
        rt.log_options = s.log.kafka.client_options() if s.log.is_kafka else {}
        rt.log_options.pop("client_id", None)
        rt.checkpoint_dir = s.resolve(s.spark.checkpoint_dir)
        return rt
    return Runtime.from_settings(s)


def _load(path: str) -> Any:
    from kappaflow.projections.api import load_projection

    _cwd_importable()
    return load_projection(path)


def replay(
    ctx: typer.Context,
    projection: Annotated[
        str, typer.Argument(help="module:Class of the projection, e.g. examples.shop:CustomerTotals")
    ],
    wait: Annotated[float, typer.Option("--wait", help="Seconds to wait for a running follower to stop.")] = 0.0,
) -> None:
    """Rebuild a view from the log into a shadow, catch up, swap it in atomically."""
    from kappaflow.projections.replay import replay as run_replay

    spec = _load(projection)
    rt = _runtime(ctx)
    try:
        progress = Progress(
            TextColumn(f"replay [bold]{spec.name}[/]"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} events"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
        )
        started = time.monotonic()
        with progress:
            task = progress.add_task("replay", total=1, rate="")

            def report(done: int, total: int) -> None:
                secs = max(time.monotonic() - started, 1e-6)
                progress.update(task, completed=done, total=max(total, 1), rate=f"{done / secs:,.0f} events/s")

            res = run_replay(spec, rt, progress=report, wait_lock_s=wait)
        console.print(
            f"[green]replayed[/] {res.projection} -> view [bold]{res.view}[/]: {res.events:,} events, "
            f"{res.rows:,} rows, {res.dead_letters} dead letters, {res.seconds:.1f}s "
            f"({res.events_per_s:,.0f} events/s in the build"
            + (f", {res.catch_up_rounds} catch-up rounds" if res.catch_up_rounds else "")
            + ")"
        )
    finally:
        rt.close()


def follow(
    ctx: typer.Context,
    projection: Annotated[str, typer.Argument(help="module:Class of the projection")],
    trigger: Annotated[str, typer.Option("--trigger", help="Micro-batch interval, e.g. 0.5s, 2s, 500ms.")] = "0.5s",
    max_records: Annotated[int, typer.Option("--max-records", help="Records per micro-batch at most.")] = 200_000,
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help="Spark checkpoint directory.")] = None,
) -> None:
    """Keep a view current (Spark Structured Streaming); Ctrl-C stops cleanly."""
    from kappaflow.projections.follow import Follower

    spec = _load(projection)
    rt = _runtime(ctx)

    def on_batch(stats: Any, res: Any) -> None:
        if res.events or res.dead_letters:
            err_console.print(
                f"batch {stats.batches}: {res.events:,} events, {res.upserted:,} upserts, {res.deleted:,} deletes"
                + (f", {res.dead_letters} dead letters" if res.dead_letters else ""),
                highlight=False,
            )

    try:
        f = Follower(
            spec, rt, trigger=trigger, max_records_per_batch=max_records, on_batch=on_batch, checkpoint=checkpoint
        ).start()
        console.print(f"following {spec.name} -> view [bold]{f.plan.view.name}[/] (trigger {trigger}); Ctrl-C stops")
        f.run_forever()
        console.print(f"stopped after {f.stats.batches} batches, {f.stats.events:,} events")
    finally:
        rt.close()


def verify(
    ctx: typer.Context,
    projection: Annotated[str, typer.Argument(help="module:Class of the projection")],
    limit: Annotated[int, typer.Option("--limit", help="Show at most this many drifted rows.")] = 20,
) -> None:
    """Replay into a scratch table and compare with the live view; exit code 1 on drift."""
    from kappaflow.projections.verify import verify as run_verify

    spec = _load(projection)
    rt = _runtime(ctx)
    try:
        res = run_verify(spec, rt, limit=limit)
    finally:
        rt.close()
    if res.ok:
        console.print(f"[green]ok[/]: view {res.view} matches a fresh replay ({res.rows:,} rows)")
        return
    table = Table(title=f"drift in {res.view}: {res.drift_count} keys")
    table.add_column("key")
    table.add_column("kind")
    table.add_column("view")
    table.add_column("replay")
    for d in res.drift:
        table.add_row(json.dumps(list(d.key), default=str), d.kind, _short(d.live), _short(d.expected))
    console.print(table)
    raise typer.Exit(1)


def _short(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    text = json.dumps(row, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


@app.command("list")
def list_projections(ctx: typer.Context) -> None:
    """Projections with a live view."""
    from kappaflow.projections.status import projection_status

    rt = _runtime(ctx, spark=False)
    try:
        rows = projection_status(rt)
    finally:
        rt.close()
    table = Table()
    for c in ("projection", "kind", "view", "rows", "lag", "following", "replayed"):
        table.add_column(c)
    for s in rows:
        table.add_row(
            s.name,
            s.kind,
            s.view,
            f"{s.rows:,}" if s.rows is not None else "?",
            f"{s.lag:,}",
            "yes" if s.following else "no",
            str(s.replayed_at or "-")[:19],
        )
    console.print(table if rows else "no projections yet: run `kappaflow replay module:Class`")


@app.command("status")
def status(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="Projection or view name (default: all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Position and lag per log partition."""
    from kappaflow.projections.status import projection_status

    rt = _runtime(ctx, spark=False)
    try:
        rows = projection_status(rt, name)
    finally:
        rt.close()
    if as_json:
        console.print_json(json.dumps([s.to_dict() for s in rows], default=str))
        return
    for s in rows:
        table = Table(
            title=f"{s.name} ({s.kind}) -> {s.view}: {s.rows if s.rows is not None else '?'} rows, "
            f"lag {s.lag:,}, {'following' if s.following else 'not followed'}"
        )
        for c in ("topic", "partition", "position", "end", "lag"):
            table.add_column(c)
        for p in s.partitions:
            table.add_row(p.topic, str(p.partition), f"{p.position:,}", f"{p.end:,}", f"{p.lag:,}")
        console.print(table)


def query(
    ctx: typer.Context,
    view: Annotated[str, typer.Argument(help="View (or projection) name")],
    key: Annotated[str, typer.Argument(help="Key value; for composite keys a JSON object or comma list")],
) -> None:
    """Print one row of a view by key."""
    rt = _runtime(ctx, spark=False)
    try:
        row = query_row(rt, view, key)
    finally:
        rt.close()
    if row is None:
        err_console.print(f"no row with key {key!r} in {view}")
        raise typer.Exit(1)
    console.print_json(json.dumps(row, default=str))


def query_row(rt: Any, view: str, key: str) -> dict[str, Any] | None:
    """The row of `view` with key `key` (text, cast by PostgreSQL to each key column's type)."""
    from psycopg import sql
    from psycopg.rows import dict_row

    from kappaflow.errors import ConfigError
    from kappaflow.projections.sinks.postgres import pg_type

    with rt.registry() as reg:
        entry = reg.by_view(view)
        if entry is None:
            known = ", ".join(e.view_table for e in reg.list()) or "none yet"
            raise ConfigError(f"unknown view {view!r} (views: {known})")
    spec = entry.view
    keys = list(spec.key)
    values: list[str]
    text = key.strip()
    if len(keys) == 1:
        values = [text]
    elif text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            raise ConfigError(f"KEY {key!r}: not valid JSON") from None
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ConfigError(f"KEY: view {view!r} is keyed by {keys}; missing {missing}")
        values = [str(obj[k]) for k in keys]
    else:
        values = [v.strip() for v in text.split(",")]
        if len(values) != len(keys):
            raise ConfigError(f"KEY: view {view!r} is keyed by {keys}: give {len(keys)} comma-separated values")
    where = sql.SQL(" AND ").join(
        sql.SQL("{} = %s::{}").format(sql.Identifier(k), sql.SQL(pg_type(spec.column(k).type))) for k in keys
    )
    stmt = sql.SQL("SELECT * FROM {}.{} WHERE {}").format(
        sql.Identifier(entry.view_schema), sql.Identifier(entry.view_table), where
    )
    import psycopg

    try:
        with psycopg.connect(rt.dsn, row_factory=dict_row) as conn:
            return conn.execute(stmt, values).fetchone()
    except psycopg.errors.DataError as exc:
        raise ConfigError(f"KEY {key!r}: {str(exc).splitlines()[0]} (key columns {keys})") from None


__all__ = ["app", "follow", "query", "query_row", "replay", "verify"]
