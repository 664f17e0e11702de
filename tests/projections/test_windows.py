"""Windowed views (``window = Tumbling/Hopping``): the documented event-time rule, checked against a
plain-Python reference that reads the log's records itself.

The reference below is written from the README's "Event time" section, not from
``folds/windowed.py``: per input partition, in offset order, the partition watermark before an event
is the largest event time of the earlier inserts/updates minus ``delay``; a part (retraction or
insertion, one window) is late when ``end + allowed_lateness <= that``; ``update`` applies late
parts, ``drop``/``dead_letter`` skip them (dead_letter reports late insertions); W = min over the
non-idle partitions of their largest event time - delay; a window is final when ``W >= end +
allowed_lateness``. Histories are seeded: out-of-order event times, updates that move orders between
windows and customers, deletes, cancelled orders (``where``), events far beyond the lateness, and a
partition that stops getting events (idle).
"""

from __future__ import annotations

import random
import sys
import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from kappaflow.errors import ConfigError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.log.partitioner import partition_for
from kappaflow.projections import Count, Hopping, Max, Projection, ProjectionSpec, Sum, Tumbling
from kappaflow.projections.deadletter import read_dead_letters
from kappaflow.projections.engine import apply_range, prepare
from kappaflow.projections.folds.windowed import window_status
from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.status import projection_status
from tests._kill import KilledProcess, live_offsets, trial_count

T0 = datetime(2024, 3, 1, tzinfo=UTC)
H = timedelta(hours=1)
PARTITIONS = 3


def schema(source: str) -> TableSchema:
    return TableSchema(
        f"{source}.public.orders",
        (
            Column("id", FieldType.INT64, optional=False),
            Column("customer_id", FieldType.INT64),
            Column("amount", FieldType.INT64),
            Column("status", FieldType.STRING),
            Column("created_at", FieldType.TIMESTAMPTZ),
        ),
        ("id",),
    )


@dataclass(frozen=True)
class Cfg:
    shape: str  # tumbling | hopping
    late: str
    emit: str
    delay: timedelta
    lateness: timedelta
    idle: timedelta | None

    @property
    def size(self) -> timedelta:
        return H

    @property
    def slide(self) -> timedelta:
        return H if self.shape == "tumbling" else timedelta(minutes=30)

    def window(self) -> Any:
        rules = {"delay": self.delay, "allowed_lateness": self.lateness, "late": self.late, "emit": self.emit,
                 "idle_timeout": self.idle}
        if self.shape == "tumbling":
            return Tumbling("created_at", size="1h", **rules)
        return Hopping("created_at", size="1h", slide="30m", **rules)


def projection(source: str, cfg: Cfg, name: str) -> type[Projection]:
    return type("Hourly", (Projection,), {
        "name": name, "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "where": "status <> 'cancelled'", "window": cfg.window(),
        "aggregates": {"orders": Count(), "revenue": Sum("amount"), "largest": Max("amount")},
    })


# --- the reference ---------------------------------------------------------------------------------
def _records(log: Any, topic: str) -> dict[int, list[tuple[int, bytes, str, dict[str, Any] | None]]]:
    out: dict[int, list[tuple[int, bytes, str, dict[str, Any] | None]]] = {}
    for p in range(log.partitions(topic)):
        out[p] = []
        for r in log.iter_partition(topic, p):
            if r.value is None:
                continue  # tombstone
            v = orjson.loads(r.value)
            out[p].append((r.offset, r.key, v["op"], v["after"]))
    return out


