"""The column-at-a-time snapshot encoder (``TableCodec.encode_reads``) against the per-row encoding.

Snapshots (initial and on demand) turn ``COPY ... TO STDOUT`` text lines into ``op=r`` records a
column at a time. The records must be byte for byte those the per-row path made before (one
``values_json`` of the split line per row, the streaming path's value expressions): checked here on
tricky values of every supported column type, in chunks that take each of the encoder's paths (clean
columns in bulk, columns with NULLs, columns with COPY escapes, values a bulk form refuses), with
hand-escaped lines and with PostgreSQL's own COPY output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Sequence
from typing import Any

import pytest

from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres import types as t
from kappaflow.connectors.postgres.ondemand import PgOnDemand
from kappaflow.connectors.postgres.rows import TableCodec, column_codec
from kappaflow.connectors.postgres.toast import TOAST_ROW_MIN
from kappaflow.events import EventCodec

PFX = b'{"version":"x","connector":"postgresql","name":"100%s","kf_pos":{"kind":"pg","lsn":7,"index":'
TIMES = b'"ts_ms":1700000000000,"ts_us":1700000000000000,"ts_ns":1700000000000000000'

# -- the per-row encoding as it was (the reference) -------------------------------------------------

_OLD_ESCAPE = re.compile(rb"\\(.)", re.S)
_OLD_CHARS = {b"\\": b"\\", b"t": b"\t", b"n": b"\n", b"r": b"\r", b"b": b"\b", b"f": b"\f", b"v": b"\v"}


def _old_unescape(field: bytes) -> bytes:
    return _OLD_ESCAPE.sub(lambda m: _OLD_CHARS.get(m.group(1), m.group(1)), field)


def old_reads(tc: TableCodec, lines: Sequence[bytes], pfx: bytes, times: bytes, first: int,
              drop: Container[bytes] = frozenset()) -> tuple[list[bytes], list[bytes]]:
    """The loop of ondemand.py / snapshot.py before the column-at-a-time encoder, verbatim."""
    keys, values = [], []
    toast = tc.toast_state is not None
    idx = first
    for line in lines:
        raw = [None if f == b"\\N" else (_old_unescape(f) if b"\\" in f else f) for f in line[:-1].split(b"\t")]
        after, key, big = tc.values_json(raw)
        if key in drop:
            continue
        value = (b'{"before":null,"after":%s,"source":%s%d,"snapshot":true}},"transaction":null,"op":"r",'
                 b'%s}' % (after, pfx, idx, times))
        keys.append(key)
        values.append(value)
        if toast and big and len(line) >= TOAST_ROW_MIN:
            tc.remember(key, tc.json_row(raw), raw)
        idx += 1
    return keys, values


# -- COPY text format, written by hand ----------------------------------------------------------------

_COPY_OUT = {ord("\\"): b"\\\\", ord("\t"): b"\\t", ord("\n"): b"\\n", ord("\r"): b"\\r", ord("\b"): b"\\b",
             ord("\f"): b"\\f", ord("\v"): b"\\v"}


def copy_line(values: Sequence[bytes | None]) -> bytes:
    """A row as ``COPY ... TO STDOUT`` (text format) writes it."""
    out = []
    for v in values:
        if v is None:
            out.append(b"\\N")
        else:
            out.append(b"".join(_COPY_OUT.get(c, bytes((c,))) for c in v))
    return b"\t".join(out) + b"\n"


def _mood(oid: int) -> t.TypeInfo | None:
    return t.TypeInfo(oid, "public.mood", "e", labels=("sad", "ok", "h\"appy")) if oid == 90001 else None


TEXT_VALUES = [b"", b"plain", b'quote " inside', b"back\\slash", b"new\nline", b"tab\there", b"cr\r\x08\x0c\x0b",
               b"\x01ctrl\x1f", b"\x7f", "é".encode(), "日本語".encode(), "emoji 😀".encode(),
               "\u2028\u2029".encode(), b"\\N", b"NULL", b"null", b"%s %d %%", b"x" * 400]

# column name, OID, typmod -> tricky values (text output under the connector's session settings)
COLUMNS: list[tuple[str, int, int, list[bytes]]] = [
    ("id", t.INT8, -1, []),  # the key: 1, 2, 3 ...
    ("i2", t.INT2, -1, [b"0", b"-32768", b"32767"]),
    ("i4", t.INT4, -1, [b"-2147483648", b"7"]),
    ("i8", t.INT8, -1, [b"9223372036854775807", b"-9223372036854775808"]),
    ("o", t.OID, -1, [b"4294967295"]),
    ("f4", t.FLOAT4, -1, [b"1.5", b"-0", b"NaN", b"Infinity", b"-Infinity", b"1e-45", b"3.4028235e+38"]),
    ("f8", t.FLOAT8, -1, [b"0.1", b"1e+100", b"-1.7976931348623157e+308", b"5e-324", b"123456789012345680",
                          b"NaN", b"2"]),
    ("dec", t.NUMERIC, (12 << 16 | 2) + 4, [b"1.25", b"-0.50", b"0.00", b"9999999999.99"]),
    ("num", t.NUMERIC, -1, [b"12345678901234567890.123456789012345678901234567890", b"NaN",
                            b"-0.000000000000000000001", b"Infinity", b"-Infinity", b"0"]),
    ("b", t.BOOL, -1, [b"t", b"f"]),
    ("bit1", t.BIT, 1, [b"1", b"0"]),
    ("bits", t.VARBIT, -1, [b"10101010", b"", b"100000001"]),
    ("by", t.BYTEA, -1, [b"\\x", b"\\x00ff5c0a", b"\\x" + b"ab" * 300]),
    ("d", t.DATE, -1, [b"2024-02-29", b"infinity", b"-infinity", b"0001-01-01", b"1970-01-01"]),
    ("tm", t.TIME, -1, [b"00:00:00", b"23:59:59.999999", b"24:00:00"]),
    ("ttz", t.TIMETZ, -1, [b"12:00:00+05:30", b"00:00:00-12"]),
    ("ts", t.TIMESTAMP, -1, [b"2024-01-02 03:04:05", b"2024-01-02 03:04:05.123456", b"infinity",
                             b"1900-01-01 00:00:00"]),
    ("tstz", t.TIMESTAMPTZ, -1, [b"2024-01-02 03:04:05+00", b"2024-01-02 03:04:05.1+00",
                                 b"2024-01-02 03:04:05.123456+00", b"infinity", b"-infinity",
                                 b"0099-01-01 00:00:00.000001+00", b"1969-12-31 23:59:59.999999+00"]),
    ("iv", t.INTERVAL, -1, [b"P1Y2M3DT4H5M6.5S", b"PT0S", b"P-1DT-2H", b"PT-0.000001S"]),
    ("u", t.UUID, -1, [b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    ("js", t.JSON, -1, [b'{"a": [1, 2.5, "x\\"y"], "b": null}', b"null", b'"s"', b'{"a":1, "a":2}',
                        b'{"big": 123456789012345678901234567890}', '{"é": "\u2028"}'.encode(), b"[]",
                        b'"tab\\t\\u0001"']),
    ("jb", t.JSONB, -1, [b'{"k": 1, "tag": "abc"}', b'{"q": "\\"\\\\"}', b"12345678901234567890",
                         b"true", b'{"a": "' + b"y" * 400 + b'"}']),
    ("txt", t.TEXT, -1, TEXT_VALUES),
    ("vc", t.VARCHAR, 64 + 4, [b"code-1", b"a\tb"]),
    ("bp", t.BPCHAR, 5 + 4, [b"ab   ", "é    ".encode()]),
    ("nm", t.NAME, -1, [b"pg_class"]),
    ("ch", t.CHAR, -1, [b"x", b'"']),
    ("xm", t.XML, -1, [b"<a b=\"c\">\n</a>"]),
    ("mo", t.MONEY, -1, [b"$1,234.56", b"-$0.01"]),
    ("ip", t.INET, -1, [b"192.168.0.1/24", b"::1"]),
    ("cidr", t.CIDR, -1, [b"10.0.0.0/8"]),
    ("mac", t.MACADDR, -1, [b"08:00:2b:01:02:03"]),
    ("ia", 1007, -1, [b"{1,NULL,3}", b"{}", b"{{1,2},{3,4}}"]),  # int4[]
    ("ta", 1009, -1, [b'{"a b","c,d","e\\"f",NULL,"NULL","\\\\"}', b'{"{x}",y}']),  # text[]
    ("mood", 90001, -1, [b"sad", b'h"appy', b"ok"]),
]


def _codec(decimal_mode: str = "string", key: Sequence[str] = ("id",)) -> TableCodec:
    cols = [column_codec(name, oid, typmod, optional=name != "id", lookup=_mood, decimal_mode=decimal_mode)
            for name, oid, typmod, _vals in COLUMNS]
    return TableCodec(source="src", db="db", schema="public", table="t", columns=cols, key=list(key),
                      codec=EventCodec(decimal_mode=decimal_mode), type_oids=[c[1] for c in COLUMNS],
                      typmods=[c[2] for c in COLUMNS])


def _plain_row(i: int) -> list[bytes | None]:
    """A row whose every value is the first (plain) tricky value of its column."""
    return [str(i).encode()] + [vals[0] for _n, _o, _m, vals in COLUMNS[1:]]


def _chunks() -> list[tuple[str, list[list[bytes | None]]]]:
    """Chunks that take every path: all plain, then per column every tricky value and NULL
    (the other columns plain), then everything at once."""
    out: list[tuple[str, list[list[bytes | None]]]] = [("plain", [_plain_row(i) for i in range(1, 6)])]
    key = 100
    every: list[list[bytes | None]] = []
    for c, (name, _oid, _typmod, vals) in enumerate(COLUMNS[1:], start=1):
        rows = []
        for v in [*vals, None]:
            key += 1
            row = _plain_row(key)
            row[c] = v
            rows.append(row)
        out.append((name, rows))
        out.append((f"{name} without NULL", rows[:-1]))
        out.extend((f"{name} {v!r}", [row]) for row, v in zip(rows, vals, strict=False))
        every.extend(rows)
    out.append(("everything", every))
    out.append(("all NULL", [[b"1"] + [None] * (len(COLUMNS) - 1), [b"2"] + [None] * (len(COLUMNS) - 1)]))
    return out


@pytest.mark.parametrize("decimal_mode", ["string", "precise", "double"])
def test_encode_reads_is_byte_for_byte_the_per_row_encoding(decimal_mode: str) -> None:
    remembered = 0
    for what, rows in _chunks():
        lines = [copy_line(r) for r in rows]
        tc, ref = _codec(decimal_mode), _codec(decimal_mode)
        try:
            want_keys, want_values = old_reads(ref, lines, PFX, TIMES, 5)
        except ValueError as exc:  # NaN / infinite numerics have no precise decimal form: the same error
            assert decimal_mode == "precise", (what, exc)
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                tc.encode_reads(lines, PFX, TIMES, 5)
            continue
        keys, values = tc.encode_reads(lines, PFX, TIMES, 5)
        assert keys == want_keys, what
        assert len(values) == len(want_values), what
        for got, want in zip(values, want_values, strict=True):
            assert got == want, what
        assert tc.toast_state == ref.toast_state, what  # long rows remembered as before
        remembered += len(tc.toast_state or ())
    assert remembered, "no chunk had a long row"


def test_the_bulk_path_takes_chunks_with_nulls_and_escapes() -> None:
    """Not a per-row fallback in disguise: the lines split in bulk whatever their values."""
    tc = _codec()
    for what, rows in _chunks():
        assert tc._read_fragments([copy_line(r) for r in rows]) is not None, what


BULK_COLUMNS = {  # columns whose values all take the bulk form of their kind
    "tstz": [b"2024-01-02 03:04:05+00", b"2024-01-02 03:04:05.1+00", b"2024-01-02 03:04:05.12345+00",
             b"2024-01-02 03:04:05.123456+00", b"1969-12-31 23:59:59.99999+00", b"0099-01-01 00:00:00.000001+00"],
    "jb": [b'{"k": 1, "tag": "abc"}', b"null", b'"s"', b"[1, 2.5, -0.0, 1e-7, 9007199254740993]",
           '{"é": "\u2028 x", "q": 1}'.encode(), b'{"a": {"b": [true, false]}}', b"{}"],
    "js": [b'{"a":1, "a":2}', b' [ 1 , 2 ] '],
    "txt": [b"", b"plain", "é 日本語 😀 \u2028".encode(), b"\x7f", b"%s %d %%", b"x" * 400],
    "f8": [b"0.1", b"1e+100", b"-1.7976931348623157e+308", b"5e-324", b"2", b"-0"],
    "dec": [b"1.25", b"-0.50"],
    "b": [b"t", b"f", b"t"],
    "d": [b"2024-02-29", b"2024-02-29", b"infinity", b"1970-01-01"],
}


def test_bulk_forms_equal_the_per_value_expressions() -> None:
    from kappaflow.connectors.postgres.rows import _bulk

    tc = _codec()
    tc._read_fragments([copy_line(_plain_row(1))])  # builds the plan
    assert tc._reads is not None
    names = [c[0] for c in COLUMNS]

    def refuse(v: bytes) -> bytes:
        raise AssertionError(f"value by value: {v!r}")

    for name, vals in BULK_COLUMNS.items():
        kind, one = tc._reads[0][names.index(name)]
        want = list(map(one, vals))
        got = _bulk(kind, (one if name in ("d", "jb", "js") else refuse), vals)  # dates: once per value; json: each
        assert got == want, name
        rows = []
        for i, v in enumerate(vals):
            row = _plain_row(i + 1)
            row[names.index(name)] = v
            rows.append(row)
        lines = [copy_line(r) for r in [*rows, *rows[:1]]]
        assert _codec().encode_reads(lines, PFX, TIMES, 0) == old_reads(_codec(), lines, PFX, TIMES, 0), name


def test_drop_leaves_keys_out_and_indexes_run_over_the_kept_rows() -> None:
    rows = [_plain_row(i) for i in range(1, 9)]
    rows[3][COLUMNS.index(next(c for c in COLUMNS if c[0] == "txt"))] = b"esc\\aped\n"
    lines = [copy_line(r) for r in rows]
    drop = {b'{"id":2}', b'{"id":4}', b'{"id":8}', b'{"id":99}'}
    keys, values = _codec().encode_reads(lines, PFX, TIMES, 40, drop)
    want_keys, want_values = old_reads(_codec(), lines, PFX, TIMES, 40, drop)
    assert keys == want_keys == [b'{"id":%d}' % i for i in (1, 3, 5, 6, 7)]
    assert values == want_values
    assert b'"index":44,' in values[-1]
    assert _codec().encode_reads(lines, PFX, TIMES, 0, {k for k in want_keys} | drop) == ([], [])
    assert _codec().encode_reads([], PFX, TIMES, 0) == ([], [])


def test_composite_keys_and_a_single_column_table() -> None:
    tc = _codec(key=("txt", "id"))
    lines = [copy_line(r) for _w, rows in _chunks() for r in rows if r[0] is not None][:200]
    keys, values = tc.encode_reads(lines, PFX, TIMES, 0)
    assert (keys, values) == old_reads(_codec(key=("txt", "id")), lines, PFX, TIMES, 0)
    one = TableCodec(source="s", db="d", schema="public", table="k", columns=[column_codec("k", t.TEXT, -1)],
                     key=["k"], codec=EventCodec())
    lines = [copy_line([v]) for v in TEXT_VALUES]
    assert one.encode_reads(lines, PFX, TIMES, 0) == old_reads(one, lines, PFX, TIMES, 0)


@pytest.mark.parametrize(("column", "bad"), [("i4", b"x1"), ("f8", b"one"), ("d", b"2024-13-01"),
                                             ("tstz", b"12345-01-01 00:00:00+00"), ("jb", b"{bad"),
                                             ("txt", b"\xff\xfe")])
def test_bad_values_fail_as_the_per_row_path_fails(column: str, bad: bytes) -> None:
    rows = [_plain_row(1), _plain_row(2)]
    rows[1][[c[0] for c in COLUMNS].index(column)] = bad
    lines = [copy_line(r) for r in rows]
    try:
        want: Any = old_reads(_codec(), lines, PFX, TIMES, 0)
    except Exception as exc:  # whatever the per-row path raised
        with pytest.raises(type(exc)):
            _codec().encode_reads(lines, PFX, TIMES, 0)
    else:  # values the converters take as they are (ints are not parsed): the same bytes
        assert _codec().encode_reads(lines, PFX, TIMES, 0) == want


def test_copy_split_fallback_for_lines_that_do_not_split_into_the_columns() -> None:
    tc = _codec()
    short = b"1\tx\n"
    assert tc._read_fragments([short]) is None
    with pytest.raises(Exception) as ei:
        tc.encode_reads([copy_line(_plain_row(1)), short], PFX, TIMES, 0)
    with pytest.raises(type(ei.value)):
        old_reads(_codec(), [copy_line(_plain_row(1)), short], PFX, TIMES, 0)


# -- PostgreSQL's own COPY output -----------------------------------------------------------------------

PG_TABLE = """CREATE TABLE enc (
    id bigint PRIMARY KEY, i2 smallint, f4 real, f8 double precision, dec numeric(12, 2), num numeric,
    b boolean, bit1 bit(1), bits varbit, by bytea, d date, tm time, ttz timetz, ts timestamp, tstz timestamptz,
    iv interval, u uuid, js json, jb jsonb, txt text, vc varchar(64), bp char(5), ia int[], ta text[],
    mood enc_mood, tsa timestamptz[], inet_ inet)"""

PG_ROWS = """INSERT INTO enc VALUES
 (1, 1, 1.5, 0.1, 1.25, 12345678901234567890.12345678901234567890, true, B'1', B'1010', '\\x00ff5c0a',
  '2024-02-29', '23:59:59.999999', '12:00:00+05:30', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.1+00',
  '1 year 2 mons 3 days 04:05:06.5', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2.5, "x\\"y"]}',
  '{"k": 1, "tag": "abc"}', 'plain', 'code-1', 'ab', '{1,NULL,3}', '{"a b","c,d","e\\"f",NULL,"NULL","\\\\"}',
  'sad', '{"2024-01-02 03:04:05+00",NULL}', '::1'),
 (2, NULL, 'NaN', 'Infinity', NULL, 'NaN', false, B'0', B'', '\\x', 'infinity', '24:00:00', NULL,
  '-infinity', '-infinity', '-00:00:00.000001', NULL, 'null', '"s"', E'tab\\there "q" \\\\ \\x01 \\n\\r', NULL,
  NULL, '{}', '{}', 'h"appy', '{}', NULL),
 (3, -32768, '-Infinity', '5e-324', 0, '-0.000000000000000000001', NULL, NULL, NULL, NULL, '0001-01-01', NULL,
  NULL, '1900-01-01 00:00:00', '0099-01-01 00:00:00.000001+00', NULL, NULL, '{"a":1, "a":2}',
  '{"big": 123456789012345678901234567890}', E'\\\\N', E'\\u00e9\\u2028 \\U0001F600', NULL, NULL, NULL,
  'ok', NULL, NULL),
 (4, 7, 0, 1e100, 9999999999.99, 'Infinity', true, B'1', B'100000001', NULL, '1970-01-01', '00:00:00',
  NULL, NULL, '2024-01-02 03:04:05+00', NULL, NULL, NULL, NULL, '', '', '', NULL, NULL, NULL, NULL, NULL)"""


def test_postgres_copy_output_encodes_as_the_per_row_path(pg_dsn: str, sql: Callable[..., Any]) -> None:
    sql("DROP TABLE IF EXISTS enc")
    sql("DROP TYPE IF EXISTS enc_mood")
    sql("""CREATE TYPE enc_mood AS ENUM ('sad', 'ok', 'h"appy')""")
    sql(PG_TABLE)
    sql(PG_ROWS)
    sql("INSERT INTO enc (id, txt, jb, by) SELECT x, repeat('long ', 100) || x, "
        "jsonb_build_object('k', repeat('v', 500)), decode(repeat('ab', 300), 'hex') FROM generate_series(10, 12) x")
    sql("INSERT INTO enc (id, i2, f8, txt, d, tstz, b) SELECT x, x % 100, x / 7.0, 'name ' || x, "
        "date '2024-01-01' + x % 30, timestamptz '2024-01-01' + x * interval '1.5 second', x % 2 = 0 "
        "FROM generate_series(100, 400) x")
    conn = slots.connect(pg_dsn, what="encoder test")
    try:
        info = slots.load_table(conn, "public", "enc", None, source="src")
        lookup = slots.TypeCatalog(conn)

        def codec() -> TableCodec:
            return TableCodec.from_table_info(info, source="src", db="db", codec=EventCodec(), lookup=lookup)

        codec()  # the type catalog keeps what it read: later codecs need no connection
        query = b"COPY (SELECT * FROM enc ORDER BY id) TO STDOUT"
        lines = PgOnDemand._copy(conn.pgconn, query)
    finally:
        conn.close()
    assert len(lines) == 4 + 3 + 301
    chunks = [lines, lines[:4], lines[4:], *([line] for line in lines[:7])]
    for chunk in chunks:
        tc, ref = codec(), codec()
        assert tc._read_fragments(chunk) is not None
        keys, values = tc.encode_reads(chunk, PFX, TIMES, 3)
        want_keys, want_values = old_reads(ref, chunk, PFX, TIMES, 3)
        assert keys == want_keys
        assert values == want_values
        assert tc.toast_state == ref.toast_state
    assert tc.toast_state is not None
    drop = {b'{"id":2}', b'{"id":11}', b'{"id":200}'}
    assert codec().encode_reads(lines, PFX, TIMES, 0, drop) == old_reads(codec(), lines, PFX, TIMES, 0, drop)
