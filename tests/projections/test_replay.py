"""Replay equals a reference fold in plain Python; determinism; zero-downtime rebuilds; bad input."""

from __future__ import annotations

import random
import threading
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kappaflow.errors import ConfigError
from kappaflow.projections.deadletter import read_dead_letters
from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from tests.projections import defs
from tests.projections.pj_helpers import orders_schema, totals_reference, view_rows

pytestmark = pytest.mark.integration

T0 = datetime(2024, 1, 1, tzinfo=UTC)
TOTALS_COLS = "customer_id, n, total, last, statuses"


def order(i: int, customer: int, amount: int, status: str, minute: int) -> dict[str, Any]:
    return {
        "id": i,
        "customer_id": customer,
        "amount": Decimal(amount) / 100,
        "status": status,
        "created_at": T0 + timedelta(minutes=minute),
    }


# A history step: (kind, id, customer, amount, status). Deletes of absent ids and inserts of
# present ids turn into updates/no-ops, so every generated history is valid.
steps = st.lists(
    st.tuples(
        st.sampled_from(["insert", "update", "update", "delete"]),
        st.integers(1, 8),
        st.integers(1, 3),
        st.integers(1, 5000),
        st.sampled_from(["new", "paid", "cancelled"]),
    ),
    min_size=1,
    max_size=40,
)


def play(w: TableWriter, history: list[tuple[str, int, int, int, str]]) -> None:
    for minute, (kind, i, customer, amount, status) in enumerate(history):
        k = (i,)
        if kind == "delete":
            if k in w.rows:
                w.delete(k)
        elif k in w.rows:  # update: may move the order to another customer (group)
            w.update(k, {"customer_id": customer, "amount": Decimal(amount) / 100, "status": status})
        else:  # insert, or re-insert after a delete
            w.insert(order(i, customer, amount, status, minute))
    w.flush()


@settings(
    max_examples=10,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=steps)
def test_grouped_replay_equals_a_reference_fold(
    rt: Any, embedded_log: Any, pg_dsn: str, history: list[tuple[str, int, int, int, str]]
) -> None:
    source = "h" + uuid.uuid4().hex[:8]
    w = TableWriter(embedded_log, orders_schema(source), partitions=2)
    play(w, history)
    proj = defs.totals(source, name="t_" + source)
    replay(proj, rt)
    assert view_rows(pg_dsn, proj.name, TOTALS_COLS) == totals_reference(w.rows)


def random_history(w: TableWriter, seed: int, n: int = 300) -> None:
    rnd = random.Random(seed)
    for minute in range(n):
        i = rnd.randint(1, 60)
        k = (i,)
        r = rnd.random()
        if k not in w.rows:
            w.insert(order(i, rnd.randint(1, 6), rnd.randint(1, 9999), "new", minute))
        elif r < 0.2:
            w.delete(k)
        else:
            w.update(
                k,
                {
                    "customer_id": rnd.randint(1, 6),
                    "status": rnd.choice(["new", "paid", "cancelled"]),
                    "amount": Decimal(rnd.randint(1, 9999)) / 100,
                },
            )
    w.flush()


def test_latest_row_and_custom_fold_equal_the_reference_and_are_deterministic(
    rt: Any, embedded_log: Any, pg_dsn: str
) -> None:
    w = TableWriter(embedded_log, orders_schema("det"), partitions=3)
    random_history(w, seed=11)
    latest = defs.latest("det")
    custom = defs.custom("det")
    replay(latest, rt)
    first = view_rows(pg_dsn, latest.name, "*")
    expected = [
        (r["id"], r["customer_id"], r["amount"], r["status"], r["created_at"], int(r["amount"] * 100))
        for _, r in sorted(w.rows.items())
    ]
    assert [row[:6] for row in first] == expected
    replay(latest, rt)  # determinism: a second replay gives the same table, versions included
    assert view_rows(pg_dsn, latest.name, "*") == first

    replay(custom, rt)
    got = view_rows(pg_dsn, custom.name, "id, customer_id")
    assert got == [(r["id"], r["customer_id"]) for _, r in sorted(w.rows.items())]
    once = view_rows(pg_dsn, custom.name, "*")
    replay(custom, rt)
    assert view_rows(pg_dsn, custom.name, "*") == once


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_replay_on_kafka_equals_the_reference(
    spark: Any, kafka_broker: Any, pg_dsn: str, source_name: str, tmp_path: Any, client: str,
    request: pytest.FixtureRequest,
) -> None:
    """Written and read (driver and executors) with each Kafka client, chosen as `[log.kafka] client`."""
    from kappaflow.config import KafkaClientConfig, LogConfig
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    log = request.getfixturevalue("confluent_log" if client == "confluent" else "kafka_log")
    url = f"kafka://{kafka_broker.bootstrap}"
    options = LogConfig(url=url, kafka=KafkaClientConfig(client=client)).open_options()
    w = TableWriter(log, orders_schema(source_name), partitions=2)
    random_history(w, seed=5, n=200)
    rt = Runtime(spark, url, PostgresSink(pg_dsn), log_options=options, checkpoint_dir=tmp_path)
    try:
        assert type(rt.reader()) is type(log)
        proj = defs.totals(source_name)
        res = replay(proj, rt)
        assert res.events == sum(log.end_offsets(w.topic).values())
        assert view_rows(pg_dsn, proj.name, TOTALS_COLS) == totals_reference(w.rows)
    finally:
        rt.close()


