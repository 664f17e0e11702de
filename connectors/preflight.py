"""Checks of the captured tables that `source add`, `doctor` and capture share.

Why one place: a table capture would refuse must be refused by `source add` and flagged by
`doctor` with the same words, before a snapshot has run for minutes. Each source kind has
its own checks (``connectors/<kind>/preflight.py``, found through the source registry:
``source_kind(config).tables``); they all report :class:`TableCheck`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kappaflow.errors import Retry, SourceError

__all__ = [
    "DUPLICATES_MEAN",
    "DUPLICATE_CHECK_MAX_ROWS",
    "TableCheck",
    "key_columns_hint",
    "require_capturable",
]

# Above this many (estimated) rows the duplicate check is skipped: it scans the whole table.
DUPLICATE_CHECK_MAX_ROWS = 1_000_000

DUPLICATES_MEAN = ("rows sharing key columns are one key to kappaflow: each change of either row replaces the "
                   "other in the log and in every view, a delete of one removes the key, and grouped counts "
                   "count them once")


@dataclass(frozen=True)
class TableCheck:
    """The verdict on one captured table: ``problem`` empty means capturable."""

    table: str
    detail: str  # the key (and how it was checked) or what is wrong
    fix: str = ""
    problem: bool = False


def key_columns_hint(source: str | None, table: str, columns: Sequence[str] | None = None) -> str:
    """How to name key columns for ``table``: the CLI flag and the kappaflow.toml form."""
    cols = ",".join(columns) if columns else "COL[,COL...]"
    listed = ", ".join(f'"{c}"' for c in columns) if columns else '"COL", ...'
    src = source or "NAME"
    return (f"`kappaflow source add {src} ... --key-columns {table}={cols} --replace` "
            f'(or key_columns = {{ "{table}" = [{listed}] }} under [sources.{src}] in kappaflow.toml)')


def require_capturable(source: str, checks: Iterable[TableCheck]) -> None:
    """Raise one terminal SourceError naming every table that cannot be captured, with every fix."""
    bad = [c for c in checks if c.problem]
    if not bad:
        return
    lines = [f"source {source!r}: {len(bad)} table(s) cannot be captured:"]
    lines += [f"  {c.table}: {c.detail}. Fix: {c.fix}" for c in bad]
    raise SourceError("\n".join(lines), retry=Retry.TERMINAL)
