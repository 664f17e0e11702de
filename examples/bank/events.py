"""The bank's domain events. Amounts are integer cents (no float rounding in money)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt

from kappaflow.ledger import EventRegistry


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AccountOpened(_Event):
    owner: str


class Deposited(_Event):
    amount: PositiveInt


class Withdrawn(_Event):
    amount: PositiveInt


class TransferSent(_Event):
    transfer_id: str
    to_account: str
    amount: PositiveInt


class TransferReceived(_Event):
    transfer_id: str
    from_account: str
    amount: PositiveInt


registry = EventRegistry()
for _cls in (AccountOpened, Deposited, Withdrawn, TransferSent, TransferReceived):
    registry.register(_cls)

STREAM_TYPE = "account"


def stream_id(account: str) -> str:
    return f"{STREAM_TYPE}-{account}"


def account_of(stream: str) -> str:
    return stream.removeprefix(f"{STREAM_TYPE}-")
