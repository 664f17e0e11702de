"""The bank example on the ledger: no overdraw under concurrency, atomic transfers that survive
kill -9 of the writer process, and the invariant at every replay point."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from examples.bank.account import AccountNotOpen, BankError, InsufficientFunds
from examples.bank.bank import Bank
from examples.bank.events import Deposited, registry
from examples.bank.invariant import InvariantViolation, balances, check_invariants
from kappaflow.ledger import Ledger, NewEvent, StreamAppend

pytestmark = pytest.mark.integration

WRITER = Path(__file__).with_name("_bank_writer.py")


@pytest.fixture
def bank_ledger(ledger_dsn: str):  # type: ignore[no-untyped-def]
    with Ledger(ledger_dsn, registry=registry, pool_size=10) as led:
        yield led


def test_bank_commands_and_rules(bank_ledger: Ledger) -> None:
    bank = Bank(bank_ledger)
    bank.open_account("alice", "Alice")
    bank.open_account("bob", "Bob")
    bank.deposit("alice", 100)
    bank.withdraw("alice", 30)
    with pytest.raises(InsufficientFunds):
        bank.withdraw("alice", 71)
    r = bank.transfer("alice", "bob", 50, transfer_id="t-1")
    again = bank.transfer("alice", "bob", 50, transfer_id="t-1")
    assert again.duplicate and again.position == r.position
    with pytest.raises(InsufficientFunds):
        bank.transfer("alice", "bob", 21)
    with pytest.raises(AccountNotOpen):
        bank.transfer("alice", "carol", 1)
    with pytest.raises(AccountNotOpen):
        bank.deposit("carol", 1)
    with pytest.raises(BankError):
        bank.transfer("bob", "bob", 1)
    # a fresh service (e.g. after a restart) sees the same state, and a retried transfer whose
    # funds are now spent still returns its original result
    fresh = Bank(bank_ledger)
    assert (fresh.account("alice").balance, fresh.account("bob").balance) == (20, 50)
    assert fresh.transfer("alice", "bob", 50, transfer_id="t-1").duplicate
    rep = check_invariants(bank_ledger.iter_all())
    assert rep.balances == {"alice": 20, "bob": 50} and rep.transfers == 1
    assert bank_ledger.verify().ok


def test_no_overdraw_with_concurrent_withdrawals(bank_ledger: Ledger) -> None:
    setup = Bank(bank_ledger)
    setup.open_account("shared", "S")
    setup.deposit("shared", 100)
    ok: list[int] = []
    refused: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        bank = Bank(bank_ledger)
        barrier.wait()
        for _ in range(3):
            try:
                bank.withdraw("shared", 30)
                with lock:
                    ok.append(i)
            except InsufficientFunds:
                with lock:
                    refused.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(ok) == 3 and len(refused) == 21
    assert Bank(bank_ledger).account("shared").balance == 10
    check_invariants(bank_ledger.iter_all())


def test_invariant_check_catches_a_broken_history(bank_ledger: Ledger) -> None:
    bank = Bank(bank_ledger)
    bank.open_account("a", "A")
    bank.open_account("b", "B")
    bank.deposit("a", 10)
    # a "transfer" written as two separate appends: half applied between them
    sent = {"transfer_id": "x", "to_account": "b", "amount": 5}
    bank_ledger.append("account-a", [NewEvent("TransferSent", sent)])
    bank_ledger.append("account-a", [Deposited(amount=1)])
    with pytest.raises(InvariantViolation, match="position 5: the transfer at position 4 is half applied"):
        check_invariants(bank_ledger.iter_all())


def read_line(proc: subprocess.Popen[str], sel: selectors.BaseSelector, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=deadline - time.monotonic()):
            line = proc.stdout.readline() if proc.stdout else ""
            if line:
                return line.strip()
            raise AssertionError(f"writer exited early: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError("writer did not answer in time")


@pytest.mark.slow
def test_transfers_all_or_nothing_when_writer_is_killed(bank_ledger: Ledger, ledger_dsn: str) -> None:
    n_accounts = 10
    bank = Bank(bank_ledger)
    for i in range(n_accounts):
        bank.open_account(str(i), f"owner {i}")
        bank.deposit(str(i), 500)
    rnd = random.Random(20261122)
    killed_with_attempt = 0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for trial in range(12):
        proc = subprocess.Popen([sys.executable, str(WRITER), ledger_dsn, str(trial), str(n_accounts)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while read_line(proc, sel, 60) != "ready":
                pass
            time.sleep(rnd.uniform(0.0, 0.25))  # the random kill moment (not a synchronisation)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        out = proc.stdout.read()
        attempts = [line.split() for line in out.splitlines() if line.startswith("attempt")]
        # every transfer is complete or absent, the chain is intact
        rep = check_invariants(bank_ledger.iter_all())
        assert sum(rep.balances.values()) == n_accounts * 500
        report = bank_ledger.verify()
        assert report.ok, report
        if attempts:
            # retrying the transfer whose outcome the killed writer never learned is safe
            killed_with_attempt += 1
            _, tid, a, b, amount = attempts[-1]
            before = bank_ledger.head().position
            committed = bank_ledger.idempotent_result(tid)
            try:
                r = Bank(bank_ledger).transfer(a, b, int(amount), transfer_id=tid)
                assert r.duplicate == (committed is not None)
                if committed is not None:
                    assert r.position == committed.position and bank_ledger.head().position == before
            except InsufficientFunds:
                assert committed is None
    assert killed_with_attempt >= 10
    rep = check_invariants(bank_ledger.iter_all())
    assert rep.transfers > 0 and sum(balances(bank_ledger.iter_all()).values()) == n_accounts * 500


def test_multi_stream_append_is_atomic_in_the_log_order(bank_ledger: Ledger) -> None:
    """Both legs get adjacent positions: readers never observe a half-applied transfer."""
    bank = Bank(bank_ledger)
    bank.open_account("x", "X")
    bank.open_account("y", "Y")
    bank.deposit("x", 5)
    r = bank_ledger.append_many([
        StreamAppend("account-x", [NewEvent("TransferSent", {"transfer_id": "t", "to_account": "y", "amount": 5})]),
        StreamAppend("account-y", [NewEvent("TransferReceived", {"transfer_id": "t", "from_account": "x",
                                                                 "amount": 5})])])
    assert r.position == r.first_position + 1
    assert check_invariants(bank_ledger.iter_all()).balances == {"x": 0, "y": 5}
