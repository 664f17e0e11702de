"""The source registry: a source config's ``kind`` -> everything kappaflow does with such a source.

Why: the CLI (`capture`, `source add|list|remove|status`), `doctor` and the metrics probes each
used to branch on the source kind; adding a kind meant finding every branch. Now each connector
package describes its kind once, in ``connectors/<package>/kind.py``, as a :class:`SourceKind`, and
callers ask the registry (:func:`source_kind`) instead of testing the config's type.

A kind module is imported only when a source of that kind is used (``_KINDS`` names modules, not
objects), so `doctor` on a PostgreSQL-only project never imports the MySQL or Kafka drivers. A new
source kind is: its config model in ``kappaflow.config`` (the ``SourceConfig`` union), its package
under ``connectors/`` with a ``kind.py``, and one line in ``_KINDS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kappaflow.errors import ConfigError

if TYPE_CHECKING:
    from kappaflow.connectors.base import Connector
    from kappaflow.connectors.preflight import TableCheck
    from kappaflow.connectors.writer import FaultHook
    from kappaflow.doctor import Finding
    from kappaflow.log.base import Log
    from kappaflow.metrics.probes import SourceProbe

__all__ = ["SourceKind", "kinds", "source_kind"]


def _connector_status(config: Any, log: Log) -> dict[str, Any]:
    return source_kind(config).open(config, log).status()


def _no_tables(config: Any, duplicates: bool) -> list[TableCheck] | None:
    return None


def _no_probe(config: Any) -> SourceProbe | None:
    return None


def _no_append_only(config: Any, log: Log, topics: Mapping[str, Any]) -> set[str]:
    return set()


@dataclass(frozen=True)
class SourceKind:
    """What kappaflow does with one kind of source; every hook takes the source's config model.

    * ``connector(config, log, *, partitions, progress, log_kafka)`` -- the `Connector` that captures
      it (``log_kafka``: the configuration's ``[log.kafka]``, for kinds that read Kafka themselves);
    * ``status(config, log)`` -- `kappaflow source status` (only reads; ``log`` may be read-only);
    * ``doctor(config)`` -- `kappaflow doctor`'s findings for the source (connection, server
      settings, privileges, slot, tables); never raises for an unreachable server;
    * ``tables(config, duplicates)`` -- the preflight verdict on every captured table, shared by
      `source add`, `doctor` and capture (None: the kind has no tables of its own);
    * ``release(config, others, keep_slot)`` -- what `source remove` lets go on the server, one line
      per thing (``others``: the remaining sources);
    * ``probe(config)`` -- the lag probe the metrics and progress lines read (None: no probe);
    * ``append_only_topics(config, log, topics)`` -- the source's topics written with
      ``cleanup.policy=delete`` by design (every other topic of the source is compacted);
    * ``captured(config)`` -- what `source list` shows it captures (tables, topics);
    * ``postgres_slot`` -- it holds a logical replication slot on a PostgreSQL server (doctor's
      server-wide slot and retained-WAL checks look at those servers);
    * ``fault_hook`` -- its connector takes the capture writer's fault hook (``fault=``, see
      ``connectors/writer.py``): a test can stop it at a chosen writer step of a chosen phase. The
      shipped kill -9 suite (``kappaflow.connectors.testing``) needs it; no product code sets one.
    """

    kind: str
    connector: Callable[..., Connector]
    doctor: Callable[[Any], Iterator[Finding]]
    release: Callable[[Any, Iterable[Any], bool], list[str]]
    captured: Callable[[Any], list[str]]
    status: Callable[[Any, Log], dict[str, Any]] = _connector_status
    tables: Callable[[Any, bool], list[TableCheck] | None] = _no_tables
    probe: Callable[[Any], SourceProbe | None] = _no_probe
    append_only_topics: Callable[[Any, Log, Mapping[str, Any]], set[str]] = _no_append_only
    postgres_slot: bool = False
    fault_hook: bool = False

    def open(self, config: Any, log: Log, *, partitions: int = 4, progress: bool | None = None,
             log_kafka: Any = None, fault: FaultHook | None = None) -> Connector:
        """The connector for ``config``, writing to ``log`` (``fault``: a test's writer fault hook,
        for kinds registered with ``fault_hook``)."""
        if fault is None:
            return self.connector(config, log, partitions=partitions, progress=progress, log_kafka=log_kafka)
        if not self.fault_hook:
            raise ConfigError(f"source kind {self.kind!r}: its connector takes no writer fault hook")
        return self.connector(config, log, partitions=partitions, progress=progress, log_kafka=log_kafka,
                              fault=fault)


# kind -> the module whose ``KIND`` describes it (imported on first use).
_KINDS: dict[str, str] = {
    "postgres": "kappaflow.connectors.postgres.kind",
    "mysql": "kappaflow.connectors.mysql.kind",
    "debezium": "kappaflow.connectors.debezium.kind",
    "ledger": "kappaflow.connectors.ledger.kind",
}


def kinds() -> list[str]:
    """Every registered source kind."""
    return list(_KINDS)


def source_kind(config_or_kind: Any) -> SourceKind:
    """The registry entry for a source config (or a kind name); ConfigError naming the source when unknown."""
    kind = config_or_kind if isinstance(config_or_kind, str) else getattr(config_or_kind, "kind", None)
    module = _KINDS.get(kind) if isinstance(kind, str) else None
    if module is None:
        name = getattr(config_or_kind, "name", None)
        where = f"source {name!r}: " if name else ""
        raise ConfigError(f"{where}kind: expected one of {', '.join(_KINDS)}, got {kind!r}")
    entry: SourceKind = importlib.import_module(module).KIND
    return entry
