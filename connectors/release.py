"""What a removed source leaves on its server, and letting it go (`kappaflow source remove`).

Why: an inactive logical replication slot retains WAL without limit; a source removed from the
configuration without dropping its slot fills the database server's disk. PostgreSQL sources
(and the ledger, captured the same way) own a slot and, unless configured explicitly, a
publication; MySQL keeps no per-reader state (the server purges binlogs by its own expiry); a
Debezium source's slot belongs to the Kafka Connect connector, not to kappaflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["RELEASERS", "RELEASE_WAIT_S", "release_source"]

RELEASE_WAIT_S = 5.0  # how long an active slot may take to become free before remove refuses


def _release_postgres(src: Any, others: Iterable[Any], keep: bool) -> list[str]:
    from kappaflow.connectors.postgres import slots

    slot, pub = src.slot_name, src.publication_name
    if keep:
        return [f"replication slot {slot!r} and publication {pub!r} kept (--keep-slot): the slot retains WAL "
                f"until it is dropped: SELECT pg_drop_replication_slot('{slot}')"]
    conn = slots.connect(src.connect_dsn(), what=f"dropping the replication slot of source {src.name!r}")
    out: list[str] = []
    try:
        # A capture that just stopped leaves its slot active for a moment while its walsender exits;
        # a running one holds it for good, and drop_slot then says to stop it first.
        deadline = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < deadline and conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)).fetchone():
            time.sleep(0.1)
        out.append(f"replication slot {slot!r} " + ("dropped" if slots.drop_slot(conn, slot) else "did not exist"))
        shared = [o.name for o in others if getattr(o, "publication_name", None) == pub]
        if src.publication is not None:
            out.append(f"publication {pub!r} kept: it is configured explicitly (it may be shared); drop it with "
                       f"DROP PUBLICATION {pub} when nothing uses it")
        elif shared:
            out.append(f"publication {pub!r} kept: source(s) {', '.join(shared)} use it too")
        else:
            existed = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()
            slots.drop_publication(conn, pub)
            out.append(f"publication {pub!r} " + ("dropped" if existed else "did not exist"))
    finally:
        conn.close()
    return out


def _release_mysql(src: Any, others: Iterable[Any], keep: bool) -> list[str]:
    return ["nothing to drop on the MySQL/MariaDB server: a binlog reader keeps no state there "
            "(binlogs are purged by the server's own expiry)"]


def _release_debezium(src: Any, others: Iterable[Any], keep: bool) -> list[str]:
    return ["nothing dropped: the Debezium connector (and its replication slot) belongs to Kafka Connect; "
            "delete it there if it is no longer needed"]


# Source kind -> what removing such a source lets go on its server.
RELEASERS: dict[str, Callable[[Any, Iterable[Any], bool], list[str]]] = {
    "postgres": _release_postgres,
    "ledger": _release_postgres,
    "mysql": _release_mysql,
    "debezium": _release_debezium,
}


def release_source(src: Any, others: Iterable[Any] = (), *, keep_slot: bool = False) -> list[str]:
    """Drop what ``src`` holds on its server (unless ``keep_slot``); one line per thing, for the user.

    ``others``: the remaining sources (a publication one of them uses is kept). Raises SourceError
    when the server cannot be reached or the slot is in use (a capture is running).
    """
    return RELEASERS[src.kind](src, others, keep_slot)
