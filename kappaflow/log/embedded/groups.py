"""Consumer groups of the embedded log: committed offsets in groups.db (any process may commit)."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping

from kappaflow.log.base import TopicPartition, check_commit_offset, check_group, split_commit_key
from kappaflow.log.embedded.files import _now_ms
from kappaflow.log.embedded.topics import EmbeddedTopics

__all__ = ["EmbeddedGroups"]


class EmbeddedGroups(EmbeddedTopics):
    """Commit and read consumer group offsets (groups.db, apart from the topic files)."""

    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        self._check_open()
        check_group(group)
        rows = []
        now = _now_ms()
        for tp, nxt in offsets.items():
            topic, partition = split_commit_key(tp)
            t = self._topic(topic)
            self._check_partition(t, partition)
            check_commit_offset(topic, partition, nxt)
            rows.append((group, topic, t.id, partition, nxt, now))
        if not rows:
            return
        with self._groups_lock:
            conn = self._groups_conn()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.executemany(
                        "INSERT INTO offsets VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (grp, topic, partition) "
                        "DO UPDATE SET topic_id = excluded.topic_id, next_offset = excluded.next_offset, "
                        "committed_ms = excluded.committed_ms", rows)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "groups.db") from None

    def committed(self, group: str, topic: str) -> dict[int, int]:
        t = self._topic(topic)
        with self._groups_lock:
            try:
                rows = self._groups_conn().execute(
                    "SELECT partition, next_offset FROM offsets WHERE grp = ? AND topic = ? AND topic_id = ?",
                    (group, topic, t.id)).fetchall()
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "groups.db") from None
        return dict(sorted(rows))
