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
    _setup_logging(ctx, s)
    return Runtime.from_settings(s, with_spark=spark)


def _setup_logging(ctx: typer.Context, s: Any) -> None:
    """Timestamped kappaflow lines on stderr; Spark's own logging at ``[spark] log_level`` (off)."""
    from kappaflow import logs

    obj = ctx.find_root().obj or {}
    logs.setup(debug=bool(obj.get("debug")), spark_level=s.spark.log_level)


def _start_spark(ctx: typer.Context, rt: Any) -> None:
    """Start Spark for a runtime built without it (after the checks that need no Spark)."""
    from kappaflow.projections.runtime import session_from_settings

    rt.attach_spark(session_from_settings(settings(ctx)))


SinkOption = Annotated[
    list[str] | None,
    typer.Option(
        "--sink",
        help="Only this sink of the projection (postgres, search, redis); repeat for several. Default: all of them.",
    ),
]


def _load(path: str) -> Any:
    from kappaflow.projections.api import load_projection

    _cwd_importable()
    return load_projection(path)


def replay(
    ctx: typer.Context,
    projection: Annotated[
        str, typer.Argument(help="module:Class of the projection, e.g. examples.shop:CustomerTotals")
    ],
    wait: Annotated[float, typer.Option(
        "--wait", help="Seconds to wait for another replay (or a mirror's follower) to finish.")] = 0.0,
    sink: SinkOption = None,
    handover_timeout: Annotated[float, typer.Option(
        "--handover-timeout", help="Followed view: seconds to wait for its follower to take the rebuilt view.")] = 60.0,
) -> None:
    """Rebuild a view from the log into a shadow in each of its sinks, catch up, swap it in atomically.

    A view a follower keeps current is rebuilt beside it and handed over: the follower catches the
    rebuilt view up and swaps it in between two batches, then follows it (no stop, nothing lost)."""
    from kappaflow.projections.replay import lock_sinks, replay_sinks, unlock_sinks
    from kappaflow.projections.replay import replay as run_replay

    spec = _load(projection)
    rt = _runtime(ctx, spark=False)
    try:
        # The locks first: a followed projection is refused at once, not after Spark's start-up.
        selected = replay_sinks(spec, rt, sink)
        followed = lock_sinks(spec, selected, wait, handover=bool(rt.dsn))
        if followed:
            err_console.print(f"{spec.name} is followed in {', '.join(followed)}: building the new view beside "
                              "the live one, then handing it over to the follower")
        try:
            _start_spark(ctx, rt)
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

                res = run_replay(spec, rt, progress=report, sinks=sink, locked=True, followed=followed,
                                 handover_timeout_s=handover_timeout)
        finally:
            unlock_sinks(spec, list(selected.values()))
        per_sink = ", ".join(
            f"{k} {r.rows:,} rows" + (f" ({r.dead_letters} dead letters)" if r.dead_letters else "")
            + (" (swapped in by its follower)" if r.handed_over else "")
            for k, r in res.sinks.items()
        )
        console.print(
            f"[green]replayed[/] {res.projection} -> view [bold]{res.view}[/] ({per_sink}): {res.events:,} events, "
            f"{res.dead_letters} dead letters, {res.seconds:.1f}s "
            f"({res.events_per_s:,.0f} events/s in the build"
            + (f", {res.catch_up_rounds} catch-up rounds" if res.catch_up_rounds else "")
            + ")"
        )
    finally:
        rt.close()


