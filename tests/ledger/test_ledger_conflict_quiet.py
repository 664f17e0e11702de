"""Optimistic-concurrency conflicts are results, not server errors (issue 13, item 18).

Under contention every writer that lost a race gets a conflict and retries. PostgreSQL logs
every error a statement raises, with the whole call, at ERROR level: hundreds of lines a
minute that bury real errors. The append function reports a conflict as a result instead; the
client still raises its typed exception. Checked against the private server's own log file.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest

from kappaflow.ledger import (
    AppendCondition,
    AppendConditionFailedError,
    ExpectedVersion,
    Ledger,
    NewEvent,
    Query,
    StreamAppend,
    WrongExpectedVersionError,
)

pytestmark = pytest.mark.integration


def _log_since(pg_server: Any, offset: int, dsn: str) -> str:
    """The server log written after `offset`, up to a marker this call logs (so every line of
    the statements before it is in the file)."""
    marker = f"kf-log-marker-{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DO $$ BEGIN RAISE LOG '{marker}'; END $$")
    deadline = time.monotonic() + 30
    while True:
        with open(pg_server.logfile, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        if marker in text:
            return text.split(marker)[0]
        assert time.monotonic() < deadline, f"the log marker never reached {pg_server.logfile}"
        time.sleep(0.05)


@pytest.mark.parametrize("group_commit", [True, False], ids=["group_commit", "sync"])
def test_conflicts_leave_no_error_in_the_server_log(pg_server: Any, ledger_dsn: str, group_commit: bool) -> None:
    with Ledger(ledger_dsn, group_commit=group_commit) as ledger:
        ledger.append("acct-a", [NewEvent("Opened", {}, tags=["owner:ann"])])
        ledger.append("acct-b", [NewEvent("Opened", {}), NewEvent("Deposited", {"amount": 5})],
                      idempotency_key="open-b")
        offset = pg_server.logfile.stat().st_size

        # an idempotent retry (its streams moved: found through the conflict) returns the first result
        again = ledger.append("acct-b", [NewEvent("Opened", {}), NewEvent("Deposited", {"amount": 5})], 0,
                              idempotency_key="open-b")
        assert again.duplicate and again.position == 3
        with pytest.raises(WrongExpectedVersionError) as err:  # single stream, stale version
            ledger.append("acct-a", [NewEvent("Deposited", {"amount": 1})], expected_version=0)
        assert (err.value.stream_id, err.value.expected, err.value.actual) == ("acct-a", 0, 1)
        with pytest.raises(WrongExpectedVersionError):  # no_stream on an existing stream
            ledger.append("acct-b", [NewEvent("X", {})], ExpectedVersion.NO_STREAM)
        with pytest.raises(WrongExpectedVersionError):  # exists on a missing one
            ledger.append("acct-z", [NewEvent("X", {})], ExpectedVersion.STREAM_EXISTS)
        # two streams: the first (acct-a) is bumped before the second (acct-b) conflicts -> undone
        with pytest.raises(WrongExpectedVersionError) as err:
            ledger.append_many([StreamAppend("acct-a", [NewEvent("Sent", {})], 1),
                                StreamAppend("acct-b", [NewEvent("Received", {})], 1),
                                StreamAppend("acct-new", [NewEvent("Opened", {})], ExpectedVersion.NO_STREAM)])
        assert (err.value.stream_id, err.value.actual) == ("acct-b", 2)
        # a new stream created before a conflict on a later one is taken back too
        with pytest.raises(WrongExpectedVersionError):
            ledger.append_many([StreamAppend("acct-0new", [NewEvent("Opened", {})], ExpectedVersion.NO_STREAM),
                                StreamAppend("acct-b", [NewEvent("Received", {})], 7)])
        with pytest.raises(AppendConditionFailedError) as cerr:  # a tag condition
            ledger.append("acct-c", [NewEvent("Opened", {})],
                          condition=AppendCondition(Query.where(tags=["owner:ann"]), after=0))
        assert cerr.value.position == 1

        log = _log_since(pg_server, offset, ledger_dsn)
        assert "ERROR" not in log, f"conflicts were logged as server errors:\n{log[-3000:]}"

        # nothing of the failed appends was written; the ledger goes on where it was
        assert (ledger.stream_version("acct-a"), ledger.stream_version("acct-b")) == (1, 2)
        assert ledger.stream_version("acct-new") == ledger.stream_version("acct-0new") == 0
        assert ledger.stream_version("acct-c") == 0
        assert ledger.head().position == 3
        assert ledger.append("acct-a", [NewEvent("Deposited", {"amount": 1})], expected_version=1).position == 4
        assert ledger.verify().ok


def test_a_conflict_inside_the_callers_transaction_leaves_it_usable(pg_server: Any, ledger_dsn: str) -> None:
    """With `connection=`, the append runs in the caller's transaction; a conflict no longer aborts
    it (the append took back its own writes), so the caller decides what to commit."""
    with Ledger(ledger_dsn) as ledger:
        ledger.append("acct-a", [NewEvent("Opened", {})])
        offset = pg_server.logfile.stat().st_size
        with psycopg.connect(ledger_dsn) as conn:
            with pytest.raises(WrongExpectedVersionError):
                ledger.append_many([StreamAppend("acct-new", [NewEvent("Opened", {})], ExpectedVersion.NO_STREAM),
                                    StreamAppend("acct-x", [NewEvent("Opened", {})], 3)], connection=conn)
            assert conn.execute("select 1").fetchone() == (1,)  # not an aborted transaction
            r = ledger.append("acct-a", [NewEvent("Deposited", {})], expected_version=1, connection=conn)
            conn.commit()
        assert r.position == 2
        assert ledger.stream_version("acct-new") == 0 and ledger.stream_version("acct-a") == 2
        assert "ERROR" not in _log_since(pg_server, offset, ledger_dsn)
        assert ledger.verify().ok
