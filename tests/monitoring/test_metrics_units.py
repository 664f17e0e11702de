"""The parts of the monitoring that need no running capture or follower (issue 21).

Health verdicts per threshold and their precedence, the documented metric set against Prometheus's
naming conventions (prometheus.io/docs/practices/naming) and against the README, position numbers,
the history's bounded ring of slots (against the session's PostgreSQL), topic file sizes.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from kappaflow.config import HealthConfig
from kappaflow.metrics.health import CODES, check
from kappaflow.metrics.history import HistoryStore, parse_key, samples_of, series_key
from kappaflow.metrics.log import topic_disk_bytes
from kappaflow.metrics.names import METRICS
from kappaflow.metrics.probes import SourceReading, position_number
from kappaflow.metrics.report import LagRow, ProjectionRow, Report, SinkRow, SourceRow

ROOT = Path(__file__).resolve().parents[2]
LABELS = {"source", "table", "phase", "slot", "kind", "projection", "sink", "topic", "partition", "op", "state"}


def _report(*, following: bool = True, lag_s: float = 0.0, dead: int = 0, retained: int = 10,
            error: str | None = None) -> Report:
    sink = SinkRow("postgres", 5, following, [LagRow("shop.public.orders", 0, 10, 12 if lag_s else 10, lag_s)],
                   error)
    return Report(
        sources=[SourceRow("shop", "postgres", reading=SourceReading(slot="kappaflow_shop",
                                                                     retained_wal_bytes=retained))],
        projections=[ProjectionRow("orders", "latest", "public.orders", None, dead, [sink])],
    )


def test_health_is_ok_under_every_threshold() -> None:
    assert check(_report(), HealthConfig()) == []


@pytest.mark.parametrize(("report", "reason"), [
    (_report(following=False), "stopped_follower"),
    (_report(lag_s=400), "lag"),
    (_report(retained=2 << 30), "retained_wal"),
    (_report(dead=3), "dead_letters"),
    (_report(error="connection refused"), "unknown"),
])
def test_each_threshold_has_its_reason_and_code(report: Report, reason: str) -> None:
    problems = check(report, HealthConfig())
    assert [p.reason for p in problems] == [reason]
    assert problems[0].code == CODES[reason]


def test_the_most_severe_reason_decides_the_exit_code_and_all_are_listed() -> None:
    problems = check(_report(following=False, lag_s=400, dead=1, retained=2 << 30), HealthConfig())
    assert [p.reason for p in problems] == ["stopped_follower", "lag", "retained_wal", "dead_letters"]
    assert problems[0].code == 4


def test_followers_setting_limits_the_stopped_follower_check() -> None:
    assert check(_report(following=False), HealthConfig(followers=[])) == []
    assert check(_report(following=False), HealthConfig(followers=["other"]))[0].message.startswith(
        "projection other: no live view")
    assert check(_report(dead=5), HealthConfig(max_dead_letters=5)) == []


def test_metric_names_follow_prometheus_conventions() -> None:
    for d in METRICS.values():
        assert re.fullmatch(r"kappaflow_[a-z_]+", d.name), d.name
        assert not d.name.endswith("_total"), f"{d.name}: counters get _total on the wire"
        assert d.labels and set(d.labels) <= LABELS, (d.name, d.labels)
        assert d.help.endswith("."), d.name
        if d.kind == "histogram" or "duration" in d.name or d.name.endswith("_lag"):
            assert d.name.endswith("_seconds"), d.name
    assert METRICS["kappaflow_capture_changes"].exposed == "kappaflow_capture_changes_total"


def test_readme_monitoring_section_documents_every_metric() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    for d in METRICS.values():
        assert f"`{d.exposed}`" in section, f"{d.exposed} is missing from the README's Monitoring section"
    named = set(re.findall(r"`(kappaflow_[a-z_]+)`", section))
    exposed = {d.exposed for d in METRICS.values()}
    suffixes = ("_bucket", "_count", "_sum")
    unknown = {n for n in named if n not in exposed and not (n.endswith(suffixes) and n.rsplit("_", 1)[0] in exposed)}
    assert not unknown, f"the README names metrics kappaflow does not export: {sorted(unknown)}"


def test_positions_as_numbers() -> None:
    assert position_number("0/3A2B1C8") == 0x3A2B1C8
    assert position_number("1/0") == 1 << 32
    assert position_number("mysql-bin.000003:4567") == (3 << 32) + 4567
    assert position_number("mysql-bin.000003:4567 gtid 0-1-5") == (3 << 32) + 4567
    assert position_number(None) is None and position_number("?") is None


def test_history_series_keep_their_labels_and_fold_partitions() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    text = (
        "# TYPE kappaflow_follow_lag_records gauge\n"
        'kappaflow_follow_lag_records{projection="p",sink="postgres",topic="t",partition="0"} 3\n'
        'kappaflow_follow_lag_records{projection="p",sink="postgres",topic="t",partition="1"} 4\n'
        "# TYPE kappaflow_follow_lag_seconds gauge\n"
        'kappaflow_follow_lag_seconds{projection="p",sink="postgres",topic="t",partition="0"} 1.5\n'
        'kappaflow_follow_lag_seconds{projection="p",sink="postgres",topic="t",partition="1"} 9\n'
        "# TYPE kappaflow_log_end_offset gauge\n"
        'kappaflow_log_end_offset{topic="t",partition="0"} 10\n'
    )
    got = samples_of(text_string_to_metric_families(text))
    assert got == {'kappaflow_follow_lag_records{projection="p",sink="postgres"}': 7,
                   'kappaflow_follow_lag_seconds{projection="p",sink="postgres"}': 9}
    assert parse_key(series_key("kappaflow_x", {"source": "shop"})) == ("kappaflow_x", {"source": "shop"})


@pytest.mark.integration
def test_history_is_a_bounded_ring(pg_dsn: str) -> None:
    store = HistoryStore(pg_dsn, interval_s=10, retention_s=60)  # 7 slots per series
    try:
        t0 = 1_800_000_000.0
        for i in range(50):  # 500 s of samples: far more than the retention
            store.write({'kappaflow_capture_changes_total{source="shop"}': float(i)}, now=t0 + 10 * i)
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute('SELECT count(*), max(value) FROM "kappaflow"."metric_history"').fetchone()
        assert rows == (7, 49.0)
    finally:
        store.close()


def test_topic_disk_bytes_by_topic_name(tmp_path: Path) -> None:
    topics = tmp_path / "topics"
    topics.mkdir()
    (topics / "shop.public.orders.0a1b2c3d4e5f.db").write_bytes(b"x" * 100)
    (topics / "shop.public.orders.0a1b2c3d4e5f.db-wal").write_bytes(b"x" * 20)
    (topics / "shop.public.orders.x.9f8e7d6c5b4a.db").write_bytes(b"x" * 7)
    (topics / "README").write_text("not a topic")
    assert topic_disk_bytes(tmp_path) == {"shop.public.orders": 120, "shop.public.orders.x": 7}
    assert topic_disk_bytes(tmp_path / "missing") == {}
