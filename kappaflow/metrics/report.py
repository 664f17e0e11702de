"""The state of a deployment read from outside its processes: sources, log, projections per sink.

One ``Report`` feeds ``kappaflow metrics`` (as metrics), ``kappaflow status --check`` (against the
``[health]`` thresholds) and the status page (as tables), so the three never disagree. It reads
only what any process may read: each source's stored offset in the log and its server's figures
(``probes``), the log's end offsets and files, and each sink's stored positions and lock. Nothing
here holds a DSN: errors are redacted and labels are names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from kappaflow.config import redact
from kappaflow.metrics.core import Families
from kappaflow.metrics.follow import lag_seconds
from kappaflow.metrics.log import embedded_dir, topic_disk_bytes
from kappaflow.metrics.probes import SourceReading, open_probe, position_number

__all__ = ["LagRow", "ProjectionRow", "Report", "ReportCollector", "SinkRow", "SourceRow", "build_report"]


@dataclass
class SourceRow:
    name: str
    kind: str
    phase: str | None = None  # from the stored offset: snapshot, streaming, done
    position: str | None = None  # last durable position stored in the log
    events: int | None = None
    snapshot_rows: int | None = None
    reading: SourceReading | None = None
    error: str | None = None


@dataclass
class LagRow:
    topic: str
    partition: int
    position: int
    end: int
    lag_seconds: float

    @property
    def lag_records(self) -> int:
        return max(0, self.end - self.position)


@dataclass
class SinkRow:
    sink: str
    rows: int | None
    following: bool
    partitions: list[LagRow] = field(default_factory=list)
    error: str | None = None

    @property
    def lag_records(self) -> int:
        return sum(p.lag_records for p in self.partitions)

    @property
    def lag_seconds(self) -> float:
        return max((p.lag_seconds for p in self.partitions), default=0.0)


@dataclass
class ProjectionRow:
    name: str
    kind: str
    view: str
    updated_at: Any
    dead_letters: int
    sinks: list[SinkRow] = field(default_factory=list)


@dataclass
class Report:
    sources: list[SourceRow] = field(default_factory=list)
    projections: list[ProjectionRow] = field(default_factory=list)
    ends: dict[str, dict[int, int]] = field(default_factory=dict)
    disk_bytes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # parts that could not be read (views down, ...)
    taken_at: float = field(default_factory=time.time)


def _stored_position(offset: dict[str, Any]) -> str | None:
    if "lsn" in offset:
        lsn = max(int(offset["lsn"]), 0)
        return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
    if "file" in offset:
        return f"{offset['file']}:{offset['pos']}"
    return None


def _snapshot_rows(offset: dict[str, Any]) -> int | None:
    snap = offset.get("snapshot")
    if not isinstance(snap, dict):
        return None
    if "rows" in snap:
        return int(snap["rows"])
    return sum(int(t.get("rows", 0)) for t in (snap.get("tables") or {}).values())


def _sources(settings: Any, log: Any, report: Report) -> None:
    from kappaflow.connectors.offsets import OFFSETS_TOPIC, OffsetStore

    store = OffsetStore(log) if log is not None and OFFSETS_TOPIC in report.ends else None
    for name, src in sorted(settings.sources.items()):
        row = SourceRow(name, src.kind)
        report.sources.append(row)
        try:
            offset = store.load(name) if store is not None else None
        except Exception as exc:
            row.error = redact(f"reading its offset: {exc}")
            offset = None
        if offset:
            row.phase = offset.get("phase")
            row.position = _stored_position(offset)
            row.events = offset.get("events")
            row.snapshot_rows = _snapshot_rows(offset)
        try:
            probe = open_probe(src)
        except Exception as exc:
            row.error = redact(str(exc))
            continue
        if probe is None:
            continue
        try:
            row.reading = probe.read(row.position)
        except Exception as exc:
            row.error = redact(" ".join(str(exc).split()))
        finally:
            probe.close()


def _projections(settings: Any, report: Report) -> None:
    from kappaflow.projections.deadletter import dead_letter_log_url, dead_letter_topics
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.status import projection_status

    rt = Runtime.from_settings(settings, with_spark=False)
    try:
        statuses = projection_status(rt)
        reader = rt.reader()
        dead_log = None
        try:
            from kappaflow.log import open_log

            url = dead_letter_log_url(rt.log_url)
            dead_log = open_log(url, **dict(rt.log_options)) if url.startswith("kafka://") else \
                open_log(url, read_only=True)
        except Exception:
            dead_log = None  # no dead letter was ever written (the embedded file does not exist)
        now = time.time()
        for st in statuses:
            dead = 0
            for topic in dead_letter_topics(st.name):
                if dead_log is None:
                    break
                try:  # the current topic and the one older versions wrote (see kappaflow/deadletters.py)
                    dead += sum(dead_log.end_offsets(topic).values())
                except Exception:
                    pass  # never written
            prow = ProjectionRow(st.name, st.kind, st.view, st.updated_at, dead)
            for s in st.sinks:
                parts = []
                for p in s.partitions:
                    try:
                        secs = lag_seconds(reader, p.topic, p.partition, p.position, p.end, now)
                    except Exception:
                        secs = 0.0
                    parts.append(LagRow(p.topic, p.partition, p.position, p.end, secs))
                prow.sinks.append(SinkRow(s.sink, s.rows, s.following, parts,
                                          redact(s.error) if s.error else None))
            report.projections.append(prow)
        if dead_log is not None:
            dead_log.close()
    finally:
        rt.close()


def build_report(settings: Any, *, projections: bool = True) -> Report:
    """Read everything once (each part that cannot be read is named in ``errors``, the rest still is)."""
    report = Report()
    log = None
    try:
        log = settings.open_log(read_only=True)
        for topic in sorted(log.list_topics()):
            report.ends[topic] = dict(log.end_offsets(topic))
    except Exception as exc:
        report.errors.append(redact(f"log: {exc}"))
    d = embedded_dir(settings)
    if d is not None:
        report.disk_bytes = topic_disk_bytes(d)
    try:
        _sources(settings, log, report)
    finally:
        if log is not None:
            log.close()
    if projections and settings.views.postgres_dsn:  # the registry of projections lives there
        try:
            _projections(settings, report)
        except Exception as exc:
            report.errors.append(redact(" ".join(f"projections: {exc}".split())))
    return report


class ReportCollector:
    """``kappaflow metrics``: the report as metrics, with the names the processes export."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def collect(self) -> Iterable[Metric]:
        return report_families(build_report(self.settings))


