"""`kappaflow doctor`: what is wrong with this configuration against the live services, and how to fix it."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kappaflow.cli.common import console, settings
from kappaflow.doctor import Status, run_checks

_STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}


def doctor(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per finding, one per line (area, check, status, detail, fix)")] = False,
) -> None:
    """Check versions, wal_level, binlog settings, slots, captured tables, topic configs and reachability.

    Exit 1 on a failure. Piped or redirected, nothing is cut: every column is printed whole.
    """
    findings = run_checks(settings(ctx))
    failed = [f for f in findings if f.status is Status.FAIL]
    if as_json:
        for f in findings:
            typer.echo(json.dumps({**dataclasses.asdict(f), "status": f.status.value}))
    else:
        table = Table("area", "check", "status", "detail", "how to fix")
        for f in findings:
            # Text, not markup: details and fixes hold brackets ("[sources.shop]", "key_columns = [...]")
            table.add_row(Text(f.area), Text(f.check), Text(f.status.value, style=_STYLE[f.status]), Text(f.detail),
                          Text(f.fix))
        console.print(table)
        if failed:
            console.print(f"[bold red]{len(failed)} problem(s) found[/]")
        else:
            console.print("[green]all checks passed[/]")
    if failed:
        raise typer.Exit(1)