def _windows(t: datetime, cfg: Cfg) -> list[datetime]:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    last = epoch + ((t - epoch) // cfg.slide) * cfg.slide
    out = []
    s = last
    while s > t - cfg.size:
        out.append(s)
        s -= cfg.slide
    return sorted(out)


def reference(
    log: Any, topic: str, cfg: Cfg, upto: dict[int, int] | None = None
) -> tuple[dict[Any, Any], int, list[int]]:
    """(view rows {(customer, start, end): (orders, revenue, largest, final)}, late events, late offsets
    reported) over each partition's records below `upto`."""
    pmax: dict[int, datetime] = {}
    contrib: dict[bytes, dict[datetime, tuple[int, int]]] = {}
    late_n = 0
    late_offsets: list[int] = []
    apply_late = cfg.late == "update"
    for p, recs in _records(log, topic).items():
        for off, key, _op, after in recs:
            if upto is not None and off >= upto.get(p, 0):
                break
            t = datetime.fromisoformat(after["created_at"]) if after and after.get("created_at") else None
            wm = pmax[p] - cfg.delay if p in pmax else None
            mine = contrib.setdefault(key, {})
            for ws in list(mine):
                if wm is not None and ws + cfg.size + cfg.lateness <= wm and not apply_late:
                    continue
                del mine[ws]
            keep = after is not None and after["status"] != "cancelled" and after["customer_id"] is not None
            if keep and t is not None:
                was_late = False
                for ws in _windows(t, cfg):
                    if wm is not None and ws + cfg.size + cfg.lateness <= wm:
                        was_late = True
                        if not apply_late:
                            continue
                    mine[ws] = (after["customer_id"], after["amount"])
                if was_late:
                    late_n += 1
                    late_offsets.append(off)
            if after is not None and t is not None and (p not in pmax or t > pmax[p]):
                pmax[p] = t
    seen = [pmax[p] for p in range(PARTITIONS) if p in pmax]
    if not seen or (cfg.idle is None and len(seen) < PARTITIONS):
        w = None
    elif cfg.idle is None:
        w = min(seen) - cfg.delay
    else:
        w = min(v for v in seen if v >= max(seen) - cfg.idle) - cfg.delay
    acc: dict[tuple[int, datetime], list[int]] = {}
    for mine in contrib.values():
        for ws, (cust, amount) in mine.items():
            acc.setdefault((cust, ws), []).append(amount)
    view = {}
    for (cust, ws), amounts in acc.items():
        final = w is not None and ws + cfg.size + cfg.lateness <= w
        if cfg.emit == "final_only" and not final:
            continue
        view[(cust, ws, ws + cfg.size)] = (len(amounts), sum(amounts), max(amounts), final)
    return view, late_n, (late_offsets if cfg.late == "dead_letter" else [])


# --- the history -----------------------------------------------------------------------------------
def history(w: TableWriter, rnd: random.Random, steps: int, idle_after: int | None,
            at: dict[str, Any] | None = None) -> None:
    """Orders in slowly advancing event time, 15% out of order by up to 90 minutes, 4% far beyond any
    lateness (a day late); updates moving orders in time and between customers, deletes, cancels.
    From `idle_after` on, partition 0 gets no events (idle). `at` carries the clock and the next order
    id from one call to the next."""
    at = at if at is not None else {}
    clock = at.get("clock", T0)
    next_id = at.get("next_id", 1)

    def pick_id() -> int:
        nonlocal next_id
        while True:
            i = next_id
            next_id += 1
            if idle_after is None or step < idle_after or partition_for(orjson.dumps({"id": i}), PARTITIONS) != 0:
                return i

    for step in range(steps):
        clock += timedelta(minutes=rnd.randint(0, 9))
        r = rnd.random()
        live = [k for k in w.rows if idle_after is None or step < idle_after
                or partition_for(orjson.dumps({"id": k[0]}), PARTITIONS) != 0]
        if r < 0.55 or not live:
            t = clock
            if rnd.random() < 0.15:
                t -= timedelta(minutes=rnd.randint(1, 90))
            if rnd.random() < 0.04:
                t -= timedelta(days=1)
            w.insert({"id": pick_id(), "customer_id": rnd.randint(1, 4), "amount": rnd.randint(1, 500),
                      "status": "new", "created_at": t})
        elif r < 0.75:
            k = rnd.choice(live)
            w.update(k, {"created_at": clock - timedelta(minutes=rnd.randint(0, 150))})
        elif r < 0.85:
            k = rnd.choice(live)
            w.update(k, {"customer_id": rnd.randint(1, 4), "amount": rnd.randint(1, 500)})
        elif r < 0.92:
            w.delete(rnd.choice(live))
        else:
            w.update(rnd.choice(live), {"status": rnd.choice(["cancelled", "paid"])})
        if rnd.random() < 0.2:
            w.flush()
    w.flush()
    at.update(clock=clock, next_id=next_id)


# --- reading the views -----------------------------------------------------------------------------
def view(dsn: str, name: str) -> dict[Any, Any]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f'SELECT customer_id, window_start, window_end, orders, revenue, largest, final FROM public."{name}"'
        ).fetchall()
    return {(r[0], r[1], r[2]): (r[3], int(r[4]), r[5], r[6]) for r in rows}


def diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want), key=repr)
    bad = [f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k)]
    return f"{len(bad)} rows differ, e.g. " + "; ".join(bad[:6])


def late_offsets(rt: Any, name: str) -> list[int]:
    rows = read_dead_letters(rt.log_url, rt.log_options, name)
    assert all(r["reason"] == "late" and r["event_time"] and "watermark" in r for r in rows), rows[:3]
    return sorted(r["offset"] for r in rows)