def report_families(report: Report) -> list[Metric]:
    fams = Families()
    for s in report.sources:
        r = s.reading
        confirmed = position_number(s.position)
        if r is not None:
            if r.slot is not None:
                fams.add("kappaflow_capture_retained_wal_bytes", (s.name, r.slot), r.retained_wal_bytes)
                fams.add("kappaflow_capture_unconfirmed_wal_bytes", (s.name, r.slot), r.unconfirmed_wal_bytes)
            fams.add("kappaflow_capture_binlog_files_behind", (s.name,), r.binlog_files_behind)
            fams.add("kappaflow_capture_binlog_bytes_behind", (s.name,), r.binlog_bytes_behind)
            if r.confirmed_position is not None:
                confirmed = r.confirmed_position
        fams.add("kappaflow_capture_confirmed_position", (s.name,), confirmed)
    for topic, parts in sorted(report.ends.items()):
        for p, end in sorted(parts.items()):
            fams.add("kappaflow_log_end_offset", (topic, p), end)
    for topic, size in sorted(report.disk_bytes.items()):
        fams.add("kappaflow_log_disk_bytes", (topic,), size)
    for pr in report.projections:
        fams.add("kappaflow_projection_dead_letters", (pr.name,), pr.dead_letters)
        for sk in pr.sinks:
            fams.add("kappaflow_projection_following", (pr.name, sk.sink), 1 if sk.following else 0)
            for lr in sk.partitions:
                labels = (pr.name, sk.sink, lr.topic, lr.partition)
                fams.add("kappaflow_follow_lag_records", labels, lr.lag_records)
                fams.add("kappaflow_follow_lag_seconds", labels, lr.lag_seconds)
    return list(fams)
