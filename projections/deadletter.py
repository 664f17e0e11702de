"""Dead letters: records a projection could not process, with their position and the reason.

Nothing is dropped silently: a record that cannot be folded (malformed value, an
``apply()`` that raises, a row that does not fit the view schema) goes to the topic
``kf.dead_letter.projection.<projection>`` (the naming scheme of every component's dead letters:
``kappaflow/deadletters.py``; dead letters written under the old name ``kf.deadletter.<projection>``
are still read) and the rest of the batch proceeds. Each dead letter is a
JSON object ``{"projection", "topic", "partition", "offset", "key" (base64 or null),
"reason", "ts_ms"}`` keyed by ``topic:partition:offset``, so re-processing the same batch
after a crash overwrites rather than duplicates once the topic is compacted. A row a sink
refused (``WriteResult.rejected``, e.g. a document the search mapping rejects) also names
the ``sink``, the view ``row_key`` and the row's ``version``, and is keyed by
``topic:partition:offset:sink:row_key`` (one record may be refused by one sink only).

Where: on Kafka, the same cluster as the log. The embedded log has exactly one writer
(the capture process), so for it dead letters go to a sibling embedded log
``<log dir>.deadletters`` that projections open briefly to append.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from kappaflow.deadletters import dead_letter_topic as _topic
from kappaflow.deadletters import legacy_dead_letter_topics
from kappaflow.errors import LogUnavailableError
from kappaflow.log.base import CleanupPolicy, Record, TopicConfig


def dead_letter_topic(projection: str) -> str:
    """Where a projection's dead letters are written."""
    return _topic("projection", projection)


def dead_letter_topics(projection: str) -> tuple[str, ...]:
    """Every topic that may hold a projection's dead letters: the current one, then older names."""
    return (dead_letter_topic(projection), *legacy_dead_letter_topics("projection", projection))


def dead_letter_log_url(log_url: str) -> str:
    if log_url.startswith("kafka://"):
        return log_url
    path = Path(log_url.removeprefix("file:"))
    return str(path.with_name(path.name + ".deadletters"))


def _open_writer(log_url: str, client_options: Mapping[str, Any], timeout_s: float = 30.0) -> Any:
    from kappaflow.log import open_log

    url = dead_letter_log_url(log_url)
    if url.startswith("kafka://"):
        return open_log(url, **dict(client_options))
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            return open_log(url)
        except LogUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)  # another projection is appending its dead letters right now
            delay = min(delay * 2, 0.5)


def write_dead_letters(
    log_url: str, client_options: Mapping[str, Any], projection: str, rows: Sequence[Mapping[str, Any]]
) -> int:
    """Append dead letters (dicts with topic, partition, offset, key, reason; for rows a sink
    refused also sink, row_key, version; ``extra``: more fields a fold reports, e.g. a late
    event's ``event_time``, ``watermark``, ``window_start``/``window_end``)."""
    if not rows:
        return 0
    now = int(time.time() * 1000)
    records = []
    for r in rows:
        key = r.get("key")
        value = {
            "projection": projection,
            "topic": r.get("topic"),
            "partition": r.get("partition"),
            "offset": r.get("offset"),
            "key": base64.b64encode(key).decode() if isinstance(key, bytes) else key,
            "reason": r.get("reason"),
            "ts_ms": now,
        }
        if r.get("extra"):  # a fold's details (a late event: its event time, the watermark, the window)
            value.update({k: v for k, v in r["extra"].items() if k not in value})
        rk_text = f"{r.get('topic')}:{r.get('partition')}:{r.get('offset')}"
        if r.get("sink"):
            value.update(sink=r["sink"], row_key=r.get("row_key"), version=r.get("version"))
            rk_text += f":{r['sink']}:{r.get('row_key')}"
        rk = rk_text.encode()
        records.append(Record(rk, orjson.dumps(value)))
    log = _open_writer(log_url, client_options)
    try:
        topic = dead_letter_topic(projection)
        log.create_topic(topic, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT), exist_ok=True)
        log.append(topic, records)
    finally:
        log.close()
    return len(records)


def read_dead_letters(log_url: str, client_options: Mapping[str, Any] | None, projection: str) -> list[dict[str, Any]]:
    """All dead letters of a projection (latest per position), oldest first."""
    from kappaflow.errors import UnknownTopicError
    from kappaflow.projections.datasource import open_reader

    url = dead_letter_log_url(log_url)
    try:
        log = open_reader(url, client_options)
    except LogUnavailableError:
        return []
    try:
        out: dict[bytes | None, dict[str, Any]] = {}
        for topic in reversed(dead_letter_topics(projection)):  # the current name last: it wins
            try:
                n = log.partitions(topic)
            except UnknownTopicError:
                continue
            for p in range(n):
                for rec in log.iter_partition(topic, p):
                    if rec.value is not None:
                        out[rec.key] = orjson.loads(rec.value)
        return sorted(out.values(), key=lambda d: (d["topic"] or "", d["partition"] or 0, d["offset"] or 0))
    finally:
        log.close()


__all__ = ["dead_letter_log_url", "dead_letter_topic", "dead_letter_topics", "read_dead_letters", "write_dead_letters"]
