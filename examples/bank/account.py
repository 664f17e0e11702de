"""The Account aggregate: state folded from its events, and the decisions it allows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from examples.bank.events import AccountOpened, Deposited, TransferReceived, TransferSent, Withdrawn
from kappaflow.ledger import Fold


class BankError(Exception):
    """A business rule refused the command (not a technical failure)."""


class InsufficientFunds(BankError):
    def __init__(self, account: str, balance: int, amount: int) -> None:
        super().__init__(f"account {account!r}: balance {balance} is less than {amount}")
        self.account, self.balance, self.amount = account, balance, amount


class AccountNotOpen(BankError):
    def __init__(self, account: str) -> None:
        super().__init__(f"account {account!r} is not open")
        self.account = account


@dataclass(slots=True)
class Account:
    id: str
    version: int = 0  # the stream version the state reflects (= expected version of the next append)
    opened: bool = False
    balance: int = 0

    def apply(self, event: object) -> None:
        match event:
            case AccountOpened():
                self.opened = True
            case Deposited(amount=a) | TransferReceived(amount=a):
                self.balance += a
            case Withdrawn(amount=a) | TransferSent(amount=a):
                self.balance -= a

    def fold(self, events: Iterable[tuple[int, object]]) -> Account:
        """Fold ``(stream_version, event)`` pairs (`Ledger.load_events`)."""
        for version, event in events:
            self.apply(event)
            self.version = version
        return self

    def require_open(self) -> None:
        if not self.opened:
            raise AccountNotOpen(self.id)

    def require_funds(self, amount: int) -> None:
        self.require_open()
        if self.balance < amount:
            raise InsufficientFunds(self.id, self.balance, amount)


def _apply(acc: Account, version: int, event: object) -> Account:
    acc.apply(event)
    acc.version = version
    return acc


def _initial(stream: str) -> Account:
    from examples.bank.events import account_of

    return Account(account_of(stream))


# The account as a ledger Fold: `ledger.load(stream_id(a), ACCOUNT_FOLD)` starts from the latest
# snapshot (Ledger(..., snapshot_every={"account": N})). Bump `version` when `apply` changes.
ACCOUNT_FOLD: Fold[Account] = Fold("account", version=1, state_type=Account, initial=_initial, apply=_apply)
