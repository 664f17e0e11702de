"""The peer in `bench/ledger.py`: the `eventsourcing` library (9.5, PostgreSQL recorder) on the
same server, for the read-all comparison (a bench-only dependency: ``pip install -e '.[bench]'``).

`peer_read_all` stores `n` events of an aggregate with the library's own application and mapper
(JSON transcoder, no cipher, no compression), then times reading them all in global
(notification) order and mapping each to its typed domain event, in pages of `page` -- the
library's own read path (``recorder.select_notifications`` + ``mapper.to_domain_event``), what
a projection processing the application's events does.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlparse


def _env(dsn: str, schema: str) -> dict[str, str]:
    u = urlparse(dsn)
    return {
        "PERSISTENCE_MODULE": "eventsourcing.postgres",
        "POSTGRES_DBNAME": u.path.lstrip("/") or "postgres",
        "POSTGRES_HOST": u.hostname or "127.0.0.1",
        "POSTGRES_PORT": str(u.port or 5432),
        "POSTGRES_USER": u.username or "postgres",
        "POSTGRES_PASSWORD": u.password or "",
        "POSTGRES_SCHEMA": schema,
        "CREATE_TABLE": "y",
    }


try:
    from eventsourcing.application import Application
    from eventsourcing.domain import Aggregate, event
except ImportError:  # pragma: no cover - the bench says what to install
    Application = Aggregate = None  # type: ignore[assignment,misc]

if Aggregate is not None:
    class Account(Aggregate):  # type: ignore[misc,valid-type]
        def __init__(self, owner: str) -> None:
            self.owner = owner
            self.balance = 0

        @event("Deposited")
        def deposit(self, amount: int, reference: str) -> None:
            self.balance += amount

    class Bank(Application):  # type: ignore[misc,valid-type,type-arg]
        pass


def peer_read_all(dsn: str, n: int, *, page: int = 5000, batch: int = 1000) -> dict[str, Any]:
    if Aggregate is None:
        raise SystemExit("the peer needs the eventsourcing library: pip install -e '.[bench]'")
    import psycopg

    schema = "peer_es"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"drop schema if exists {schema} cascade")
        conn.execute(f"create schema {schema}")
    app = Bank(env=_env(dsn, schema))
    try:
        written = 0
        while written < n:  # one aggregate per batch: one save = one transaction of `batch` events
            acc = Account(owner=f"o{written}")
            for i in range(batch - 1):
                acc.deposit(amount=i % 1000 + 1, reference=f"r-{written + i}")
            app.save(acc)
            written += batch
        recorder, mapper = app.recorder, app.mapper
        recorder.select_notifications(1, 10)  # warm: connection, prepared statement
        best = 0.0
        for _ in range(2):  # best of two passes, as the ledger's figure
            t0 = time.perf_counter()
            count, start = 0, 1
            last: Any = None
            while True:
                notes = recorder.select_notifications(start, page)
                for note in notes:
                    last = mapper.to_domain_event(note)
                count += len(notes)
                if len(notes) < page:
                    break
                start = notes[-1].id + 1
            best = max(best, count / (time.perf_counter() - t0))
            assert count == written and last is not None and last.originator_version >= 1
        return {"events": written, "events_per_s": best}
    finally:
        app.close()
