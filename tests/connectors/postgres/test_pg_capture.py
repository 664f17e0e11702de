"""PostgreSQL capture against a real server with logical WAL, into both log backends."""

from __future__ import annotations

import datetime as dt
import random
import threading
import uuid
from decimal import Decimal
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import capture, compacted, config, positions, records, schemas, table_state, wait_for

from kappaflow.config import SnapshotMode
from kappaflow.connectors.base import StopSignal, record_position
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.connector import PostgresConnector, postgres_status
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.events import EventCodec, FieldType, Op
from kappaflow.log.base import Log

pytestmark = pytest.mark.integration

UTC = dt.UTC

# (column, type, SQL literal, expected Python value after decoding the event)
TYPES: list[tuple[str, str, str, Any]] = [
    ("c_int2", "int2", "-32768", -32768),
    ("c_int4", "int4", "2147483647", 2147483647),
    ("c_int8", "int8", "-9223372036854775808", -9223372036854775808),
    ("c_num", "numeric(12,3)", "123456789.125", Decimal("123456789.125")),
    ("c_numv", "numeric", "0.0000001", Decimal("0.0000001")),
    ("c_f4", "float4", "1.5", 1.5),
    ("c_f8", "float8", "0.1", 0.1),
    ("c_text", "text", "E'h\\u00e9llo \"q\" \\\\ tab\\t'", 'héllo "q" \\ tab\t'),
    ("c_vc", "varchar(20)", "'v'", "v"),
    ("c_char", "char(3)", "'ab'", "ab "),
    ("c_bool", "bool", "true", True),
    ("c_date", "date", "'2024-02-29'", dt.date(2024, 2, 29)),
    ("c_time", "time", "'23:59:59.999999'", dt.time(23, 59, 59, 999999)),
    ("c_ts", "timestamp", "'2024-01-02 03:04:05.5'", dt.datetime(2024, 1, 2, 3, 4, 5, 500000)),
    ("c_tstz", "timestamptz", "'2024-01-02 03:04:05.25+02'", dt.datetime(2024, 1, 2, 1, 4, 5, 250000, tzinfo=UTC)),
    ("c_iv", "interval", "'3 days 04:05:06.789'", dt.timedelta(days=3, hours=4, minutes=5, seconds=6.789)),
    ("c_uuid", "uuid", "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'", uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")),
    ("c_json", "json", """'{"a": [1, 2.5, null], "b": "x"}'""", {"a": [1, 2.5, None], "b": "x"}),
    ("c_jsonb", "jsonb", """'{"z": 1, "big": 123456789012345678901234567890}'""",
     {"z": 1, "big": 123456789012345678901234567890}),
    ("c_bytea", "bytea", "'\\x00ff10'", b"\x00\xff\x10"),
    ("c_iarr", "int[]", "'{1,NULL,3}'", [1, None, 3]),
    ("c_tarr", "text[]", """'{"a b","c,d","e\\"f",NULL}'""", ["a b", "c,d", 'e"f', None]),
    ("c_darr", "date[]", "'{2020-01-01,NULL}'", [dt.date(2020, 1, 1), None]),
    ("c_enum", "mood", "'happy'", "happy"),
    ("c_enum_arr", "mood[]", "'{sad,ok}'", ["sad", "ok"]),
    ("c_domain", "posint", "5", 5),
    ("c_bits", "bit(4)", "B'1010'", bytes([0b1010])),
    ("c_bit1", "bit(1)", "B'1'", True),
    ("c_inet", "inet", "'10.0.0.1/8'", "10.0.0.1/8"),
]


def _create_types_table(sql: Any) -> None:
    sql("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    sql("CREATE DOMAIN posint AS int CHECK (VALUE > 0)")
    cols = ", ".join(f"{name} {typ}" for name, typ, _, _ in TYPES)
    sql(f"CREATE TABLE alltypes (id int PRIMARY KEY, {cols})")


def _insert_types_row(sql: Any, row_id: int) -> None:
    names = ", ".join(name for name, _, _, _ in TYPES)
    values = ", ".join(lit for _, _, lit, _ in TYPES)
    sql(f"INSERT INTO alltypes (id, {names}) VALUES ({row_id}, {values})".replace("%", "%%"))


def _events(log: Log, topic: str, schema: Any) -> list[Any]:
    codec = EventCodec()
    return [codec.decode_value(r.value, schema) for r in records(log, topic) if r.value is not None]


def test_every_type_round_trips_through_snapshot_and_streaming(pg_dsn: str, sql: Any, source_name: str,
                                                               embedded_log: Log) -> None:
    _create_types_table(sql)
    _insert_types_row(sql, 1)
    sql("INSERT INTO alltypes (id) VALUES (2)")  # every other column NULL
    cfg = config(pg_dsn, source_name, ["public.alltypes"])
    capture(cfg, embedded_log)
    _insert_types_row(sql, 3)  # streamed
    capture(cfg, embedded_log)

    schema = schemas(embedded_log, source_name)["public.alltypes"]
    assert schema.key == ("id",)
    num = schema.column("c_num")
    assert (num.type, num.scale, num.precision) == (FieldType.DECIMAL, 3, 12)
    assert schema.column("c_numv").type is FieldType.VARIABLE_DECIMAL
    assert schema.column("c_enum").allowed == ("sad", "ok", "happy")
    assert schema.column("c_enum_arr").type is FieldType.ARRAY
    assert (schema.column("c_domain").type, schema.column("c_domain").native_type) == (FieldType.INT32, "posint")
    assert schema.column("id").optional is False and schema.column("c_text").optional is True

    events = {e.after["id"]: e for e in _events(embedded_log, f"{source_name}.public.alltypes", schema)}
    assert events[1].op is Op.READ and events[3].op is Op.CREATE
    for row_id in (1, 3):
        after = events[row_id].after
        for name, _, _, expected in TYPES:
            assert after[name] == expected, f"{name} ({'snapshot' if row_id == 1 else 'streaming'})"
    assert all(events[2].after[name] is None for name, _, _, _ in TYPES)


def test_inserts_updates_deletes_truncate_identity_and_commit_order(pg_dsn: str, sql: Any, source_name: str,
                                                                    any_log: Log) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v text)")
    sql("CREATE TABLE b (id int PRIMARY KEY, v text, n int)")
    sql("ALTER TABLE b REPLICA IDENTITY FULL")
    sql("INSERT INTO a SELECT i, 'a' || i FROM generate_series(1, 5) i")
    sql("INSERT INTO b SELECT i, 'b' || i, i FROM generate_series(1, 5) i")
    cfg = config(pg_dsn, source_name, ["public.a", "public.b"])
    first = capture(cfg, any_log)
    assert first.snapshot_rows == 10

    with psycopg.connect(pg_dsn) as conn, conn.transaction():  # one transaction over both tables
        conn.execute("INSERT INTO a VALUES (10, 'new')")
        conn.execute("UPDATE b SET v = 'changed' WHERE id = 1")
        conn.execute("DELETE FROM a WHERE id = 2")
        conn.execute("DELETE FROM b WHERE id = 2")
        conn.execute("UPDATE a SET id = 20 WHERE id = 3")  # primary key change
        conn.execute("UPDATE a SET v = 'same key' WHERE id = 4")
    sql("TRUNCATE b")
    sql("INSERT INTO b VALUES (7, 'after truncate', 7)")
    second = capture(cfg, any_log)
    assert second.snapshot_rows == 0

    ta, tb = f"{source_name}.public.a", f"{source_name}.public.b"
    sch = schemas(any_log, source_name)
    ev_a = [e for e in _events(any_log, ta, sch["public.a"]) if e.op is not Op.READ]
    ev_b = [e for e in _events(any_log, tb, sch["public.b"]) if e.op is not Op.READ]
    streamed = sorted(ev_a + ev_b, key=lambda e: e.source.position)
    tx = [e for e in streamed if e.op is not Op.TRUNCATE and e.source.position.lsn == streamed[0].source.position.lsn]
    # one transaction: one commit LSN, indexes in statement order, a PK change is delete + create
    assert [(e.source.table, e.op.value, e.source.position.index) for e in tx] == [
        ("a", "c", 0), ("b", "u", 1), ("a", "d", 2), ("b", "d", 3), ("a", "d", 4), ("a", "c", 5), ("a", "u", 6),
    ]
    assert {e.transaction.id for e in tx} == {tx[0].transaction.id}
    assert [e.transaction.total_order for e in tx] == [1, 2, 3, 4, 5, 6, 7]
    by = {(e.source.table, e.op, (e.before or e.after or {}).get("id")): e for e in tx}
    # REPLICA IDENTITY FULL: whole before-images; DEFAULT: only the key (other columns absent, not NULL)
    assert by[("b", Op.UPDATE, 1)].before == {"id": 1, "v": "b1", "n": 1}
    assert by[("b", Op.DELETE, 2)].before == {"id": 2, "v": "b2", "n": 2}
    assert by[("a", Op.DELETE, 2)].before == {"id": 2}
    assert by[("a", Op.UPDATE, 4)].before is None
    assert by[("a", Op.DELETE, 3)].before == {"id": 3}
    assert by[("a", Op.CREATE, 20)].after == {"id": 20, "v": "a3"}
    # truncate: an op=t event in every partition of b, then b's later insert
    truncs = [r for r in records(any_log, tb) if r.key == b"{}"]
    assert len(truncs) == any_log.partitions(tb)
    assert all(dict(r.headers)["kf.op"] == b"t" for r in truncs)
    # ... each followed, in its partition, by a delete of every row b held (the row as the log last held
    # it, at the truncate's position, flagged kf_truncate) and that key's tombstone
    for p in range(any_log.partitions(tb)):
        part = list(any_log.iter_partition(tb, p))
        at = next(i for i, r in enumerate(part) if r.key == b"{}")
        after = part[at + 1:]
        removed = [r for r in after if r.value is not None and orjson.loads(r.value).get("kf_truncate")]
        assert [r.key for r in after[:2 * len(removed)]] == [k for r in removed for k in (r.key, r.key)]
        assert all(r.value is None for r in after[1:2 * len(removed):2])
        assert all(record_position(r) == record_position(part[at]) for r in after[:2 * len(removed)])
    removed_rows = sorted((orjson.loads(r.value)["op"], orjson.loads(r.value)["before"]["id"],
                           orjson.loads(r.value)["before"]["v"]) for r in records(any_log, tb)
                          if r.value is not None and orjson.loads(r.value).get("kf_truncate"))
    assert removed_rows == [("d", 1, "changed"), ("d", 3, "b3"), ("d", 4, "b4"), ("d", 5, "b5")]
    assert compacted(any_log, ta) == table_state(pg_dsn, "public.a", source_name)
    assert compacted(any_log, tb) == table_state(pg_dsn, "public.b", source_name)
    assert list(compacted(any_log, tb)) == [b'{"id":7}']
    # every delete is followed by its tombstone, at the same position
    recs = records(any_log, ta)
    for i, r in enumerate(recs):
        if r.value is not None and orjson.loads(r.value)["op"] == "d":
            assert recs[i + 1].value is None and recs[i + 1].key == r.key
            assert record_position(recs[i + 1]) == record_position(r)
    # positions increase within every partition
    for topic in (ta, tb):
        for p in range(any_log.partitions(topic)):
            ps = [record_position(r) for r in any_log.iter_partition(topic, p)]
            assert ps == sorted(ps)


def test_unchanged_toast_survives_updates_and_restarts(pg_dsn: str, sql: Any, source_name: str,
                                                       any_log: Log) -> None:
    big = "".join(random.Random(7).choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(20_000))
    sql("CREATE TABLE docs (id int PRIMARY KEY, title text, body text)")
    sql("ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")
    sql("INSERT INTO docs VALUES (1, 'snap', %s)", (big,))
    cfg = config(pg_dsn, source_name, ["public.docs"])
    capture(cfg, any_log)
    sql("INSERT INTO docs VALUES (2, 'streamed', %s)", (big + "2",))
    sql("UPDATE docs SET title = 't1' WHERE id = 1")  # body not resent by the server ('u')
    sql("UPDATE docs SET title = 't2' WHERE id = 2")
    capture(cfg, any_log)
    # a new run has no keyed state: the value comes back from the log
    sql("UPDATE docs SET title = 't3' WHERE id = 1")
    sql("UPDATE docs SET id = 3 WHERE id = 2")  # key change with an unchanged TOAST value
    capture(cfg, any_log)
    topic = f"{source_name}.public.docs"
    updates = [orjson.loads(r.value) for r in records(any_log, topic) if r.value and b'"op":"u"' in r.value]
    assert len(updates) == 3
    for u in updates:
        assert len(u["after"]["body"]) >= 20_000
        assert "kf_unavailable" not in u
    assert compacted(any_log, topic) == table_state(pg_dsn, "public.docs", source_name)


def test_unknown_toast_value_is_marked_unavailable(pg_dsn: str, sql: Any, source_name: str,
                                                   embedded_log: Log) -> None:
    big = "".join(random.Random(8).choice("abcdefghij0123456789") for _ in range(20_000))
    sql("CREATE TABLE docs (id int PRIMARY KEY, title text, body text)")
    sql("ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")
    sql("INSERT INTO docs VALUES (1, 'before capture', %s)", (big,))
    cfg = config(pg_dsn, source_name, ["public.docs"], snapshot_mode=SnapshotMode.NEVER)
    capture(cfg, embedded_log)  # creates the slot; the row was never seen
    sql("UPDATE docs SET title = 'x' WHERE id = 1")
    capture(cfg, embedded_log)
    (rec,) = [r for r in records(embedded_log, f"{source_name}.public.docs") if r.value]
    ev = EventCodec().decode_value(rec.value, schemas(embedded_log, source_name)["public.docs"])
    assert ev.op is Op.UPDATE and ev.unavailable == ("body",)
    assert "body" not in ev.after and ev.after["title"] == "x"  # absent, not NULL


def test_snapshot_taken_while_writers_run(pg_dsn: str, sql: Any, source_name: str, any_log: Log) -> None:
    sql("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, note text)")
    sql("INSERT INTO acct SELECT i, 100, 'n' || i FROM generate_series(1, 4000) i")
    stop_writer = threading.Event()
    rng = random.Random(42)
    writes = {"n": 0}

    def writer() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            next_id = 5000
            while not stop_writer.is_set() or writes["n"] < 100:
                k = rng.randint(1, 4000)
                op = rng.random()
                if op < 0.5:
                    conn.execute("UPDATE acct SET balance = balance + 1 WHERE id = %s", (k,))
                elif op < 0.7:
                    conn.execute("DELETE FROM acct WHERE id = %s", (k,))
                elif op < 0.8:
                    conn.execute("UPDATE acct SET id = %s WHERE id = %s", (next_id, k))
                    next_id += 1
                else:
                    conn.execute("INSERT INTO acct VALUES (%s, 1, 'w') ON CONFLICT DO NOTHING", (next_id,))
                    next_id += 1
                writes["n"] += 1

    cfg = config(pg_dsn, source_name, ["public.acct"], snapshot_chunk_rows=250)
    wt = threading.Thread(target=writer)
    wt.start()
    stop = StopSignal()
    result: dict[str, Any] = {}
    conn = PostgresConnector(cfg, any_log, partitions=3, progress=False)
    ct = threading.Thread(target=lambda: result.setdefault("s", conn.run(stop)))
    ct.start()
    try:
        wait_for(lambda: conn.summary is not None and conn.summary.phase == "streaming", 60, "the snapshot to end")
    finally:
        stop_writer.set()
        wt.join()
        stop.set("test")
        ct.join()
    assert result["s"].snapshot_rows > 0
    capture(cfg, any_log)  # drain what the writer did after the first run stopped
    assert compacted(any_log, f"{source_name}.public.acct") == table_state(pg_dsn, "public.acct", source_name)


def test_heartbeats_advance_the_slot_of_an_idle_source(pg_dsn: str, sql: Any, source_name: str,
                                                       embedded_log: Log) -> None:
    sql("CREATE TABLE quiet (id int PRIMARY KEY)")
    sql("CREATE TABLE busy (id serial PRIMARY KEY, v int)")  # written, but not captured
    cfg = config(pg_dsn, source_name, ["public.quiet"], heartbeat_interval_s=0.2)
    conn = PostgresConnector(cfg, embedded_log, partitions=1, progress=False, status_interval_s=0.2)
    stop = StopSignal()
    t = threading.Thread(target=conn.run, args=(stop,))
    t.start()
    try:
        with slots.connect(pg_dsn) as c:
            wait_for(lambda: conn.summary is not None and conn.summary.phase == "streaming", 30, "streaming")
            first = slots.slot_info(c, cfg.slot_name)
            assert first is not None and first.confirmed_flush_lsn is not None
            sql("INSERT INTO busy (v) SELECT g FROM generate_series(1, 1000) g")  # filtered-out WAL
            target = slots.current_lsn(c)
            info = wait_for(lambda: (i := slots.slot_info(c, cfg.slot_name)) and (i.confirmed_flush_lsn or 0) >= target
                            and i, 30, "confirmed_flush_lsn to pass the filtered writes")
            assert info.confirmed_flush_lsn > first.confirmed_flush_lsn
            # and with no writes at all, heartbeats alone keep it moving
            now = slots.slot_info(c, cfg.slot_name).confirmed_flush_lsn  # type: ignore[union-attr]
            wait_for(lambda: (slots.slot_info(c, cfg.slot_name).confirmed_flush_lsn or 0) > now, 30,  # type: ignore[union-attr]
                     "a heartbeat to advance the idle slot")
    finally:
        stop.set("test")
        t.join()


def test_new_columns_give_new_shape_and_a_schema_record(pg_dsn: str, sql: Any, source_name: str,
                                                        any_log: Log) -> None:
    sql("CREATE TABLE items (id int PRIMARY KEY, name text)")
    sql("INSERT INTO items VALUES (1, 'one')")
    cfg = config(pg_dsn, source_name, ["public.items"])
    capture(cfg, any_log)
    sql("ALTER TABLE items ADD COLUMN price numeric(8,2)")
    sql("INSERT INTO items VALUES (2, 'two', 2.50)")
    sql("ALTER TABLE items DROP COLUMN name")
    sql("INSERT INTO items VALUES (3, 3.75)")
    capture(cfg, any_log)
    history = [orjson.loads(r.value) for r in any_log.iter_partition(f"{source_name}.__schema", 0)]
    shapes = [[c["name"] for c in h["columns"]] for h in history if h["table"] == "public.items"]
    assert shapes == [["id", "name"], ["id", "name", "price"], ["id", "price"]]
    afters = {r.key: orjson.loads(r.value)["after"] for r in records(any_log, f"{source_name}.public.items")}
    assert afters[b'{"id":2}'] == {"id": 2, "name": "two", "price": "2.50"}
    assert afters[b'{"id":3}'] == {"id": 3, "price": "3.75"}


def test_snapshot_modes_and_status(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    sql("CREATE TABLE m (id int PRIMARY KEY)")
    sql("INSERT INTO m SELECT generate_series(1, 10)")
    topic = f"{source_name}.public.m"
    # initial_only: a snapshot, no slot, nothing more on the next run
    only = config(pg_dsn, source_name, ["public.m"], snapshot_mode=SnapshotMode.INITIAL_ONLY)
    assert capture(only, embedded_log).snapshot_rows == 10
    assert capture(only, embedded_log).snapshot_rows == 0
    with slots.connect(pg_dsn) as c:
        assert slots.slot_info(c, only.slot_name) is None
    # never: stream only
    never_name = source_name + "n"
    never = config(pg_dsn, never_name, ["public.m"], snapshot_mode=SnapshotMode.NEVER)
    assert capture(never, embedded_log).snapshot_rows == 0
    sql("INSERT INTO m VALUES (11)")
    s = capture(never, embedded_log)
    assert (s.snapshot_rows, s.events) == (0, 1)
    # always: every run re-reads the table, at positions after everything before
    always = config(pg_dsn, never_name, ["public.m"], snapshot_mode=SnapshotMode.ALWAYS)
    last_before = max(p for p, _ in positions(embedded_log, f"{never_name}.public.m"))
    assert capture(always, embedded_log).snapshot_rows == 11
    reread = [p for p, _ in positions(embedded_log, f"{never_name}.public.m") if p > last_before]
    assert len(reread) == 11 and all(isinstance(p, PgPosition) and p.snapshot for p in reread)
    assert compacted(embedded_log, topic) == {k: v for k, v in table_state(pg_dsn, "public.m").items() if v["id"] <= 10}
    from kappaflow.log.embedded import EmbeddedLog

    reader = EmbeddedLog(embedded_log.path, read_only=True)  # type: ignore[attr-defined]
    try:
        status = postgres_status(never, reader)
        assert postgres_status(config(pg_dsn, "nothing_yet", ["public.m"]), reader)["offset"] is None
    finally:
        reader.close()
    assert status["offset"]["phase"] == "streaming"
    assert status["events_captured"] == 1 + 11
    assert status["slot_state"]["active"] is False and status["lag_bytes"] >= 0
    assert status["topics"][f"{never_name}.public.m"] == 12


def test_all_tables_source_picks_up_new_tables(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    sql("CREATE TABLE one (id int PRIMARY KEY, v text)")
    sql("INSERT INTO one SELECT i, 'x' FROM generate_series(1, 50) i")
    cfg = config(pg_dsn, source_name, [], snapshot_chunk_rows=10)  # no tables listed: FOR ALL TABLES
    first = capture(cfg, embedded_log, progress=True)
    assert first.snapshot_rows == 50
    err = capfd.readouterr().err
    assert "public.one" in err and "rows/s" in err  # the snapshot progress bar, on request
    sql("CREATE TABLE two (id int PRIMARY KEY, v text)")
    sql("INSERT INTO two VALUES (1, 'new table')")
    sql("UPDATE one SET v = 'y' WHERE id = 1")
    second = capture(cfg, embedded_log)
    assert second.events == 2
    assert compacted(embedded_log, f"{source_name}.public.two") == table_state(pg_dsn, "public.two")
    assert "public.two" in schemas(embedded_log, source_name)


def test_existing_wider_publication_is_used_as_is(pg_dsn: str, sql: Any, source_name: str,
                                                  embedded_log: Log) -> None:
    sql("CREATE TABLE wanted (id int PRIMARY KEY)")
    sql("CREATE TABLE other (id int PRIMARY KEY)")
    sql(f'CREATE PUBLICATION "kappaflow_{source_name}" FOR TABLE wanted, other')  # made by an admin
    cfg = config(pg_dsn, source_name, ["public.wanted"])
    capture(cfg, embedded_log)
    sql("INSERT INTO other VALUES (1)")
    sql("INSERT INTO wanted VALUES (1)")
    assert capture(cfg, embedded_log).events == 1
    pubs = sql("SELECT tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1", (cfg.publication_name,))
    assert [r[0] for r in pubs] == ["other", "wanted"]
    assert f"{source_name}.public.other" not in embedded_log.list_topics()


def test_partitioned_table_is_captured_under_its_own_name(pg_dsn: str, sql: Any, source_name: str,
                                                          embedded_log: Log) -> None:
    sql("CREATE TABLE ev (id int, day date, v text, PRIMARY KEY (id, day)) PARTITION BY RANGE (day)")
    sql("CREATE TABLE ev_2024 PARTITION OF ev FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')")
    sql("CREATE TABLE ev_2025 PARTITION OF ev FOR VALUES FROM ('2025-01-01') TO ('2026-01-01')")
    sql("INSERT INTO ev VALUES (1, '2024-05-01', 'a'), (2, '2025-05-01', 'b')")
    cfg = config(pg_dsn, source_name, ["public.ev"])
    assert capture(cfg, embedded_log).snapshot_rows == 2
    sql("INSERT INTO ev VALUES (3, '2025-06-01', 'c')")
    sql("UPDATE ev SET v = 'changed' WHERE id = 1")
    assert capture(cfg, embedded_log).events == 2
    topic = f"{source_name}.public.ev"
    assert compacted(embedded_log, topic) == table_state(pg_dsn, "public.ev", source_name)
    assert not [t for t in embedded_log.list_topics() if "ev_20" in t]


def test_a_retyped_column_with_the_same_type_oid_gets_a_new_shape(pg_dsn: str, sql: Any, source_name: str,
                                                                 any_log: Log) -> None:
    """numeric(8,2) -> numeric(12,4) keeps the type OID and changes only the type modifier: the
    decimal's scale (a parameter of its Connect schema, and in `precise` mode the scale its unscaled
    bytes are read with) must follow, and so must varchar's length."""
    sql("CREATE TABLE retyped (id int PRIMARY KEY, price numeric(8,2), label varchar(5))")
    sql("INSERT INTO retyped VALUES (1, 1.25, 'ab')")
    cfg = config(pg_dsn, source_name, ["public.retyped"])
    capture(cfg, any_log)
    sql("INSERT INTO retyped VALUES (3, 3.75, 'abc')")  # in the WAL before the change, read after it
    sql("ALTER TABLE retyped ALTER COLUMN price TYPE numeric(12,4), ALTER COLUMN label TYPE varchar(40)")
    sql("INSERT INTO retyped VALUES (2, 2.5, 'a longer label than before')")
    sql("UPDATE retyped SET price = 1.0625 WHERE id = 1")
    capture(cfg, any_log)
    history = [orjson.loads(r.value) for r in any_log.iter_partition(f"{source_name}.__schema", 0)]
    mine = [h for h in history if h["table"] == "public.retyped"]
    price = [next(c for c in h["columns"] if c["name"] == "price") for h in mine]
    assert [p.get("scale") for p in price] == [2, 4], [h["columns"] for h in mine]
    label = [next(c for c in h["columns"] if c["name"] == "label") for h in mine]
    assert [c["native_type"] for c in label] == ["character varying(5)", "character varying(40)"]
    raw = {orjson.loads(r.key)["id"]: orjson.loads(r.value)["after"]
           for r in records(any_log, f"{source_name}.public.retyped") if r.value is not None}
    assert raw[3]["price"] == "3.75" and raw[2]["price"] == "2.5000", raw
    topic = f"{source_name}.public.retyped"
    events = _events(any_log, topic, schemas(any_log, source_name)["public.retyped"])
    after = {e.after["id"]: e.after for e in events if e.after is not None}
    assert after[2] == {"id": 2, "price": Decimal("2.5000"), "label": "a longer label than before"}
    assert after[1]["price"] == Decimal("1.0625")
