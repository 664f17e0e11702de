"""kill -9 the MySQL/MariaDB capture during the snapshot and while streaming, with writes going
on: the shipped capture contract suite (``kappaflow.connectors.testing``) with a MariaDB driver.

The suite kills ``python -m kappaflow.cli.capture`` at a seeded writer step of a seeded snapshot
batch and at seeded moments while it streams, restarts it, and checks that per key every change
the binlog holds after the capture's start (parsed independently with plain mysql-replication)
is in the log once, in commit order. The driver also checks that the compacted log equals the
table, row for row, and that no position appears twice among the change events.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kappaflow.connectors.testing import CaptureContract, SourceDriver
from kappaflow.log.base import Log

pytestmark = [pytest.mark.integration]

Change = tuple[str, int, int, str]  # (binlog file, transaction start, row in the transaction, op)


class MariaDBDriver(SourceDriver):
    """One table ``t``; random inserts, updates and deletes in small transactions."""

    ROWS = 400
    CHUNK = 10  # a snapshot of 40 batches: two kills at batches 2..12 land inside it
    snapshot_batches = (2, 12)

    def __init__(self, server: Any, db: str, mh: Any) -> None:
        self.server, self.db, self.mh = server, db, mh
        self.name = "m" + os.urandom(4).hex()
        self.next_id = self.ROWS

    def source_config(self) -> str:
        return (f'kind = "mysql"\ndsn = "{self.mh.dsn(self.server, self.db)}"\ntables = ["{self.db}.t"]\n'
                f"snapshot_chunk_rows = {self.CHUNK}\nheartbeat_interval_s = 0.5\n"
                f"server_id = {random.Random(self.name).randint(10_000, 2**31)}\n")

    def prepare(self) -> None:
        self.server.execute("CREATE TABLE t (id INT PRIMARY KEY, v INT, s VARCHAR(20))",
                            "INSERT INTO t VALUES " + ",".join(f"({i},{i % 7},'r{i}')" for i in range(self.ROWS)),
                            db=self.db)

    def session(self) -> Any:
        import pymysql

        return pymysql.connect(host=self.server.host, port=self.server.port, user="root", password="",
                               database=self.db, autocommit=False)

    def write_one(self, conn: Any, rng: random.Random) -> None:
        with conn.cursor() as cur:
            for _ in range(rng.randint(1, 3)):
                r = rng.random()
                if r < 0.4:
                    cur.execute("INSERT INTO t VALUES (%s, %s, %s)", (self.next_id, rng.randint(0, 99),
                                                                     f"s{self.next_id}"))
                    self.next_id += 1
                elif r < 0.8:
                    cur.execute("UPDATE t SET v = v + 1, s = %s WHERE id = %s",
                                (f"u{rng.randint(0, 999)}", rng.randint(0, self.next_id)))
                else:
                    cur.execute("DELETE FROM t WHERE id = %s", (rng.randint(0, self.next_id),))
        conn.commit()
        time.sleep(0.003)  # pacing the load, not synchronising

    def expected(self, offset: Any) -> dict[int, list[Change]]:
        """Per id, the changes to db.t in the binlog after the capture's stream start, in commit order."""
        from pymysqlreplication import BinLogStreamReader
        from pymysqlreplication.event import MariadbGtidEvent
        from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

        start = offset["stream_start"]
        reader = BinLogStreamReader(
            connection_settings={"host": self.server.host, "port": self.server.port, "user": "root", "password": ""},
            server_id=9999, resume_stream=True, log_file=start["file"], log_pos=start["pos"], blocking=False,
            only_events=[MariadbGtidEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent], enable_logging=False)
        out: dict[int, list[Change]] = {}
        txn, row = 0, 0
        try:
            for ev in reader:
                if isinstance(ev, MariadbGtidEvent):
                    txn, row = ev.packet.log_pos - ev.event_size, 0
                    continue
                if ev.schema != self.db or ev.table != "t":
                    continue
                op = "c" if isinstance(ev, WriteRowsEvent) else "u" if isinstance(ev, UpdateRowsEvent) else "d"
                for r in ev.rows:
                    image = r["after_values"] if op == "u" else r["values"]
                    out.setdefault(int(image["id"]), []).append((reader.log_file, txn, row, op))
                    row += 1
        finally:
            reader.close()
        return out

    def logged(self, log: Log) -> dict[int, list[Change]]:
        """Per id, the streamed change events of the log, partition by partition."""
        out: dict[int, list[Change]] = {}
        for rec in self.mh.values(log, f"{self.name}.{self.db}.t"):
            if rec.value is None:
                continue
            doc = orjson.loads(rec.value)
            src = doc["source"]
            if src["kf_pos"]["snapshot"] or doc["op"] == "t":
                continue
            image = doc["after"] if doc["after"] is not None else doc["before"]
            out.setdefault(int(image["id"]), []).append((src["file"], src["pos"], src["row"], doc["op"]))
        return out

    def check_log(self, log: Log) -> None:
        topic = f"{self.name}.{self.db}.t"
        state = {orjson.loads(k)["id"]: (v["v"], v["s"]) for k, v in self.mh.compacted(log, topic).items()}
        table = {r["id"]: (r["v"], r["s"]) for r in self.mh.table_rows(self.server, self.db, "t")}
        assert state == table
        positions = Counter(orjson.dumps(orjson.loads(r.value)["source"]["kf_pos"], option=orjson.OPT_SORT_KEYS)
                            for r in self.mh.values(log, topic)
                            if r.value is not None and orjson.loads(r.value)["op"] != "t")
        twice = [p for p, n in positions.items() if n > 1]
        assert not twice, f"{len(twice)} change(s) written twice, e.g. {twice[:3]}"


class TestMariaDBCapture(CaptureContract):
    kills = 6
    snapshot_kills = 2
    seed = 4242
    streaming_pause = (0.05, 0.6)

    @pytest.fixture
    def driver(self, mariadb_server: Any, mh: Any) -> Iterator[MariaDBDriver]:
        db = f"kill_{os.getpid()}_{os.urandom(3).hex()}"
        mariadb_server.execute(f"DROP DATABASE IF EXISTS `{db}`", f"CREATE DATABASE `{db}`")
        try:
            yield MariaDBDriver(mariadb_server, db, mh)
        finally:
            mariadb_server.execute(f"DROP DATABASE IF EXISTS `{db}`")
