"""Prometheus metrics, health checks and the status page's data (issue 21).

Modules by role: ``names`` (the documented set), ``core`` (families, the ``/metrics`` endpoint),
``capture`` / ``follow`` / ``relay`` / ``log`` (collectors of each long-running process),
``probes`` (what a source's server says: retained WAL, binlog behind), ``report`` (the state read
from outside the processes: ``kappaflow metrics``, ``status --check``, the page), ``health`` (the
thresholds), ``history`` (the bounded sample history behind the page's plots), ``process``
(wiring a command's endpoint).
"""

from kappaflow.metrics.names import METRICS, MetricDef

__all__ = ["METRICS", "MetricDef"]
