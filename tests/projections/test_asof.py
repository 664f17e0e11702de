"""As-of enrichment (stream-table): replay == follow == a plain-Python reference of the README's rule.

Two clocks (README "As-of enrichment"): a ledger-shaped event topic enriched from a table of
ANOTHER source (time: the event's ``recorded_at`` against the table change's commit time made
non-decreasing by a running maximum, strictly earlier counts, events wait until the table's
frontier passes them), and an append-only table enriched from a table of the SAME source
(position: the change's LSN). Seeded interleavings: renames between events, deletes and
re-inserts, commit times that step back, equal times, and table changes that reach the log
rounds after the events that follow them (late table rows). Every round a running follower is
compared with the reference over what the log holds; at the end a fresh replay equals the
followed view.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import ConfigError
from kappaflow.events import ChangeEvent, Column, FieldType, Op, SourceInfo, TableSchema
from kappaflow.log.base import Record, TopicConfig
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections import AsOf, Event, Projection, Source
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.postgres import PostgresSink

pytestmark = pytest.mark.integration

T0_US = int(datetime(2025, 3, 1, tzinfo=UTC).timestamp() * 1_000_000)


@pytest.fixture
def art(spark: Any, pg_dsn: str, tmp_path: Path) -> Any:
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = Runtime(spark, str(log_dir), PostgresSink(pg_dsn), dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt")
    try:
        yield rt, log
    finally:
        rt.close()
        log.close()


class TimedWriter(TableWriter):
    """A TableWriter whose commit time (``source.ts_ms``) and LSN the test sets (``at``)."""

    ts_ms = 0

    def at(self, ts_ms: int, lsn: int | None = None) -> TimedWriter:
        self.ts_ms = ts_ms
        if lsn is not None:
            self.lsn = lsn - 1
        return self

    def _event(self, op: Op, before: dict[str, Any] | None, after: dict[str, Any] | None, key: dict[str, Any]) -> None:
        self.lsn += 1
        src = SourceInfo(
            "postgresql",
            self.source,
            "db",
            self.pg_schema,
            self.table,
            PgPosition(self.lsn, 0),
            ts_ms=self.ts_ms,
            tx_id=self.lsn,
        )
        ev = ChangeEvent(op, key, before, after, src, ts_ms=self.ts_ms)
        kb = self.codec.encode_key(key, self.schema)
        self.pending.append(Record(kb, self.codec.encode_value(ev, self.schema), (("kf.op", op.value.encode()),)))
        if op is Op.DELETE:
            self.pending.append(Record(kb, None))


def _cut(log: EmbeddedLog, source: str, topics: list[str]) -> None:
    """What a capture writes after each transaction: the source's cut (readers stop there)."""
    OffsetStore(log).save(
        source,
        {"n": sum(sum(log.end_offsets(t).values()) for t in topics)},
        cut={t: log.end_offsets(t) for t in topics},
    )


def _holders(source: str) -> TableSchema:
    return TableSchema(
        f"{source}.public.holders",
        (
            Column("stream_id", FieldType.STRING, optional=False),
            Column("name", FieldType.STRING),
            Column("tier", FieldType.INT64),
        ),
        ("stream_id",),
    )


def statement(topic: str, table: str) -> type[Projection]:
    """One row per account event with the holder's name and tier as of the event."""

    class Statement(Projection):
        name = "ao_" + uuid.uuid4().hex[:8]
        sources = [Source(topic, events=True, key={"position": "position"})]
        key = ["position"]
        schema = "position bigint, stream_id string, amount bigint, holder_name string, holder_tier bigint"
        as_of = [AsOf("holder", table, on={"stream_id": "stream_id"}, columns=["name", "tier"])]

        def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
            e = event.after or {}
            return {
                "stream_id": e["stream_id"],
                "amount": e["data"]["amount"],
                "holder_name": e["holder_name"],
                "holder_tier": e["holder_tier"],
            }

    return Statement


