"""The bank service: commands that append to the ledger with optimistic concurrency.

No overdraw is enforced at append time: a debit is appended with the expected version of the
account state the balance check was made on. If anyone appended to the account in between,
the ledger refuses (WrongExpectedVersionError); the service catches up and decides again.

A transfer is ONE append to two streams (debit with the source's expected version, credit to
an existing destination), keyed by the transfer id: both legs commit or neither, and retrying
a transfer whose outcome is unknown (crash, lost connection) cannot apply it twice.

Not thread-safe (it caches account states): use one Bank per thread, sharing one Ledger.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from examples.bank.account import ACCOUNT_FOLD, Account, AccountNotOpen, BankError
from examples.bank.events import AccountOpened, Deposited, TransferReceived, TransferSent, Withdrawn, stream_id
from kappaflow.ledger import AppendResult, ExpectedVersion, Ledger, StreamAppend, WrongExpectedVersionError

Attempt = Callable[[Account], AppendResult]


class Bank:
    def __init__(self, ledger: Ledger, *, max_retries: int = 100, trust_cache: bool = False) -> None:
        """`trust_cache`: decide on the cached state first (fewer reads when this service is the
        account's only writer; a stale cache only costs a conflict and a retry)."""
        self.ledger = ledger
        self.max_retries = max_retries
        self.trust_cache = trust_cache
        self.conflicts = 0
        self._accounts: dict[str, Account] = {}

    def account(self, account_id: str, *, refresh: bool = True) -> Account:
        """The account's state, caught up with the ledger (reads only the events not yet seen)."""
        acc = self._accounts.get(account_id)
        if acc is None:  # first sight: from the latest snapshot (if the ledger keeps them) + the tail
            acc = self._accounts[account_id] = self.ledger.load(stream_id(account_id), ACCOUNT_FOLD).state
            return acc
        if refresh:
            acc.fold(self.ledger.load_events(stream_id(account_id), from_version=acc.version + 1))
        return acc

    def open_account(self, account_id: str, owner: str) -> AppendResult:
        event = AccountOpened(owner=owner)
        r = self.ledger.append(stream_id(account_id), [event], ExpectedVersion.NO_STREAM)
        self._note(account_id, event, r)
        return r

    def deposit(self, account_id: str, amount: int) -> AppendResult:
        event = Deposited(amount=amount)

        def attempt(acc: Account) -> AppendResult:
            acc.require_open()
            return self.ledger.append(stream_id(account_id), [event], acc.version)

        r = self._retry(account_id, attempt)
        self._note(account_id, event, r)
        return r

    def withdraw(self, account_id: str, amount: int) -> AppendResult:
        event = Withdrawn(amount=amount)

        def attempt(acc: Account) -> AppendResult:
            acc.require_funds(amount)
            return self.ledger.append(stream_id(account_id), [event], acc.version)

        r = self._retry(account_id, attempt)
        self._note(account_id, event, r)
        return r

    def transfer(self, from_account: str, to_account: str, amount: int,
                 transfer_id: str | None = None) -> AppendResult:
        """Move `amount` atomically; a repeat with the same transfer id returns the first result."""
        tid = transfer_id or uuid.uuid4().hex
        if from_account == to_account:
            raise BankError("a transfer needs two different accounts")
        sent = TransferSent(transfer_id=tid, to_account=to_account, amount=amount)
        received = TransferReceived(transfer_id=tid, from_account=from_account, amount=amount)

        def attempt(acc: Account) -> AppendResult:
            acc.require_funds(amount)
            return self.ledger.append_many([
                StreamAppend(stream_id(from_account), [sent], acc.version),
                StreamAppend(stream_id(to_account), [received], ExpectedVersion.STREAM_EXISTS),
            ], idempotency_key=tid)

        try:
            r = self._retry(from_account, attempt)
        except WrongExpectedVersionError as exc:
            if exc.stream_id == stream_id(to_account):
                raise AccountNotOpen(to_account) from None
            raise
        except BankError:
            done = self.ledger.idempotent_result(tid)  # a retry of a transfer that already happened
            if done is not None:
                return done
            raise
        self._note(from_account, sent, r)
        self._note(to_account, received, r)
        return r

    def _retry(self, account_id: str, attempt: Attempt) -> AppendResult:
        acc = self.account(account_id, refresh=not self.trust_cache)  # reads only events not yet seen
        for _ in range(self.max_retries):
            try:
                return attempt(acc)
            except WrongExpectedVersionError as exc:
                if exc.stream_id != stream_id(account_id):
                    raise
                self.conflicts += 1
                self.account(account_id)  # someone else appended: catch up, decide again
            except BankError:
                seen = acc.version
                self.account(account_id)
                if acc.version == seen:
                    raise  # refused on the current state
        raise BankError(f"account {account_id!r}: still conflicting after {self.max_retries} attempts")

    def _note(self, account_id: str, event: object, result: AppendResult) -> None:
        """Keep the cache current after our own append (if it was exactly one step behind)."""
        acc = self._accounts.get(account_id)
        version = result.versions.get(stream_id(account_id))
        if acc is not None and version is not None and not result.duplicate and acc.version == version - 1:
            acc.apply(event)
            acc.version = version
