"""Ledger -> log through the PostgreSQL connector (source kind ``ledger``).

* snapshot then streaming, on both log backends: every event exactly once, one topic per
  stream type (cleanup policy delete), keyed by stream id, in stream order per partition;
* the connector and `LedgerRelay` write identical records (topic, partition, offset, key,
  value, headers, timestamp);
* restarts skip what the log holds; changing an event behind the trigger stops the capture;
* a database without the ledger gets a clear error.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from kappaflow.config import LedgerSourceConfig
from kappaflow.connectors.ledger import LedgerConnector
from kappaflow.errors import SourceError
from kappaflow.ledger import Ledger, LedgerRelay, NewEvent, StreamAppend
from kappaflow.ledger.logmap import to_log_record
from kappaflow.log.base import CleanupPolicy, Log
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.log.partitioner import partition_for

pytestmark = pytest.mark.integration


@pytest.fixture
def source() -> str:
    """Unique per test: slots are cluster-wide and the Kafka broker is shared by the session."""
    return f"l{uuid.uuid4().hex[:10]}"


def source_config(dsn: str, name: str, **kw: Any) -> LedgerSourceConfig:
    kw.setdefault("heartbeat_interval_s", 0.5)
    return LedgerSourceConfig(name=name, dsn=dsn, **kw)


def capture(cfg: LedgerSourceConfig, log: Log, **kw: Any) -> Any:
    kw.setdefault("partitions", 3)
    kw.setdefault("progress", False)
    return LedgerConnector(cfg, log, **kw).run(until_caught_up=True)


def dump(log: Log, source: str) -> list[tuple[Any, ...]]:
    """Every record of the source's ledger topics, comparable across logs."""
    out = []
    for topic, cfg in sorted(log.list_topics().items()):
        if topic.startswith(source + ".") and topic != source + ".__schema":
            for p in range(cfg.partitions):
                out += [(topic, p, r.offset, r.key, r.value, tuple(r.headers), r.timestamp_ms)
                        for r in log.iter_partition(topic, p)]
    return out


def fill(ledger: Ledger, start: int, n: int) -> None:
    """Two stream types; each append touches an account and an audit stream in one commit. Every
    fourth debit carries tags (one with characters PostgreSQL quotes in an array's text form)."""
    for i in range(start, start + n):
        tags = [f"account:{i % 7}", 'note:a "b" c,{d}\\'] if i % 4 == 0 else []
        ledger.append_many([StreamAppend(f"account-{i % 7}", [NewEvent("Debited", {"i": i, "note": "x" * (i % 5)},
                                                                       tags=tags)]),
                            StreamAppend(f"audit-{i % 2}", [NewEvent("Logged", {"i": i}, metadata={"by": "t"})])],
                           idempotency_key=f"k-{i}" if i % 3 == 0 else None)


def test_snapshot_then_streaming_exactly_once(ledger: Ledger, ledger_dsn: str, source: str, any_log: Log) -> None:
    fill(ledger, 0, 30)  # 60 events before the slot exists: the snapshot reads them
    cfg = source_config(ledger_dsn, source)
    first = capture(cfg, any_log)
    assert first.snapshot_rows == 60 and first.connector == "ledger"
    fill(ledger, 30, 20)  # streamed
    second = capture(cfg, any_log)
    assert second.events == 40 and second.snapshot_rows == 0

    recs = dump(any_log, source)
    positions = Counter(record_position_of(h) for *_, h, _ts in recs)
    assert sorted(positions) == list(range(1, 101)) and set(positions.values()) == {1}
    assert {r[0] for r in recs} == {f"{source}.account", f"{source}.audit"}
    assert source + ".__schema" not in any_log.list_topics()  # no change events, no schemas
    for topic in (f"{source}.account", f"{source}.audit"):
        cfg_t = any_log.topic_config(topic)
        assert cfg_t.cleanup_policy is CleanupPolicy.DELETE and cfg_t.partitions == 3
        if not isinstance(any_log, EmbeddedLog):  # Kafka: no retention limit (the broker's default is 7 days)
            assert (cfg_t.retention_ms, cfg_t.retention_bytes) == (-1, -1)
    per_stream: dict[bytes, list[int]] = {}
    for _topic, p, _off, key, value, headers, _ts in recs:
        assert p == partition_for(key, 3)
        doc = orjson.loads(value)
        assert doc["stream_id"].encode() == key and doc["event_type"] in ("Debited", "Logged")
        assert dict(headers)["kf.ledger.event_type"] == doc["event_type"].encode()
        # tags: one kf.ledger.tag header each (sorted, as stored), and in the value
        if doc["event_type"] == "Debited" and doc["data"]["i"] % 4 == 0:
            want_tags = sorted([f"account:{doc['data']['i'] % 7}", 'note:a "b" c,{d}\\'])
            assert [v.decode() for k, v in headers if k == "kf.ledger.tag"] == want_tags == doc["tags"]
        else:
            assert "kf.ledger.tag" not in dict(headers) and "tags" not in doc
        per_stream.setdefault(key, []).append(doc["stream_version"])
    assert all(v == list(range(1, len(v) + 1)) for v in per_stream.values())  # stream order, no gaps

    status = LedgerConnector(cfg, any_log).status()
    assert (status["kind"], status["log_position"], status["ledger_head_position"], status["lag_events"]) == \
        ("ledger", 100, 100, 0)
    assert status["topics"] == {f"{source}.account": 50, f"{source}.audit": 50}

    # what the log holds is exactly what the ledger holds, event for event
    want = {r.position: to_log_record(source, r)[1].value for r in ledger.iter_all(decode=False, hashes=True)}
    got = {record_position_of(h): v for *_, v, h, _ts in recs}
    assert got == want