def _view(rt: Runtime, proj: type[Projection]) -> dict[int, tuple[Any, ...]]:
    spec = as_spec(proj)
    live = rt.sink.live(prepare(spec, rt).view)
    assert live is not None, f"{spec.name}: no live view"
    out = {}
    for r in rt.sink.scan(live):
        out[r["position"]] = tuple(r[c] for c in ("stream_id", "amount", "holder_name", "holder_tier"))
    return out


def _diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want))
    return "; ".join(f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k))[:2000]


def reference_by_time(
    events: list[dict[str, Any]], changes: list[tuple[str, int, dict[str, Any] | None]]
) -> dict[int, tuple[Any, ...]]:
    """The README's time rule in plain Python. `changes`: the table's changes in commit (log) order as
    (key, commit ts_ms, row or None for a delete); `events`: the events the log holds."""
    eff, hist = None, {}
    for k, ts, row in changes:
        eff = ts * 1000 if eff is None else max(eff, ts * 1000)
        hist.setdefault(k, []).append((eff, row))
    out = {}
    for e in events:
        t = e["_t"]
        if eff is None or t > eff:
            continue  # waits: the table's capture has not passed it
        row = None
        for ve, vr in hist.get(e["stream_id"], []):
            if ve < t:
                row = vr
        out[e["position"]] = (
            e["stream_id"],
            e["data"]["amount"],
            row["name"] if row else None,
            row["tier"] if row else None,
        )
    return out


def _iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, UTC).isoformat()


