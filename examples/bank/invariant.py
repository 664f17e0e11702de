"""The bank's invariants, checked by replaying plain ledger reads in global order.

    sum(balances) == deposits - withdrawals          at every commit point
    no balance ever below zero
    both legs of a transfer are adjacent positions of one commit (never half applied)

The replay takes any iterable of recorded events (`ledger.iter_all()`, or the events up to a
commit point); `check_balances_view` holds the balances view (`examples/bank/projections.py`)
replayed to the same point against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from examples.bank.events import account_of
from kappaflow.ledger import RecordedEvent


class InvariantViolation(AssertionError):
    def __init__(self, message: str, position: int) -> None:
        super().__init__(f"position {position}: {message}")
        self.position = position


@dataclass
class Replay:
    balances: dict[str, int] = field(default_factory=dict)
    deposits: int = 0
    withdrawals: int = 0
    transfers: int = 0
    events: int = 0
    commit_points: int = 0
    last_position: int = 0


def check_invariants(events: Iterable[RecordedEvent]) -> Replay:
    """Replay and check every invariant; raises InvariantViolation naming the position."""
    st = Replay()
    open_transfer: RecordedEvent | None = None
    for e in events:
        st.events += 1
        if e.position != st.last_position + 1:
            raise InvariantViolation(f"expected position {st.last_position + 1} (gap in the replay)", e.position)
        st.last_position = e.position
        if e.stream_type != "account":
            continue
        if open_transfer is not None and e.event_type != "TransferReceived":
            raise InvariantViolation(f"the transfer at position {open_transfer.position} is half applied", e.position)
        acc = account_of(e.stream_id)
        amount = int(e.data.get("amount", 0))
        bal = st.balances.setdefault(acc, 0)
        if e.event_type == "Deposited":
            st.balances[acc] = bal + amount
            st.deposits += amount
        elif e.event_type == "Withdrawn":
            st.balances[acc] = bal - amount
            st.withdrawals += amount
        elif e.event_type == "TransferSent":
            st.balances[acc] = bal - amount
            open_transfer = e
        elif e.event_type == "TransferReceived":
            sent = open_transfer
            if sent is None or sent.position != e.position - 1 or sent.data["transfer_id"] != e.data["transfer_id"] \
                    or sent.data["amount"] != amount or account_of(sent.stream_id) != e.data["from_account"] \
                    or sent.data["to_account"] != acc:
                raise InvariantViolation("transfer credit without its debit in the same commit", e.position)
            st.balances[acc] = bal + amount
            st.transfers += 1
            open_transfer = None
        if st.balances[acc] < 0:
            raise InvariantViolation(f"account {acc!r} overdrawn ({st.balances[acc]})", e.position)
        if open_transfer is None:
            st.commit_points += 1
            total = sum(st.balances.values())
            if total != st.deposits - st.withdrawals:
                raise InvariantViolation(
                    f"sum of balances {total} != deposits {st.deposits} - withdrawals {st.withdrawals}", e.position)
    if open_transfer is not None:
        raise InvariantViolation("the ledger ends with a half-applied transfer", open_transfer.position)
    return st


def balances(events: Iterable[RecordedEvent]) -> dict[str, int]:
    """Balances after replaying `events` (what the balances view must show)."""
    return check_invariants(events).balances


def check_balances_view(rows: Iterable[Mapping[str, Any]], events: Iterable[RecordedEvent]) -> Replay:
    """The balances view at a commit point, checked on its own and against a replay of `events`
    (the ledger up to that point): sum(balance) == sum(deposits) - sum(withdrawals) in the view,
    and every balance and both totals equal the replay's. Raises InvariantViolation."""
    st = check_invariants(events)
    view = {str(r["account"]): r for r in rows}
    total = sum(int(r["balance"]) for r in view.values())
    deposits = sum(int(r["deposits"]) for r in view.values())
    withdrawals = sum(int(r["withdrawals"]) for r in view.values())
    where = max((int(r["last_position"]) for r in view.values()), default=0)
    if total != deposits - withdrawals:
        raise InvariantViolation(f"balances view: sum of balances {total} != deposits {deposits} - withdrawals "
                                 f"{withdrawals}", where)
    if (deposits, withdrawals) != (st.deposits, st.withdrawals):
        raise InvariantViolation(f"balances view: deposits/withdrawals {deposits}/{withdrawals}, the ledger says "
                                 f"{st.deposits}/{st.withdrawals}", where)
    got = {a: int(r["balance"]) for a, r in view.items()}
    if got != st.balances:
        wrong = sorted(a for a in set(got) | set(st.balances) if got.get(a) != st.balances.get(a))
        raise InvariantViolation(f"balances view differs from the ledger for accounts {wrong[:10]}", where)
    return st
