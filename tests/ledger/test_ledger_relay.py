"""Ledger -> log relay (exactly-once effect across restarts and crashes) and read-your-writes
through the projections' committed log offsets."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import psycopg
import pytest

from kappaflow.ledger import (
    Ledger,
    LedgerRelay,
    LogProjectionPositions,
    NewEvent,
    ProjectionTimeoutError,
    StreamAppend,
    wait_for_projection,
)
from kappaflow.ledger.relay import record_position
from kappaflow.log.partitioner import partition_for

pytestmark = pytest.mark.integration


def relayed(log: Any, source: str) -> list[tuple[str, int, int, bytes]]:
    """(topic, partition, ledger position, key) of every record in the source's topics."""
    out = []
    for topic, cfg in log.list_topics().items():
        if topic.startswith(source + "."):
            for p in range(cfg.partitions):
                out += [(topic, p, record_position(r) or 0, r.key or b"") for r in log.iter_partition(topic, p)]
    return out


def fill(ledger: Ledger, start: int, n: int) -> None:
    for i in range(start, start + n):
        ledger.append_many([StreamAppend(f"account-{i % 5}", [NewEvent("Debited", {"i": i})]),
                            StreamAppend(f"audit-{i % 2}", [NewEvent("Logged", {"i": i})])])


def test_relay_publishes_every_event_once_in_stream_order(ledger: Ledger, embedded_log: Any) -> None:
    fill(ledger, 0, 20)
    relay = LedgerRelay(ledger, embedded_log, "bank", partitions=3)
    assert relay.run_once() == 40
    assert relay.run_once() == 0
    recs = relayed(embedded_log, "bank")
    assert sorted(r[2] for r in recs) == list(range(1, 41))
    assert {r[0] for r in recs} == {"bank.account", "bank.audit"}
    assert embedded_log.topic_config("bank.account").cleanup_policy.value == "delete"
    for _topic, p, _, key in recs:
        assert p == partition_for(key, 3)
    by_stream: dict[bytes, list[int]] = {}
    for _, _, pos, key in sorted(recs, key=lambda r: (r[0], r[1])):
        by_stream.setdefault(key, []).append(pos)
    assert all(v == sorted(v) for v in by_stream.values())  # per-stream order kept in the partition
    first = embedded_log.read("bank.account", partition_for(b"account-0", 3), 0, 1)[0]
    value = orjson.loads(first.value)
    assert (value["stream_id"], value["event_type"], value["data"]) == ("account-0", "Debited", {"i": 0})


def test_relay_resumes_exactly_once_after_a_crash(ledger: Ledger, embedded_log: Any) -> None:
    fill(ledger, 0, 10)
    LedgerRelay(ledger, embedded_log, "bank", partitions=2).run_once()
    fill(ledger, 10, 10)

    class Crash(Exception):
        pass

    calls = {"n": 0}
    real_append = embedded_log.append

    def flaky_append(topic: str, records: Any, *, partition: int | None = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise Crash("killed mid-relay")
        return real_append(topic, records, partition=partition)

    crashing = LedgerRelay(ledger, embedded_log, "bank", partitions=2)
    embedded_log.append = flaky_append
    with pytest.raises(Crash):
        crashing.run_once()
    embedded_log.append = real_append
    partial = sorted(r[2] for r in relayed(embedded_log, "bank"))
    assert partial == list(range(1, len(partial) + 1)) and 20 < len(partial) < 40  # a prefix

    restarted = LedgerRelay(ledger, embedded_log, "bank", partitions=2)
    assert restarted.resume_position() == len(partial) + 1
    restarted.run_once()
    counts = Counter(r[2] for r in relayed(embedded_log, "bank"))
    assert sorted(counts) == list(range(1, 41)) and set(counts.values()) == {1}


def test_wait_for_projection_through_log_offsets(ledger: Ledger, ledger_dsn: str, embedded_log: Any) -> None:
    from kappaflow.migrations import upgrade

    upgrade(ledger_dsn, "projections@head")
    fill(ledger, 0, 6)
    r = ledger.append("account-3", [NewEvent("Credited", {"x": 1})])
    LedgerRelay(ledger, embedded_log, "bank", partitions=2).run_once()
    positions = LogProjectionPositions(ledger_dsn, embedded_log, ledger, "bank")
    topic, part = positions.locate(r.position)
    assert topic == "bank.account" and part == partition_for(b"account-3", 2)
    offsets = [rec.offset for rec in embedded_log.iter_partition(topic, part)
               if record_position(rec) == r.position]
    assert len(offsets) == 1
    with psycopg.connect(ledger_dsn, autocommit=True) as conn:
        upsert = ("insert into kappaflow.projection_positions (projection, target, topic, partition, next_offset) "
                  "values ('balances', 'live', %s, %s, %s) on conflict (projection, target, topic, partition) "
                  "do update set next_offset = excluded.next_offset")
        conn.execute(upsert, (topic, part, offsets[0]))  # everything before our event
        with pytest.raises(ProjectionTimeoutError) as err:
            wait_for_projection(positions, "balances", r.position, timeout=0.1)
        assert err.value.reached is not None and err.value.reached < r.position
        conn.execute(upsert, (topic, part, offsets[0] + 1))  # the projection committed our event
        assert wait_for_projection(positions, "balances", r.position, timeout=5) == r.position
    positions.close()


def test_relay_command_serves_its_metrics(ledger: Ledger, ledger_dsn: str, tmp_path: Any) -> None:
    """Issue 21: `kappaflow ledger relay` is a long-running process with /metrics: the events it relayed,
    the last ledger position and the records it appended per topic equal what the ledger holds."""
    import os
    import signal
    import subprocess
    import sys

    from tests._kill import wait_for
    from tests.monitoring._scrape import endpoint_of, scrape, value

    fill(ledger, 0, 10)  # 20 events: 10 account, 10 audit
    (tmp_path / "kappaflow.toml").write_text(f'[log]\nurl = "{tmp_path / "log"}"\npartitions = 2\n')
    out = tmp_path / "relay.log"
    with out.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kappaflow.cli", "ledger", "relay", "bank", "--dsn", ledger_dsn,
                                 "--metrics-port", "0"], cwd=tmp_path, env=dict(os.environ), stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        url = endpoint_of(out, 120)
        wait_for(lambda: value(scrape(url), "kappaflow_relay_events_total", source="bank") == 20, 60, "20 relayed")
        fill(ledger, 10, 5)
        s = wait_for(lambda: (lambda x: x if value(x, "kappaflow_relay_events_total", source="bank") == 30 else None)(
            scrape(url)), 60, "30 relayed")
        assert value(s, "kappaflow_relay_position", source="bank") == 30
        assert value(s, "kappaflow_log_records_appended_total", topic="bank.account") == 15
        assert value(s, "kappaflow_log_records_appended_total", topic="bank.audit") == 15
        assert value(s, "kappaflow_relay_errors_total", source="bank", kind="transient") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, out.read_text()
    assert "stopped: 30 events relayed" in out.read_text()
