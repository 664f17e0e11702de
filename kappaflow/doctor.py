"""`kappaflow doctor`: check a configuration against the live services and say how to fix what is wrong.

Each check returns findings; a finding is OK, WARN or FAIL with a one-line fix. Checks never
raise for an unreachable service: unreachability is itself a finding.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

import orjson
from rich.filesize import decimal

from kappaflow.config import (
    DebeziumSourceConfig,
    LedgerSourceConfig,
    MySQLSourceConfig,
    PostgresSourceConfig,
    Settings,
    redact,
)
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


def _ok(area: str, check: str, detail: str) -> Finding:
    return Finding(area, check, Status.OK, detail)


def _fail(area: str, check: str, detail: str, fix: str) -> Finding:
    return Finding(area, check, Status.FAIL, redact(detail), fix)


def _warn(area: str, check: str, detail: str, fix: str) -> Finding:
    return Finding(area, check, Status.WARN, redact(detail), fix)


def check_log(settings: Settings) -> Iterator[Finding]:
    area = "log"
    embedded_dir = settings.resolve(settings.log.url.removeprefix("file:"))
    if not settings.log.is_kafka and not (embedded_dir / "meta.db").exists():
        yield _ok(area, "reachable", f"{settings.log.url}: not created yet (the first capture creates it)")
        return
    try:
        # A reader: never contends with a running capture for the embedded log's writer lock.
        log = settings.open_log(read_only=True)
    except KappaflowError as exc:
        fix = ("start the broker or correct log.url / KAPPAFLOW_LOG__URL" if settings.log.is_kafka
               else "make log.url a writable directory")
        yield _fail(area, "reachable", f"{settings.log.url}: {exc}", fix)
        return
    try:
        try:
            topics = log.list_topics()
        except LogUnavailableError as exc:
            yield _fail(area, "reachable", str(exc), "start the broker or correct log.url / KAPPAFLOW_LOG__URL")
            return
        yield _ok(area, "reachable", f"{settings.log.url}: {len(topics)} topics")
        keyless = _keyless_debezium_tables(settings, log, topics)
        for topic, cfg in sorted(topics.items()):
            want_compacted = False if topic in keyless else _wants_compaction(settings, topic)
            if want_compacted is None or want_compacted == cfg.compacted:
                continue
            if want_compacted:
                yield _fail(area, f"topic {topic}", "cleanup.policy=delete: old changes of a key are never "
                            "removed and deleted keys stay forever",
                            f"kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                            "--add-config cleanup.policy=compact")
            else:
                yield _fail(area, f"topic {topic}", "cleanup.policy=compact on an append-only topic: compaction "
                            "keeps only the last record of each key (a ledger stream's last event)",
                            f"kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                            "--add-config cleanup.policy=delete")
    except KappaflowError as exc:
        yield _fail(area, "topics", str(exc), "check the broker's logs and ACLs (DescribeConfigs)")
    finally:
        log.close()


# Topics a source kind writes append-only (cleanup.policy=delete) by design; its other topics are
# compacted. Debezium: dead letters (their name before kappaflow/deadletters.py), logical messages and
# verbatim-routed metadata (and the topics of
# tables without a key, see _keyless_debezium_tables); PostgreSQL/MySQL: the transaction metadata topic
# (connectors/transactions.py); ledger: one topic per stream type.
_APPEND_ONLY_TOPICS: dict[str, Callable[[str, str], bool]] = {
    "debezium": lambda src, topic: topic in {f"{src}.__dead_letter", f"{src}.transaction", f"{src}.message",
                                             f"{src}.__debezium_schema"},
    "postgres": lambda src, topic: topic == f"{src}.transaction",
    "mysql": lambda src, topic: topic == f"{src}.transaction",
    "ledger": lambda src, topic: topic != f"{src}.__schema",
}


def _keyless_debezium_tables(settings: Settings, log: Any, topics: Mapping[str, Any]) -> set[str]:
    """The topics of tables a Debezium source read without a key (its ``__schema`` records name no key
    columns): written append-only by design (connectors/debezium/source.py)."""
    out: set[str] = set()
    for src in settings.sources.values():
        schema_topic = f"{src.name}.__schema"
        if src.kind != "debezium" or schema_topic not in topics:
            continue
        last: dict[bytes, bytes | None] = {}
        for rec in log.iter_partition(schema_topic, 0):
            if rec.key is not None:
                last[rec.key] = rec.value
        for key, value in last.items():
            if value is not None and not orjson.loads(value).get("key"):
                out.add(f"{src.name}.{orjson.loads(key)}")
    return out


def _wants_compaction(settings: Settings, topic: str) -> bool | None:
    """True/False: the cleanup policy a topic kappaflow writes must have; None: not kappaflow's topic."""
    if topic.lstrip("_").startswith("kappaflow_offsets"):
        return True
    src = settings.sources.get(topic.partition(".")[0])
    if src is None or "." not in topic:
        return None
    append_only = _APPEND_ONLY_TOPICS.get(src.kind)
    return not (append_only is not None and append_only(src.name, topic))