CONFIGS = {
    "tumbling-drop-updates": Cfg("tumbling", "drop", "updates", timedelta(minutes=10), timedelta(minutes=30), None),
    "hopping-deadletter-finalonly-idle": Cfg("hopping", "dead_letter", "final_only", timedelta(minutes=5),
                                             timedelta(minutes=20), timedelta(hours=3)),
    "tumbling-update-idle": Cfg("tumbling", "update", "updates", timedelta(0), timedelta(minutes=15),
                                timedelta(hours=2)),
}


# --- tests -----------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("case", list(CONFIGS))
def test_replay_and_follow_in_batches_equal_the_reference(rt: Any, embedded_log: Any, case: str) -> None:
    """Replay, and a follower fed the same log in batches of different sizes (cut anywhere), give the
    reference's windows, final flags, late counts and late dead letters, at an intermediate cut and at
    the end."""
    cfg = CONFIGS[case]
    source = "w" + uuid.uuid4().hex[:8]
    rnd = random.Random(zlib.crc32(case.encode()))  # not hash(): str hashes differ per process
    w = TableWriter(embedded_log, schema(source), partitions=PARTITIONS)
    history(w, rnd, 260, idle_after=120 if cfg.idle is not None else None)
    topic = w.topic
    end = embedded_log.end_offsets(topic)
    want, want_late, want_dead = reference(embedded_log, topic, cfg)
    assert want_late > 0 and len(want) > 10, "the history must produce late events and many windows"

    replayed = projection(source, cfg, "wr_" + uuid.uuid4().hex[:8])
    replay(replayed, rt)
    assert view(rt.dsn, replayed.name) == want, "replay: " + diff(view(rt.dsn, replayed.name), want)
    (status,) = [st.details for st in projection_status(rt, replayed.name)[0].sinks]  # as `kappaflow status`
    assert status["late_events"] == want_late and status["state_rows"] > 0
    assert late_offsets(rt, replayed.name) == sorted(want_dead)
    if cfg.emit == "updates":
        assert any(r[3] for r in want.values()) and not all(r[3] for r in want.values())

    followed = projection(source, cfg, "wf_" + uuid.uuid4().hex[:8])
    fspec = ProjectionSpec.from_class(followed)
    plan = prepare(fspec, rt)
    target = rt.sink.ensure(plan.view)
    pos = {p: 0 for p in range(PARTITIONS)}
    sizes = [1, 7, 40, 3, 90, 25, 200, 10_000]
    checked_mid = False
    for n in sizes:
        nxt = {p: min(end[p], pos[p] + max(1, n // PARTITIONS + (p == 0) * (n % PARTITIONS))) for p in pos}
        apply_range(plan, rt, target, {topic: dict(pos)}, {topic: dict(nxt)})
        pos = nxt
        if not checked_mid and sum(pos.values()) > sum(end.values()) // 3:
            mid, _, _ = reference(embedded_log, topic, cfg, upto=pos)
            assert view(rt.dsn, followed.name) == mid, "follow (mid-log): " + diff(view(rt.dsn, followed.name), mid)
            checked_mid = True
        if pos == dict(end):
            break
    assert pos == dict(end)
    assert view(rt.dsn, followed.name) == want, "follow: " + diff(view(rt.dsn, followed.name), want)
    fstatus = window_status(rt.sink, target)
    assert fstatus["late_events"] == want_late and fstatus["watermark"] == status["watermark"]
    assert late_offsets(rt, followed.name) == sorted(want_dead)
    if cfg.late != "update":  # the state of windows every partition has passed is dropped
        assert fstatus["state_rows"] <= status["state_rows"] + 50


def test_bad_window_definitions_fail_at_load_naming_the_attribute() -> None:
    base = {"name": "hourly", "sources": ["s.public.orders"], "key": ["customer_id"],
            "aggregates": {"n": Count()}}

    def load(**attrs: Any) -> ProjectionSpec:
        return ProjectionSpec.from_class(type("Hourly", (Projection,), {**base, **attrs}))

    cases = [
        (Tumbling("created_at", size=0), r"'window'.size: must be > 0"),
        (Tumbling("created_at", size="-1h"), r"'window'.size: must be > 0"),
        (Hopping("created_at", size="1h", slide="2h"), r"'window'.slide: must be at most size"),
        (Hopping("created_at", size="1h", slide=0), r"'window'.slide: must be > 0"),
        (Tumbling("created_at", size="1h", delay=-5), r"'window'.delay: must be >= 0"),
        (Tumbling("created_at", size="1h", allowed_lateness="-1m"), r"'window'.allowed_lateness: must be >= 0"),
        (Tumbling("created_at", size="1h", late="ignore"), r"'window'.late: unknown late-data policy 'ignore'"),
        (Tumbling("created_at", size="1h", emit="eventually"), r"'window'.emit: unknown emit mode 'eventually'"),
        (Tumbling("created_at", size="an hour"), r"'window'.size: expected a duration"),
        ("1h", r"'window': expected Tumbling"),
    ]
    for window, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            load(window=window)
        assert "Hourly" in str(info.value)
    with pytest.raises(ConfigError, match="'sinks': a windowed projection"):
        load(window=Tumbling("created_at", size="1h"), sinks=("postgres", "redis"))
    with pytest.raises(ConfigError, match="'aggregates'\\['final'\\]"):
        load(window=Tumbling("created_at", size="1h"), aggregates={"final": Count()})
    with pytest.raises(ConfigError, match="'aggregates': a windowed view needs"):
        load(window=Tumbling("created_at", size="1h"), aggregates={})
    spec = load(window=Tumbling("created_at", size="1h", delay="10m", allowed_lateness=timedelta(minutes=30)))
    assert spec.kind == "windowed" and spec.fold.size_us == 3_600_000_000  # type: ignore[attr-defined]


@pytest.mark.integration
def test_a_non_timestamp_event_time_column_fails_when_the_projection_is_compiled(rt: Any, embedded_log: Any) -> None:
    source = "w" + uuid.uuid4().hex[:8]
    TableWriter(embedded_log, schema(source), partitions=1).flush()
    for column, typ in (("amount", "bigint"), ("status", "string")):
        proj = type("ByAmount", (Projection,), {
            "name": "wbad", "sources": [f"{source}.public.orders"], "key": ["customer_id"],
            "window": Tumbling(column, size="1h"), "aggregates": {"n": Count()}})
        with pytest.raises(ConfigError, match=f"'window'.column: the event-time column '{column}' is {typ}"):
            prepare(ProjectionSpec.from_class(proj), rt)
    proj = type("Derived", (Projection,), {
        "name": "wderived", "sources": [f"{source}.public.orders"], "key": ["customer_id"],
        "derive": {"day": "cast(to_date(created_at) as timestamp)"},
        "window": Tumbling("day", size="1d"), "aggregates": {"n": Count()}})
    assert "window_start" in prepare(ProjectionSpec.from_class(proj), rt).view.column_names


# --- kill -9 of a follower mid-window ------------------------------------------------------------------
RUNNER = Path(__file__).with_name("window_runner.py")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)  # three follower processes start their own Spark
@pytest.mark.parametrize("shape", ["tumbling", "session"])
def test_follower_killed_with_sigkill_mid_window_equals_the_reference(rt: Any, embedded_log: Any,
                                                                       tmp_path: Path, shape: str) -> None:
    """A follower process (batches of at most 40 records) is killed with -9 while windows are open and
    late events arrive, then restarted: the same windows, the same late decisions, nothing counted
    twice -- the view equals the reference and a fresh replay. ``session``: the same with session
    windows (window_runner.sessions), whose batches merge and split sessions."""
    from tests.projections.window_runner import PROJECTIONS

    make = PROJECTIONS[shape]

    def want_of() -> tuple[dict[Any, Any], int]:
        if shape == "session":
            from tests.projections.test_session_windows import CONFIGS as SESSION_CONFIGS
            from tests.projections.test_session_windows import session_reference

            ref = session_reference(embedded_log, w.topic, SESSION_CONFIGS["session-drop-updates"])
            return ref.view, ref.late
        got, late, _ = reference(embedded_log, w.topic, CONFIGS["tumbling-drop-updates"])
        return got, late

    source = "k" + uuid.uuid4().hex[:7]
    name = make(source).name
    w = TableWriter(embedded_log, schema(source), partitions=PARTITIONS)
    rnd = random.Random(4242)
    at: dict[str, Any] = {}
    history(w, rnd, 120, None, at)
    argv = [sys.executable, str(RUNNER), str(embedded_log.path), rt.dsn, str(tmp_path / "ckpt"), source, shape]
    proc = KilledProcess(argv, tmp_path / "runner.log", "the follower")
    try:
        proc.kill_after_progress(lambda: live_offsets(rt.dsn, name), lambda _: history(w, rnd, 80, None, at),
                                 trial_count(1, 2), rnd, 1.0)
        end = sum(embedded_log.end_offsets(w.topic).values())
        proc.wait(lambda: live_offsets(rt.dsn, name) >= end, 300, "the restarted follower to reach the log end")
    finally:
        proc.kill()
    want, want_late = want_of()
    assert view(rt.dsn, name) == want, "after kill -9: " + diff(view(rt.dsn, name), want)
    spec = ProjectionSpec.from_class(make(source))
    assert window_status(rt.sink, rt.sink.live(prepare(spec, rt).view))["late_events"] == want_late
    replay(make(source), rt)
    assert view(rt.dsn, name) == want, "a fresh replay differs"