def record_position_of(headers: tuple[tuple[str, bytes], ...]) -> int:
    return int(dict(headers)["kf.ledger.position"])


def test_connector_and_relay_write_identical_records(ledger: Ledger, ledger_dsn: str, source: str, any_log: Log,
                                                     tmp_path: Path) -> None:
    fill(ledger, 0, 25)
    cfg = source_config(ledger_dsn, source, snapshot_chunk_rows=7)  # several snapshot chunks
    capture(cfg, any_log)
    fill(ledger, 25, 25)
    ledger.append("account-big", [NewEvent("Debited", {"blob": "y" * 5000, "n": [1, 2.5, None, True]})])
    capture(cfg, any_log)
    with EmbeddedLog(tmp_path / "relay-log") as relay_log:
        relay = LedgerRelay(ledger, relay_log, source, partitions=3)
        while relay.run_once():
            pass
        assert dump(any_log, source) == dump(relay_log, source)


def test_connector_continues_a_log_the_relay_started(ledger: Ledger, ledger_dsn: str, source: str,
                                                    embedded_log: Log) -> None:
    fill(ledger, 0, 15)
    LedgerRelay(ledger, embedded_log, source, partitions=3).run_once()
    fill(ledger, 15, 10)
    summary = capture(source_config(ledger_dsn, source), embedded_log)
    assert summary.duplicates_skipped == 30 and summary.events == 20  # the snapshot skipped the relayed events
    positions = Counter(record_position_of(h) for *_, h, _ts in dump(embedded_log, source))
    assert sorted(positions) == list(range(1, 51)) and set(positions.values()) == {1}


class Crash(BaseException):
    """Stands for the process dying at a step (not an Exception: nothing may swallow it)."""


@pytest.mark.parametrize(("phase", "step", "nth"), [("snapshot", "after_records", 3), ("snapshot", "after_offset", 2),
                                                    ("streaming", "after_records", 2),
                                                    ("streaming", "before_records", 3)])
def test_crash_at_a_commit_step_then_restart_is_exact(ledger: Ledger, ledger_dsn: str, source: str,
                                                      embedded_log: Log, phase: str, step: str, nth: int) -> None:
    """A crash between the records and the offset (or before either): the restart re-reads the
    snapshot chunk or re-streams the transactions and writes nothing twice, nothing less."""
    fill(ledger, 0, 20)
    cfg = source_config(ledger_dsn, source, snapshot_chunk_rows=5)
    if phase == "streaming":
        capture(cfg, embedded_log)
        fill(ledger, 20, 15)
    seen: Counter[str] = Counter()

    def fault(name: str) -> None:
        seen[name] += 1
        if name == step and seen[name] == nth:
            raise Crash(f"crash at {step} #{nth}")

    with pytest.raises(Crash):
        capture(cfg, embedded_log, fault=fault, batch_records=4, linger_s=0)
    partial = sorted(record_position_of(h) for *_, h, _ts in dump(embedded_log, source))
    assert len(partial) == len(set(partial))
    fill(ledger, 35, 5)  # committed after the crash: streamed (and, resuming a snapshot, also read by it)
    again = capture(cfg, embedded_log)
    if step == "after_records":
        assert again.duplicates_skipped >= 1
    positions = Counter(record_position_of(h) for *_, h, _ts in dump(embedded_log, source))
    assert sorted(positions) == list(range(1, 81 if phase == "streaming" else 51)) \
        and set(positions.values()) == {1}


def test_a_changed_event_stops_the_capture(ledger: Ledger, ledger_dsn: str, source: str,
                                           embedded_log: Log) -> None:
    fill(ledger, 0, 3)
    cfg = source_config(ledger_dsn, source)
    capture(cfg, embedded_log)
    with psycopg.connect(ledger_dsn, autocommit=True) as conn:  # a superuser going around the trigger
        conn.execute("ALTER TABLE kappaflow_ledger.events DISABLE TRIGGER events_immutable")
        conn.execute("UPDATE kappaflow_ledger.events SET payload = '{\"i\": 99}' WHERE position = 2")
    with pytest.raises(SourceError) as err:
        capture(cfg, embedded_log)
    text = str(err.value)
    assert "kappaflow_ledger.events: UPDATE at WAL" in text and "kappaflow ledger verify" in text
    assert not err.value.transient


def test_missing_ledger_is_named(pg_dsn: str, source: str, embedded_log: Log) -> None:
    with pytest.raises(SourceError, match=r"no ledger in schema 'kappaflow_ledger'.*kappaflow ledger install"):
        capture(source_config(pg_dsn, source), embedded_log)
