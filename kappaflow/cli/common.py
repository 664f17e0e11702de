"""Helpers shared by CLI sub-commands: settings from the context, error exit."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

from kappaflow.config import Settings, redact

console = Console()
err_console = Console(stderr=True)


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj or {}
    return Settings.load(obj.get("config"), profile=obj.get("profile"))


def fail(message: str, *, transient: bool = False, code: int = 2) -> NoReturn:
    verdict = " (transient: retrying later may succeed)" if transient else ""
    err_console.print("[bold red]error:[/] ", end="")
    err_console.print(redact(f"{message}{verdict}"), highlight=False, markup=False)
    raise SystemExit(code)
