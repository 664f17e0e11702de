"""Building blocks shared by every collector: documented families and the ``/metrics`` endpoint.

Collectors read the figures the processes keep anyway (a capture's summary and writer counters,
a follower's stats, the stores' positions) when Prometheus scrapes, instead of updating metric
objects on the hot path: a capture appends ~100k changes/s and a per-row ``inc()`` (a lock and
a float add) would cost several percent of that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kappaflow.metrics.names import METRICS, MetricDef

__all__ = ["Families", "MetricsEndpoint", "new_registry", "register", "render"]

log = logging.getLogger("kappaflow.metrics")


class Families:
    """Families of documented metrics, filled one sample at a time, yielded in definition order."""

    def __init__(self) -> None:
        self._families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def _family(self, d: MetricDef) -> CounterMetricFamily | GaugeMetricFamily:
        fam = self._families.get(d.name)
        if fam is None:
            fam = self._families[d.name] = (CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily)(
                d.name, d.help, labels=list(d.labels))
        return fam

    def add(self, name: str, labels: Sequence[Any], value: float | int | None) -> None:
        """One sample of metric ``name``; ``labels`` in the documented order; None is skipped."""
        d = METRICS[name]
        if value is None:
            return
        if len(labels) != len(d.labels):
            raise ValueError(f"metric {name}: expected labels {d.labels}, got {tuple(labels)}")
        self._family(d).add_metric([str(v) for v in labels], float(value))

    def declare(self, name: str) -> None:
        """Export ``name`` even without samples (its HELP and TYPE lines)."""
        self._family(METRICS[name])

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class _Safe(Collector):
    """Wraps a collector so one failing read (a store down) never fails the whole scrape."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self.inner.collect())
        except Exception as exc:
            log.debug("metrics collector %s failed: %s", type(self.inner).__name__, exc)
            return []


def new_registry(*collectors: Any) -> CollectorRegistry:
    """A registry of its own (never the global one: tests run several processes' collectors in one)."""
    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        register(reg, c)
    return reg


def register(registry: CollectorRegistry, collector: Any) -> None:
    """Add ``collector`` so that its failure leaves the rest of a scrape intact."""
    registry.register(_Safe(collector))


def render(registry: CollectorRegistry) -> str:
    """The Prometheus text exposition of ``registry`` (what a scrape of ``/metrics`` returns)."""
    return generate_latest(registry).decode()


class MetricsEndpoint:
    """``/metrics`` over HTTP (prometheus_client's own server, one daemon thread), plus the history
    sampler when one is given. A context manager; ``port`` 0 takes a free port (``self.port``)."""

    def __init__(self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int | None = None,
                 history: Any = None, announce: Any = None) -> None:
        self.registry = registry
        self.announce = announce
        self.host = host
        self.port = port
        self.history = history
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MetricsEndpoint:
        from prometheus_client import start_http_server

        from kappaflow.errors import ConfigError

        if self.port is not None:
            try:
                self._server, self._thread = start_http_server(self.port, addr=self.host, registry=self.registry)
            except OSError as exc:
                raise ConfigError(f"--metrics-port / [metrics] port: cannot listen on {self.host}:{self.port}: "
                                  f"{exc.strerror or exc}") from None
            self.port = int(self._server.server_port)
            line = f"metrics on http://{self.host}:{self.port}/metrics"
            if self.announce is not None:
                self.announce(line)
            else:
                log.info("%s", line)
        if self.history is not None:
            self.history.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.history is not None:
            self.history.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
