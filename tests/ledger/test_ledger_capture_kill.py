"""kill -9 the ledger capture process at seeded moments while appends go on.

The capture runs as a real process (``python -m kappaflow.cli.capture NAME --config ...``,
source kind ``ledger``). The first trials kill it during the snapshot (at a seeded writer step
of a seeded snapshot batch), the others while streaming; each time it is started again. At the
end, with the writer stopped and one clean ``--until-caught-up`` run, every ledger event is in
the log exactly once, as the very record `to_log_record` defines (same topic, partition, key,
value, headers).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kappaflow.ledger import Ledger, NewEvent, StreamAppend
from kappaflow.ledger.logmap import to_log_record
from kappaflow.ledger.relay import record_position
from kappaflow.log.partitioner import partition_for
from tests._kill import BackgroundWriter, kill_trials, open_for_check, run_until_caught_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 3


class Appender(BackgroundWriter):
    """Atomic two-stream appends (an account and an audit stream) until stopped."""

    def __init__(self, ledger: Ledger, seed: int) -> None:
        super().__init__(seed)
        self.ledger = ledger

    def write_one(self, session: Any) -> None:
        i = self.rng.randint(0, 40)
        self.ledger.append_many([StreamAppend(f"account-{i}", [NewEvent("Moved", {"i": self.commits})]),
                                 StreamAppend(f"audit-{i % 3}", [NewEvent("Seen", {"i": i})])])
        time.sleep(0.002)


def trials(tmp_path: Path, ledger: Ledger, dsn: str, name: str, log_url: str, *, kafka: bool, kills: int,
           seed: int, client: str | None = None) -> None:
    rng = random.Random(seed)
    for b in range(12):  # 12,000 events before the first start: 80 snapshot batches, two kills at 2..30 land inside
        ledger.append(f"account-{b}", [NewEvent("Opened", {"n": k}) for k in range(1000)])
    config = tmp_path / "kappaflow.toml"
    config.write_text(f'[log]\nurl = "{log_url}"\npartitions = {PARTITIONS}\n\n'
                      f'[sources.{name}]\nkind = "ledger"\ndsn = "{dsn}"\n'
                      "snapshot_chunk_rows = 150\nheartbeat_interval_s = 0.5\n"
                      + (f'\n[log.kafka]\nclient = "{client}"\n' if client else ""))
    cmd = [sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(config), "--no-progress"]
    writer = Appender(ledger, seed)
    writer.start()
    try:
        phases = kill_trials(cmd, tmp_path, log_url, name, kafka=kafka, kills=kills, snapshot_kills=2, rng=rng,
                             streaming_pause=(0.05, 0.5), snapshot_batches=(2, 30))
    finally:
        writer.stop()
    assert writer.error is None, writer.error
    assert writer.commits > 20
    assert "snapshot" in phases and "streaming" in phases, phases
    run_until_caught_up(cmd, tmp_path)

    want = {}
    for e in ledger.iter_all(decode=False, hashes=True):
        topic, rec = to_log_record(name, e)
        want[e.position] = (topic, partition_for(rec.key, PARTITIONS), rec.key, rec.value, rec.headers,
                            rec.timestamp_ms)
    log = open_for_check(log_url, kafka)
    try:
        got: dict[int, tuple[Any, ...]] = {}
        seen: Counter[int] = Counter()
        for topic, cfg in log.list_topics().items():
            if not topic.startswith(name + "."):
                continue
            for p in range(cfg.partitions):
                last = 0
                for r in log.iter_partition(topic, p):
                    pos = record_position(r)
                    assert pos is not None and pos > last, f"{topic}[{p}] offset {r.offset}: out of order"
                    last = pos
                    seen[pos] += 1
                    got[pos] = (topic, p, r.key, r.value, r.headers, r.timestamp_ms)
        twice = [p for p, n in seen.items() if n > 1]
        assert not twice, f"written twice: {twice[:10]}"
        missing = sorted(set(want) - set(got))
        assert not missing, f"{len(missing)} events missing from the log, first {missing[:10]}"
        assert got == want
    finally:
        log.close()


def test_kill_9_ledger_capture_embedded(tmp_path: Path, ledger: Ledger, ledger_dsn: str) -> None:
    trials(tmp_path, ledger, ledger_dsn, "lk" + os.urandom(4).hex(), str(tmp_path / "log"), kafka=False,
           kills=5, seed=2024)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])  # capture with each Kafka client
def test_kill_9_ledger_capture_kafka(tmp_path: Path, ledger: Ledger, ledger_dsn: str, kafka_broker: Any,
                                     client: str) -> None:
    trials(tmp_path, ledger, ledger_dsn, "lk" + os.urandom(4).hex(), f"kafka://{kafka_broker.bootstrap}",
           kafka=True, kills=3, seed=77, client=client)
