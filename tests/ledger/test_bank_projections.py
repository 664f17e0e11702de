"""The bank's projections over the ledger's topics (ledger -> connector -> log -> Spark -> views).

* replayed to several commit points (log cuts at a ledger position), the balances view
  satisfies sum(balance) == deposits - withdrawals and equals a replay of the ledger;
* the activity view has one row per account event and its deltas add up to the balances;
  the same replay fills the projection's second sink, the account-activity search index,
  which holds the same rows as the PostgreSQL view;
* read-your-writes: append -> capture -> follow -> `wait_for_projection` returns once the
  view has the position, then the view shows the write; a position the projection cannot
  reach times out with a clear error.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from examples.bank.account import InsufficientFunds
from examples.bank.bank import Bank
from examples.bank.events import registry
from examples.bank.invariant import check_balances_view, check_invariants
from examples.bank.projections import (
    ACCOUNT_TOPIC,
    SOURCE,
    AccountActivity,
    Balances,
)
from kappaflow.config import LedgerSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.ledger import LedgerConnector
from kappaflow.ledger import AppendResult, Ledger, LogProjectionPositions, ProjectionTimeoutError, wait_for_projection
from kappaflow.ledger.cut import offsets_at
from kappaflow.log.base import Log
from kappaflow.projections.api import Source

pytestmark = pytest.mark.integration

ACCOUNTS = ["alice", "bob", "carol", "dave", "erin"]


@pytest.fixture
def bank_ledger(ledger_dsn: str) -> Any:
    with Ledger(ledger_dsn, registry=registry) as led:
        yield led


def history(bank: Bank, n: int, seed: int) -> list[AppendResult]:
    """Deposits, withdrawals and transfers; returns every append's result (its commit point)."""
    rnd = random.Random(seed)
    done = []
    for _ in range(n):
        r = rnd.random()
        a, b = rnd.sample(ACCOUNTS, 2)
        try:
            if r < 0.35:
                done.append(bank.deposit(a, rnd.randint(100, 5000)))
            elif r < 0.55:
                done.append(bank.withdraw(a, rnd.randint(50, 3000)))
            else:
                done.append(bank.transfer(a, b, rnd.randint(10, 2000)))
        except InsufficientFunds:
            pass
    return done


def open_accounts(bank: Bank) -> list[AppendResult]:
    return [bank.open_account(a, a.title()) for a in ACCOUNTS]


def source_config(dsn: str) -> LedgerSourceConfig:
    # source name "bank" (the projections read bank.account); slot unique: slots are cluster-wide
    return LedgerSourceConfig(name=SOURCE, dsn=dsn, slot=f"kf_{uuid.uuid4().hex[:12]}", heartbeat_interval_s=0.5)


def capture(cfg: LedgerSourceConfig, log: Log) -> None:
    LedgerConnector(cfg, log, partitions=3, progress=False).run(until_caught_up=True)


@pytest.fixture
def rt(spark: Any, embedded_log: Any, ledger_dsn: str, tmp_path: Path) -> Any:
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    runtime = Runtime(spark, str(embedded_log.path), PostgresSink(ledger_dsn), checkpoint_dir=tmp_path / "ckpt")
    yield runtime
    runtime.close()


