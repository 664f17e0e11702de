"""Search sink options (sink-wide, and per view under ``view.options["search"]``) and the picklable
config Spark executors open a sink from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.search.mapping import StringDefault


class SearchSinkOptions(BaseModel):
    """Search sink options. Sink-wide here; per view under ``view.options["search"]`` (same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str | None = None
    """The public alias (per view; default: the view name, lower-cased)."""
    fields: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    """Per-field mapping overrides: 'text', 'keyword', 'text+keyword', a type name or a mapping dict."""
    string_default: StringDefault = "text+keyword"
    settings: dict[str, Any] = Field(default_factory=dict)
    """Extra index settings, e.g. {"analysis": {...}} for custom analyzers, shards, replicas."""
    refresh_interval: str | None = None  # of a live index; None: the server's default
    build_refresh_interval: str | None = "30s"  # while a shadow fills (fewer refreshes: faster)
    bulk_docs: int = Field(1000, ge=1)
    bulk_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    concurrency: int = Field(1, ge=1, le=16)
    """Bulk requests in flight at once."""
    max_retries: int = Field(8, ge=0)
    backoff_initial_s: float = Field(0.2, gt=0)
    backoff_max_s: float = Field(20.0, gt=0)
    positions_index: str = "kappaflow-positions"
    lock_ttl_s: float = Field(30.0, ge=1)
    """Lease of the projection lock (try_lock): renewed every third of it, expires after a kill -9."""


def _parse_options(data: Mapping[str, Any], where: str) -> SearchSinkOptions:
    """Options from a mapping; a bad value is a ConfigError naming the field and what was given."""
    import pydantic

    from kappaflow.config import format_validation_error

    try:
        return SearchSinkOptions(**data)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None
