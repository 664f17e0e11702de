"""`kappaflow log compact` while a capture writes the log, and the capture's own background compaction.

Issue 13, item 22: the embedded log grew without bound while capture ran, and `log compact`
refused ("already open for writing ... read_only=True", advice meant for the Python API).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.cli.capture import open_log_for
from kappaflow.config import Settings
from kappaflow.log.base import CleanupPolicy, Record, TopicConfig
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.log.embedded.space import file_bytes
from kappaflow.log.testing import read_all

_WRITER = """
import sys, time
from kappaflow.cli.capture import open_log_for
from kappaflow.config import Settings

log = open_log_for(Settings.load(sys.argv[1]))  # the log exactly as `kappaflow capture` opens it
print("ready", flush=True)
time.sleep(600)
"""


def _config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "kappaflow.toml"
    path.write_text(f'[log]\nurl = "log"\npartitions = 2\n{extra}')
    return path


def _fill(log_dir: Path) -> dict[bytes, bytes]:
    latest: dict[bytes, bytes] = {}
    hour_ago = time.time_ns() // 1_000_000 - 3_600_000
    with EmbeddedLog(log_dir) as log:
        log.create_topic("shop.public.orders", TopicConfig(partitions=2, cleanup_policy=CleanupPolicy.COMPACT))
        for r in range(25):
            # appended an hour ago: past the default min_compaction_lag_s
            recs = [Record(b'{"id":%d}' % i, b'{"v":%d}' % r + b" " * 1500, timestamp_ms=hour_ago) for i in range(400)]
            log.append("shop.public.orders", recs)
            latest.update((rec.key, rec.value) for rec in recs)  # type: ignore[misc]
    return latest


def test_log_compact_asks_the_running_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    latest = _fill(tmp_path / "log")
    (topic_file,) = (tmp_path / "log" / "topics").glob("shop.public.orders.*.db")
    before = file_bytes(topic_file)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(config)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        monkeypatch.chdir(tmp_path)
        res = CliRunner().invoke(app, ["log", "compact", "shop.public.orders"])
        assert res.exit_code == 0, res.output
        assert "read_only" not in res.output
        assert f"compacted by the running writer (pid {proc.pid})" in res.output
        assert "shop.public.orders: kept 400, removed 9,600" in res.output, res.output
        res = CliRunner().invoke(app, ["log", "compact"])  # every compact-policy topic
        assert res.exit_code == 0 and "shop.public.orders: kept 400, removed 0" in res.output, res.output
        after = file_bytes(topic_file)
        assert after < before * 0.2, f"{after} bytes on disk after compaction, {before} before"
        with EmbeddedLog(tmp_path / "log", read_only=True) as reader:
            stored = {r.key: r.value for rs in read_all(reader, "shop.public.orders").values() for r in rs}
        assert stored == latest
        res = CliRunner().invoke(app, ["log", "compact", "no.such.topic"])
        assert res.exit_code != 0 and "no.such.topic" in res.output
    finally:
        proc.kill()
        proc.wait(30)


def test_capture_log_compacts_in_the_background(tmp_path: Path) -> None:
    settings = Settings.load(_config(tmp_path, "compact_interval_s = 0.1\nmin_compaction_lag_s = 0\n"))
    latest = _fill(tmp_path / "log")
    log = open_log_for(settings)  # what `kappaflow capture` writes through
    try:
        log.append("shop.public.orders", [Record(b'{"id":0}', b'{"v":"last"}')])
        latest[b'{"id":0}'] = b'{"v":"last"}'
        deadline = time.monotonic() + 60
        while True:
            stored = [r for rs in read_all(log, "shop.public.orders").values() for r in rs]
            if len(stored) == 400:
                break
            assert time.monotonic() < deadline, f"not compacted in the background: {len(stored)} records"
            time.sleep(0.05)
        assert {r.key: r.value for r in stored} == latest
    finally:
        log.close()
