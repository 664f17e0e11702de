"""Debezium sources in the source registry (`kappaflow.connectors.registry`): topics a Debezium connector wrote."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from kappaflow.connectors.registry import SourceKind
from kappaflow.doctor import fail, ok, tcp_error

if TYPE_CHECKING:
    from kappaflow.connectors.base import Connector
    from kappaflow.doctor import Finding
    from kappaflow.log.base import Log

__all__ = ["KIND"]


def _connector(config: Any, log: Log, *, partitions: int, progress: bool | None, log_kafka: Any) -> Connector:
    from kappaflow.connectors.debezium.source import DebeziumSource

    return DebeziumSource.from_config(config, log, partitions=partitions, log_kafka=log_kafka)


def _doctor(config: Any) -> Iterator[Finding]:
    """`kappaflow doctor` on a Debezium source: is each broker of its cluster reachable."""
    area = f"source {config.name}"
    for address in config.bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        err = tcp_error(host, int(port or 9092))
        if err:
            yield fail(area, "broker", f"{address}: {err}", "check the Debezium cluster's bootstrap address")
        else:
            yield ok(area, "broker", f"{address} reachable")


def _release(config: Any, others: Iterable[Any], keep_slot: bool) -> list[str]:
    return ["nothing dropped: the Debezium connector (and its replication slot) belongs to Kafka Connect; "
            "delete it there if it is no longer needed"]


def _append_only(config: Any, log: Log, topics: Mapping[str, Any]) -> set[str]:
    """Dead letters (their name before kappaflow/deadletters.py), logical messages and verbatim-routed
    metadata, and the topics of tables read without a key (the source's ``__schema`` records name no
    key columns): append-only by design (``source.py``)."""
    name = config.name
    out = {f"{name}.__dead_letter", f"{name}.transaction", f"{name}.message", f"{name}.__debezium_schema"}
    schema_topic = f"{name}.__schema"
    if schema_topic not in topics:
        return out
    last: dict[bytes, bytes | None] = {}
    for rec in log.iter_partition(schema_topic, 0):
        if rec.key is not None:
            last[rec.key] = rec.value
    for key, value in last.items():
        if value is not None and not orjson.loads(value).get("key"):
            out.add(f"{name}.{orjson.loads(key)}")
    return out


KIND = SourceKind(
    kind="debezium",
    connector=_connector,
    doctor=_doctor,
    release=_release,
    append_only_topics=_append_only,
    captured=lambda config: list(config.topics) or list(config.tables) or ["(all)"],
)
