"""`kappaflow doctor`: check a configuration against the live services and say how to fix what is wrong.

Each check returns findings; a finding is OK, WARN or FAIL with a one-line fix. Checks never
raise for an unreachable service: unreachability is itself a finding. The checks of one source
(connection, server settings, privileges, slot, tables) belong to its kind in the source registry
(`SourceKind.doctor`, in ``connectors/<kind>/``); this module runs them, checks the log, the views
and Spark, and what spans sources (slots on a PostgreSQL server, retained WAL, topic policies).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from rich.filesize import decimal

from kappaflow.config import Settings, redact
from kappaflow.connectors.history import history_state, history_topic_names
from kappaflow.connectors.registry import source_kind
from kappaflow.errors import KappaflowError, LogUnavailableError


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    area: str
    check: str
    status: Status
    detail: str
    fix: str = ""


def ok(area: str, check: str, detail: str) -> Finding:
    return Finding(area, check, Status.OK, detail)


def fail(area: str, check: str, detail: str, fix: str) -> Finding:
    return Finding(area, check, Status.FAIL, redact(detail), fix)


def warn(area: str, check: str, detail: str, fix: str) -> Finding:
    return Finding(area, check, Status.WARN, redact(detail), fix)


def check_log(settings: Settings) -> Iterator[Finding]:
    area = "log"
    embedded_dir = settings.resolve(settings.log.url.removeprefix("file:"))
    if not settings.log.is_kafka and not (embedded_dir / "meta.db").exists():
        yield ok(area, "reachable", f"{settings.log.url}: not created yet (the first capture creates it)")
        return
    try:
        # A reader: never contends with a running capture for the embedded log's writer lock.
        log = settings.open_log(read_only=True)
    except KappaflowError as exc:
        fix = ("start the broker or correct log.url / KAPPAFLOW_LOG__URL" if settings.log.is_kafka
               else "make log.url a writable directory")
        yield fail(area, "reachable", f"{settings.log.url}: {exc}", fix)
        return
    try:
        try:
            topics = log.list_topics()
        except LogUnavailableError as exc:
            yield fail(area, "reachable", str(exc), "start the broker or correct log.url / KAPPAFLOW_LOG__URL")
            return
        yield ok(area, "reachable", f"{settings.log.url}: {len(topics)} topics")
        append_only = set[str]().union(*(source_kind(src).append_only_topics(src, log, topics)
                                          for src in settings.sources.values()))
        history = {topic: src.name for src in settings.sources.values()
                   for topic in history_topic_names(src).values()}
        for topic, cfg in sorted(topics.items()):
            if topic in history:  # keep_history: delete policy and no retention limit (connectors/history.py)
                state = history_state(cfg)
                if cfg.keeps_everything:
                    yield ok(area, f"topic {topic}", state)
                else:
                    yield fail(area, f"topic {topic}", f"{state}; sources.{history[topic]}.keep_history lists "
                               "its table, so an as-of replay needs every version",
                               f"kafka-configs.sh --alter --entity-type topics --entity-name {topic} --add-config "
                               "cleanup.policy=delete,retention.ms=-1,retention.bytes=-1 (embedded log: "
                               f"kappaflow log delete {topic}, then capture and kappaflow snapshot the table)")
                continue
            want_compacted = _wants_compaction(settings, topic, append_only)
            if want_compacted is None or want_compacted == cfg.compacted:
                continue
            if want_compacted:
                yield fail(area, f"topic {topic}", "cleanup.policy=delete: old changes of a key are never "
                            "removed and deleted keys stay forever",
                            f"kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                            "--add-config cleanup.policy=compact")
            else:
                yield fail(area, f"topic {topic}", "cleanup.policy=compact on an append-only topic: compaction "
                            "keeps only the last record of each key (a ledger stream's last event)",
                            f"kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                            "--add-config cleanup.policy=delete")
    except KappaflowError as exc:
        yield fail(area, "topics", str(exc), "check the broker's logs and ACLs (DescribeConfigs)")
    finally:
        log.close()


def _wants_compaction(settings: Settings, topic: str, append_only: set[str]) -> bool | None:
    """True/False: the cleanup policy a topic kappaflow writes must have; None: not kappaflow's topic.

    A source's topics are compacted except those its kind writes append-only by design
    (`SourceKind.append_only_topics`: transaction metadata, dead letters, ledger streams...)."""
    if topic.lstrip("_").startswith("kappaflow_offsets"):
        return True
    src = settings.sources.get(topic.partition(".")[0])
    if src is None or "." not in topic:
        return None
    return topic not in append_only


def check_tables(src: Any, area: str, *, missing_fix: str | None = None) -> Iterator[Finding]:
    """One finding per captured table: its key, or what capture would refuse and the fix."""
    try:
        checks = source_kind(src).tables(src, True)
    except KappaflowError as exc:
        yield fail(area, "tables", str(exc).splitlines()[0], "check the connection and the user's SELECT rights")
        return
    for c in checks or ():
        if not c.problem:
            yield ok(area, f"table {c.table}", c.detail)
        else:
            missing = "does not exist" in c.detail or "unknown table" in c.detail
            fix = missing_fix if missing_fix and missing else c.fix
            yield fail(area, f"table {c.table}", c.detail, fix)


def tcp_error(host: str, port: int) -> str | None:
    """Why a TCP connection to host:port fails (None: it connects), for reachability findings."""
    try:
        with socket.create_connection((host, port), timeout=3):
            return None
    except OSError as exc:
        return str(exc)


def check_views(settings: Settings) -> Iterator[Finding]:
    views = settings.views
    if views.postgres_dsn:
        import psycopg

        try:
            with psycopg.connect(views.postgres_connect_dsn(), connect_timeout=5) as conn:
                version = conn.execute("show server_version").fetchone()
            yield ok("views", "postgres", f"PostgreSQL {version[0] if version else '?'}")
        except (psycopg.Error, KappaflowError) as exc:
            yield fail("views", "postgres", f"{views.postgres_dsn}: {str(exc).strip().splitlines()[0]}",
                        "check views.postgres.dsn and its password_env")
    if views.search_url:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(views.search_url.rstrip("/") + "/", timeout=5) as resp:
                info = json.loads(resp.read() or b"{}")
            number = info.get("version", {}).get("number", "?")
            distro = info.get("version", {}).get("distribution", "elasticsearch")
            yield ok("views", "search", f"{distro} {number}")
            if (distro == "opensearch") != (views.search_flavor == "opensearch"):
                want = "opensearch" if distro == "opensearch" else "elasticsearch"
                yield warn("views", "search flavor", f"server is {distro}, config says {views.search_flavor}",
                            f'set flavor = "{want}" under [views.search]')
        except (OSError, ValueError) as exc:
            yield fail("views", "search", f"{views.search_url}: {exc}", "check views.search.url")
    if views.redis_url:
        import redis

        try:
            redis.Redis.from_url(views.redis_url, socket_timeout=3).ping()
            yield ok("views", "redis", "ping ok")
        except redis.RedisError as exc:
            yield fail("views", "redis", f"{views.redis_url}: {exc}", "check views.redis.url")


def check_spark(settings: Settings) -> Iterator[Finding]:
    master = settings.spark.master
    if master.startswith("local"):
        yield ok("spark", "master", f"{master} (in-process)")
        return
    if master.startswith("spark://"):
        for address in master.removeprefix("spark://").split(","):
            host, _, port = address.rpartition(":")
            err = tcp_error(host, int(port or 7077))
            if err:
                yield fail("spark", "master", f"{address}: {err}", "start the Spark master or fix spark.master")
            else:
                yield ok("spark", "master", f"{address} reachable")
        return
    yield ok("spark", "master", f"{master} (not checked)")


def _server(dsn: str) -> tuple[str, int]:
    parts = urlsplit(dsn)
    return (parts.hostname or "localhost", parts.port or 5432)


def _slot_sources(settings: Settings) -> list[Any]:
    """The sources holding a logical replication slot on a PostgreSQL server (PostgreSQL, ledger)."""
    return [src for src in settings.sources.values() if source_kind(src).postgres_slot]


def check_postgres_slots(settings: Settings) -> Iterator[Finding]:
    """Inactive replication slots retaining WAL, on every PostgreSQL server a source reads (any slot, anyone's).

    An inactive slot keeps every WAL segment from its restart point on: the disk fills until the
    slot is dropped or ``max_slot_wal_keep_size`` invalidates it. The configured sources' own slots
    are reported with their source (a WARN: capture is not running); any other inactive slot is a FAIL.
    """
    import psycopg

    servers: dict[tuple[str, int], list[Any]] = {}
    for src in _slot_sources(settings):
        servers.setdefault(_server(src.dsn), []).append(src)
    for (host, port), srcs in sorted(servers.items()):
        area = f"postgres {host}:{port}"
        ours = {s.slot_name for s in srcs}
        try:
            with psycopg.connect(srcs[0].connect_dsn(), connect_timeout=5, autocommit=True) as conn:
                rows = conn.execute(
                    "select slot_name, slot_type, coalesce(database, ''), "
                    "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
                    "from pg_replication_slots where not active and restart_lsn is not null "
                    "order by 4 desc, 1").fetchall()
        except (psycopg.Error, KappaflowError):
            continue  # the source's own connect finding says why
        for name, kind, database, retained in rows:
            if name in ours or not retained:
                continue
            where = f"{kind} slot, database {database}" if database else f"{kind} slot"
            owner = " (left by a removed kappaflow source?)" if name.startswith("kappaflow_") else ""
            yield fail(area, f"slot {name}", f"inactive ({where}){owner}, retains {decimal(int(retained))} of WAL, "
                        "kept until the slot is dropped", f"if nothing will resume it: SELECT "
                        f"pg_drop_replication_slot('{name}') (in database {database or 'any'})")


def check_slot_wal(settings: Settings) -> Iterator[Finding]:
    """WAL kept for capture's slots: a slot past ``[health] max_retained_wal_bytes`` (the threshold
    ``status --check`` alerts on), and servers without ``max_slot_wal_keep_size``, where a slot whose
    capture stopped keeps WAL until the disk is full (the failure this field reports most)."""
    import psycopg

    from kappaflow.metrics.probes import open_probe

    limit = settings.health.max_retained_wal_bytes
    seen: set[str] = set()
    for src in _slot_sources(settings):
        area = f"source {src.name}"
        try:
            conn = psycopg.connect(src.connect_dsn(), connect_timeout=5, autocommit=True)
        except (psycopg.Error, KappaflowError):
            continue  # the source's own checks report the connection
        with conn:
            server = f"{conn.info.host}:{conn.info.port}"
            row = conn.execute("show max_slot_wal_keep_size").fetchone()
            if server not in seen and row is not None and str(row[0]).strip() in ("-1", "-1kB"):
                seen.add(server)
                yield warn(area, "max_slot_wal_keep_size",
                            "unset (-1): a slot whose capture stops keeps WAL until the disk is full",
                            "ALTER SYSTEM SET max_slot_wal_keep_size = '50GB'; SELECT pg_reload_conf(); (size it "
                            "below the free disk; a slot past it is invalidated and its capture re-snapshots)")
        probe = open_probe(src)
        if probe is None:
            continue
        try:
            reading = probe.read(None)
        except Exception:
            continue
        finally:
            probe.close()
        retained = reading.retained_wal_bytes
        if retained is not None and retained > limit:
            yield warn(area, "retained WAL", f"slot {reading.slot} retains {decimal(retained)} of WAL, over the "
                        f"[health] max_retained_wal_bytes threshold ({decimal(limit)})",
                        "check that its capture runs and keeps up (kappaflow metrics / status --check); a slot "
                        "no capture will use again: kappaflow source remove")


def run_checks(settings: Settings) -> list[Finding]:
    checks: list[Callable[[], Iterator[Finding]]] = [lambda: check_log(settings)]
    for src in settings.sources.values():
        checks.append(lambda src=src: source_kind(src).doctor(src))  # type: ignore[misc]
    checks += [lambda: check_postgres_slots(settings), lambda: check_slot_wal(settings), lambda: check_views(settings),
               lambda: check_spark(settings)]
    findings: list[Finding] = []
    for check in checks:
        findings.extend(check())
    return findings
