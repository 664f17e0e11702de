"""Edit ``kappaflow.toml`` in place: `source add` / `source remove` touch one ``[sources.NAME]`` table.

Why not dump the parsed :class:`~kappaflow.config.Settings` back: the parsed settings have lost
the user's comments and layout, hold the environment and profile overrides (which must not be
frozen into the file), and cannot tell ``partitions = 4`` written by the user from the default 4.
tomlkit keeps a round-trip document, so every line we do not change stays byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import Table

from kappaflow.config import PostgresSourceConfig
from kappaflow.errors import ConfigError

__all__ = ["remove_source", "source_table", "write_source"]


def _load(path: Path) -> tomlkit.TOMLDocument:
    if not path.exists():
        return tomlkit.document()
    try:
        return tomlkit.parse(path.read_text())
    except tomlkit.exceptions.TOMLKitError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def source_table(src: Any) -> dict[str, Any]:
    """What a source config writes to its table: ``kind`` plus every value that differs from the default.

    The password never leaves the process; ``name`` is the table's own key.
    """
    data: dict[str, Any] = src.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    data.pop("password", None)
    data.pop("name", None)
    first: dict[str, Any] = {k: data.pop(k) for k in ("dsn", "bootstrap", "topics", "tables") if k in data}
    return {"kind": src.kind, **first, **data}


def write_source(path: Path, name: str, src: PostgresSourceConfig | Any) -> None:
    """Create or replace ``[sources.NAME]``; keys that stay keep their comments, the rest of the file is untouched."""
    doc = _load(path)
    sources = doc.get("sources")
    if sources is None:
        sources = tomlkit.table(is_super_table=True)
        doc["sources"] = sources
    values = source_table(src)
    current = sources.get(name)
    if not isinstance(current, Table):
        table = tomlkit.table()
        for key, value in values.items():
            table[key] = value
        table.add(tomlkit.nl())
        sources[name] = table
    else:
        for key in [k for k in current if k not in values]:
            del current[key]
        for key, value in values.items():
            if current.get(key) != value:
                current[key] = value
    path.write_text(tomlkit.dumps(doc))


def remove_source(path: Path, name: str) -> bool:
    """Delete ``[sources.NAME]`` (and an emptied ``[sources]``); False when the file has no such table."""
    doc = _load(path)
    sources = doc.get("sources")
    if sources is None or name not in sources:
        return False
    del sources[name]
    if not sources:
        del doc["sources"]
    path.write_text(tomlkit.dumps(doc))
    return True
