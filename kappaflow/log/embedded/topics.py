"""Topics of the embedded log: the registry in meta.db, topic files and their connections."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import uuid
from pathlib import Path

from kappaflow.errors import ConfigError, CorruptLogError, UnknownTopicError
from kappaflow.log.base import CleanupPolicy, TopicConfig, check_partition, validate_topic_name
from kappaflow.log.embedded.files import _FILE_FORMAT, _PAGE_SIZE, EmbeddedFiles, _now_ms, _Topic

__all__ = ["EmbeddedTopics"]


def _config_row(config: TopicConfig) -> tuple[int, str, int, int]:
    return (config.partitions, config.cleanup_policy.value, config.delete_retention_ms,
            config.max_record_bytes)


class EmbeddedTopics(EmbeddedFiles):
    """Create, delete and list topics; open each topic file (the writer checks its end offsets)."""

    def _topic_path(self, name: str, tid: str) -> Path:
        return self._path / "topics" / f"{name}.{tid}.db"

    def _load_topics(self) -> None:
        with self._meta_lock:
            try:
                version = self._meta.execute("PRAGMA data_version").fetchone()[0]
                if version == self._meta_version:
                    return
                rows = self._meta.execute(
                    "SELECT name, id, partitions, cleanup_policy, delete_retention_ms, max_record_bytes "
                    "FROM topics"
                ).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):  # a writer is creating the log right now
                    rows, version = [], -1
                else:
                    raise self._db_error(exc, self._path / "meta.db") from None
            except sqlite3.DatabaseError as exc:
                raise self._db_error(exc, self._path / "meta.db") from None
            seen = {}
            for name, tid, parts, policy, retention, max_bytes in rows:
                old = self._topics.get(name)
                if old is not None and old.id == tid:
                    seen[name] = old
                    continue
                config = TopicConfig(partitions=parts, cleanup_policy=CleanupPolicy(policy),
                                     delete_retention_ms=retention, max_record_bytes=max_bytes)
                seen[name] = _Topic(name, tid, config, self._topic_path(name, tid))
            # Topics that went away are dropped, not closed: another thread may be reading from
            # them right now; their connections close when the last reference goes.
            self._topics = seen
            self._meta_version = version

    def _topic(self, name: str) -> _Topic:
        self._check_open()
        if self._read_only:
            self._load_topics()
        t = self._topics.get(name)
        if t is None:
            raise UnknownTopicError(name)
        return t

    def _remove_orphans(self) -> None:
        """Delete topic files no topic refers to (left by a crash inside create/delete_topic)."""
        wanted = {t.path.name for t in self._topics.values()}
        for f in (self._path / "topics").iterdir():
            base = f.name
            for suffix in ("-wal", "-shm", "-journal"):
                base = base.removesuffix(suffix)
            if base not in wanted:
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()

    def create_topic(self, name: str, config: TopicConfig | None = None, *, exist_ok: bool = True) -> TopicConfig:
        self._require_writer("create_topic")
        validate_topic_name(name)
        if config is not None and not isinstance(config, TopicConfig):
            raise ConfigError(f"topic {name!r} config: expected a TopicConfig, got {type(config).__name__}")
        with self._meta_lock:
            existing = self._topics.get(name)
            if existing is not None:
                if not exist_ok:
                    raise ConfigError(f"topic {name!r} already exists")
                if config is not None and config != existing.config:
                    raise ConfigError(
                        f"topic {name!r} already exists with a different config: "
                        f"existing {existing.config}, requested {config}"
                    )
                return existing.config
            config = config or TopicConfig()
            tid = uuid.uuid4().hex[:12]
            path = self._topic_path(name, tid)
            conn = self._connect(path, create=True, writer=True, page_size=_PAGE_SIZE)
            try:
                tables = "".join(
                    f"CREATE TABLE p{p}(base INTEGER PRIMARY KEY, last INTEGER NOT NULL, n INTEGER NOT NULL, "
                    "idx BLOB NOT NULL, data BLOB NOT NULL, crc INTEGER NOT NULL);"
                    for p in range(config.partitions)
                )
                conn.executescript(
                    "BEGIN;"
                    "CREATE TABLE topic(name TEXT NOT NULL, id TEXT NOT NULL, partitions INTEGER NOT NULL, "
                    "cleanup_policy TEXT NOT NULL, delete_retention_ms INTEGER NOT NULL, "
                    "max_record_bytes INTEGER NOT NULL);"
                    "CREATE TABLE ends(partition INTEGER PRIMARY KEY, end_offset INTEGER NOT NULL);"
                    "CREATE TABLE tombstones(partition INTEGER NOT NULL, offset INTEGER NOT NULL, "
                    "seen_ms INTEGER NOT NULL, PRIMARY KEY (partition, offset)) WITHOUT ROWID;"
                    + tables
                    + f"PRAGMA user_version={_FILE_FORMAT};"
                )
                conn.execute("INSERT INTO topic VALUES (?, ?, ?, ?, ?, ?)", (name, tid, *_config_row(config)))
                conn.executemany("INSERT INTO ends VALUES (?, 0)", [(p,) for p in range(config.partitions)])
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                conn.close()
                raise self._db_error(exc, path, name) from None
            conn.close()
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the new file's directory entry survives power loss too
            finally:
                os.close(dir_fd)
            try:
                self._meta.execute(
                    "INSERT INTO topics VALUES (?, ?, ?, ?, ?, ?, ?)", (name, tid, *_config_row(config), _now_ms())
                )
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "meta.db") from None
            self._topics[name] = _Topic(name, tid, config, path)
            return config

    def delete_topic(self, name: str) -> None:
        self._require_writer("delete_topic")
        t = self._topic(name)
        with t.clock, t.wlock, t.rlock, self._meta_lock:
            try:
                self._meta.execute("DELETE FROM topics WHERE name = ?", (name,))
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "meta.db") from None
            del self._topics[name]
            t.close()
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{t.path}{suffix}")
        with self._groups_lock:
            try:
                self._groups_conn().execute("DELETE FROM offsets WHERE topic = ?", (name,))
            except sqlite3.Error as exc:
                raise self._db_error(exc, self._path / "groups.db") from None

    def list_topics(self) -> dict[str, TopicConfig]:
        self._check_open()
        if self._read_only:
            self._load_topics()
        return {name: t.config for name, t in sorted(self._topics.items())}

    def topic_config(self, name: str) -> TopicConfig:
        return self._topic(name).config

    def partitions(self, topic: str) -> int:
        return self._topic(topic).config.partitions

    # --- connections per topic ------------------------------------------------------------
    def _wconn(self, t: _Topic) -> sqlite3.Connection:
        """The writer's connection (caller holds t.wlock); loads and checks the end offsets."""
        if t.wconn is None:
            conn = self._open_topic_file(t, writer=True)
            try:
                ends = dict(conn.execute("SELECT partition, end_offset FROM ends").fetchall())
                for p in range(t.config.partitions):
                    last = conn.execute(f"SELECT max(last) FROM p{p}").fetchone()[0]
                    if p not in ends or (last is not None and last >= ends[p]):
                        raise CorruptLogError(
                            f"embedded log file is damaged: {t.path}: partition {p} end offset "
                            f"{ends.get(p)} is not past its last record {last}",
                            path=str(t.path), topic=t.name, partition=p, offset=ends.get(p))
            except sqlite3.Error as exc:
                conn.close()
                raise self._db_error(exc, t.path, t.name) from None
            except BaseException:
                conn.close()
                raise
            t.ends = [ends[p] for p in range(t.config.partitions)]
            t.wconn = conn
        return t.wconn

    def _rconn(self, t: _Topic) -> sqlite3.Connection:
        if t.rconn is None:
            t.rconn = self._open_topic_file(t, writer=False)
        return t.rconn

    def _open_topic_file(self, t: _Topic, *, writer: bool) -> sqlite3.Connection:
        if not t.path.exists():
            if self._read_only:
                self._meta_version = -1
                self._load_topics()
                if self._topics.get(t.name) is not t:
                    raise UnknownTopicError(t.name)
            raise CorruptLogError(f"embedded log file is missing: {t.path} (topic {t.name!r})",
                                  path=str(t.path), topic=t.name)
        conn = self._connect(t.path, create=False, writer=writer)
        try:
            if not writer:
                # A query_only connection cannot write the schema; the pragma only makes SQLite
                # read a file shorter than its header says (truncated) up to the missing pages,
                # so the records before the damage stay readable.
                conn.execute("PRAGMA writable_schema=ON")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as exc:
            conn.close()
            raise self._db_error(exc, t.path, t.name) from None
        if version != _FILE_FORMAT:
            conn.close()
            raise CorruptLogError(
                f"embedded log file {t.path} has format version {version}, expected {_FILE_FORMAT}",
                path=str(t.path), topic=t.name)
        return conn

    # --- validation helpers ---------------------------------------------------------------
    @staticmethod
    def _check_partition(t: _Topic, partition: object) -> int:
        return check_partition(t.name, partition, t.config.partitions)
