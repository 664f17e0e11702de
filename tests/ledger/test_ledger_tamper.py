"""Immutability is enforced by the database; tampering with superuser rights is detected by
verify, which names the first bad position (API and CLI)."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from typer.testing import CliRunner

from kappaflow.cli.ledger import app as ledger_cli
from kappaflow.ledger import ImmutableLedgerError, Ledger, NewEvent, StreamAppend
from kappaflow.ledger.hashing import GENESIS_HASH, event_hash

pytestmark = pytest.mark.integration

E = '"kappaflow_ledger".events'


def fill(ledger: Ledger, n_appends: int = 6) -> None:
    for i in range(n_appends):
        ledger.append_many([StreamAppend(f"acct-{i % 3}", [NewEvent("Debited", {"amount": i, "note": "é✓"})]),
                            StreamAppend(f"acct-{(i + 1) % 3}", [NewEvent("Credited", {"amount": i})])],
                           idempotency_key=f"t-{i}" if i % 2 else None, metadata={"by": "test"})


def superuser(dsn: str, *statements: str) -> None:
    """Run statements with the immutability triggers switched off (as a superuser could)."""
    with psycopg.connect(dsn, autocommit=False) as conn:
        conn.execute("set session_replication_role = replica")  # disables ordinary triggers
        for s in statements:
            conn.execute(s)
        conn.commit()


def test_update_delete_truncate_are_rejected_by_the_database(ledger: Ledger, ledger_dsn: str) -> None:
    fill(ledger, 2)
    for stmt in (f"update {E} set payload = '{{}}' where position = 1", f"delete from {E} where position = 2",
                 f"truncate {E}"):
        with psycopg.connect(ledger_dsn) as conn, pytest.raises(psycopg.Error) as err:
            conn.execute(stmt)
        assert err.value.sqlstate == "KL010"
        assert "immutable" in str(err.value)
    with pytest.raises(ImmutableLedgerError, match=r"UPDATE on kappaflow_ledger\.events"), \
            ledger.connection() as conn:
        conn.execute(f"update {E} set event_type = 'x'")
    assert ledger.verify().ok


def test_python_reference_hash_matches_the_database(ledger: Ledger, ledger_dsn: str) -> None:
    fill(ledger, 3)
    # tagged events (ledger_0002): the tags extend the content digest; odd characters included
    ledger.append("acct-9", [NewEvent("Tagged", {"x": 1}, tags=["b:2", "a:1", 'note:a "q" ,{x}\\ é']),
                             NewEvent("Untagged", {"x": 2})])
    with psycopg.connect(ledger_dsn) as conn:
        rows = conn.execute(
            f"select position, stream_version, (extract(epoch from recorded_at) * 1000000)::bigint, stream_id, "
            f"stream_type, event_type, schema_version, payload::text, metadata::text, idempotency_key, "
            f"prev_hash, hash, tags from {E} order by position").fetchall()
    assert rows[-2][12] == ["a:1", "b:2", 'note:a "q" ,{x}\\ é'] and rows[-1][12] is None  # sorted as stored
    prev = GENESIS_HASH
    for r in rows:
        assert bytes(r[10]) == prev
        prev = event_hash(prev, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[12])
        assert prev == bytes(r[11]), f"position {r[0]}"
    assert ledger.verify().ok


def test_altered_tags_are_detected(ledger: Ledger, ledger_dsn: str) -> None:
    ledger.append("acct-1", [NewEvent("Enrolled", {}, tags=["course:7"])])
    ledger.append("acct-2", [NewEvent("Enrolled", {}, tags=["course:8"])])
    superuser(ledger_dsn, f"update {E} set tags = '{{course:9}}' where position = 2")
    report = ledger.verify()
    assert (report.ok, report.first_bad_position) == (False, 2)
    assert "does not match its hash" in (report.reason or "")


def forge_next() -> list[str]:
    """An extra event whose hash and prev_hash are recomputed correctly (chain intact)."""
    prev = FORGE["prev"]
    h = event_hash(prev, 13, 5, 0, "acct-0", "acct", "Credited", 1, '{"amount": 1000}', "{}", None)
    return [f"insert into {E} values (13, 'acct-0', 'acct', 5, 'Credited', 1, '{{\"amount\": 1000}}', '{{}}', "
            f"null, to_timestamp(0), '\\x{prev.hex()}', '\\x{h.hex()}')"]


FORGE: dict[str, bytes] = {}

TAMPERS: dict[str, tuple[Callable[[], list[str]], int, str]] = {
    "edit payload": (lambda: [f"update {E} set payload = '{{\"amount\": 1000}}' where position = 5"], 5,
                     "does not match its hash"),
    "edit metadata": (lambda: [f"update {E} set metadata = '{{}}' where position = 7"], 7, "does not match"),
    "edit recorded_at": (lambda: [f"update {E} set recorded_at = recorded_at + interval '1 s' where position = 2"],
                         2, "does not match"),
    "edit idempotency key": (lambda: [f"update {E} set idempotency_key = 'x' where position = 3"], 3,
                             "does not match"),
    "delete middle row": (lambda: [f"delete from {E} where position = 6"], 6, "position 6 is missing"),
    "delete first row": (lambda: [f"delete from {E} where position = 1"], 1, "position 1 is missing"),
    "delete last row": (lambda: [f"delete from {E} where position = 12"], 12, "removed from the end"),
    "insert a copied row at the end": (lambda: [
        f"insert into {E} select position + 1, stream_id, stream_type, stream_version + 1, event_type, "
        f"schema_version, payload, metadata, idempotency_key, recorded_at, hash, hash from {E} "
        "where position = 12"], 13, "does not match its hash"),
    "insert a forged self-consistent row at the end": (forge_next, 13, "events were inserted"),
    "reorder two rows": (lambda: [
        f"update {E} set position = position + 1000 where position in (4, 5)",
        f"update {E} set position = 1009 - position where position in (1004, 1005)"], 4, "does not match"),
    "replace a row with a self-consistent forged hash": (lambda: [
        f"update {E} set payload = '{{\"amount\": 1}}', hash = sha256(hash) where position = 8"], 8, ""),
}


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampering_is_detected_and_named(ledger: Ledger, ledger_dsn: str, name: str) -> None:
    fill(ledger)
    assert ledger.head().position == 12
    assert ledger.verify().ok
    statements, position, reason = TAMPERS[name]
    FORGE["prev"] = ledger.head().hash
    superuser(ledger_dsn, *statements())
    report = ledger.verify(chunk=4)  # small chunks: exercise the chunk borders
    assert not report.ok
    assert report.first_bad_position == position, report
    assert reason in (report.reason or "")

    result = CliRunner().invoke(ledger_cli, ["verify", "--dsn", ledger_dsn])
    assert result.exit_code == 1, result.output
    assert f"FAILED at position {position}" in result.output


def test_external_anchor_catches_a_rewritten_suffix(ledger: Ledger, ledger_dsn: str) -> None:
    fill(ledger, 2)
    anchor = (4, ledger.head().hash)  # e.g. published elsewhere from `kappaflow ledger stats`
    # A forger rewrites the last event and recomputes its hash and the head consistently.
    with psycopg.connect(ledger_dsn) as conn:
        r = conn.execute(
            f"select position, stream_version, (extract(epoch from recorded_at) * 1000000)::bigint, stream_id, "
            f"stream_type, event_type, schema_version, metadata::text, idempotency_key, prev_hash from {E} "
            "where position = 4").fetchone()
    assert r is not None
    forged = event_hash(bytes(r[9]), r[0], r[1], r[2], r[3], r[4], r[5], r[6], '{"amount": 666}', r[7], r[8])
    superuser(ledger_dsn, f"update {E} set payload = '{{\"amount\": 666}}', hash = '\\x{forged.hex()}' "
                          "where position = 4")
    assert ledger.verify().ok  # undetectable from inside the database alone
    report = ledger.verify(anchors=[anchor])
    assert not report.ok and report.first_bad_position == 4 and "anchor" in (report.reason or "")
    result = CliRunner().invoke(ledger_cli, ["verify", "--dsn", ledger_dsn, "--anchor", f"4:{anchor[1].hex()}"])
    assert result.exit_code == 1 and "FAILED at position 4" in result.output


def test_tail_reader_stops_at_a_hole_and_names_it(ledger: Ledger, ledger_dsn: str) -> None:
    from kappaflow.ledger import CorruptLedgerError, TailReader

    fill(ledger, 3)  # positions 1..6
    superuser(ledger_dsn, f"delete from {E} where position = 3")
    reader = TailReader(ledger, hole_timeout=0.2)
    assert [e.position for e in reader.poll()] == [1, 2]
    with pytest.raises(CorruptLedgerError) as err:
        reader.poll(timeout=5)
    assert err.value.position == 3 and "position 3 is missing" in str(err.value)
    assert reader.next_position == 3  # never moved past the hole
