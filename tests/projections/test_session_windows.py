"""Session windows (``window = Session(column, gap)``): the documented session rule, checked against a
plain-Python reference that reads the log's records itself.

The reference is written from the README's "Event time" section, with the watermark of
``test_windows.py`` (same histories, same log, same reading of the records): per input partition, in
offset order, the partition watermark before an event is the largest event time of the earlier
inserts/updates minus ``delay``; a contribution at event time t is late when ``t + allowed_lateness <=
that``; ``update`` applies late insertions and retractions, ``drop``/``dead_letter`` skip both
(dead_letter reports late insertions). Then, per customer, contributions sorted by event time less
than ``gap`` apart form one session [first, last + gap); a session is final when ``W >= end +
allowed_lateness``. The histories merge sessions (out-of-order orders bridging two) and split them
(deletes, updates moving an order's time, cancels, orders moved to another customer).
"""

from __future__ import annotations

import random
import uuid
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest

from kappaflow.errors import ConfigError
from kappaflow.projections import Count, Max, Projection, ProjectionSpec, Session, Sum
from kappaflow.projections.engine import apply_range, prepare
from kappaflow.projections.folds.sessions import session_bounds
from kappaflow.projections.folds.windowed import window_status
from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.status import projection_status
from tests.projections.test_windows import PARTITIONS, _records, diff, history, late_offsets, schema, view


@dataclass(frozen=True)
class SessionCfg:
    gap: timedelta
    late: str
    emit: str
    delay: timedelta
    lateness: timedelta
    idle: timedelta | None

    def window(self) -> Session:
        return Session("created_at", gap=self.gap, delay=self.delay, allowed_lateness=self.lateness,
                       late=self.late, emit=self.emit, idle_timeout=self.idle)


def sessions_projection(source: str, cfg: SessionCfg, name: str) -> type[Projection]:
    return type("Sessions", (Projection,), {
        "name": name, "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "where": "status <> 'cancelled'", "window": cfg.window(),
        "aggregates": {"orders": Count(), "revenue": Sum("amount"), "largest": Max("amount")},
    })


# --- the reference ---------------------------------------------------------------------------------
def _sessions(times: list[datetime], gap: timedelta) -> list[list[datetime]]:
    """The documented rule, written out: sorted times less than `gap` apart are one session."""
    out: list[list[datetime]] = []
    for t in sorted(times):
        if out and t - out[-1][-1] < gap:
            out[-1].append(t)
        else:
            out.append([t])
    return out


@dataclass
class SessionRef:
    view: dict[Any, Any]
    late: int
    dead: list[int]
    merges: int  # insertions that joined two or more sessions
    splits: int  # retractions that cut a session in two or more