def check_tables(src: Any, area: str, *, missing_fix: str | None = None) -> Iterator[Finding]:
    """One finding per captured table: its key, or what capture would refuse and the fix."""
    from kappaflow.connectors.preflight import check_source_tables

    try:
        checks = check_source_tables(src)
    except KappaflowError as exc:
        yield _fail(area, "tables", str(exc).splitlines()[0], "check the connection and the user's SELECT rights")
        return
    for c in checks or ():
        if not c.problem:
            yield _ok(area, f"table {c.table}", c.detail)
        else:
            missing = "does not exist" in c.detail or "unknown table" in c.detail
            fix = missing_fix if missing_fix and missing else c.fix
            yield _fail(area, f"table {c.table}", c.detail, fix)


def check_postgres_source(src: PostgresSourceConfig) -> Iterator[Finding]:
    import psycopg

    area = f"source {src.name}"
    try:
        conn = psycopg.connect(src.connect_dsn(), connect_timeout=5, autocommit=True)
    except (psycopg.Error, KappaflowError) as exc:
        yield _fail(area, "connect", f"{src.dsn}: {str(exc).strip().splitlines()[0]}",
                    "check host, port, database, user and the password variable")
        return
    with conn:
        version = conn.execute("show server_version").fetchone()
        yield _ok(area, "connect", f"PostgreSQL {version[0] if version else '?'}")
        wal = conn.execute("show wal_level").fetchone()
        if wal and wal[0] == "logical":
            yield _ok(area, "wal_level", "logical")
        else:
            yield _fail(area, "wal_level", f"wal_level={wal[0] if wal else '?'}; logical decoding is off",
                        "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL")
        row = conn.execute("select rolreplication or rolsuper from pg_roles where rolname = current_user").fetchone()
        if row and row[0]:
            yield _ok(area, "replication role", "current role may replicate")
        else:
            yield _fail(area, "replication role", "the role lacks REPLICATION",
                        "ALTER ROLE <user> WITH REPLICATION (as a superuser)")
        slots = conn.execute("show max_replication_slots").fetchone()
        used = conn.execute("select count(*) from pg_replication_slots").fetchone()
        if slots and used and int(used[0]) >= int(slots[0]):
            yield _warn(area, "slots", f"all {slots[0]} replication slots are in use",
                        "raise max_replication_slots or drop unused slots")
        slot = conn.execute(
            "select active, wal_status, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) "
            "from pg_replication_slots where slot_name = %s", (src.slot_name,)).fetchone()
        if slot is None:
            yield _ok(area, "slot", f"{src.slot_name} not created yet (capture creates it)")
        elif slot[1] == "lost":
            yield _fail(area, "slot", f"{src.slot_name} was invalidated (WAL removed)",
                        f"drop it (select pg_drop_replication_slot('{src.slot_name}')) and capture "
                        "again with snapshot_mode=always")
        elif slot[0]:
            yield _ok(area, "slot", f"{src.slot_name} active, {int(slot[2] or 0):,} bytes behind")
        else:
            retained = int(slot[3] or 0)
            yield _warn(area, "slot", f"{src.slot_name} inactive (capture not running), retains "
                        f"{decimal(retained)} of WAL until capture resumes",
                        f"run `kappaflow capture {src.name}`, or `kappaflow source remove {src.name}` "
                        "to drop the slot")
    yield from check_tables(src, area)


