"""`kappaflow snapshot SOURCE` and `kappaflow source add-table|remove-table`: on-demand snapshots of a
running capture (``connectors/ondemand.py`` says how requests reach it and how progress is kept).

The CLI checks a request on the source server first (the tables exist, are captured, have a key;
``--where`` parses and runs, in a READ ONLY transaction), then leaves it in the request channel;
the running capture applies it on its next loop turn and reports its progress in its beat.
"""

from __future__ import annotations

import importlib
import json
import time
from typing import Annotated, Any

import typer

from kappaflow.cli.common import console, fail, settings
from kappaflow.connectors.ondemand import ALIVE_S, RequestChannel, channel_for, progress_view
from kappaflow.errors import ConfigError

__all__ = ["add_table", "ondemand_status", "remove_table", "snapshot"]

# source kind -> the module with cli_validate / cli_add_table / cli_remove_table
_ONDEMAND = {
    "postgres": "kappaflow.connectors.postgres.ondemand",
    "mysql": "kappaflow.connectors.mysql.ondemand",
}


def _kind_module(src: Any) -> Any:
    module = _ONDEMAND.get(src.kind)
    if module is None:
        raise ConfigError(f"source {src.name!r} is a {src.kind} source: on-demand snapshots and add/remove-table "
                          f"work for {', '.join(_ONDEMAND)} sources")
    return importlib.import_module(module)


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _line(view: dict[str, Any] | None) -> str:
    if not view:
        return "no on-demand snapshot"
    rate = view.get("rows_per_s")
    eta = view.get("eta_s")
    tables = ", ".join(f"{t} {v['rows']:,}/{v['estimate']:,}{' done' if v['done'] else ''}"
                       for t, v in view["tables"].items())
    error = f"; stopped by the capture: {view['error']}" if view.get("error") else ""
    return (f"{view['state']}: {view['rows']:,} rows, {'--' if rate is None else f'{rate:,.0f}'} rows/s, "
            f"ETA {'--' if eta is None else f'{eta:,.0f} s'} ({tables}){error}")


_ENDED = ("done", "stopped", "failed")


def ondemand_status(src: Any, log: Any, stored: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The on-demand snapshot's progress: live from the capture's beat, else as stored in the offset."""
    channel = channel_for(log)
    try:
        beat = channel.alive(src.name)
    finally:
        channel.close()
    if stored is None:
        from kappaflow.connectors.offsets import OFFSETS_TOPIC, OffsetStore

        stored = OffsetStore(log).load(src.name) if OFFSETS_TOPIC in log.list_topics() else None
    kept = (stored or {}).get("ondemand") or {}
    view = progress_view(kept or None)
    if beat is not None and beat.get("ondemand"):
        # The beat is written every few seconds, the offset with every chunk: a snapshot the offset
        # already records as ended (for the same request or a later one) is ended, whatever an
        # older beat still says.
        ended = view is not None and view["state"] in _ENDED and int(kept.get("seq", 0)) >= int(beat.get("seq", 0))
        if not ended:
            return {**beat["ondemand"], "live": True}
    return None if view is None else {**view, "live": False}


def _wait(channel: RequestChannel, source: str, seq: int, *, follow: bool, timeout_s: float) -> None:
    """Wait until the capture applied request ``seq``; with ``follow``, print progress until it ends."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        beat = channel.alive(source)
        if beat is None:
            fail(f"the capture of source {source!r} stopped before applying request {seq}; the request stays "
                 "queued and is applied when `kappaflow capture` runs again", code=3)
        applied = int(beat.get("seq", 0)) >= seq
        view = beat.get("ondemand")
        if applied and not follow:
            console.print(f"request {seq} applied: {_line(view)}", highlight=False, markup=False)
            return
        if applied:
            line = _line(view)
            if line != last:
                console.print(line, highlight=False, markup=False)
                last = line
            if view and view.get("state") in ("done", "stopped"):
                return
        if time.monotonic() > deadline:
            fail(f"request {seq} to the capture of source {source!r}: not {'finished' if applied else 'applied'} "
                 f"within {timeout_s:.0f} s (it stays queued; `kappaflow snapshot {source}` shows the progress)",
                 transient=True, code=3)
        time.sleep(0.5)


def snapshot(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="The source (its capture must be running).")],
    tables: Annotated[str | None, typer.Option("--tables", help="Comma list of captured tables to snapshot.")] = None,
    where: Annotated[str | None, typer.Option(
        "--where", help="SQL condition on the table's own columns (your SQL for your database; checked on the "
                        "server first, run READ ONLY).")] = None,
    pause: Annotated[bool, typer.Option("--pause", help="Pause the running on-demand snapshot.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Resume a paused on-demand snapshot.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the on-demand snapshot (progress is kept).")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Print progress until the snapshot ends.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the capture.")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Progress as one JSON object.")] = False,
) -> None:
    """Snapshot tables again while streaming goes on (no lock, no pause); or pause/resume/stop/show it."""
    actions = [a for a, on in (("pause", pause), ("resume", resume), ("stop", stop)) if on]
    if len(actions) > 1:
        fail("give at most one of --pause, --resume, --stop")
    if actions and (tables or where):
        fail(f"--{actions[0]} applies to the running snapshot: it takes no --tables/--where")
    if where is not None and not tables:
        fail("--where needs --tables")
    s = settings(ctx)
    src = s.source(source)
    mod = _kind_module(src)
    with s.open_log(read_only=True) as log:
        if not tables and not actions:
            view = ondemand_status(src, log)
            if as_json:
                typer.echo(json.dumps(view))
            else:
                console.print(_line(view), highlight=False, markup=False)
            return
        checked = mod.cli_validate(src, _csv(tables), where) if tables else []
        channel = channel_for(log)
        try:
            if channel.alive(source) is None:
                fail(f"source {source!r} is not capturing (no running `kappaflow capture {source}` answered within "
                     f"{ALIVE_S:.0f} s): start the capture first; an on-demand snapshot runs inside it")
            if tables:
                for name, est in checked:
                    console.print(f"  {name}: ~{est:,} rows{' matching --where' if where else ''}",
                                  highlight=False, markup=False)
                seq = channel.submit(source, "start", [n for n, _ in checked], where)
            else:
                seq = channel.submit(source, actions[0])
            console.print(f"request {seq} sent to the capture of {source!r}", highlight=False, markup=False)
            _wait(channel, source, seq, follow=wait, timeout_s=timeout)
        finally:
            channel.close()


