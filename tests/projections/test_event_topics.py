"""Event topics (e.g. the ledger's): domain events folded by a custom fold, in position order."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kappaflow.log.base import Record, TopicConfig
from kappaflow.projections import Event, Projection, Source
from kappaflow.projections.replay import replay
from tests.projections.pj_helpers import view_rows

pytestmark = pytest.mark.integration


class Balances(Projection):
    name = "ev_balances"
    sources = [Source("evs.account", events=True, key={"stream_id": "stream_id"})]
    key = ["stream_id"]
    schema = "stream_id string, balance bigint, events bigint, last_position bigint"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        e = event.after or {}
        row = dict(row or {"balance": 0, "events": 0, "last_position": 0})
        assert e["position"] > row["last_position"], "events of a key arrive in position order"
        row["balance"] += e["amount"]
        row["events"] += 1
        row["last_position"] = e["position"]
        return row


def test_event_topic_fold_in_position_order_with_redelivered_events_folded_once(
    rt: Any, embedded_log: Any, pg_dsn: str
) -> None:
    embedded_log.create_topic("evs.account", TopicConfig(partitions=2))
    events = [{"position": p, "stream_id": f"account-{p % 3}", "amount": p} for p in range(1, 31)]
    recs = [Record(e["stream_id"].encode(), orjson.dumps(e)) for e in events]
    recs += recs[25:]  # a relay restarted and re-delivered the tail: same positions
    embedded_log.append("evs.account", recs)
    replay(Balances, rt)
    want = {}
    for e in events:
        b = want.setdefault(e["stream_id"], [0, 0, 0])
        b[0] += e["amount"]
        b[1] += 1
        b[2] = e["position"]
    assert view_rows(pg_dsn, "ev_balances", "stream_id, balance, events, last_position") == [
        (k, *v) for k, v in sorted(want.items())
    ]