def check_mysql_source(src: MySQLSourceConfig) -> Iterator[Finding]:
    import pymysql

    area = f"source {src.name}"
    parts = urlsplit(src.connect_dsn())
    try:
        conn = pymysql.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                               user=parts.username or "root", password=parts.password or "",
                               connect_timeout=5)
    except pymysql.MySQLError as exc:
        yield _fail(area, "connect", f"{src.dsn}: {exc}", "check host, port, user and the password variable")
        return
    try:
        with conn.cursor() as cur:
            cur.execute("select version(), @@log_bin, @@binlog_format, @@binlog_row_image")
            version, log_bin, fmt, image = cur.fetchone()
            yield _ok(area, "connect", f"server {version}")
            # Capture needs column names in row events; servers before MySQL 8.0.14 / MariaDB 10.5 lack it.
            cur.execute("show global variables like 'binlog_row_metadata'")
            row = cur.fetchone()
            metadata = row[1] if row else "(not supported by this server version)"
            expected = {"log_bin": (log_bin, 1, "--log-bin"), "binlog_format": (fmt, "ROW", "--binlog-format=ROW"),
                        "binlog_row_image": (image, "FULL", "--binlog-row-image=FULL"),
                        "binlog_row_metadata": (metadata, "FULL", "--binlog-row-metadata=FULL (MySQL >= 8.0.14, "
                                                "MariaDB >= 10.5)")}
            for name, (value, want, flag) in expected.items():
                if str(value).upper() == str(want):
                    yield _ok(area, name, str(value))
                else:
                    yield _fail(area, name, f"{name}={value}, kappaflow needs {want}",
                                f"start the server with {flag} (or SET GLOBAL {name}='{want}' where allowed)")
            cur.execute("show grants")
            grants = " ".join(str(r[0]) for r in cur.fetchall()).upper()
            if "ALL PRIVILEGES ON *.*" in grants or ("REPLICATION SLAVE" in grants and (
                    "REPLICATION CLIENT" in grants or "BINLOG MONITOR" in grants)):
                yield _ok(area, "privileges", "replication privileges granted")
            else:
                yield _fail(area, "privileges", "missing REPLICATION SLAVE / REPLICATION CLIENT",
                            "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO <user>")
    finally:
        conn.close()
    yield from check_tables(src, area)


def _tcp(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=3):
            return None
    except OSError as exc:
        return str(exc)


def check_debezium_source(src: DebeziumSourceConfig) -> Iterator[Finding]:
    area = f"source {src.name}"
    for address in src.bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        err = _tcp(host, int(port or 9092))
        if err:
            yield _fail(area, "broker", f"{address}: {err}", "check the Debezium cluster's bootstrap address")
        else:
            yield _ok(area, "broker", f"{address} reachable")


def check_views(settings: Settings) -> Iterator[Finding]:
    views = settings.views
    if views.postgres_dsn:
        import psycopg

        try:
            with psycopg.connect(views.postgres_connect_dsn(), connect_timeout=5) as conn:
                version = conn.execute("show server_version").fetchone()
            yield _ok("views", "postgres", f"PostgreSQL {version[0] if version else '?'}")
        except (psycopg.Error, KappaflowError) as exc:
            yield _fail("views", "postgres", f"{views.postgres_dsn}: {str(exc).strip().splitlines()[0]}",
                        "check views.postgres.dsn and its password_env")
    if views.search_url:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(views.search_url.rstrip("/") + "/", timeout=5) as resp:
                info = json.loads(resp.read() or b"{}")
            number = info.get("version", {}).get("number", "?")
            distro = info.get("version", {}).get("distribution", "elasticsearch")
            yield _ok("views", "search", f"{distro} {number}")
            if (distro == "opensearch") != (views.search_flavor == "opensearch"):
                want = "opensearch" if distro == "opensearch" else "elasticsearch"
                yield _warn("views", "search flavor", f"server is {distro}, config says {views.search_flavor}",
                            f'set flavor = "{want}" under [views.search]')
        except (OSError, ValueError) as exc:
            yield _fail("views", "search", f"{views.search_url}: {exc}", "check views.search.url")
    if views.redis_url:
        import redis

        try:
            redis.Redis.from_url(views.redis_url, socket_timeout=3).ping()
            yield _ok("views", "redis", "ping ok")
        except redis.RedisError as exc:
            yield _fail("views", "redis", f"{views.redis_url}: {exc}", "check views.redis.url")