def session_reference(log: Any, topic: str, cfg: SessionCfg, upto: dict[int, int] | None = None) -> SessionRef:
    pmax: dict[int, datetime] = {}
    contrib: dict[bytes, dict[datetime, tuple[int, int]]] = {}
    late_n, merges, splits = 0, 0, 0
    late_offs: list[int] = []
    apply_late = cfg.late == "update"

    def count(cust: int) -> int:
        return len(_sessions([t for m in contrib.values() for t, (c, _) in m.items() if c == cust], cfg.gap))

    for p, recs in _records(log, topic).items():
        for off, key, _op, after in recs:
            if upto is not None and off >= upto.get(p, 0):
                break
            t = datetime.fromisoformat(after["created_at"]) if after and after.get("created_at") else None
            wm = pmax[p] - cfg.delay if p in pmax else None
            mine = contrib.setdefault(key, {})
            for old in list(mine):
                if wm is not None and old + cfg.lateness <= wm and not apply_late:
                    continue  # a late retraction: the contribution stays
                cust = mine[old][0]
                before = count(cust)
                del mine[old]
                splits += count(cust) > before
            keep = after is not None and after["status"] != "cancelled" and after["customer_id"] is not None
            if keep and t is not None:
                late = wm is not None and t + cfg.lateness <= wm
                if late:
                    late_n += 1
                    late_offs.append(off)
                if apply_late or not late:
                    before = count(after["customer_id"])
                    mine[t] = (after["customer_id"], after["amount"])
                    merges += count(after["customer_id"]) < before
            if after is not None and t is not None and (p not in pmax or t > pmax[p]):
                pmax[p] = t
    seen = [pmax[p] for p in range(PARTITIONS) if p in pmax]
    if not seen or (cfg.idle is None and len(seen) < PARTITIONS):
        w = None
    elif cfg.idle is None:
        w = min(seen) - cfg.delay
    else:
        w = min(v for v in seen if v >= max(seen) - cfg.idle) - cfg.delay
    by_cust: dict[int, list[tuple[datetime, int]]] = {}
    for mine in contrib.values():
        for t, (cust, amount) in mine.items():
            by_cust.setdefault(cust, []).append((t, amount))
    out = {}
    for cust, items in by_cust.items():
        amounts: dict[datetime, list[int]] = {}
        for t, a in items:
            amounts.setdefault(t, []).append(a)
        for sess in _sessions([t for t, _ in items], cfg.gap):
            start, end = sess[0], sess[-1] + cfg.gap
            values = [a for t in dict.fromkeys(sess) for a in amounts[t]]
            final = w is not None and end + cfg.lateness <= w
            if cfg.emit == "final_only" and not final:
                continue
            out[(cust, start, end)] = (len(values), sum(values), max(values), final)
    return SessionRef(out, late_n, late_offs if cfg.late == "dead_letter" else [], merges, splits)


CONFIGS = {
    "session-drop-updates": SessionCfg(timedelta(minutes=20), "drop", "updates", timedelta(minutes=10),
                                       timedelta(minutes=30), None),
    "session-deadletter-finalonly-idle": SessionCfg(timedelta(minutes=25), "dead_letter", "final_only",
                                                    timedelta(minutes=5), timedelta(minutes=20), timedelta(hours=3)),
    "session-update-idle": SessionCfg(timedelta(minutes=20), "update", "updates", timedelta(0),
                                      timedelta(minutes=15), timedelta(hours=2)),
}


