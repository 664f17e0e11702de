"""The bank's read models, folded from the ledger's ``account`` topic with the Projection API.

The ledger source (``kappaflow source add bank --ledger postgresql://...``, or `LedgerRelay`)
writes every account event to the topic ``bank.account``: key = the stream id
(``account-alice``), value = the domain event (``position``, ``stream_id``, ``event_type``,
``data``...). These are event topics (``Source(..., events=True)``): each record is one
event to fold, in ledger order, never a row version.

- `Balances` (PostgreSQL view ``balances``): one row per account with its balance, the
  money deposited and withdrawn, transfers in and out, and the last ledger position
  folded into it. Sum of balances == sum of deposits - sum of withdrawals at every
  commit point (transfers move money between rows, they never create any).
- `AccountActivity` (view ``account_activity``): one row per account event — the
  statement lines, with the signed amount and the counterparty of transfers. It declares two
  sinks: the PostgreSQL table and a search index (alias ``account_activity``, field mappings
  in ``ACTIVITY_SEARCH_FIELDS``). One replay folds the log once per sink and swaps both; each
  sink keeps its own positions, so a follow of one never waits for the other
  (``kappaflow replay ...:AccountActivity --sink postgres`` rebuilds one of them).
- `AccountStatement` (view ``account_statement``): the statement lines again, each with the
  account holder's name AS IT WAS when the money moved (as-of enrichment, ``AsOf``). The
  holder's name is master data, not an event: it lives in the bank's customer (CRM) database,
  table ``public.account_holders`` (``stream_id`` primary key, ``name``), captured by a
  PostgreSQL source ``crm``. A rename changes later lines only; a replay a year later gives
  every line the name it showed on the day.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kappaflow.projections import AsOf, Event, Projection, Source

SOURCE = "bank"  # the ledger source name: the topic prefix
ACCOUNT_TOPIC = f"{SOURCE}.account"
HOLDERS_TOPIC = "crm.public.account_holders"  # the CRM database's holders table (PostgreSQL source "crm")

# Search field mappings of the activity index (overrides of the mapping derived from the schema):
# exact keywords for ids and names to filter on, the owner's name as full text plus keyword.
ACTIVITY_SEARCH_FIELDS: dict[str, str] = {
    "account": "keyword", "stream_id": "keyword", "event_type": "keyword", "counterparty": "keyword",
    "transfer_id": "keyword", "owner": "text+keyword",
}


def account_of(stream_id: str) -> str:
    return stream_id.removeprefix("account-")


class Balances(Projection):
    name = "balances"
    sources = [Source(ACCOUNT_TOPIC, events=True, key={"stream_id": "stream_id"})]
    key = ["stream_id"]
    schema = ("stream_id string, account string, owner string, balance bigint, deposits bigint, "
              "withdrawals bigint, transfers_in bigint, transfers_out bigint, events bigint, last_position bigint")

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        e = event.after or {}
        if row is None:
            row = {"account": account_of(e["stream_id"]), "owner": None, "balance": 0, "deposits": 0,
                   "withdrawals": 0, "transfers_in": 0, "transfers_out": 0, "events": 0, "last_position": 0}
        else:
            row = dict(row)
        data = e.get("data") or {}
        amount = int(data.get("amount", 0))
        kind = e["event_type"]
        if kind == "AccountOpened":
            row["owner"] = data.get("owner")
        elif kind == "Deposited":
            row["balance"] += amount
            row["deposits"] += amount
        elif kind == "Withdrawn":
            row["balance"] -= amount
            row["withdrawals"] += amount
        elif kind == "TransferSent":
            row["balance"] -= amount
            row["transfers_out"] += amount
        elif kind == "TransferReceived":
            row["balance"] += amount
            row["transfers_in"] += amount
        row["events"] += 1
        row["last_position"] = max(row["last_position"], int(e["position"]))
        return row


class AccountActivity(Projection):
    name = "account_activity"
    sources = [Source(ACCOUNT_TOPIC, events=True, key={"position": "position"})]
    key = ["position"]
    schema = ("position bigint, stream_id string, account string, stream_version bigint, event_type string, "
              "amount bigint, delta bigint, counterparty string, transfer_id string, owner string, "
              "recorded_at timestamp_ltz")  # the ledger's recorded_at is a timestamptz
    sinks: ClassVar[Sequence[str]] = ("postgres", "search")
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {"search": {"fields": ACTIVITY_SEARCH_FIELDS}}

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        e = event.after or {}
        data = e.get("data") or {}
        kind = e["event_type"]
        amount = data.get("amount")
        sign = {"Deposited": 1, "TransferReceived": 1, "Withdrawn": -1, "TransferSent": -1}.get(kind, 0)
        return {
            "stream_id": e["stream_id"], "account": account_of(e["stream_id"]),
            "stream_version": e["stream_version"], "event_type": kind,
            "amount": amount, "delta": sign * int(amount or 0),
            "counterparty": data.get("to_account") or data.get("from_account"),
            "transfer_id": data.get("transfer_id"), "owner": data.get("owner"),
            "recorded_at": dt.datetime.fromisoformat(e["recorded_at"]),
        }



SIGNS = {"Deposited": 1, "TransferReceived": 1, "Withdrawn": -1, "TransferSent": -1}


class AccountStatement(Projection):
    """Statement lines with the holder's name as of each event (the CRM table's row at that moment).

    The ledger and the CRM are two sources, so "at that moment" is by time: a rename committed
    in the CRM strictly before the event's ``recorded_at`` counts; lines wait until the CRM's
    capture has passed them (README "As-of enrichment")."""

    name = "account_statement"
    sources = [Source(ACCOUNT_TOPIC, events=True, key={"position": "position"})]
    key = ["position"]
    schema = ("position bigint, stream_id string, account string, event_type string, delta bigint, "
              "holder_name string, recorded_at timestamp_ltz")
    as_of = [AsOf("holder", HOLDERS_TOPIC, on={"stream_id": "stream_id"}, columns=["name"])]

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        e = event.after or {}
        amount = int((e.get("data") or {}).get("amount", 0))
        return {
            "stream_id": e["stream_id"], "account": account_of(e["stream_id"]), "event_type": e["event_type"],
            "delta": SIGNS.get(e["event_type"], 0) * amount, "holder_name": e["holder_name"],
            "recorded_at": dt.datetime.fromisoformat(e["recorded_at"]),
        }
