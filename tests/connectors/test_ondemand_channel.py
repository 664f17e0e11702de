"""The on-demand snapshot request channel and state (``connectors/ondemand.py``), without a database.

The channel is what another process writes while the capture holds the log: requests are numbered
in submission order, read once after the last number applied, and the capture's beat says whether
it runs. Both implementations (the embedded log's ``ondemand.db`` and the requests topic on Kafka)
keep the same contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kappaflow.connectors.ondemand import (
    FileChannel,
    OnDemandState,
    RequestChannel,
    SnapshotRequest,
    TableRun,
    TopicChannel,
    channel_for,
    progress_view,
)
from kappaflow.errors import ValidationError
from kappaflow.log import open_log


def _contract(ch: RequestChannel) -> None:
    assert ch.since("s1", 0) == []
    assert ch.alive("s1") is None
    a = ch.submit("s1", "start", ["public.a"], "id > 5")
    ch.submit("s2", "start", ["public.x"])
    b = ch.submit("s1", "pause")
    assert 0 < a < b
    reqs = ch.since("s1", 0)
    assert [(r.seq, r.action, r.tables, r.where) for r in reqs] == [(a, "start", ("public.a",), "id > 5"),
                                                                     (b, "pause", (), None)]
    assert [r.seq for r in ch.since("s1", a)] == [b]
    assert ch.since("s1", b) == []
    ch.beat("s1", {"seq": b, "ondemand": None})
    beat = ch.alive("s1")
    assert beat is not None and beat["seq"] == b
    assert ch.alive("s2") is None
    ch.beat("s1", {"seq": b, "stopped": True})
    assert ch.alive("s1") is None  # a capture that said it stopped is not capturing
    c = ch.submit("s1", "resume")
    assert [r.seq for r in ch.since("s1", b)] == [c]


def test_file_channel_keeps_the_contract_across_processes(tmp_path: Path) -> None:
    log = open_log(str(tmp_path / "log"), compact_interval_s=None)
    try:
        ch = channel_for(log)
        assert isinstance(ch, FileChannel)
        _contract(ch)
        other = FileChannel(tmp_path / "log")  # another process's view of the same file
        try:
            assert [r.action for r in other.since("s1", 0)] == ["start", "pause", "resume"]
            ch.changed()  # in step with the file now
            assert not ch.changed()
            other.submit("s1", "stop")
            assert ch.changed()  # a write by another connection is seen without reading the table
            assert not ch.changed()
        finally:
            other.close()
        ch.close()
    finally:
        log.close()


def test_topic_channel_on_an_embedded_log(tmp_path: Path) -> None:
    log = open_log(str(tmp_path / "log"), compact_interval_s=None)
    try:
        _contract(TopicChannel(log, "_kappaflow_requests_test"))
    finally:
        log.close()


def test_topic_channel_on_kafka(kafka_log: Any, unique_topic: str) -> None:
    ch = channel_for(kafka_log)
    assert isinstance(ch, TopicChannel)
    _contract(TopicChannel(kafka_log, unique_topic))


def test_state_applies_requests_once_and_round_trips() -> None:
    st = OnDemandState()
    assert progress_view(st) is None
    st.apply(SnapshotRequest(1, "s", "start", ("public.a", "public.b"), "x > 1"))
    assert st.state == "running" and [t.table for t in st.tables] == ["public.a", "public.b"]
    st.apply(SnapshotRequest(2, "s", "start", ("public.a", "public.c")))  # a is queued already
    assert [t.table for t in st.tables] == ["public.a", "public.b", "public.c"]
    st.apply(SnapshotRequest(3, "s", "pause"))
    assert st.state == "paused" and st.seq == 3
    st.tables[0] = TableRun("public.a", "x > 1", ["10"], rows=100, chunks=2, estimate=400)
    st.active_s = 2.0
    view = progress_view(st)
    assert view is not None and view["rows"] == 100 and view["rows_per_s"] == 50.0 and view["eta_s"] == 6.0
    back = OnDemandState.from_dict(st.to_dict())
    assert back == st
    st.apply(SnapshotRequest(4, "s", "resume"))
    assert st.state == "running"
    for t in st.tables:
        t.done = True
    st.finish_if_done()
    assert st.state == "done" and progress_view(st)["eta_s"] == 0.0  # type: ignore[index]
    st.apply(SnapshotRequest(5, "s", "stop"))
    assert st.state == "done"  # nothing to stop


def test_malformed_requests_and_state_are_refused() -> None:
    with pytest.raises(ValidationError, match="action: expected one of"):
        SnapshotRequest.from_body(7, {"source": "s", "action": "explode"})
    with pytest.raises(ValidationError, match=r"offset\.ondemand"):
        OnDemandState.from_dict({"tables": [{"rows": 1}]})


def test_capture_metrics_export_the_ondemand_progress() -> None:
    from types import SimpleNamespace

    from kappaflow.connectors.base import CaptureSummary
    from kappaflow.metrics.capture import CaptureCollector

    st = OnDemandState(seq=1, state="running", tables=[TableRun("public.a", rows=300, estimate=1000)], active_s=3.0)
    summary = CaptureSummary(source="s", connector="postgresql", phase="streaming", ondemand=progress_view(st) or {})
    connector = SimpleNamespace(live_summary=lambda: summary)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in CaptureCollector(SimpleNamespace(name="s"), lambda: [connector]).collect() for s in m.samples}
    assert samples[("kappaflow_capture_ondemand_rows", (("source", "s"),))] == 300
    assert samples[("kappaflow_capture_ondemand_rows_per_second", (("source", "s"),))] == 100
    assert samples[("kappaflow_capture_ondemand_eta_seconds", (("source", "s"),))] == 7
    assert samples[("kappaflow_capture_ondemand_state", (("source", "s"), ("state", "running")))] == 1
    assert samples[("kappaflow_capture_ondemand_state", (("source", "s"), ("state", "done")))] == 0
