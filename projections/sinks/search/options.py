"""Search sink options (sink-wide, and per view under ``view.options["search"]``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from kappaflow.projections.sinks.document import DocumentSinkOptions, parse_options
from kappaflow.projections.sinks.search.mapping import StringDefault


class SearchSinkOptions(DocumentSinkOptions):
    """Search sink options. Sink-wide here; per view under ``view.options["search"]`` (same names).
    Retries and the lock's lease: see :class:`DocumentSinkOptions`."""

    index: str | None = None
    """The public alias (per view; default: the view name, lower-cased)."""
    fields: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    """Per-field mapping overrides: 'text', 'keyword', 'text+keyword', a type name or a mapping dict."""
    string_default: StringDefault = "text+keyword"
    settings: dict[str, Any] = Field(default_factory=dict)
    """Extra index settings, e.g. {"analysis": {...}} for custom analyzers, shards, replicas."""
    refresh_interval: str | None = None  # of a live index; None: the server's default
    build_refresh_interval: str | None = "30s"  # while a shadow fills (fewer refreshes: faster)
    refresh_per_batch: bool = False
    """Refresh the live index once after each batch written to it (one call per batch, not per bulk
    request). With ``refresh_interval="-1"`` (no periodic refresh) a follow batch's documents then
    become searchable together, at that refresh; still not atomically: each shard refreshes on its
    own and a search running across the refresh may see some shards before it and some after."""
    bulk_docs: int = Field(1000, ge=1)
    bulk_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    concurrency: int = Field(1, ge=1, le=16)
    """Bulk requests in flight at once."""
    positions_index: str = "kappaflow-positions"


def _parse_options(data: Mapping[str, Any], where: str) -> SearchSinkOptions:
    """Options from a mapping; a bad value is a ConfigError naming the field and what was given."""
    return parse_options(SearchSinkOptions, data, where)
