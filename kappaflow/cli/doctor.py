"""`kappaflow doctor`: what is wrong with this configuration against the live services, and how to fix it."""

from __future__ import annotations

import typer
from rich.table import Table

from kappaflow.cli.common import console, settings
from kappaflow.doctor import Status, run_checks

_STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}


def doctor(ctx: typer.Context) -> None:
    """Check versions, wal_level, binlog settings, topic configs and reachability. Exit 1 on a failure."""
    findings = run_checks(settings(ctx))
    table = Table("area", "check", "status", "detail", "how to fix")
    for f in findings:
        table.add_row(f.area, f.check, f"[{_STYLE[f.status]}]{f.status.value}[/]", f.detail, f.fix)
    console.print(table)
    failed = [f for f in findings if f.status is Status.FAIL]
    if failed:
        console.print(f"[bold red]{len(failed)} problem(s) found[/]")
        raise typer.Exit(1)
    console.print("[green]all checks passed[/]")
