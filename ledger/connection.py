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
        # A plain lock on the fast path (an idle connection is there, or one may be opened);
        # the condition only when all `max_size` connections are out. (A Semaphore is Python
        # code on every acquire and release: measurable next to a ~100 us append.)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._out = 0  # connections handed out (or being opened)
        self._waiting = 0
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
        with self._lock:
            while True:
                if self._closed:
                    raise LedgerUnavailableError("the ledger is closed")
                if self._idle or self._out < self._max:
                    break
                self._waiting += 1
                try:
                    self._freed.wait()
                finally:
                    self._waiting -= 1
            self._out += 1
            conn = self._idle.pop() if self._idle else None
        if conn is not None and not conn.closed:
            return conn
        try:
            return self._open()
        except BaseException:
            self._give_back(None)
            raise

    def release(self, conn: psycopg.Connection) -> None:
        """Back to the pool if it is healthy and idle (no open transaction), else closed."""
        keep = False
        try:
            if not conn.closed:
                keep = conn.pgconn.transaction_status == TransactionStatus.IDLE and not self._closed \
                    and not conn.broken
                if not keep:
                    conn.close()
        finally:
            self._give_back(conn if keep else None)

    def _give_back(self, conn: psycopg.Connection | None) -> None:
        with self._lock:
            self._out -= 1
            if conn is not None:
                self._idle.append(conn)
            if self._waiting:
                self._freed.notify()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        conn = self.acquire()
        try:
            yield conn
        finally:
            self.release(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._freed.notify_all()
        for conn in idle:
            conn.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