def follow(
    ctx: typer.Context,
    projections: Annotated[list[str] | None, typer.Argument(
        help="Projections to follow: module:Class, or a module (every projection class it offers); several "
             "run in one Spark application.", show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Follow the projections listed in [follow] projections.")] = False,
    trigger: Annotated[str, typer.Option("--trigger", help="Micro-batch interval, e.g. 0.5s, 2s, 500ms.")] = "0.5s",
    max_records: Annotated[int, typer.Option("--max-records", help="Records per micro-batch at most.")] = 200_000,
    checkpoint: Annotated[str | None, typer.Option(
        "--checkpoint", help="Spark checkpoint directory (several projections: one sub-folder each).")] = None,
    sink: SinkOption = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Serve Prometheus metrics on this port (/metrics); default [metrics] port.")] = None,
) -> None:
    """Keep views current: one streaming query per projection and sink, all in one Spark application;
    Ctrl-C stops cleanly.

    A query whose store is down backs off and restarts alone while the others go on. Logs (stderr,
    timestamped) when each follower runs and when it has caught up with the log."""
    import logging

    from kappaflow.cli.follow_progress import FollowProgress
    from kappaflow.metrics.follow import follow_registry
    from kappaflow.metrics.process import serve
    from kappaflow.projections.follow import parse_trigger
    from kappaflow.projections.follow_runtime import FollowRuntime, resolve_projections

    log = logging.getLogger("kappaflow.follow")
    s = settings(ctx)
    _cwd_importable()
    specs = resolve_projections(projections or [], all_=all_, configured=s.follow.projections)
    parse_trigger(trigger)  # a bad --trigger is refused before Spark starts
    rt = _runtime(ctx, spark=False)
    try:
        runtime = FollowRuntime(specs, rt, sinks=sink, trigger=trigger, max_records_per_batch=max_records,
                                checkpoint=checkpoint, on_definition_change=s.follow.on_definition_change)
        for spec in specs:
            _refuse_if_locked(spec, {f.sink_name: rt.sink_for(spec.name, f.sink_name)
                                     for f in runtime.groups[spec.name].followers.values()})
        what = ", ".join(f"{spec.name} -> {spec.view} in {', '.join(runtime.groups[spec.name].followers)}"
                         for spec in specs)
        log.info("follow %s (trigger %s): starting Spark; Ctrl-C stops", what, trigger)
        _start_spark(ctx, rt)
        progress = FollowProgress(runtime)
        with serve(s, follow_registry(runtime, s), port=metrics_port):
            runtime.start()
            progress.start()
            try:
                runtime.run_forever()
            finally:
                progress.stop()
                for f in runtime.followers.values():
                    log.info(
                        "follower %s stopped: %s batches, %s events%s%s%s", f.name, f.stats.batches,
                        f"{f.stats.events:,}", f", {f.restarts} restarts" if f.restarts else "",
                        f", {f.rebuilds} rebuilds" if f.rebuilds else "", ", gave up" if f.failed else "",
                    )
    finally:
        rt.close()


def _refuse_if_locked(spec: Any, sinks: dict[str, Any]) -> None:
    """ProjectionBusy when another process follows or replays `spec` in one of `sinks` (checked
    without taking the lock, before Spark starts; the follower takes it for real when it starts)."""
    from kappaflow.projections.engine import ProjectionBusy

    for name, s in sinks.items():
        if s.is_locked(spec.name):
            raise ProjectionBusy(
                f"projection {spec.name!r} is already followed or being replayed in the {name} sink by another "
                "process"
            )


def verify(
    ctx: typer.Context,
    projection: Annotated[str, typer.Argument(help="module:Class of the projection")],
    limit: Annotated[int, typer.Option("--limit", help="Show at most this many drifted rows.")] = 20,
    sink: SinkOption = None,
    wait: Annotated[
        float,
        typer.Option("--wait", help="Seconds to wait (at most) for the view to reach the log end first."),
    ] = 0.0,
) -> None:
    """Replay into a scratch target and compare with the live view (per sink).

    Exit code 1 on drift; 3 when the view is behind the log end (the rows it holds were compared
    up to its own positions; --wait SECONDS lets its follower catch up first)."""
    from kappaflow.projections.verify import verify as run_verify

    spec = _load(projection)
    rt = _runtime(ctx)
    code = 0
    try:
        for name in rt.sinks_for(spec, sink):
            res = run_verify(spec, rt, limit=limit, sink=name, wait_s=wait)
            where = f"view {res.view} in {name}"
            span = (f"{res.rows_compared:,} rows compared at position {res.position:,} "
                    f"of log end {res.log_end_total:,} ({len(res.log_end)} partitions)")
            if res.drift_count:
                code = 1
                table = Table(title=f"drift in {res.view} ({name}): {res.drift_count} keys")
                table.add_column("key")
                table.add_column("kind")
                table.add_column("view")
                table.add_column("replay")
                for d in res.drift:
                    table.add_row(json.dumps(list(d.key), default=str), d.kind, _short(d.live), _short(d.expected))
                console.print(table)
                console.print(f"[red]drift[/]: {where} differs from a fresh replay: {span}", highlight=False)
            elif res.lag:
                code = code or 3
                console.print(
                    f"[yellow]behind[/]: {where} is {res.lag:,} records behind the log end: {span}; the rows it holds "
                    "match a fresh replay up to its positions"
                    + ("" if wait else "; pass --wait SECONDS to let its follower catch up first"),
                    highlight=False,
                )
            else:
                console.print(f"[green]ok[/]: {where} matches a fresh replay: {span}", highlight=False)
    finally:
        rt.close()
    if code:
        raise typer.Exit(code)


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
            "needs rebuild" if s.needs_rebuild else "yes" if s.following else "no",
            str(s.replayed_at or "-")[:19],
        )
    console.print(table if rows else "no projections yet: run `kappaflow replay module:Class`")


@app.command("status")
def status(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="Projection or view name (default: all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    check: Annotated[bool, typer.Option(
        "--check", help="Check the [health] thresholds; exit 4 stopped follower, 5 lag, 6 retained WAL, "
        "7 dead letters, 8 something could not be read; 0 healthy.")] = False,
) -> None:
    """Position and lag per sink and log partition; --check: health against the [health] thresholds."""
    from kappaflow.projections.status import projection_status

    if check:
        _check(ctx)
        return

    rt = _runtime(ctx, spark=False)
    try:
        rows = projection_status(rt, name)
    finally:
        rt.close()
    if as_json:
        console.print_json(json.dumps([s.to_dict() for s in rows], default=str))
        return
    for s in rows:
        title = f"{s.name} ({s.kind}) -> {s.view}"
        if s.needs_rebuild:
            title += f"\nNEEDS REBUILD: {s.needs_rebuild}"
        table = Table(title=title)
        for c in ("sink", "rows", "following", "topic", "partition", "position", "end", "lag"):
            table.add_column(c)
        for st in s.sinks:
            following = "needs rebuild" if s.needs_rebuild else ("yes" if st.following else "no")
            head = [st.sink, f"{st.rows:,}" if st.rows is not None else "?",
                    "error: " + st.error[:60] if st.error else following]
            for i, p in enumerate(st.partitions or [None]):
                cells = head if i == 0 else ["", "", ""]
                if p is None:
                    table.add_row(*cells, "-", "-", "-", "-", "-")
                else:
                    table.add_row(*cells, p.topic, str(p.partition), f"{p.position:,}", f"{p.end:,}", f"{p.lag:,}")
        console.print(table)
        for st in s.sinks:
            if st.details:  # the fold's own figures, e.g. a windowed view's watermark and late events
                console.print(f"{st.sink}: " + ", ".join(f"{k} {v}" for k, v in st.details.items()),
                              highlight=False, markup=False)


