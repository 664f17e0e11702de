"""The Redis sink against a real Redis: version guard, pointer switch, lost state, bad input."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest
import redis
from _sink_helpers import TOPIC, customer_view, drive, final_state, history, row, rows_by_key, wait_for
from pyspark.sql import types as T

from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.base import ViewColumn, ViewSchemaMismatch, ViewSpec, batch_from_rows
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.redis import RedisSink, get, get_many
from kappaflow.projections.sinks.testing import SinkContract

pytestmark = pytest.mark.integration


def _view(**options: Any) -> ViewSpec:
    return customer_view(f"cust_{uuid.uuid4().hex[:8]}", **options)


@pytest.fixture
def client(redis_server: Any) -> Any:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


@pytest.fixture(params=["json", "hash"])
def value_format(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_duplicate_and_out_of_order_delivery_keep_the_newest(redis_server: Any, client: Any,
                                                             value_format: str) -> None:
    view = _view(redis={"value_format": value_format})
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    first = [row(i, 100 + i) for i in range(50)]
    res = sink.write(target, batch_from_rows(view, first))
    assert (res.upserted, res.skipped) == (50, 0)
    # the same batch again: nothing changes
    res = sink.write(target, batch_from_rows(view, first))
    assert (res.upserted, res.skipped) == (0, 50)
    # an older version after a newer one (and an equal one): no effect; a newer one wins
    res = sink.write(target, batch_from_rows(view, [row(1, 5, name="older"), row(2, 102, name="same"),
                                                    row(3, 999, name="newer")]))
    assert (res.upserted, res.skipped) == (1, 2)
    # delete, then an older upsert arriving late: stays deleted (the tombstone keeps the version)
    res = sink.write(target, batch_from_rows(view, [row(4, 500, deleted=True)]))
    assert (res.deleted, res.skipped) == (1, 0)
    res = sink.write(target, batch_from_rows(view, [row(4, 400, name="resurrected?")]))
    assert (res.upserted, res.skipped) == (0, 1)
    # one batch holding the same key twice, newest first
    res = sink.write(target, batch_from_rows(view, [row(5, 700, name="new"), row(5, 600, name="old")]))
    assert (res.upserted, res.skipped) == (1, 1)

    got = sink.fetch(target, [(1,), (2,), (3,), (4,), (5,), (1234,)])
    assert got[(1,)]["name"] == "customer 1" and got[(1,)]["_kf_version"] == 101
    assert got[(2,)]["name"] == "customer 2"
    assert got[(3,)]["name"] == "newer" and got[(3,)]["_kf_version"] == 999
    assert (4,) not in got and (1234,) not in got
    assert got[(5,)]["name"] == "new"
    assert sink.count(target) == 49
    scanned = list(sink.scan(target))
    assert [r["id"] for r in scanned] == sorted(r["id"] for r in scanned)
    # typed like the view (the same values the PostgreSQL sink returns)
    assert scanned[0]["total"] == first[0]["total"] and scanned[0]["tags"] == ["a", "t0"]
    assert get(client, view.name, 3)["name"] == "newer"
    assert get(client, view.name, 4) is None


def test_versions_compare_exactly_over_63_bits(redis_server: Any) -> None:
    """Lua numbers are doubles; the guard compares decimal strings instead."""
    view = _view()
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    big = 2**62 + 1
    sink.write(target, batch_from_rows(view, [row(1, big, name="big")]))
    res = sink.write(target, batch_from_rows(view, [row(1, big - 1, name="big-1")]))  # same double as big
    assert res.skipped == 1
    res = sink.write(target, batch_from_rows(view, [row(1, 9, name="short")]))
    assert res.skipped == 1
    assert sink.fetch(target, [(1,)])[(1,)]["name"] == "big"


def test_pointer_switch_while_reading_never_shows_empty_or_partial(redis_server: Any, client: Any) -> None:
    view = _view(redis={"scan_count": 20})  # the old namespace is removed in many small steps
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    n = 400
    keys = list(range(n))
    sink.write(target, batch_from_rows(view, [row(i, i, gen=1) for i in keys]))
    reads: dict[str, Any] = {"n": 0, "gens": set()}
    problems: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        reader_client = redis.Redis.from_url(redis_server.url)
        try:
            while not stop.is_set():
                docs = get_many(reader_client, view.name, keys)
                missing = sum(d is None for d in docs)
                gens = {d["gen"] for d in docs if d is not None}
                if missing or len(gens) != 1:
                    problems.append(f"read {reads['n']}: {missing} missing, generations {gens}")
                reads["gens"] |= gens
                reads["n"] += 1
        finally:
            reader_client.close()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        wait_for(lambda: reads["n"] >= 3, timeout=20, what="the reader's first reads")
        shadow = sink.begin_shadow(view)
        for start in range(0, n, 100):
            sink.write(shadow, batch_from_rows(view, [row(i, 1000 + i, gen=2) for i in keys[start:start + 100]]),
                       positions={(TOPIC, 0): 1000 + start + 100})
        sink.swap(shadow)
        before = reads["n"]
        wait_for(lambda: reads["n"] >= before + 3, timeout=20, what="reads after the switch")
    finally:
        stop.set()
        t.join(10)
    assert not problems, problems[:5]
    assert reads["gens"] == {1, 2}
    live = sink.live(view)
    assert live is not None and sink.read_positions(live) == {(TOPIC, 0): 1400}
    # the old namespace is gone, only the live build's keys remain
    assert len(list(client.scan_iter(match=f"kf:{view.name}:*:*", count=1000))) == n


def test_rebuild_replaces_and_drops_leftover_shadows(redis_server: Any, client: Any) -> None:
    view = _view()
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    sink.write(target, batch_from_rows(view, [row(i, i) for i in range(10)]), positions={(TOPIC, 0): 10})
    leftover = sink.begin_shadow(view)
    sink.write(leftover, batch_from_rows(view, [row(i, i) for i in range(5)]))
    shadow = sink.begin_shadow(view)  # an interrupted replay's shadow is dropped first
    with pytest.raises(SinkStateLostError):
        sink.write(leftover, batch_from_rows(view, [row(1, 1)]))
    sink.write(shadow, batch_from_rows(view, [row(i, i, gen=3) for i in range(3)]), positions={(TOPIC, 0): 3})
    assert sink.read_positions(target) == {(TOPIC, 0): 10}
    live = sink.swap(shadow)
    assert sink.count(live) == 3 and sink.read_positions(live) == {(TOPIC, 0): 3}
    assert client.scard(f"kf:{view.name}:builds") == 1


def test_positions_never_move_backwards(redis_server: Any) -> None:
    view = _view()
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    sink.store_positions(target, {(TOPIC, 0): 50, (TOPIC, 1): 7})
    sink.store_positions(target, {(TOPIC, 0): 40, (TOPIC, 1): 100})
    assert sink.read_positions(target) == {(TOPIC, 0): 50, (TOPIC, 1): 100}


def test_key_longer_than_allowed_is_rejected_and_the_rest_proceeds(redis_server: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    view = customer_view(f"long_{uuid.uuid4().hex[:6]}")
    sink = RedisSink(redis_server.url, options={"max_key_bytes": 256})
    target = sink.ensure(view)
    str_view = ViewSpec(f"s{view.name}", "P", ("code",), (ViewColumn("code", T.StringType()),))
    str_target = sink.ensure(str_view)
    res = sink.write(str_target, batch_from_rows(str_view, [
        {"code": "ok-1", "_kf_version": 1}, {"code": "x" * 300, "_kf_version": 2}, {"code": "ok-2", "_kf_version": 3},
    ]))
    assert res.upserted == 2
    assert len(res.rejected) == 1
    key, reason = res.rejected[0]
    assert key == ("x" * 300,)
    assert "longer than max_key_bytes=256" in reason and "version 2" in reason
    assert sink.count(str_target) == 2
    # the default limit (64 KiB) is far below Redis's 512 MB hard limit
    sink2 = RedisSink(redis_server.url)
    res = sink2.write(str_target, batch_from_rows(str_view, [{"code": "y" * 70_000, "_kf_version": 4}]))
    assert res.upserted == 0 and "max_key_bytes=65536" in res.rejected[0][1]
    assert sink.count(target) == 0
    # a replay's bulk load returns a count only: refused rows are named in the log, never dropped silently
    with caplog.at_level(logging.ERROR, logger="kappaflow.projections.sinks"):
        loaded = sink.load(str_target, [batch_from_rows(str_view, [{"code": "z" * 300, "_kf_version": 5},
                                                                   {"code": "ok-3", "_kf_version": 6}])])
    assert loaded == 1 and sink.rejected_in_load == [(("z" * 300,), sink.rejected_in_load[0][1])]
    assert "refused key" in caplog.text and "max_key_bytes=256" in caplog.text


def test_ttl_for_rows_and_tombstones(redis_server: Any, client: Any) -> None:
    view = _view(redis={"ttl_s": 3600, "tombstone_ttl_s": 60})
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    sink.write(target, batch_from_rows(view, [row(1, 1), row(2, 2), row(2, 3, deleted=True)]))
    build = sink.live_build(view)
    assert build is not None
    assert 3_500_000 < client.pttl(sink.row_key(view, build, 1)) <= 3_600_000
    assert 0 < client.pttl(sink.row_key(view, build, 2)) <= 60_000  # the tombstone
    assert sink.count(target) == 1


def test_schema_mismatch_names_the_columns(redis_server: Any) -> None:
    view = _view()
    sink = RedisSink(redis_server.url)
    sink.ensure(view)
    changed = ViewSpec(view.name, view.projection, view.key,
                       (*view.columns[:2], ViewColumn("total", T.DoubleType()), *view.columns[3:4]))
    with pytest.raises(ViewSchemaMismatch) as exc:
        sink.ensure(changed)
    msg = str(exc.value)
    assert "'total'" in msg and "double" in msg and "'tags'" in msg and "replay" in msg
    with pytest.raises(ViewSchemaMismatch, match="stored as 'json'"):
        sink.ensure(ViewSpec(view.name, view.projection, view.key, view.columns, options={"redis": {"value_format":
                                                                                                     "hash"}}))
    with pytest.raises(ConfigError, match="value_format"):
        RedisSink(redis_server.url, options={"value_format": "xml"})


def test_composite_keys_and_the_read_helper(redis_server: Any, client: Any) -> None:
    view = ViewSpec(f"geo_{uuid.uuid4().hex[:6]}", "Geo", ("region", "id"),
                    (ViewColumn("region", T.StringType()), ViewColumn("id", T.LongType()),
                     ViewColumn("n", T.LongType())))
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    sink.write(target, batch_from_rows(view, [{"region": "eu", "id": 1, "n": 5, "_kf_version": 1},
                                              {"region": "us:east", "id": 1, "n": 6, "_kf_version": 2}]))
    assert get(client, view.name, ("eu", 1)) == {"region": "eu", "id": 1, "n": 5}
    assert get(client, view.name, ("us:east", 1))["n"] == 6
    assert client.exists(f'kf:{view.name}:{sink.live_build(view)}:["us:east",1]')
    assert sink.fetch(target, [("eu", 1)]) == {("eu", 1): {"region": "eu", "id": 1, "n": 5, "_kf_version": 1}}
    assert get(client, "no_such_view", 1) is None


def test_server_restart_mid_batch_rebuilds_from_the_log_without_loss(tmp_path: Any) -> None:
    """Redis restarted empty in the middle of a batch: the sink notices (the build marker is gone),
    reports lost state, and the runner's replay from the sink's now-empty positions restores everything."""
    from kappaflow.testing.servers._process import free_port
    from kappaflow.testing.servers.redis import PrivateRedis

    port = free_port()
    servers = [PrivateRedis(port=port).start()]
    try:
        view = _view(redis={"batch_keys": 50, "pipeline_depth": 1, "backoff_initial_s": 0.01,
                            "backoff_max_s": 0.05})
        sink = RedisSink(servers[0].url, options={"max_retries": 100, "backoff_initial_s": 0.01,
                                                  "backoff_max_s": 0.05})
        events = history(2000, 300)
        state = {"chunks": 0, "stopped": False, "sleeps": 0}
        real_encode = sink._encode_json

        def encode(*args: Any, **kwargs: Any) -> Any:
            for call in real_encode(*args, **kwargs):
                state["chunks"] += 1
                if state["chunks"] == 15 and not state["stopped"]:  # batch 3, chunk 3 of 6
                    state["stopped"] = True
                    servers[0].stop()
                yield call

        def sleep(_s: float) -> None:  # the sink's backoff: restart the server on its second retry
            state["sleeps"] += 1
            if state["sleeps"] == 2:
                servers.append(PrivateRedis(port=port).start())

        sink._encode_json = encode
        sink._sleep = sleep
        losses = drive(sink, view, events, batch=300)
        assert state["stopped"] and len(servers) == 2
        assert losses == 1
        target = sink.live(view)
        assert target is not None
        assert rows_by_key(sink, target) == final_state(events)
        assert sink.read_positions(target) == {(TOPIC, 0): 2000}
    finally:
        for s in servers:
            s.stop()


def test_missing_marker_is_detected_on_ensure(redis_server: Any, client: Any) -> None:
    view = _view()
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    sink.write(target, batch_from_rows(view, [row(1, 1)]), positions={(TOPIC, 0): 2})
    client.delete(sink.marker_key(view, sink.live_build(view) or ""))  # e.g. evicted / partially lost
    with pytest.raises(SinkStateLostError):
        sink.write(target, batch_from_rows(view, [row(2, 2)]))
    assert sink.live(view) is None
    target = sink.ensure(view)
    assert sink.read_positions(target) == {} and sink.count(target) == 0


def test_config_opens_an_equivalent_sink(redis_server: Any) -> None:
    import pickle

    view = _view()
    sink = RedisSink(redis_server.url, options={"batch_keys": 10})
    target = sink.ensure(view)
    other = pickle.loads(pickle.dumps(sink.config())).open()
    try:
        assert other.options.batch_keys == 10
        assert other.load(target, [batch_from_rows(view, [row(i, i) for i in range(25)])]) == 25
        assert sink.count(target) == 25
    finally:
        other.close()


def test_projection_lock_is_exclusive_and_expires_after_its_holder_dies(redis_server: Any) -> None:
    a = RedisSink(redis_server.url, options={"lock_ttl_s": 1})
    b = RedisSink(redis_server.url, options={"lock_ttl_s": 1})
    name = f"p_{uuid.uuid4().hex[:6]}"
    try:
        assert a.try_lock(name)
        assert not b.try_lock(name) and not a.try_lock(name)
        a.unlock(name)
        assert b.try_lock(name)
        b._leases.pop(name)._stop.set()  # the holder "dies": no more renewals, no release
        wait_for(lambda: a.try_lock(name), timeout=10, what="the dead holder's lease to expire")
    finally:
        a.close()
        b.close()


def test_a_replay_refused_by_a_held_lease_says_when_it_runs_out(redis_server: Any) -> None:
    from kappaflow.projections.api import Projection
    from kappaflow.projections.engine import ProjectionBusy
    from kappaflow.projections.replay import as_spec, lock_sinks

    class P(Projection):
        name = f"p_{uuid.uuid4().hex[:6]}"
        sources = [TOPIC]
        key = ["id"]
        sinks = ("redis",)

    holder = RedisSink(redis_server.url, options={"lock_ttl_s": 7})
    other = RedisSink(redis_server.url, options={"lock_ttl_s": 7})
    try:
        assert holder.try_lock(P.name)
        with pytest.raises(ProjectionBusy, match=r"redis sink .* lease runs out within 7 s: retry then, or pass"):
            lock_sinks(as_spec(P), {"redis": other})
    finally:
        holder.close()
        other.close()


class TestRedisSinkContract(SinkContract):
    @pytest.fixture(params=["json", "hash"])
    def sink(self, redis_server: Any, request: pytest.FixtureRequest) -> Any:
        s = RedisSink(redis_server.url, options={"value_format": request.param})
        yield s
        s.close()


@pytest.mark.parametrize("fmt", ["json", "hash"])
def test_a_batch_is_applied_atomically_for_a_reader(redis_server: Any, fmt: str) -> None:
    """Every batch rewrites all 300 keys with its generation, in script calls of 20 keys (15 per batch):
    a reader reading all keys in one atomic call (get_many: one script) sees one generation at a time,
    never a batch half applied (MULTI/EXEC around the batch's calls). The version guard still holds:
    a batch re-sent after a later one changes nothing."""
    view = _view(redis={"batch_keys": 20, "pipeline_depth": 4, "value_format": fmt})
    sink = RedisSink(redis_server.url)
    target = sink.ensure(view)
    keys = list(range(300))
    sink.write(target, batch_from_rows(view, [row(i, i, gen=0) for i in keys]))
    seen: set[Any] = set()
    problems: list[str] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        c = redis.Redis.from_url(redis_server.url)
        try:
            while not stop.is_set():
                gens = {str(d["gen"]) if d is not None else None for d in get_many(c, view.name, keys)}
                if len(gens) != 1:
                    problems.append(f"read {reads[0]}: generations {sorted(map(str, gens))}")
                seen.update(gens)
                reads[0] += 1
        finally:
            c.close()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        wait_for(lambda: reads[0] >= 3, timeout=20, what="the reader's first reads")
        for gen in range(1, 41):
            res = sink.write(target, batch_from_rows(view, [row(i, gen * 1000 + i, gen=gen) for i in keys]),
                             positions={(TOPIC, 0): gen})
            assert (res.upserted, res.skipped) == (300, 0)
        before = reads[0]
        wait_for(lambda: reads[0] >= before + 3, timeout=20, what="reads after the last batch")
    finally:
        stop.set()
        t.join(10)
    assert not problems, f"{len(problems)} of {reads[0]} reads saw part of a batch: {problems[:3]}"
    assert len(seen) > 3, seen  # the reader ran while the batches were written
    again = sink.write(target, batch_from_rows(view, [row(i, 5000 + i, gen=5) for i in keys]))
    assert (again.upserted, again.skipped) == (0, 300)
    assert {str(d["gen"]) for d in get_many(redis.Redis.from_url(redis_server.url), view.name, keys)} == {"40"}
