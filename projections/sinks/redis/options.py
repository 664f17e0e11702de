"""Redis sink options (sink-wide, and per view under ``view.options["redis"]``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from kappaflow.projections.sinks.document import DocumentSinkOptions, parse_options

ValueFormat = Literal["json", "hash"]


DEFAULT_MAX_KEY_BYTES = 64 * 1024


class RedisSinkOptions(DocumentSinkOptions):
    """Redis sink options. Sink-wide here; per view under ``view.options["redis"]`` (same names).
    Retries and the lock's lease: see :class:`DocumentSinkOptions` (backoff defaults: 0.1 s to 10 s)."""

    prefix: str = "kf"
    value_format: ValueFormat = "json"
    ttl_s: float | None = Field(None, gt=0)
    tombstone_ttl_s: float = Field(86_400.0, gt=0)
    max_key_bytes: int = Field(DEFAULT_MAX_KEY_BYTES, ge=64, le=512 * 1024 * 1024)
    """Longest full Redis key accepted. Redis allows 512 MB, but long keys slow every command and
    waste memory; 64 KiB is far beyond any sane view key. Longer keys are dead-lettered."""
    max_value_bytes: int = Field(64 * 1024 * 1024, ge=64, le=512 * 1024 * 1024)
    batch_keys: int = Field(1000, ge=1, le=100_000)
    batch_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    pipeline_depth: int = Field(8, ge=1, le=1000)
    atomic_batches: bool = True
    """Apply each batch written to a live view in one MULTI/EXEC, so readers never see part of it
    (a follow micro-batch: one source transaction whole). Costs one round trip per batch and keeps
    the batch queued in the server until EXEC; False writes the script calls as they come."""
    scan_count: int = Field(1000, ge=10)
    backoff_initial_s: float = Field(0.1, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)


def _parse_options(data: Mapping[str, Any], where: str) -> RedisSinkOptions:
    """Options from a mapping; a bad value is a ConfigError naming the field and what was given."""
    return parse_options(RedisSinkOptions, data, where)
