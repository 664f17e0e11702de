"""Helpers shared by CLI sub-commands: settings from the context, error exit."""

from __future__ import annotations

import os
from typing import NoReturn

import typer
from rich.console import Console, ConsoleDimensions

from kappaflow.config import Settings, redact


class _Console(Console):
    """Not on a terminal (piped, redirected, in a log file) lines are never cut or wrapped at 80 columns:
    a table cell's fix or a JSON record must reach the reader whole. COLUMNS still wins when set --
    read when printing, not when this module was imported (a worker process that imported it while
    COLUMNS=80 was set must not wrap every later line at 80)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if not self.is_terminal:
            columns = os.environ.get("COLUMNS", "")
            width = int(columns) if columns.isdigit() and int(columns) > 0 else 1_000_000
            return ConsoleDimensions(width, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


console = _Console()
err_console = _Console(stderr=True)


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj or {}
    return Settings.load(obj.get("config"), profile=obj.get("profile"))


def fail(message: str, *, transient: bool = False, code: int = 2) -> NoReturn:
    verdict = " (transient: retrying later may succeed)" if transient else ""
    err_console.print("[bold red]error:[/] ", end="")
    err_console.print(redact(f"{message}{verdict}"), highlight=False, markup=False)
    raise SystemExit(code)
