"""`kappaflow ledger append|read|verify|stats|install` end to end (typer runner, real database)."""

from __future__ import annotations

import orjson
import pytest
from typer.testing import CliRunner

from kappaflow.cli.ledger import app

pytestmark = pytest.mark.integration


def run(*args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), input=input)
    return result.exit_code, result.output


def test_cli_round_trip(pg_dsn: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    code, out = run("install", "--dsn", pg_dsn)
    assert code == 0 and "installed" in out
    code, out = run("append", "order-1", "Placed", '{"total": 12}', "--dsn", pg_dsn, "-e", "no_stream",
                    "-k", "req-1", "--metadata", '{"user": "ann"}')
    assert code == 0, out
    res = orjson.loads(out.splitlines()[-1])
    assert (res["position"], res["versions"], res["duplicate"]) == (1, {"order-1": 1}, False)
    code, out = run("append", "order-1", "Placed", '{"total": 12}', "--dsn", pg_dsn, "-k", "req-1",
                    "--metadata", '{"user": "ann"}')
    assert code == 0 and orjson.loads(out.splitlines()[-1])["duplicate"] is True
    code, out = run("append", "order-1", "Placed", '{"total": 12}', "--dsn", pg_dsn, "-k", "req-1")
    assert code == 2 and "idempotency_key: key 'req-1' was already used for a different append" in out
    lines = tmp_path / "events.jsonl"
    lines.write_text('{"type": "Paid", "data": {"amount": 12}}\n\n{"type": "Shipped", "data": {}}\n')
    code, out = run("append", "order-1", "--jsonl", str(lines), "--dsn", pg_dsn, "-e", "1")
    assert code == 0 and orjson.loads(out.splitlines()[-1])["versions"] == {"order-1": 3}, out

    code, out = run("read", "--dsn", pg_dsn)
    events = [orjson.loads(line) for line in out.splitlines()]
    assert [e["event_type"] for e in events] == ["Placed", "Paid", "Shipped"]
    assert events[0]["metadata"] == {"user": "ann"} and events[0]["stream_type"] == "order"
    code, out = run("read", "order-1", "--from", "3", "--dsn", pg_dsn)
    assert [orjson.loads(line)["event_type"] for line in out.splitlines()] == ["Shipped"]

    code, out = run("verify", "--dsn", pg_dsn)
    assert code == 0 and "ok: 3 events verified" in out
    code, out = run("stats", "--json", "--dsn", pg_dsn)
    st = orjson.loads(out)
    assert st["head_position"] == 3 and st["events"] == 3 and st["events_by_stream_type"] == {"order": 3}
    code, out = run("stats", "--dsn", pg_dsn)
    assert code == 0 and f"head_hash: {st['head_hash']}" in out and "events[order]: 3" in out


def test_cli_errors_are_one_clear_line(pg_dsn: str) -> None:
    run("install", "--dsn", pg_dsn)
    code, out = run("append", "order-1", "Placed", "{not json", "--dsn", pg_dsn)
    assert code == 2 and "DATA: not valid JSON" in out
    code, out = run("append", "order-1", "Placed", "{}", "-e", "-4", "--dsn", pg_dsn)
    assert code == 2 and "expected_version (stream 'order-1')" in out
    code, out = run("append", "order-1", "Placed", "[1]", "--dsn", pg_dsn)
    assert code == 2 and "events[0].data: expected a JSON object" in out
    run("append", "order-1", "Placed", "{}", "--dsn", pg_dsn)
    code, out = run("append", "order-1", "Placed", "{}", "-e", "no_stream", "--dsn", pg_dsn)
    assert code == 2 and "wrong expected version for stream 'order-1'" in out
    code, out = run("verify", "--anchor", "nonsense", "--dsn", pg_dsn)
    assert code == 2 and "POSITION:HASH_HEX" in out
    code, out = run("stats")
    assert code == 2 and "pass --dsn or set KAPPAFLOW_LEDGER_DSN" in out
