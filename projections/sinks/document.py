"""The document sinks' shared part (search, Redis): one JSON document per view key."""

from __future__ import annotations

from typing import Any

from kappaflow.projections.sinks.base import Target


def log_rejected(sink: str, target: Target, rejected: list[tuple[tuple[Any, ...], str]]) -> None:
    """Bulk loads return only a count (``Sink.load``): name every refused row in the log instead of
    dropping it silently (the write path hands them back in ``WriteResult.rejected``)."""
    import logging

    logger = logging.getLogger("kappaflow.projections.sinks")
    for key, reason in rejected[:100]:
        logger.error("%s: loading %s: refused key %s: %s", sink, target.name, key, reason)
    if len(rejected) > 100:
        logger.error("%s: loading %s: %d more refused rows", sink, target.name, len(rejected) - 100)


__all__ = ["log_rejected"]