def test_rebuild_while_a_reader_queries_never_shows_an_empty_or_partial_view(
    rt: Any, embedded_log: Any, pg_dsn: str
) -> None:
    w = TableWriter(embedded_log, orders_schema("rb"), partitions=2)
    random_history(w, seed=3, n=200)
    proj = defs.latest("rb", name="rb_latest")
    replay(proj, rt)
    full = len(w.rows)
    seen: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                while not stop.is_set():
                    seen.append(conn.execute('SELECT count(*) FROM public."rb_latest"').fetchone()[0])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=reader)
    th.start()
    try:
        replay(proj, rt)  # rebuild into a shadow, swap
        more = TableWriter.__new__(TableWriter)  # keep the same table state, append more changes
        more.__dict__.update(w.__dict__)
        for i in range(61, 81):
            more.insert(order(i, 1, 100, "new", 999))
        more.flush()
        replay(proj, rt)
    finally:
        stop.set()
        th.join(30)
    assert not errors, errors
    assert seen, "the reader never ran"
    # every count observed is a complete view: the old one or a rebuilt one
    assert set(seen) <= {full, full + 20}, sorted(set(seen))
    assert seen[-1] == full + 20


def test_a_fold_raising_on_one_event_dead_letters_it_and_the_rest_proceeds(
    rt: Any, embedded_log: Any, pg_dsn: str
) -> None:
    w = TableWriter(embedded_log, orders_schema("dl"), partitions=2)
    for i in range(1, 11):
        w.insert(order(i, i % 3, 100 * i, "new", i))
    w.flush()
    proj = defs.custom("dl", name="dl_changes", fail_on=4)
    res = replay(proj, rt)
    assert res.dead_letters == 1
    assert [r[0] for r in view_rows(pg_dsn, proj.name, "id")] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    dead = read_dead_letters(rt.log_url, {}, proj.name)
    assert len(dead) == 1
    d = dead[0]
    assert d["topic"] == w.topic and "cannot fold order 4" in d["reason"] and "ValueError" in d["reason"]
    # the position names the event exactly
    rec = embedded_log.read(w.topic, d["partition"], d["offset"], 1)[0]
    assert rec.offset == d["offset"] and b'"id":4' in rec.value


def test_a_projection_class_without_a_key_is_refused(rt: Any) -> None:
    from kappaflow.projections import Projection

    class NoKey(Projection):
        name = "nokey"
        sources = ["x.public.y"]

    with pytest.raises(ConfigError) as err:
        replay(NoKey, rt)
    assert "NoKey" in str(err.value) and "'key'" in str(err.value)


def test_a_latest_row_view_keyed_by_a_non_key_column_is_refused(rt: Any, embedded_log: Any) -> None:
    from kappaflow.projections import Projection

    TableWriter(embedded_log, orders_schema("nk"), partitions=1)

    class ByCustomer(Projection):
        name = "by_customer"
        sources = ["nk.public.orders"]
        key = ["customer_id"]

    with pytest.raises(ConfigError, match="primary key"):
        replay(ByCustomer, rt)


def test_bad_where_expression_names_the_attribute(rt: Any, embedded_log: Any) -> None:
    from kappaflow.projections import Count, Projection

    TableWriter(embedded_log, orders_schema("bw"), partitions=1)

    class BadWhere(Projection):
        name = "bad_where"
        sources = ["bw.public.orders"]
        key = ["customer_id"]
        where = "no_such_column > 1"
        aggregates = {"n": Count()}

    with pytest.raises(ConfigError) as err:
        replay(BadWhere, rt)
    assert "'where'" in str(err.value) and "no_such_column" in str(err.value)