def _check(ctx: typer.Context) -> None:
    from kappaflow.metrics.health import check
    from kappaflow.metrics.report import build_report

    s = settings(ctx)
    problems = check(build_report(s), s.health)
    if not problems:
        console.print("ok: every watched projection is followed, and no threshold of [health] is crossed",
                      highlight=False, markup=False)
        return
    for p in problems:
        console.print(f"{p.reason}: {p.message}", highlight=False, markup=False)
    raise typer.Exit(problems[0].code)


def metrics(ctx: typer.Context) -> None:
    """Print the metrics readable from outside the processes once (Prometheus text format), for cron-style
    checks: sources' retained WAL and positions, log end offsets and disk bytes, each projection's lag per
    sink and partition (records and seconds), followers and dead letters."""
    from kappaflow.metrics.core import new_registry, render
    from kappaflow.metrics.report import ReportCollector

    s = settings(ctx)
    _setup_logging(ctx, s)
    sys.stdout.write(render(new_registry(ReportCollector(s))))


def query(
    ctx: typer.Context,
    view: Annotated[str, typer.Argument(help="View (or projection) name")],
    key: Annotated[str, typer.Argument(help="Key value; for composite keys a JSON object or comma list")],
    sink: Annotated[
        str, typer.Option("--sink", help="Read the view from this sink: postgres, search or redis.")
    ] = "postgres",
) -> None:
    """Print one row of a view by key."""
    rt = _runtime(ctx, spark=False)
    try:
        row = query_row(rt, view, key, sink=sink)
    finally:
        rt.close()
    if row is None:
        err_console.print(f"no row with key {key!r} in {view} ({sink})")
        raise typer.Exit(1)
    console.print_json(json.dumps(row, default=str))


