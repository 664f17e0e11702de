"""Log metrics: records a process appended or read per topic, and bytes on disk per topic.

Appends are counted by the capture writer per batch (``CaptureWriter.per_topic``) and reads by
the follow batches; this module only turns those counts into families. Bytes on disk are the
sizes of an embedded log's topic files (``topics/NAME.ID.db`` and its ``-wal``/``-shm``), read
from the directory so that a scrape never opens SQLite; a Kafka topic's size is the brokers'
(their own exporters report it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from kappaflow.metrics.core import Families

__all__ = ["LogCollector", "topic_disk_bytes"]

_SUFFIXES = ("-wal", "-shm", "-journal")


def topic_disk_bytes(log_dir: Path) -> dict[str, int]:
    """Bytes of each topic's files in an embedded log directory ({} when there is none)."""
    out: dict[str, int] = {}
    folder = Path(log_dir) / "topics"
    try:
        entries = list(folder.iterdir())
    except OSError:
        return out
    for f in entries:
        name = f.name
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        if not name.endswith(".db") or name.count(".") < 2:
            continue
        topic = name[:-3].rsplit(".", 1)[0]  # NAME.ID.db: the id is one hex word without dots
        try:
            out[topic] = out.get(topic, 0) + f.stat().st_size
        except OSError:  # removed between the listing and the stat (a deleted topic)
            continue
    return out


class LogCollector:
    """``kappaflow_log_*`` of one process.

    ``appended``/``read``: callables returning records per topic so far in this process (None: this
    process does not append / read); ``log_dir``: an embedded log's directory (None for Kafka).
    """

    def __init__(self, *, appended: Callable[[], Mapping[str, int]] | None = None,
                 read: Callable[[], Mapping[str, int]] | None = None, log_dir: Path | None = None) -> None:
        self.appended = appended
        self.read = read
        self.log_dir = log_dir

    def collect(self) -> Iterable[Metric]:
        fams = Families()
        if self.appended is not None:
            fams.declare("kappaflow_log_records_appended")
            for topic, n in sorted(self.appended().items()):
                fams.add("kappaflow_log_records_appended", (topic,), n)
        if self.read is not None:
            fams.declare("kappaflow_log_records_read")
            for topic, n in sorted(self.read().items()):
                fams.add("kappaflow_log_records_read", (topic,), n)
        if self.log_dir is not None:
            fams.declare("kappaflow_log_disk_bytes")
            for topic, size in sorted(topic_disk_bytes(self.log_dir).items()):
                fams.add("kappaflow_log_disk_bytes", (topic,), size)
        return list(fams)


def embedded_dir(settings: Any) -> Path | None:
    """The embedded log's directory of ``settings`` (None when the log is Kafka)."""
    if settings.log.is_kafka:
        return None
    p = Path(settings.log.url.removeprefix("file:"))
    return p if p.is_absolute() else Path(settings.base_dir) / p
