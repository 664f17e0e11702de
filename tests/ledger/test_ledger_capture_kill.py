"""kill -9 the ledger capture process at seeded moments while appends go on: the shipped capture
contract suite (``kappaflow.connectors.testing``) with a ledger source driver.

The capture runs as a real process (``python -m kappaflow.cli.capture NAME --config ...``,
source kind ``ledger``), killed during the snapshot (at a seeded writer step of a seeded snapshot
batch) and while streaming, and started again. Checked after one clean ``--until-caught-up`` run:
per stream, every ledger event is in the log once, in position order; and each is the very record
`to_log_record` defines (same topic, partition, key, value, headers, timestamp).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kappaflow.connectors.testing import KafkaCaptureContract, SourceDriver
from kappaflow.ledger import Ledger, NewEvent, StreamAppend
from kappaflow.ledger.logmap import to_log_record
from kappaflow.ledger.relay import record_position
from kappaflow.log.base import Log
from kappaflow.log.partitioner import partition_for

pytestmark = [pytest.mark.integration]

PARTITIONS = 3


class LedgerDriver(SourceDriver):
    """Atomic two-stream appends (an account and an audit stream)."""

    # 12,000 events before the first start: 80 snapshot batches, two kills at 2..30 land inside
    snapshot_batches = (2, 30)

    def __init__(self, ledger: Ledger, dsn: str) -> None:
        self.ledger, self.dsn = ledger, dsn
        self.name = "lk" + os.urandom(4).hex()
        self.appended = 0

    def source_config(self) -> str:
        return f'kind = "ledger"\ndsn = "{self.dsn}"\nsnapshot_chunk_rows = 150\nheartbeat_interval_s = 0.5\n'

    def prepare(self) -> None:
        for b in range(12):
            self.ledger.append(f"account-{b}", [NewEvent("Opened", {"n": k}) for k in range(1000)])

    def write_one(self, session: Any, rng: random.Random) -> None:
        i = rng.randint(0, 40)
        self.ledger.append_many([StreamAppend(f"account-{i}", [NewEvent("Moved", {"i": self.appended})]),
                                 StreamAppend(f"audit-{i % 3}", [NewEvent("Seen", {"i": i})])])
        self.appended += 1
        time.sleep(0.002)

    def _want(self) -> dict[int, tuple[Any, ...]]:
        """Global position -> the log record the ledger event must be (topic, partition, key, ...)."""
        want = {}
        for e in self.ledger.iter_all(decode=False, hashes=True):
            topic, rec = to_log_record(self.name, e)
            want[e.position] = (topic, partition_for(rec.key, PARTITIONS), rec.key, rec.value, rec.headers,
                                rec.timestamp_ms)
        return want

    def expected(self, offset: Any) -> dict[bytes, list[int]]:
        """Per stream (the record key), the positions of its events, in commit (= position) order."""
        out: dict[bytes, list[int]] = {}
        for pos, (_topic, _p, key, *_rest) in sorted(self._want().items()):
            out.setdefault(key, []).append(pos)
        return out

    def _records(self, log: Log) -> Iterator[tuple[str, int, Any]]:
        for topic, cfg in log.list_topics().items():
            if topic.startswith(self.name + "."):
                for p in range(cfg.partitions):
                    for r in log.iter_partition(topic, p):
                        yield topic, p, r

    def logged(self, log: Log) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        for topic, p, r in self._records(log):
            pos = record_position(r)
            assert pos is not None, f"{topic}[{p}] offset {r.offset}: a record without a ledger position"
            out.setdefault(r.key, []).append(pos)
        return out

    def check_log(self, log: Log) -> None:
        got: dict[int | None, tuple[Any, ...]] = {}
        last: dict[tuple[str, int], int] = {}
        for topic, p, r in self._records(log):
            pos = record_position(r)
            assert pos is not None and pos > last.get((topic, p), 0), f"{topic}[{p}] offset {r.offset}: out of order"
            last[(topic, p)] = pos
            got[pos] = (topic, p, r.key, r.value, r.headers, r.timestamp_ms)
        assert got == self._want()


class TestLedgerCapture(KafkaCaptureContract):
    kills = 5
    snapshot_kills = 2
    kafka_kills = 3
    kafka_snapshot_kills = 2
    seed = 2024

    @pytest.fixture
    def driver(self, ledger: Ledger, ledger_dsn: str) -> LedgerDriver:
        return LedgerDriver(ledger, ledger_dsn)

    @pytest.fixture
    def kafka_bootstrap(self, kafka_broker: Any) -> str:
        return str(kafka_broker.bootstrap)
