"""A small thread-safe pool of autocommit psycopg connections.

psycopg_pool is not a dependency; the ledger needs only "borrow an idle connection or
open one, drop broken ones", which is a few lines. Each append is a single autocommit
statement, so a borrowed connection never carries a transaction back into the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import set_json_loads

from kappaflow.ledger.errors import LedgerUnavailableError


def configure_connection(conn: psycopg.Connection) -> None:
    set_json_loads(orjson.loads, conn)


class ConnectionPool:
    def __init__(self, dsn: str, *, max_size: int = 8, connect_timeout: float = 10.0,
                 configure: Callable[[psycopg.Connection], None] = configure_connection) -> None:
        self._dsn = dsn
        self._max = max(1, max_size)
        self._timeout = connect_timeout
        self._configure = configure
        self._idle: list[psycopg.Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self._max)
        self._closed = False

    def _open(self) -> psycopg.Connection:
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=max(1, int(self._timeout)),
                                   application_name="kappaflow-ledger")
        except psycopg.OperationalError as exc:
            raise LedgerUnavailableError(f"cannot connect to the ledger database: {_first_line(exc)}") from None
        self._configure(conn)
        return conn

    def acquire(self) -> psycopg.Connection:
        """An idle connection (or a new one); hand it back with `release`."""
        if self._closed:
            raise LedgerUnavailableError("the ledger is closed")
        self._slots.acquire()
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                conn = self._open()
        except BaseException:
            self._slots.release()
            raise
        return conn

    def release(self, conn: psycopg.Connection) -> None:
        """Back to the pool if it is healthy and idle (no open transaction), else closed."""
        try:
            if not conn.closed:
                if conn.info.transaction_status == TransactionStatus.IDLE and not self._closed \
                        and not conn.broken:
                    with self._lock:
                        self._idle.append(conn)
                else:
                    conn.close()
        finally:
            self._slots.release()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        conn = self.acquire()
        try:
            yield conn
        finally:
            self.release(conn)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
