"""Wiring for the long-running commands: the endpoint and the history a process keeps.

The commands (capture, follow, ledger relay) build their collectors and call ``serve`` once; every
metric-specific decision (port from ``--metrics-port`` or ``[metrics] port``, history only with a
views database) lives here, so the call sites stay one line each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kappaflow.metrics.core import MetricsEndpoint

__all__ = ["serve"]


def serve(settings: Any, registry: Any, *, port: int | None = None,
          announce: Callable[[str], None] | None = None) -> MetricsEndpoint:
    """The endpoint for ``registry`` (a context manager): ``/metrics`` on ``port`` (else ``[metrics]
    port``; neither: no endpoint), and the history sampler when ``[metrics] history`` is on and the
    views database is configured."""
    cfg = settings.metrics
    history = None
    if cfg.history and settings.views.postgres_dsn:
        from kappaflow.metrics.history import HistoryStore, HistoryWriter

        store = HistoryStore(settings.views.postgres_connect_dsn(), interval_s=cfg.history_interval_s,
                             retention_s=cfg.history_retention_s)
        history = HistoryWriter(registry, store)
    endpoint = MetricsEndpoint(registry, host=cfg.host, port=port if port is not None else cfg.port,
                               history=history, announce=announce)
    return endpoint