def view_rows(dsn: str, table: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return list(cur.execute(f'SELECT * FROM public."{table}"'))  # names are the projections' constants


def test_replay_points_activity_and_search_index(bank_ledger: Ledger, ledger_dsn: str, embedded_log: Any, rt: Any,
                                                spark: Any, search_server: Any, tmp_path: Path) -> None:
    from kappaflow.projections.engine import build, prepare
    from kappaflow.projections.replay import as_spec, replay
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.base import VERSION
    from kappaflow.projections.sinks.postgres import PostgresSink
    from kappaflow.projections.sinks.search import SearchSink

    bank = Bank(bank_ledger)
    commits = open_accounts(bank) + history(bank, 70, seed=11)
    capture(source_config(ledger_dsn), embedded_log)

    # the balances view at earlier commit points (log cuts at a ledger position, whole commits
    # only); the full replay below is the last point
    plan = prepare(as_spec(Balances), rt)
    for p in (commits[len(commits) // 3].position, commits[2 * len(commits) // 3].position):
        end = offsets_at(embedded_log, SOURCE, p, [ACCOUNT_TOPIC])
        assert sum(end[ACCOUNT_TOPIC].values()) == p  # the bank's ledger has account events only
        shadow = rt.sink.begin_shadow(plan.view, label=f"at{p}")
        try:
            build(plan, rt, shadow, end)
            rows = list(rt.sink.scan(shadow))
        finally:
            rt.sink.drop(shadow)
        st = check_balances_view(rows, bank_ledger.read_all(limit=p, decode=False))
        assert st.last_position == p and st.transfers > 0
        assert max(r["last_position"] for r in rows) == p

    # the live views, replayed in full; AccountActivity into both of its sinks, its search index under
    # an alias of this test's own (the search server is shared by the session)
    replay(Balances, rt)
    index = f"account_activity_{uuid.uuid4().hex[:8]}"
    activity_proj = type("AccountActivityT", (AccountActivity,), {
        "name": index, "view": "account_activity", "__module__": AccountActivity.__module__,
        "sink_options": {"search": {**AccountActivity.sink_options["search"], "index": index}}})
    both = Runtime(spark, str(embedded_log.path), PostgresSink(ledger_dsn),
                   sinks={"search": SearchSink(search_server.url)}, checkpoint_dir=tmp_path / "ckpt-both")
    try:
        res = replay(activity_proj, both)
        assert sorted(res.sinks) == ["postgres", "search"]
        activity_plan = prepare(as_spec(activity_proj), both)
        live = {k: both.sinks[k].live(activity_plan.view) for k in ("postgres", "search")}
        assert live["postgres"] is not None and live["search"] is not None
        pg_rows, search_rows = ({r["position"]: {c: v for c, v in r.items() if c != VERSION}
                                 for r in both.sinks[k].scan(t)} for k, t in live.items())
        assert both.sinks["search"].count(live["search"]) == len(pg_rows)
        assert search_rows == pg_rows  # the index equals the PostgreSQL account_activity view
    finally:
        both.close()
    balances = view_rows(ledger_dsn, "balances")
    everything = check_balances_view(balances, bank_ledger.iter_all(decode=False))
    assert everything.last_position == commits[-1].position
    activity = view_rows(ledger_dsn, "account_activity")
    assert sorted(r["position"] for r in activity) == list(range(1, everything.last_position + 1))
    per_account = Counter[str]()
    for r in activity:
        per_account[r["account"]] += r["delta"]
    assert dict(per_account) == {r["account"]: r["balance"] for r in balances}
    sent = [r for r in activity if r["event_type"] == "TransferSent"]
    assert sent and all(r["counterparty"] in ACCOUNTS and r["delta"] < 0 for r in sent)

    # the index as an application queries it: one document per event, filtered by account, full text on owner
    from opensearchpy import OpenSearch

    client = OpenSearch(search_server.url)
    assert client.count(index=index)["count"] == len(activity)
    alice = client.search(index=index, body={"query": {"term": {"account": "alice"}}, "size": 1000})
    assert sorted(h["_source"]["position"] for h in alice["hits"]["hits"]) == \
        sorted(r["position"] for r in activity if r["account"] == "alice")
    assert client.search(index=index, body={"query": {"match": {"owner": "Alice"}}})["hits"]["hits"][0][
        "_source"]["event_type"] == "AccountOpened"


def test_read_your_writes_end_to_end(bank_ledger: Ledger, ledger_dsn: str, embedded_log: Any, rt: Any) -> None:
    from kappaflow.projections.follow import Follower

    bank = Bank(bank_ledger)
    open_accounts(bank)
    history(bank, 20, seed=5)
    cfg = source_config(ledger_dsn)
    capture(cfg, embedded_log)  # the topic exists before the follower starts
    stop = StopSignal()
    errors: list[BaseException] = []

    def run_capture() -> None:
        try:
            LedgerConnector(cfg, embedded_log, partitions=3, progress=False, linger_s=0.01).run(stop)
        except BaseException as exc:  # reported below
            errors.append(exc)

    capturing = threading.Thread(target=run_capture, daemon=True)
    capturing.start()
    follower = Follower(Balances, rt, trigger="0.2s").start()
    positions = LogProjectionPositions(ledger_dsn, embedded_log, bank_ledger, SOURCE)
    try:
        before = bank.account("bob").balance
        funds = bank.account("alice").balance
        if funds == 0:
            bank.deposit("alice", 500)
            funds = 500
        r = bank.transfer("alice", "bob", min(funds, 123), transfer_id="ryw-1")
        reached = wait_for_projection(positions, "balances", r.position, timeout=120)
        assert reached >= r.position
        # the documented call: the views DSN, against the positions the real follower stored
        assert wait_for_projection(ledger_dsn, "balances", r.position, timeout=120, log=embedded_log,
                                   ledger=bank_ledger, source=SOURCE) >= r.position
        rows = {row["account"]: row for row in view_rows(ledger_dsn, "balances")}  # read after the wait
        assert rows["bob"]["balance"] == before + min(funds, 123)
        assert rows["alice"]["balance"] == bank.account("alice").balance
        assert rows["bob"]["last_position"] == r.position  # the credit is the transfer's last event
        check_invariants(bank_ledger.iter_all())

        # the capture stops: a new write never reaches the view, and the wait says so
        stop.set("test")
        capturing.join(timeout=60)
        assert not errors, errors
        late = bank.deposit("carol", 1)
        with pytest.raises(ProjectionTimeoutError) as err:
            wait_for_projection(positions, "balances", late.position, timeout=1.0)
        assert err.value.projection == "balances" and err.value.position == late.position
        assert f"did not reach ledger position {late.position} within 1" in str(err.value)
        assert err.value.transient
    finally:
        stop.set("test")
        follower.stop()
        positions.close()
        capturing.join(timeout=60)


def test_event_topics_need_a_custom_fold() -> None:
    from kappaflow.errors import ConfigError
    from kappaflow.projections import Projection, Sum
    from kappaflow.projections.api import ProjectionSpec

    class Totals(Projection):
        name = "totals"
        sources = [Source(ACCOUNT_TOPIC, events=True)]
        key = ["stream_id"]
        aggregates = {"n": Sum("amount")}

    with pytest.raises(ConfigError, match=r"event topics \['bank\.account'\] need an apply\(\) fold"):
        ProjectionSpec.from_class(Totals)
    spec = ProjectionSpec.from_class(Balances)
    assert spec.sources[0].events and spec.kind == "custom"
    assert spec.fingerprint() != ProjectionSpec.from_class(
        type("B2", (Balances,), {"sources": [Source(ACCOUNT_TOPIC, key={"stream_id": "stream_id"})]})).fingerprint()
