"""The `kappaflow` command: thin wiring of sub-commands owned by each part."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from kappaflow.cli import capture as capture_cli
from kappaflow.cli import ledger as ledger_cli
from kappaflow.cli import log as log_cli
from kappaflow.cli import projections as projections_cli
from kappaflow.cli import snapshot as snapshot_cli
from kappaflow.cli import sources as sources_cli
from kappaflow.cli.common import console, fail
from kappaflow.cli.doctor import doctor
from kappaflow.errors import KappaflowError


class _Group(TyperGroup):
    """Turns kappaflow errors into one clear line and exit code 2, for every sub-command."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KappaflowError as exc:
            fail(str(exc), transient=exc.transient)


app = typer.Typer(
    cls=_Group,
    name="kappaflow",
    help="Change data capture and event sourcing into a compacted log, projected by Spark into views.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(sources_cli.app, name="source")
app.add_typer(log_cli.app, name="log")
app.command("doctor")(doctor)
app.command("capture")(capture_cli.capture)
app.command("snapshot")(snapshot_cli.snapshot)
sources_cli.app.command("add-table")(snapshot_cli.add_table)
sources_cli.app.command("remove-table")(snapshot_cli.remove_table)
app.add_typer(ledger_cli.app, name="ledger")
app.command("replay")(projections_cli.replay)
app.command("follow")(projections_cli.follow)
app.command("verify")(projections_cli.verify)
app.command("query")(projections_cli.query)
app.command("status")(projections_cli.status)
app.command("metrics")(projections_cli.metrics)
app.add_typer(projections_cli.app, name="projection")


@app.command("demo")
def demo(
    dsn: Annotated[str | None, typer.Option("--dsn", help="PostgreSQL to use (default: start a private one).")] = None,
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where the demo keeps its log and config.")] = None,
) -> None:
    """The main job end to end: shop tables -> capture -> embedded log -> Spark replay -> view."""
    from examples.shop.demo import run_demo

    run_demo(dsn=dsn, workdir=workdir, out=console.print)


@app.command("ui")
def ui(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option("--host", help="Address to bind (default [ui] host: 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default [ui] port: 8050).")] = None,
) -> None:
    """Serve the read-only status page: sources, projections per sink, lag and throughput plots of the last hour."""
    import uvicorn

    from kappaflow.cli.common import settings
    from kappaflow.ui.app import create_app

    s = settings(ctx)
    bind, at = host or s.ui.host, s.ui.port if port is None else port
    console.print(f"kappaflow ui on http://{bind}:{at}/ (read-only; Ctrl-C stops)", highlight=False, markup=False)
    uvicorn.run(create_app(s), host=bind, port=at, log_level="warning")


@app.callback()
def _root(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Path to kappaflow.toml.")] = None,
    profile: Annotated[
        str | None, typer.Option("--profile", help="Use the profile.NAME overlay of the config file.")
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", help="Log full tracebacks of failures (one line each otherwise).")
    ] = False,
) -> None:
    ctx.obj = {"config": config, "profile": profile, "debug": debug}
    # Projections and examples are imported by `module:Class`; the project folder must be importable.
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def run() -> None:
    app()


__all__ = ["app", "console", "run"]
