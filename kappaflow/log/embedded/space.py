"""Giving disk space back after compaction (embedded log topic files).

Why this is needed: SQLite never shrinks a file by itself. Deleting rows moves their pages
to the file's free list, where later inserts reuse them, so a compacted topic file keeps
the size of its largest past. Two ways out, and when each is used:

* **incremental auto-vacuum** (``PRAGMA auto_vacuum=INCREMENTAL``, set on every topic file
  the log creates): ``PRAGMA incremental_vacuum(N)`` moves up to N pages from the end of the
  file into free slots and truncates the end. It runs in short steps (one small
  transaction each, the appends' lock taken per step), so the writer can do it in the
  background after every compaction;
* **a full VACUUM**: the only way to switch a file created without auto-vacuum (older logs)
  to incremental mode. It rewrites the whole file in one transaction, so appends to that
  topic wait for it: it runs only when asked for explicitly (``kappaflow log compact``).

In WAL mode a step's truncation reaches the database file when a checkpoint has copied
every frame back, so each pass ends with a passive checkpoint (never waits for readers).
The WAL itself is capped at ``journal_size_limit`` once checkpointed.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["AUTO_VACUUM_INCREMENTAL", "Pacer", "Stopped", "auto_vacuum", "checkpoint", "file_bytes", "free_pages",
           "reclaim", "vacuum_full"]

AUTO_VACUUM_INCREMENTAL = 2
_STEP_PAGES = 256  # pages moved per vacuum transaction (4 MiB with 16 KiB pages)


def file_bytes(path: Path) -> int:
    """Bytes a SQLite file occupies on disk: the database plus its WAL."""
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.path.getsize(f"{path}{suffix}")
        except FileNotFoundError:
            pass
    return total


def auto_vacuum(conn: sqlite3.Connection) -> int:
    """The file's auto-vacuum mode: 0 none, 1 full, 2 incremental."""
    return int(conn.execute("PRAGMA auto_vacuum").fetchone()[0])


def free_pages(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA freelist_count").fetchone()[0])


class Stopped(Exception):
    """Raised by :meth:`Pacer.step` once the log is closing: the work stops between two units."""


class Pacer:
    """Keeps background work to a share of wall time, so it never starves the writer's appends.

    Call :meth:`step` after each unit of work: it sleeps long enough that the work done
    since the previous call is at most ``share`` of the elapsed time. ``share=1`` never sleeps.
    ``stop`` (an Event, set when the log closes) makes the next step raise :class:`Stopped`,
    so closing a writer never waits for a whole compaction (every unit is its own transaction).
    """

    def __init__(self, share: float = 1.0, stop: threading.Event | None = None) -> None:
        self.share = share
        self.stop = stop
        self._mark = time.monotonic()

    def step(self) -> None:
        now = time.monotonic()
        worked = now - self._mark
        if self.share < 1.0 and worked > 0:
            pause = worked * (1.0 - self.share) / self.share
            if self.stop is not None:
                self.stop.wait(pause)
            else:
                time.sleep(pause)
        if self.stop is not None and self.stop.is_set():
            raise Stopped
        self._mark = time.monotonic()


def reclaim(conn: sqlite3.Connection, lock: threading.Lock, pace: Callable[[], None] | None = None,
            step_pages: int = _STEP_PAGES) -> int:
    """Free pages back to the file system, a small transaction at a time; returns the pages freed.

    ``conn`` is the writer's connection of an incremental auto-vacuum file and ``lock`` the
    lock that serialises its use (appends take it too, so they run between steps).
    """
    freed = 0
    while True:
        with lock:
            if auto_vacuum(conn) != AUTO_VACUUM_INCREMENTAL:
                return freed
            before = free_pages(conn)
            if before == 0:
                break
            conn.execute(f"PRAGMA incremental_vacuum({int(step_pages)})").fetchall()
            after = free_pages(conn)
        freed += before - after
        if after >= before:  # nothing moved (another connection holds a snapshot?): try later
            break
        if pace is not None:
            pace()
    with lock:
        checkpoint(conn)
    return freed


def vacuum_full(conn: sqlite3.Connection, lock: threading.Lock) -> None:
    """Rewrite the file compactly and switch it to incremental auto-vacuum (blocks ``lock`` meanwhile)."""
    with lock:
        conn.execute(f"PRAGMA auto_vacuum={AUTO_VACUUM_INCREMENTAL}")
        conn.execute("VACUUM")
        checkpoint(conn)


def checkpoint(conn: sqlite3.Connection) -> None:
    """Copy the WAL back and truncate both files where no reader needs the old pages.

    ``TRUNCATE`` waits for readers through the busy handler; with the handler off for this
    call it never does: when a reader is still on an older snapshot, the WAL is left as it
    is (it is reset on a later write and capped at ``journal_size_limit``).
    """
    timeout = conn.execute("PRAGMA busy_timeout").fetchone()[0]
    conn.execute("PRAGMA busy_timeout=0")
    try:
        busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    except sqlite3.OperationalError:  # SQLITE_BUSY: another connection is mid-checkpoint
        pass
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(timeout)}")
