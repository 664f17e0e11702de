"""Aggregate snapshots: state from a snapshot plus the tail equals the full fold; snapshots of
another fold version are ignored; a damaged one falls back to a full fold with a warning; none
of it touches the hash chain."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.bank.account import ACCOUNT_FOLD, Account
from examples.bank.events import AccountOpened, Deposited, Withdrawn, registry
from kappaflow.errors import ConfigError
from kappaflow.ledger import ExpectedVersion, Fold, InvalidAppendError, Ledger

pytestmark = pytest.mark.integration

SNAPSHOTS = '"kappaflow_ledger".snapshots'


def full_fold(ledger: Ledger, stream: str) -> Account:
    acc = Account(stream.removeprefix("account-"))
    return acc.fold(ledger.load_events(stream))


def snapshot_row(dsn: str, stream: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"select stream_version, fold_version, state from {SNAPSHOTS} where stream_id = %s",
                            (stream,)).fetchone()


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batches=st.lists(st.lists(st.integers(-50, 100).filter(bool), min_size=1, max_size=7), min_size=1,
                        max_size=8),
       every=st.integers(1, 9))
def test_snapshot_plus_tail_equals_the_full_fold(ledger_dsn: str, batches: list[list[int]], every: int) -> None:
    stream = f"account-h{uuid.uuid4().hex[:12]}"
    with Ledger(ledger_dsn, registry=registry, snapshot_every={"account": every}) as ledger:
        ledger.append(stream, [AccountOpened(owner="ann")], ExpectedVersion.NO_STREAM)
        for batch in batches:  # a load between appends: snapshots land at various versions
            loaded = ledger.load(stream, ACCOUNT_FOLD)
            assert loaded.state == full_fold(ledger, stream) and loaded.version == loaded.state.version
            ledger.append(stream, [Deposited(amount=a) if a > 0 else Withdrawn(amount=-a) for a in batch],
                          loaded.version)
        loaded = ledger.load(stream, ACCOUNT_FOLD)
        assert loaded.state == full_fold(ledger, stream)
        assert loaded.version == 1 + sum(len(b) for b in batches)
        row = snapshot_row(ledger_dsn, stream)
        if loaded.version >= every:  # a snapshot within N events of the head
            assert row is not None and loaded.version - row[0] < every
        else:
            assert row is None
        assert loaded.snapshot_version is None or loaded.folded == loaded.version - loaded.snapshot_version


def test_load_reads_only_the_tail_after_the_snapshot(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry, snapshot_every={"account": 10}) as ledger:
        ledger.append("account-a", [AccountOpened(owner="ann")] + [Deposited(amount=1)] * 24)
        first = ledger.load("account-a", ACCOUNT_FOLD)
        assert (first.snapshot_version, first.folded, first.stored_snapshot, first.version) == (None, 25, True, 25)
        ledger.append("account-a", [Deposited(amount=5)] * 3, 25)
        second = ledger.load("account-a", ACCOUNT_FOLD)
        assert (second.snapshot_version, second.folded, second.stored_snapshot) == (25, 3, False)
        assert second.state.balance == 24 + 15 and second.version == 28
        empty = ledger.load("account-none", ACCOUNT_FOLD)
        assert (empty.version, empty.state, empty.stored_snapshot) == (0, Account("none"), False)
        other = ledger.load("ledgerless-1", ACCOUNT_FOLD)  # a stream type without a policy: no snapshot
        assert other.version == 0 and snapshot_row(ledger_dsn, "ledgerless-1") is None


def test_a_snapshot_of_another_fold_version_is_ignored(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry, snapshot_every={"*": 5}) as ledger:
        ledger.append("account-a", [AccountOpened(owner="ann")] + [Deposited(amount=2)] * 9)
        assert ledger.load("account-a", ACCOUNT_FOLD).stored_snapshot

        def apply_v2(acc: Account, version: int, event: object) -> Account:  # the new rule: double deposits
            if isinstance(event, Deposited):
                acc.balance += event.amount
            acc.apply(event)
            acc.version = version
            return acc

        v2 = Fold("account", version=2, state_type=Account, initial=ACCOUNT_FOLD.initial, apply=apply_v2)
        loaded = ledger.load("account-a", v2)
        assert loaded.snapshot_version is None and loaded.folded == 10  # the v1 state never reaches v2 code
        assert loaded.state.balance == 36 and loaded.stored_snapshot
        assert snapshot_row(ledger_dsn, "account-a")[:2] == (10, 2)  # type: ignore[index]
        again = ledger.load("account-a", v2)
        assert (again.snapshot_version, again.folded, again.state.balance) == (10, 0, 36)


@pytest.mark.parametrize("damage", [
    "update {t} set state = replace(state, '\"balance\":18', '\"balance\":1000')",  # edited: checksum mismatch
    "update {t} set state = '{{\"id\": 1', checksum = '\\x00'",                        # truncated JSON
    "update {t} set stream_version = 3",                                           # moved: checksum mismatch
])
def test_a_damaged_snapshot_falls_back_to_a_full_fold_with_a_warning(
        ledger_dsn: str, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    with Ledger(ledger_dsn, registry=registry, snapshot_every={"account": 5}) as ledger:
        ledger.append("account-a", [AccountOpened(owner="ann")] + [Deposited(amount=2)] * 9)
        ledger.load("account-a", ACCOUNT_FOLD)
        with psycopg.connect(ledger_dsn, autocommit=True) as conn:
            conn.execute(damage.format(t=SNAPSHOTS))
        caplog.set_level(logging.WARNING, logger="kappaflow.ledger.snapshots")
        loaded = ledger.load("account-a", ACCOUNT_FOLD)
        assert loaded.state == full_fold(ledger, "account-a") and loaded.state.balance == 18
        assert loaded.snapshot_version is None and loaded.folded == 10
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "snapshot of stream 'account-a'" in warnings[0]
        assert "folding the stream from its first event" in warnings[0]
        assert ledger.verify().ok  # snapshots are outside the chain


def test_snapshots_never_change_what_verify_checks(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry, snapshot_every={"account": 2}) as ledger:
        ledger.append("account-a", [AccountOpened(owner="ann"), Deposited(amount=3), Deposited(amount=4)])
        before = ledger.verify()
        ledger.load("account-a", ACCOUNT_FOLD)
        with psycopg.connect(ledger_dsn, autocommit=True) as conn:
            conn.execute(f"update {SNAPSHOTS} set state = 'garbage'")
        after = ledger.verify()
        assert before == after and after.ok and ledger.head() == ledger.head()
        with psycopg.connect(ledger_dsn, autocommit=True) as conn:
            conn.execute(f"delete from {SNAPSHOTS}")  # a cache: deleting it is allowed
        assert ledger.load("account-a", ACCOUNT_FOLD).state.balance == 7


def test_bad_snapshot_configuration(ledger_dsn: str) -> None:
    with pytest.raises(ConfigError, match=r"snapshot_every\['account'\]: expected an integer >= 1, got 0"):
        Ledger(ledger_dsn, snapshot_every={"account": 0})
    with pytest.raises(InvalidAppendError, match=r"fold.version: expected an integer >= 1"):
        Fold("account", version=0, state_type=Account, initial=Account, apply=lambda s, v, e: s)
    with Ledger(ledger_dsn) as ledger, pytest.raises(InvalidAppendError, match="fold: expected a Fold"):
        ledger.load("account-a", object())  # type: ignore[arg-type]
