"""Source positions: total order within a kind, dict round-trip, clear errors."""

from __future__ import annotations

import itertools
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kappaflow.connectors.ledger.source_info import LedgerPosition
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.postgres.source_info import PgPosition, lsn_from_str, lsn_to_str
from kappaflow.errors import ValidationError
from kappaflow.events import Position

LSN = st.integers(0, (1 << 64) - 1)
pg_positions = st.builds(PgPosition, LSN, st.integers(0, 10**6), st.booleans())
binlog_positions = st.builds(
    BinlogPosition,
    st.builds(lambda base, n, width: f"{base}.{n:0{width}d}", st.sampled_from(["mysql-bin", "binlog"]),
              st.integers(1, 2_000_000), st.integers(6, 7)),
    st.integers(4, 1 << 40),
    st.integers(0, 5000),
    st.one_of(st.none(), st.just("0-1-42"), st.just("3E11FA47-71CA-11E1-9E33-C80AA9429562:23")),
    st.one_of(st.none(), st.integers(1, 2**32 - 1)),
    st.booleans(),
)
ledger_positions = st.builds(LedgerPosition, st.integers(0, 1 << 62))
any_position = st.one_of(pg_positions, binlog_positions, ledger_positions)

FAST = settings(max_examples=150, deadline=None)


@FAST
@given(any_position)
def test_round_trip_via_dict(p: Position) -> None:
    d = p.to_dict()
    assert d["kind"] == p.kind
    back = Position.from_dict(d)
    assert back == p and type(back) is type(p)
    assert back.to_dict() == d  # every field, not only the order key
    assert type(p).from_dict(d) == p
    assert pickle.loads(pickle.dumps(p)) == p


@FAST
@given(st.one_of(st.lists(pg_positions, min_size=2, max_size=8), st.lists(binlog_positions, min_size=2, max_size=8),
                 st.lists(ledger_positions, min_size=2, max_size=8)))
def test_total_order(ps: list[Position]) -> None:
    s = sorted(ps)
    for a, b in itertools.pairwise(s):
        assert a <= b and not a > b
    for a in ps:
        for b in ps:
            # exactly one of <, ==, > holds, and == agrees with hash
            assert [a < b, a == b, a > b].count(True) == 1
            assert (a <= b) == (a < b or a == b) and (a >= b) == (a > b or a == b)
            if a == b:
                assert hash(a) == hash(b)


def test_pg_order_commit_lsn_then_index() -> None:
    assert PgPosition(100, 5) < PgPosition(101, 0)
    assert PgPosition(100, 1) < PgPosition(100, 2)
    assert PgPosition(100, 2) == PgPosition(100, 2)


def test_pg_snapshot_rows_order_before_streaming_from_the_consistent_point() -> None:
    consistent_point = 0x16B3748
    snap_last = PgPosition(consistent_point, 1_000_000, snapshot=True)
    assert snap_last < PgPosition(consistent_point, 0)  # a change committed at the consistent point
    assert snap_last < PgPosition(consistent_point + 1, 0)
    assert PgPosition(consistent_point - 1, 7) < PgPosition(consistent_point, 0, snapshot=True)
    assert PgPosition(consistent_point, 3, True) < PgPosition(consistent_point, 4, True)


def test_binlog_order_uses_the_file_sequence_number_not_the_name() -> None:
    # a string comparison would put "mysql-bin.1000000" before "mysql-bin.999999"
    assert BinlogPosition("mysql-bin.999999", 900) < BinlogPosition("mysql-bin.1000000", 4)
    assert BinlogPosition("mysql-bin.000009", 900, 3) < BinlogPosition("mysql-bin.000010", 4, 0)
    assert BinlogPosition("b.000001", 10, 1) < BinlogPosition("b.000001", 10, 2)
    # gtid and server id travel along but do not order
    assert BinlogPosition("b.000001", 10, 1, gtid="0-1-5") == BinlogPosition("b.000001", 10, 1, gtid=None)
    assert BinlogPosition("b.000002", 4, 0, snapshot=True) < BinlogPosition("b.000002", 4, 0)


def test_positions_of_different_kinds_do_not_compare() -> None:
    with pytest.raises(TypeError, match="different sources"):
        _ = PgPosition(1, 0) < LedgerPosition(1)
    with pytest.raises(TypeError):
        _ = LedgerPosition(1) >= BinlogPosition("b.000001", 4)
    with pytest.raises(TypeError):
        _ = PgPosition(1, 0) < 5
    assert PgPosition(1, 0) != LedgerPosition(1)


def test_str_forms() -> None:
    assert str(PgPosition(0x16B3748, 3)) == "0/16B3748:3"
    assert str(PgPosition(0x1_0000_0010, 0, snapshot=True)) == "1/10:snapshot:0"
    assert str(BinlogPosition("mysql-bin.000003", 154, 2)) == "mysql-bin.000003:154:2"
    assert str(LedgerPosition(42)) == "42"


@FAST
@given(LSN)
def test_lsn_text_round_trip(lsn: int) -> None:
    text = lsn_to_str(lsn)
    assert lsn_from_str(text) == lsn
    assert lsn_from_str(text.lower()) == lsn


def test_lsn_helpers_reject_bad_input() -> None:
    assert lsn_to_str(0) == "0/0" and lsn_from_str("16/B374D848") == (0x16 << 32) | 0xB374D848
    for bad in ("", "16B3748", "0/", "x/1", "0/123456789", "0/1/2"):
        with pytest.raises(ValidationError, match="lsn: expected PostgreSQL LSN text"):
            lsn_from_str(bad)
    with pytest.raises(ValidationError, match="lsn"):
        lsn_to_str(-1)
    with pytest.raises(ValidationError, match="lsn"):
        lsn_to_str(1 << 64)


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"lsn": 1, "index": 0}, r"position.kind: expected one of \['binlog', .*'ledger', .*'pg', .*\], got None"),
        ({"kind": "cobol"}, "position.kind: expected one of"),
        ({"kind": "pg", "index": 0}, r"position \(pg\).lsn: expected an integer >= 0, missing"),
        ({"kind": "pg", "lsn": -1, "index": 0}, r"position \(pg\).lsn: expected an integer >= 0, got -1"),
        ({"kind": "pg", "lsn": "0/1", "index": 0}, r"position \(pg\).lsn"),
        ({"kind": "pg", "lsn": 1, "index": 0, "snapshot": "yes"}, r"position \(pg\).snapshot: expected true or false"),
        ({"kind": "binlog", "file": "nosuffix", "pos": 4, "row": 0}, "binlog file: expected a name ending in a"),
        ({"kind": "binlog", "file": "b.000001", "pos": True}, r"position \(binlog\).pos"),
        ({"kind": "binlog", "file": "b.000001", "pos": 4, "gtid": 5}, r"position \(binlog\).gtid"),
        ({"kind": "ledger"}, r"position \(ledger\).position: expected an integer >= 0, missing"),
        ([1, 2], "position: expected an object"),
    ],
)
def test_from_dict_names_the_bad_field(d: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Position.from_dict(d)  # type: ignore[arg-type]


def test_from_dict_on_a_subclass_checks_the_kind() -> None:
    with pytest.raises(ValidationError, match="expected 'pg', got 'ledger'"):
        PgPosition.from_dict({"kind": "ledger", "position": 1})


def test_positions_are_immutable() -> None:
    p = PgPosition(1, 2)
    with pytest.raises(AttributeError):
        p.lsn = 5  # type: ignore[misc]
