"""Table topics that keep every version: ``[sources.<name>] keep_history = ["schema.table", ...]``.

Why: a table topic is compacted (the latest row per key), which is all a latest-row, grouped or
lookup view needs. An as-of enrichment (``projections/joins/asof.py``) needs the row *as it was* at
each event, so a replay after compaction would find versions missing (``asof_stage._check_history``
refuses it). A table listed in ``keep_history`` gets a topic with ``cleanup.policy=delete`` and, on
Kafka, ``retention.ms=-1`` and ``retention.bytes=-1`` (else the broker deletes after its default 7
days); the embedded log never compacts or deletes a delete-policy topic.

A topic's policy is fixed when it is created: capture checks an existing topic of such a table at
start and refuses one that compacts or deletes by age or size, saying how to fix it, instead of
writing history into a topic that will lose it. Shared by the PostgreSQL and MySQL/MariaDB connectors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kappaflow.errors import ConfigError
from kappaflow.log.base import CleanupPolicy, TopicConfig

__all__ = [
    "check_existing_topics",
    "check_keep_history",
    "default_schema",
    "history_state",
    "history_tables",
    "history_topic_names",
    "table_topic_config",
]


def default_schema(config: Any) -> str:
    """Where a bare table name is, as capture reads it: schema ``public`` (PostgreSQL), the DSN's
    database (MySQL/MariaDB)."""
    return "public" if config.kind == "postgres" else urlsplit(config.dsn).path.lstrip("/")


def _qualified(name: str, default: str) -> str:
    return name if "." in name else f"{default}.{name}"


def check_keep_history(source: str, tables: list[str], keep_history: list[str], default: str) -> None:
    """At load time: every listed table is captured (when the source names its tables), once
    (``default``: the schema or database of a bare name).

    ValueError (the config model's validator turns it into the file's ConfigError)."""
    where = f"sources.{source}.keep_history"
    names = [_qualified(t, default) for t in keep_history]
    dupes = sorted({t for t in names if names.count(t) > 1})
    if dupes:
        raise ValueError(f"{where}: {dupes} listed more than once")
    captured = {_qualified(t, default) for t in tables}
    missing = [t for t, q in zip(keep_history, names, strict=True) if tables and q not in captured]
    if missing:
        raise ValueError(
            f"{where}: {missing} not among the source's tables {tables}; a table must be "
            "captured for its topic to keep its history (add it to tables)"
        )


def history_tables(source: str, keep_history: Iterable[str], captured: Iterable[str]) -> frozenset[str]:
    """At capture start: the listed tables, each among the ``captured`` ones (qualified names, as
    resolved on the server -- a source capturing every table is checked here, not at load time)."""
    known = set(captured)
    listed = list(keep_history)
    missing = [t for t in listed if t not in known]
    if missing:
        raise ConfigError(
            f"sources.{source}.keep_history: {missing} not captured by source {source!r} "
            f"(it captures {sorted(known)}); remove them or capture them"
        )
    return frozenset(listed)


def table_topic_config(partitions: int, *, keep_history: bool) -> TopicConfig:
    """A new table topic's config: compacted, or append-only with no retention limit."""
    if keep_history:
        return TopicConfig(
            partitions=partitions, cleanup_policy=CleanupPolicy.DELETE, retention_ms=-1, retention_bytes=-1
        )
    return TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.COMPACT)


def check_existing_topics(source: str, existing: Mapping[str, TopicConfig], topics: Mapping[str, str]) -> None:
    """Refuse, naming every one, the existing topics of keep_history tables (``topics``: table ->
    topic) that would lose versions: a compact policy, or a retention by age or size."""
    problems = []
    for table, topic in sorted(topics.items()):
        cfg = existing.get(topic)
        if cfg is None:
            continue
        if cfg.compacted:
            problems.append(f"topic {topic!r} (table {table}) exists with cleanup.policy=compact")
        elif cfg.retention_ms not in (None, -1) or cfg.retention_bytes not in (None, -1):
            problems.append(
                f"topic {topic!r} (table {table}) deletes old records "
                f"(retention.ms={cfg.retention_ms}, retention.bytes={cfg.retention_bytes})"
            )
    if not problems:
        return
    names = " ".join(sorted({topics[t] for t in topics if topics[t] in existing}))
    raise ConfigError(
        f"sources.{source}.keep_history: " + "; ".join(problems) + ". A topic's cleanup policy is set when "
        "capture creates it, and capture does not change an existing topic's policy. Versions already "
        "compacted away are gone: to keep the history from now on, stop the capture, delete the topic "
        f"(`kappaflow log delete {names}`; Kafka: also kafka-topics.sh --delete), start the capture again "
        "(it creates the topic with cleanup.policy=delete) and re-read the table "
        "(`kappaflow snapshot <source> --tables <table>`). On Kafka, keeping what is left is "
        "kafka-configs.sh --alter --entity-type topics --entity-name <topic> --add-config "
        "cleanup.policy=delete,retention.ms=-1,retention.bytes=-1 (a replay of an as-of view still "
        "refuses a history with records missing)"
    )


def history_topic_names(config: Any) -> dict[str, str]:
    """keep_history table -> its topic, from a source config alone (no server): a bare table name is
    in schema ``public`` (PostgreSQL) or the DSN's database (MySQL/MariaDB), as capture reads it."""
    out = {}
    for t in getattr(config, "keep_history", None) or ():
        t = _qualified(t, default_schema(config))
        out[t] = f"{config.name}.{t}"
    return out


def history_state(config: TopicConfig | None) -> str:
    """What `kappaflow source status` and `doctor` say of a keep_history table's topic."""
    if config is None:
        return "not created yet (capture creates it with cleanup.policy=delete)"
    if config.compacted:
        return "cleanup.policy=compact: compaction removes old versions (see sources.<name>.keep_history)"
    if config.retention_ms not in (None, -1) or config.retention_bytes not in (None, -1):
        return (
            f"cleanup.policy=delete with retention.ms={config.retention_ms}, "
            f"retention.bytes={config.retention_bytes}: old versions are deleted"
        )
    return "every version kept (cleanup.policy=delete, no retention limit)"
