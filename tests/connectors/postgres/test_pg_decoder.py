"""pgoutput decoder: every message type, the relation cache, and malformed input."""

from __future__ import annotations

import struct

import pytest
from pg_helpers import tup

from kappaflow.connectors.postgres.decoder import (
    PG_EPOCH_US,
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    PgOutputDecoder,
    Relation,
    Truncate,
    TypeMessage,
    Update,
)
from kappaflow.errors import ValidationError


def relation(relid: int = 16400, ns: bytes = b"public", name: bytes = b"orders", ident: bytes = b"d") -> bytes:
    cols = [(1, b"id", 23, -1), (0, b"note", 25, -1), (0, b"amount", 1700, (12 << 16 | 2) + 4)]
    body = b"R" + struct.pack(">I", relid) + ns + b"\0" + name + b"\0" + ident + struct.pack(">h", len(cols))
    for flags, cname, oid, typmod in cols:
        body += struct.pack(">B", flags) + cname + b"\0" + struct.pack(">Ii", oid, typmod)
    return body


def test_begin_and_commit() -> None:
    d = PgOutputDecoder()
    b = d.decode(b"B" + struct.pack(">QqI", 0x16B3748, 1_000_000, 777))
    assert b == Begin(final_lsn=0x16B3748, commit_ts_us=1_000_000 + PG_EPOCH_US, xid=777)
    c = d.decode(b"C" + struct.pack(">BQQq", 0, 0x16B3748, 0x16B3780, 5))
    assert c == Commit(0, 0x16B3748, 0x16B3780, 5 + PG_EPOCH_US)


def test_relation_is_cached_and_rows_decode() -> None:
    d = PgOutputDecoder()
    rel = d.decode(relation())
    assert isinstance(rel, Relation)
    assert rel.qualified == "public.orders"
    assert [c.name for c in rel.columns] == ["id", "note", "amount"]
    assert [c.key for c in rel.columns] == [True, False, False]
    assert rel.columns[2].type_oid == 1700
    assert d.relations[16400] is rel

    ins = d.decode(b"I" + struct.pack(">I", 16400) + b"N" + tup(b"1", None, b"12.50"))
    assert ins == Insert(16400, (b"1", None, b"12.50"))

    upd = d.decode(b"U" + struct.pack(">I", 16400) + b"N" + tup(b"1", UNCHANGED, b"13.00"))
    assert isinstance(upd, Update) and upd.old is None and upd.new == (b"1", UNCHANGED, b"13.00")

    upd_k = d.decode(b"U" + struct.pack(">I", 16400) + b"K" + tup(b"1", None, None) + b"N" + tup(b"2", b"x", b"1"))
    assert isinstance(upd_k, Update) and upd_k.old_kind == "K" and upd_k.old == (b"1", None, None)

    upd_o = d.decode(b"U" + struct.pack(">I", 16400) + b"O" + tup(b"1", b"a", b"1") + b"N" + tup(b"1", b"b", b"1"))
    assert isinstance(upd_o, Update) and upd_o.old_kind == "O"

    dele = d.decode(b"D" + struct.pack(">I", 16400) + b"K" + tup(b"2", None, None))
    assert dele == Delete(16400, "K", (b"2", None, None))


def test_pg_catalog_namespace_and_type_truncate_origin_message() -> None:
    d = PgOutputDecoder()
    assert d.decode(relation(ns=b"")).namespace == "pg_catalog"  # type: ignore[union-attr]
    y = d.decode(b"Y" + struct.pack(">I", 90001) + b"public\0mood\0")
    assert y == TypeMessage(90001, "public", "mood") and d.types[90001] == y
    t = d.decode(b"T" + struct.pack(">iB", 2, 3) + struct.pack(">II", 1, 2))
    assert t == Truncate((1, 2), cascade=True, restart_identity=True)
    o = d.decode(b"O" + struct.pack(">Q", 99) + b"node_a\0")
    assert o == Origin(99, "node_a")
    m = d.decode(b"M" + b"\x00" + struct.pack(">Q", 1234) + b"kappaflow_heartbeat:s\0" + struct.pack(">I", 3) + b"abc")
    assert m == LogicalMessage(False, 1234, "kappaflow_heartbeat:s", b"abc")


@pytest.mark.parametrize(
    ("data", "type_name", "byte_pos"),
    [
        (b"", "message", 0),
        (b"Z\x00\x01", "unknown (0x5a)", 0),
        (b"B" + b"\x00" * 10, "Begin", 1),
        (b"C" + b"\x00" * 30, "Commit", 26),  # trailing bytes
        (b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", 2) + b"t" + struct.pack(">I", 50) + b"abc",
         "Insert", 9),  # value length (at byte 9) beyond the message
        (b"I" + struct.pack(">I", 1) + b"X" + tup(b"1"), "Insert", 5),  # bad tuple marker
        (b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", 1) + b"q", "Insert", 8),  # bad column kind
        (b"U" + struct.pack(">I", 1) + b"K" + tup(b"1") + b"Q" + tup(b"1"), "Update", 14),
        (b"D" + struct.pack(">I", 1) + b"N" + tup(b"1"), "Delete", 5),
        (b"R" + struct.pack(">I", 1) + b"public\0orders", "Relation", 12),  # unterminated name
        (b"R" + struct.pack(">I", 1) + b"public\0orders\0x" + struct.pack(">h", 0), "Relation", 19),
        (b"T" + struct.pack(">iB", 3, 0) + struct.pack(">I", 1), "Truncate", 6),
        (b"M\x00" + struct.pack(">Q", 1) + b"p\0" + struct.pack(">I", 9) + b"ab", "Message", 16),
    ],
)
def test_malformed_messages_name_type_and_position(data: bytes, type_name: str, byte_pos: int) -> None:
    with pytest.raises(ValidationError) as ei:
        PgOutputDecoder().decode(data, lsn=0x1_0000_0010)
    msg = str(ei.value)
    assert f"malformed pgoutput {type_name}" in msg or (not data and "empty payload at byte 0" in msg)
    if data:
        assert f"at byte {byte_pos}:" in msg, msg
        assert "1/10" in msg  # the WAL position
