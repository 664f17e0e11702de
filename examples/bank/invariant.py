"""The bank's invariants, checked by replaying plain ledger reads in global order.

    sum(balances) == deposits - withdrawals          at every commit point
    no balance ever below zero
    both legs of a transfer are adjacent positions of one commit (never half applied)

The replay takes any iterable of recorded events, so the same check runs on
`ledger.iter_all()` today and, once the Projection API exists, against the balances view:
SEAM -- the projections part will add `examples/bank/projections.py` with the balances
(PostgreSQL view) and account-activity projections, and a test comparing the view's rows with
`balances(ledger.iter_all())` after a replay.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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