# --- tests -----------------------------------------------------------------------------------------
def test_session_bounds_follow_the_gap() -> None:
    """Half-open sessions: times exactly `gap` apart are two sessions, closer ones one."""
    assert session_bounds([0, 5, 10, 20, 29, 100], 10) == [
        (0, 20), (0, 20), (0, 20), (20, 39), (20, 39), (100, 110)]
    assert session_bounds([], 10) == [] and session_bounds([7, 7], 1) == [(7, 8), (7, 8)]


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CONFIGS))
def test_session_replay_and_follow_in_random_batches_equal_the_reference(rt: Any, embedded_log: Any,
                                                                         case: str) -> None:
    """Replay, and a follower fed the same log in batches cut at random places per partition, give the
    reference's sessions (merged and split ones included), final flags, late counts and late dead
    letters, at an intermediate cut and at the end."""
    cfg = CONFIGS[case]
    source = "s" + uuid.uuid4().hex[:8]
    rnd = random.Random(zlib.crc32(case.encode()))
    w = TableWriter(embedded_log, schema(source), partitions=PARTITIONS)
    history(w, rnd, 260, idle_after=120 if cfg.idle is not None else None)
    topic = w.topic
    end = embedded_log.end_offsets(topic)
    ref = session_reference(embedded_log, topic, cfg)
    assert ref.late > 0 and len(ref.view) > 10, "the history must produce late events and many sessions"
    assert ref.merges > 0 and ref.splits > 0, f"the history must merge and split sessions ({ref.merges}, {ref.splits})"
    assert any(r[0] > 1 for r in ref.view.values()), "some session must hold several orders"

    replayed = sessions_projection(source, cfg, "sr_" + uuid.uuid4().hex[:8])
    replay(replayed, rt)
    assert view(rt.dsn, replayed.name) == ref.view, "replay: " + diff(view(rt.dsn, replayed.name), ref.view)
    (status,) = [st.details for st in projection_status(rt, replayed.name)[0].sinks]
    assert status["late_events"] == ref.late and status["state_rows"] > 0
    assert late_offsets(rt, replayed.name) == sorted(ref.dead)
    if cfg.emit == "updates":
        assert any(r[3] for r in ref.view.values()) and not all(r[3] for r in ref.view.values())

    followed = sessions_projection(source, cfg, "sf_" + uuid.uuid4().hex[:8])
    plan = prepare(ProjectionSpec.from_class(followed), rt)
    target = rt.sink.ensure(plan.view)
    pos = {p: 0 for p in range(PARTITIONS)}
    cuts = random.Random(zlib.crc32(("cuts" + case).encode()))
    checked_mid, batches = False, 0
    while pos != dict(end):
        nxt = {p: min(end[p], pos[p] + cuts.choice([0, 1, 2, 5, 13, 30, 60])) for p in pos}
        if nxt == pos:
            continue
        apply_range(plan, rt, target, {topic: dict(pos)}, {topic: dict(nxt)})
        pos, batches = nxt, batches + 1
        if not checked_mid and sum(pos.values()) > sum(end.values()) // 3:
            mid = session_reference(embedded_log, topic, cfg, upto=pos).view
            assert view(rt.dsn, followed.name) == mid, "follow (mid-log): " + diff(view(rt.dsn, followed.name), mid)
            checked_mid = True
    assert batches >= 4
    assert view(rt.dsn, followed.name) == ref.view, "follow: " + diff(view(rt.dsn, followed.name), ref.view)
    fstatus = window_status(rt.sink, target)
    assert fstatus["late_events"] == ref.late and fstatus["watermark"] == status["watermark"]
    assert late_offsets(rt, followed.name) == sorted(ref.dead)
    if cfg.late != "update":  # the state of sessions every partition has passed is dropped
        assert fstatus["state_rows"] <= status["state_rows"] + 50


def test_bad_session_definitions_fail_at_load_naming_the_attribute() -> None:
    base = {"name": "sessions", "sources": ["s.public.orders"], "key": ["customer_id"],
            "aggregates": {"n": Count()}}

    def load(**attrs: Any) -> ProjectionSpec:
        return ProjectionSpec.from_class(type("Sessions", (Projection,), {**base, **attrs}))

    cases = [
        (Session("created_at", gap=0), r"'window'.gap: must be > 0"),
        (Session("created_at", gap="-30m"), r"'window'.gap: must be > 0"),
        (Session("created_at", gap="a while"), r"'window'.gap: expected a duration"),
        (Session("created_at", gap="30m", delay="-1m"), r"'window'.delay: must be >= 0"),
        (Session("created_at", gap="30m", allowed_lateness=-1), r"'window'.allowed_lateness: must be >= 0"),
        (Session("created_at", gap="30m", late="ignore"), r"'window'.late: unknown late-data policy 'ignore'"),
        (Session("", gap="30m"), r"'window'.column: expected the event-time column's name"),
    ]
    for window, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            load(window=window)
        assert "Sessions" in str(info.value)
    spec = load(window=Session("created_at", gap="30m", delay="1m"))
    assert spec.fold.shape == "session" and spec.fold.size_us == 1_800_000_000  # type: ignore[attr-defined]


@pytest.mark.integration
def test_a_non_timestamp_session_column_fails_when_the_projection_is_compiled(rt: Any, embedded_log: Any) -> None:
    source = "s" + uuid.uuid4().hex[:8]
    TableWriter(embedded_log, schema(source), partitions=1).flush()
    proj = type("ByAmount", (Projection,), {
        "name": "sbad", "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "window": Session("amount", gap="30m"), "aggregates": {"n": Count()}})
    with pytest.raises(ConfigError, match=r"'window'\.column: the event-time column 'amount' is bigint"):
        prepare(ProjectionSpec.from_class(proj), rt)