def test_event_stream_enriched_as_of_another_source_replay_equals_follow(art: Any) -> None:
    rt, log = art
    x = uuid.uuid4().hex[:6]
    ev_source, tb_source = f"bank{x}", f"crm{x}"
    topic = f"{ev_source}.account"
    log.create_topic(topic, TopicConfig(partitions=2))
    table = TimedWriter(log, _holders(tb_source), partitions=2)
    rng = random.Random(15)
    accounts = [f"account-{i}" for i in range(6)]
    # the timeline: table changes and events, in time order (ms ticks, some equal, some stepping back)
    t_ms = T0_US // 1000
    tl_changes: list[tuple[str, int, str, dict[str, Any] | None]] = []  # (key, ts_ms, op, row)
    tl_events: list[dict[str, Any]] = []
    live: dict[str, dict[str, Any]] = {}
    pos = 0
    for i in range(160):
        t_ms += rng.choice((0, 1, 1, 2, 5))
        r = rng.random()
        acct = rng.choice(accounts)
        if r < 0.35:
            ts = t_ms - (1 if rng.random() < 0.15 else 0)  # a commit time that steps back a little
            if acct in live and rng.random() < 0.2:
                tl_changes.append((acct, ts, "delete", None))
                del live[acct]
            else:
                row = {"stream_id": acct, "name": f"{acct}-n{i}", "tier": rng.randint(1, 3)}
                tl_changes.append((acct, ts, "update" if acct in live else "insert", row))
                live[acct] = row
        else:
            pos += 1
            at_us = t_ms * 1000 + rng.choice((0, 0, 1, 500))  # 0: the same instant as a change of that ms
            tl_events.append(
                {
                    "position": pos,
                    "stream_id": acct,
                    "stream_version": pos,
                    "event_type": "Deposited",
                    "data": {"amount": rng.randint(1, 500)},
                    "recorded_at": _iso(at_us),
                    "_t": at_us,
                }
            )
    proj = statement(topic, table.topic)
    written_changes: list[tuple[str, int, dict[str, Any] | None]] = []
    written_events: list[dict[str, Any]] = []
    ci = ei = 0

    def write_round(n_changes: int, n_events: int) -> None:
        nonlocal ci, ei
        for k, ts, op, row in tl_changes[ci : ci + n_changes]:
            table.at(ts)
            if op == "delete":
                table.delete((k,))
            elif op == "insert":
                table.insert(row or {})
            else:
                table.update((k,), {c: v for c, v in (row or {}).items() if c != "stream_id"})
            written_changes.append((k, ts, row))
        table.flush()
        _cut(log, tb_source, [table.topic])
        evs = tl_events[ei : ei + n_events]
        if evs:
            log.append(
                topic,
                [Record(e["stream_id"].encode(), orjson.dumps({k: v for k, v in e.items() if k != "_t"})) for e in evs],
            )
        _cut(log, ev_source, [topic])
        written_events.extend(evs)
        ci += len(tl_changes[ci : ci + n_changes])
        ei += len(evs)

    write_round(len(tl_changes) // 5, len(tl_events) // 4)  # events ahead of the table: some wait
    replay(proj, rt)
    got, want = _view(rt, proj), reference_by_time(written_events, written_changes)
    assert got == want, f"replay: {_diff(got, want)}"
    assert len(want) < len(written_events), "the test must hold some events back (table behind the events)"
    f = Follower(proj, rt, trigger="0.2s").start()
    try:
        for rnd in range(3):
            if rnd % 2:  # the table catches up past the events (late table rows reach the log now)
                write_round(len(tl_changes) // 4, len(tl_events) // 8)
            else:  # events run ahead of the table
                write_round(len(tl_changes) // 10, len(tl_events) // 5)
            assert f.wait_for(lambda s: f.caught_up(), 120), "follower did not catch up within 120 s"
            got, want = _view(rt, proj), reference_by_time(written_events, written_changes)
            assert got == want, f"round {rnd}: {_diff(got, want)}"
        write_round(len(tl_changes), len(tl_events))
        assert f.wait_for(lambda s: f.caught_up(), 120), "follower did not catch up within 120 s"
        followed = _view(rt, proj)
    finally:
        f.stop()
    want = reference_by_time(written_events, written_changes)
    assert followed == want, _diff(followed, want)
    renamed = {e["stream_id"] for e in written_events if want.get(e["position"])} & {k for k, _, _ in written_changes}
    names = {v[2] for v in want.values() if v[0] in renamed}
    assert len(names) > len(renamed), "the timeline must rename holders between their events"
    replay(proj, rt, wait_lock_s=60)  # a year later: the same view (the stopped follower's lock may linger)
    assert _view(rt, proj) == followed


def test_append_only_table_enriched_as_of_same_source_by_position(art: Any) -> None:
    """Same source: the LSN orders payments against the accounts' renames; nothing waits."""
    rt, log = art
    source = "s" + uuid.uuid4().hex[:7]
    accounts = TimedWriter(
        log,
        TableSchema(
            f"{source}.public.accounts",
            (Column("id", FieldType.INT64, optional=False), Column("holder", FieldType.STRING)),
            ("id",),
        ),
        partitions=2,
    )
    payments = TimedWriter(
        log,
        TableSchema(
            f"{source}.public.payments",
            (
                Column("id", FieldType.INT64, optional=False),
                Column("account_id", FieldType.INT32),
                Column("amount", FieldType.INT64),
            ),
            ("id",),
        ),
        partitions=2,
    )

    class Payments(Projection):
        name = "ap_" + uuid.uuid4().hex[:8]
        sources = [payments.topic]
        key = ["id"]
        schema = "id bigint, account_id int, amount bigint, acct_holder string"
        as_of = [AsOf("account", accounts.topic, on={"account_id": "id"}, columns=["holder"], prefix="acct_")]

        def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
            return None if event.after is None else {k: event.after[k] for k in ("account_id", "amount", "acct_holder")}

    rng = random.Random(7)
    lsn, hist, want = 100, {}, {}
    live: set[int] = set()
    pid = 0

    def step(n: int) -> None:
        nonlocal lsn, pid
        for _ in range(n):
            lsn += rng.choice((1, 2))
            a = rng.randint(1, 4)
            if rng.random() < 0.4:
                if a in live and rng.random() < 0.25:
                    accounts.at(0, lsn).delete((a,))
                    live.discard(a)
                    hist.setdefault(a, []).append(None)
                else:
                    row = {"id": a, "holder": f"h{a}-{lsn}"}
                    (
                        accounts.at(0, lsn).update((a,), {"holder": row["holder"]})
                        if a in live
                        else accounts.at(0, lsn).insert(row)
                    )
                    live.add(a)
                    hist.setdefault(a, []).append(row["holder"])
            else:
                pid += 1
                payments.at(0, lsn).insert({"id": pid, "account_id": a, "amount": pid * 3})
                want[pid] = (a, pid * 3, hist[a][-1] if hist.get(a) else None)
        accounts.flush()
        payments.flush()
        _cut(log, source, [accounts.topic, payments.topic])

    def view() -> dict[int, tuple[Any, ...]]:
        live_t = rt.sink.live(prepare(as_spec(Payments), rt).view)
        assert live_t is not None
        return {r["id"]: (r["account_id"], r["amount"], r["acct_holder"]) for r in rt.sink.scan(live_t)}

    step(30)
    replay(Payments, rt)
    assert view() == want, _diff(view(), want)
    f = Follower(Payments, rt, trigger="0.2s").start()
    try:
        for _ in range(2):
            step(30)
            assert f.wait_for(lambda s: f.caught_up(), 120), "follower did not catch up within 120 s"
            assert view() == want, _diff(view(), want)
    finally:
        f.stop()
    followed = view()
    replay(Payments, rt, wait_lock_s=60)
    assert view() == followed == want
    # compaction drops superseded versions of the accounts: a replay now would enrich old payments with
    # later holders -- it is refused, naming the topic, and the live view stays as it was
    stats = log.compact(accounts.topic, now_ms=2**62)
    assert stats.removed > 0
    with pytest.raises(ConfigError, match=rf"as_of lookup needs every version of table topic '{accounts.topic}'.*"
                                          r"records are missing from its history \(partition 0: \d+ of \d+"):
        replay(Payments, rt, wait_lock_s=60)
    assert view() == want


def test_bad_as_of_definitions_fail_at_load_time_naming_projection_and_attribute(art: Any) -> None:
    rt, log = art
    x = uuid.uuid4().hex[:6]
    topic = f"bank{x}.account"
    log.create_topic(topic, TopicConfig(partitions=1))
    table = TimedWriter(log, _holders(f"crm{x}"), partitions=1)
    good = statement(topic, table.topic)

    def error(**attrs: Any) -> str:
        p = type("BadAsOf", (good,), {"name": "ae_" + uuid.uuid4().hex[:6], **attrs})
        with pytest.raises(ConfigError) as info:
            prepare(as_spec(p), rt)
        return str(info.value)

    msg = error(as_of=[AsOf("holder", table.topic, on={"stream_id": "stream_id"}, columns=["name", "nope"])])
    assert "'as_of'['holder'].columns" in msg and "nope" in msg and "ae_" in msg
    msg = error(as_of=[AsOf("holder", f"crm{x}.public.missing", on={"stream_id": "stream_id"})])
    assert "'as_of'['holder'].topic" in msg and "missing" in msg
    msg = error(as_of=[AsOf("holder", table.topic, on={"stream_id": "name"})])
    assert "'as_of'['holder'].on" in msg and "primary key" in msg
    msg = error(as_of=[AsOf("holder", table.topic, on={"stream_id": "stream_id"}, prefix="bad prefix")])
    assert "'as_of'['holder'].prefix" in msg and "BadAsOf" in msg
    msg = error(sinks=("postgres", "search"))
    assert "'as_of'" in msg and "sinks" in msg
    latest = type(
        "LatestAsOf",
        (Projection,),
        {
            "name": "ae_latest",
            "sources": [table.topic],
            "key": ["stream_id"],
            "as_of": [AsOf("holder", table.topic, on={"stream_id": "stream_id"})],
        },
    )
    with pytest.raises(ConfigError, match=r"LatestAsOf: 'as_of': as-of enrichment feeds custom folds"):
        as_spec(latest)