def _save_tables(ctx: typer.Context, src: Any, new_tables: list[str]) -> str:
    from kappaflow.cli.sources import _config_path
    from kappaflow.config_file import write_source

    path = _config_path(ctx)
    updated = src.model_copy(update={"tables": new_tables})
    write_source(path, src.name, updated)
    return str(path)


def add_table(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="The source.")],
    table: Annotated[str, typer.Argument(help="schema.table (PostgreSQL) / db.table (MySQL) to start capturing.")],
    wait: Annotated[bool, typer.Option("--wait", help="Print the new table's snapshot progress until done.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the capture.")] = 60.0,
) -> None:
    """Capture one more table: publish it (or add it to the binlog filter), snapshot it on demand, stream it."""
    s = settings(ctx)
    src = s.source(source)
    mod = _kind_module(src)
    name, lines = mod.cli_add_table(src, table)
    for line in lines:
        console.print(f"  {line}", highlight=False, markup=False)
    path = _save_tables(ctx, src, [*src.tables, name])
    console.print(f"  {name} added to source {source!r} in {path}", highlight=False, markup=False)
    with s.open_log(read_only=True) as log:
        channel = channel_for(log)
        try:
            seq = channel.submit(source, "add_table", [name])
            if channel.alive(source) is None:
                console.print(f"source {source!r} is not capturing: the table is snapshotted and streamed when "
                              f"`kappaflow capture {source}` runs (request {seq} is queued)", highlight=False,
                              markup=False)
                return
            console.print(f"request {seq} sent to the capture of {source!r}", highlight=False, markup=False)
            _wait(channel, source, seq, follow=wait, timeout_s=timeout)
        finally:
            channel.close()


def remove_table(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="The source.")],
    table: Annotated[str, typer.Argument(help="The table to stop capturing (its topic stays in the log).")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the capture.")] = 60.0,
) -> None:
    """Stop capturing one table: unpublish it (or drop it from the binlog filter); its topic stays."""
    s = settings(ctx)
    src = s.source(source)
    mod = _kind_module(src)
    name, lines = mod.cli_remove_table(src, table)
    for line in lines:
        console.print(f"  {line}", highlight=False, markup=False)
    keep = [t for t in src.tables if mod.qualify(src, t) != name]
    kept: list[str] = getattr(src, "keep_history", None) or []
    if kept:  # a table no longer captured leaves keep_history (its topic stays)
        src = src.model_copy(update={"keep_history": [t for t in kept if mod.qualify(src, t) != name]})
    path = _save_tables(ctx, src, keep)
    console.print(f"  {name} removed from source {source!r} in {path}; its topic stays in the log",
                  highlight=False, markup=False)
    with s.open_log(read_only=True) as log:
        channel = channel_for(log)
        try:
            seq = channel.submit(source, "remove_table", [name])
            if channel.alive(source) is not None:
                _wait(channel, source, seq, follow=False, timeout_s=timeout)
        finally:
            channel.close()