def check_spark(settings: Settings) -> Iterator[Finding]:
    master = settings.spark.master
    if master.startswith("local"):
        yield _ok("spark", "master", f"{master} (in-process)")
        return
    if master.startswith("spark://"):
        for address in master.removeprefix("spark://").split(","):
            host, _, port = address.rpartition(":")
            err = _tcp(host, int(port or 7077))
            if err:
                yield _fail("spark", "master", f"{address}: {err}", "start the Spark master or fix spark.master")
            else:
                yield _ok("spark", "master", f"{address} reachable")
        return
    yield _ok("spark", "master", f"{master} (not checked)")


def check_ledger_source(src: LedgerSourceConfig) -> Iterator[Finding]:
    """The ledger is captured like a PostgreSQL source whose only table is ``<schema>.events``."""
    pg = src.postgres_config()
    for f in check_postgres_source(pg):
        if f.check == f"table {src.events_table}" and f.status is Status.FAIL and "unknown table" in f.detail:
            f = Finding(f.area, f.check, f.status, f.detail, "install the ledger there: kappaflow ledger install "
                        f"(its schema is {src.schema_name!r}; --ledger-schema when adding the source)")
        yield f


def _server(dsn: str) -> tuple[str, int]:
    parts = urlsplit(dsn)
    return (parts.hostname or "localhost", parts.port or 5432)


def check_postgres_slots(settings: Settings) -> Iterator[Finding]:
    """Inactive replication slots retaining WAL, on every PostgreSQL server a source reads (any slot, anyone's).

    An inactive slot keeps every WAL segment from its restart point on: the disk fills until the
    slot is dropped or ``max_slot_wal_keep_size`` invalidates it. The configured sources' own slots
    are reported with their source (a WARN: capture is not running); any other inactive slot is a FAIL.
    """
    import psycopg

    servers: dict[tuple[str, int], list[PostgresSourceConfig | LedgerSourceConfig]] = {}
    for src in settings.sources.values():
        if isinstance(src, PostgresSourceConfig | LedgerSourceConfig):
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
            yield _fail(area, f"slot {name}", f"inactive ({where}){owner}, retains {decimal(int(retained))} of WAL, "
                        "kept until the slot is dropped", f"if nothing will resume it: SELECT "
                        f"pg_drop_replication_slot('{name}') (in database {database or 'any'})")


# Source kind -> its checks (connection, server settings, slot, tables).
SOURCE_CHECKS: dict[str, Callable[[Any], Iterator[Finding]]] = {
    "postgres": check_postgres_source,
    "mysql": check_mysql_source,
    "debezium": check_debezium_source,
    "ledger": check_ledger_source,
}


def _unknown_kind(src: Any) -> Iterator[Finding]:
    yield _fail(f"source {src.name}", "kind", f"no checks for kind {src.kind!r}", "report this: doctor lacks them")


def check_slot_wal(settings: Settings) -> Iterator[Finding]:
    """WAL kept for capture's slots: a slot past ``[health] max_retained_wal_bytes`` (the threshold
    ``status --check`` alerts on), and servers without ``max_slot_wal_keep_size``, where a slot whose
    capture stopped keeps WAL until the disk is full (the failure this field reports most)."""
    import psycopg

    from kappaflow.metrics.probes import open_probe

    limit = settings.health.max_retained_wal_bytes
    seen: set[str] = set()
    for src in settings.sources.values():
        if src.kind not in ("postgres", "ledger"):
            continue
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
                yield _warn(area, "max_slot_wal_keep_size",
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
            yield _warn(area, "retained WAL", f"slot {reading.slot} retains {decimal(retained)} of WAL, over the "
                        f"[health] max_retained_wal_bytes threshold ({decimal(limit)})",
                        "check that its capture runs and keeps up (kappaflow metrics / status --check); a slot "
                        "no capture will use again: kappaflow source remove")


def run_checks(settings: Settings) -> list[Finding]:
    checks: list[Callable[[], Iterator[Finding]]] = [lambda: check_log(settings)]
    for src in settings.sources.values():
        source_check = SOURCE_CHECKS.get(src.kind, _unknown_kind)
        checks.append(lambda src=src, source_check=source_check: source_check(src))  # type: ignore[misc]
    checks += [lambda: check_postgres_slots(settings), lambda: check_slot_wal(settings), lambda: check_views(settings),
               lambda: check_spark(settings)]
    findings: list[Finding] = []
    for check in checks:
        findings.extend(check())
    return findings