def _key_values(view: str, keys: list[str], key: str) -> list[str]:
    from kappaflow.errors import ConfigError

    text = key.strip()
    if len(keys) == 1:
        return [text]
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            raise ConfigError(f"KEY {key!r}: not valid JSON") from None
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ConfigError(f"KEY: view {view!r} is keyed by {keys}; missing {missing}")
        return [str(obj[k]) for k in keys]
    values = [v.strip() for v in text.split(",")]
    if len(values) != len(keys):
        raise ConfigError(f"KEY: view {view!r} is keyed by {keys}: give {len(keys)} comma-separated values")
    return values


def _typed_key(spec: Any, values: list[str]) -> tuple[Any, ...]:
    """Key text -> the key columns' Python values (how the search / Redis sinks name rows)."""
    from decimal import Decimal, InvalidOperation

    from pyspark.sql import types as st

    from kappaflow.errors import ConfigError

    out: list[Any] = []
    for name, v in zip(spec.key, values, strict=True):
        t = spec.column(name).type
        try:
            if isinstance(t, st.ByteType | st.ShortType | st.IntegerType | st.LongType):
                out.append(int(v))
            elif isinstance(t, st.DecimalType):
                out.append(Decimal(v))
            elif isinstance(t, st.FloatType | st.DoubleType):
                out.append(float(v))
            elif isinstance(t, st.BooleanType):
                out.append(v.lower() in ("true", "t", "1", "yes"))
            else:
                out.append(v)
        except (ValueError, InvalidOperation):
            raise ConfigError(f"KEY: {name!r} is a {t.simpleString()} column, got {v!r}") from None
    return tuple(out)


def query_row(rt: Any, view: str, key: str, *, sink: str = "postgres") -> dict[str, Any] | None:
    """The row of `view` with key `key` in `sink` (PostgreSQL: text cast by the server to each key
    column's type; Redis: the ``get`` helper that follows the build pointer; search: by document id)."""
    from psycopg import sql
    from psycopg.rows import dict_row

    from kappaflow.errors import ConfigError
    from kappaflow.projections.runtime import SINK_SETTINGS
    from kappaflow.projections.sinks.postgres import pg_type

    if sink not in SINK_SETTINGS:
        raise ConfigError(f"--sink: expected one of {list(SINK_SETTINGS)}, got {sink!r}")
    with rt.registry() as reg:
        entry = reg.by_view(view)
        if entry is None:
            known = ", ".join(e.view_table for e in reg.list()) or "none yet"
            raise ConfigError(f"unknown view {view!r} (views: {known})")
    spec = entry.view
    keys = list(spec.key)
    values = _key_values(view, keys, key)
    if sink != "postgres":
        store = rt.sink_for(entry.name, sink)
        typed = _typed_key(spec, values)
        if sink == "redis":
            from kappaflow.projections.sinks.redis import get

            prefix = store.view_options(spec).prefix
            return get(store.client, spec.name, typed if len(typed) > 1 else typed[0], prefix=prefix)
        live = store.live(spec)
        if live is None:
            raise ConfigError(f"view {view!r} has no live index in the search sink (replay it with --sink search)")
        row = store.fetch(live, [typed]).get(typed)
        if row is not None:
            row.pop("_kf_version", None)
        return row
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


__all__ = ["app", "follow", "metrics", "query", "query_row", "replay", "verify"]
