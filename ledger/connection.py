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

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if self._closed:
            raise LedgerUnavailableError("the ledger is closed")
        self._slots.acquire()
        conn: psycopg.Connection | None = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                conn = self._open()
            yield conn
        except BaseException:
            if conn is not None and not conn.closed and (
                    conn.broken or conn.info.transaction_status != TransactionStatus.IDLE):
                conn.close()
            raise
        finally:
            if conn is not None:
                if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE \
                        and not self._closed:
                    with self._lock:
                        self._idle.append(conn)
                elif not conn.closed:
                    conn.close()
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
