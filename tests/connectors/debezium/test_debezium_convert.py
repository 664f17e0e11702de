"""The Debezium source's fast path (``DebeziumDecoder.convert``: Debezium's JSON straight to the JSON
kappaflow writes) against the decode/encode path (``decode``, then ``EventCodec.encode_value``): the
same records, keys, values, errors and ordering state, byte for byte (no server needed).

The records are Debezium's documented ones (``dbz_helpers.SOURCES``): the PostgreSQL connector's
create/update/delete/truncate events of ``customers``, the MySQL connector's update and delete, the
SQL Server connector's create/update/delete, and the PostgreSQL connector's data type mapping
(``pg_products_logical_types.json``: ``Decimal`` bytes, ``Date``, ``MicroTimestamp``,
``ZonedTimestamp``, ``Json``, ``Uuid``, ``VariableScaleDecimal``), with the values varied over what
the converters must get right (signs, scales, the ends of the ranges, PostgreSQL's infinity
timestamps, JSON whitespace, upper-case UUIDs) and bad or odd records between them.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import orjson
import pytest
from dbz_helpers import fx

from kappaflow.connectors.debezium.decode import DebeziumDecoder
from kappaflow.errors import ValidationError
from kappaflow.events import EventCodec

PRODUCTS = "PostgreSQL_server.inventory.products"
PG = "PostgreSQL_server.public.customers"
PG_KEY = {"schema": {"type": "struct", "name": f"{PG}.Key", "optional": False,
                     "fields": [{"type": "int32", "optional": False, "field": "id"}]}, "payload": {"id": 1}}


def _dec(i: int) -> str:
    return base64.b64encode(i.to_bytes((i.bit_length() + 8) // 8, "big", signed=True)).decode()


def _product(i: int, op: str = "c", **after: Any) -> bytes:
    doc = fx("pg_products_logical_types.json")
    payload = doc["payload"]
    payload["after"].update({"id": i, **after})
    payload["op"] = op
    payload["source"]["lsn"] += i
    if op == "d":
        payload["before"], payload["after"] = payload["after"], None
    elif op == "u":
        payload["before"] = dict(payload["after"], price=_dec(1))
    return orjson.dumps(doc)


def _records() -> list[tuple[str, bytes | None, bytes | None]]:
    """(topic, key, value) in the order a partition would deliver them."""
    products: list[tuple[str, bytes | None, bytes | None]] = []
    values = [
        {}, {"price": _dec(-5)}, {"price": _dec(0)}, {"price": _dec(-100)}, {"price": _dec(10 ** 30 + 7)},
        {"born": -719162}, {"born": 2932896}, {"born": None},
        {"updated": -62135596800000000}, {"updated": 253402300799999999},
        {"updated": 9223372036825200000},  # PostgreSQL's infinity: written as the largest timestamp
        {"updated": -9223372036832400000},
        {"seen": "2024-01-02T05:04:05.1+02:00"}, {"seen": "2024-01-02T03:04:05Z"},
        {"doc": '{"b" :  [1, 2],\n "a": null}'}, {"doc": "null"}, {"doc": '"text"'},
        {"uid": "F8F7E5C4-3B4A-4D2E-9C1B-0A9E8D7C6B5A"},
        {"amount": {"scale": 0, "value": _dec(-12)}}, {"amount": None},
        {"price": "not base64!"},  # bad: dead letter, the same reason either way
        {"born": "2024-01-01"},  # bad
        {"extra_column": 1},  # bad: not in the schema
        {"doc": "__debezium_unavailable_value"},  # unavailable, not a value
        {"doc": '{"__debezium_unavailable_value" : "__debezium_unavailable_value"}'},  # hstore as json: too
        {"doc": '{"x": -99999999, "y": -99999999.0}'}, {"doc": '["__debezium_unavailable_value"]'},
        {"doc": '{"wkb": "AQEAACDmEAAAAAAA/IPXl8EAAAD8g9eXwQ=="}'},
        {"seen": 12},  # bad
    ]
    for i, after in enumerate(values):
        products.append((PRODUCTS, orjson.dumps({"id": 100 + i}), _product(100 + i, **after)))
    products.append((PRODUCTS, orjson.dumps({"id": 100}), _product(100, "u", price=_dec(123456))))
    products.append((PRODUCTS, orjson.dumps({"id": 101}), _product(101, "d")))
    products.append((PRODUCTS, orjson.dumps({"id": 101}), None))  # the delete's tombstone
    numeric = orjson.loads(_product(102, "u"))  # decimal.format=NUMERIC: a JSON number
    numeric["payload"]["after"]["price"] = 12.34
    products.append((PRODUCTS, orjson.dumps({"id": 102}), orjson.dumps(numeric)))
    no_after = orjson.loads(_product(103))
    no_after["payload"]["after"] = None  # bad: a create without its row
    products.append((PRODUCTS, orjson.dumps({"id": 103}), orjson.dumps(no_after)))
    bad_lsn = orjson.loads(_product(104))
    bad_lsn["payload"]["source"]["lsn"] = "0/16B3748"  # bad source block
    products.append((PRODUCTS, orjson.dumps({"id": 104}), orjson.dumps(bad_lsn)))
    products.append((PRODUCTS, orjson.dumps({"id": 105}), _product(105)))

    customers: list[tuple[str, bytes | None, bytes | None]] = []
    key = orjson.dumps(PG_KEY)
    for name in ("pg_doc_create.json", "pg_doc_update.json", "pg_doc_update.json", "pg_doc_delete.json",
                 "pg_doc_truncate.json", "pg_doc_create.json"):
        customers.append((PG, key, orjson.dumps(fx(name))))
    placeholder = fx("pg_doc_update.json")
    placeholder["payload"]["after"]["email"] = "__debezium_unavailable_value"
    customers.append((PG, key, orjson.dumps(placeholder)))
    customers.append((PG, None, orjson.dumps(fx("pg_doc_create.json"))))  # keyless

    others: list[tuple[str, bytes | None, bytes | None]] = []
    mysql = "mysql-server-1.inventory.customers"
    for name in ("mysql_customers_update.json", "mysql_customers_update.json", "mysql_customers_delete.json"):
        others.append((mysql, orjson.dumps({"id": 1004}), orjson.dumps(fx(name))))
    sqlserver = "server1.testDB.dbo.customers"
    for name in ("sqlserver_doc_create.json", "sqlserver_doc_update.json", "sqlserver_doc_delete.json"):
        others.append((sqlserver, orjson.dumps({"id": 1005}), orjson.dumps(fx(name))))
    return products + customers + others


def _outcome(dec: DebeziumDecoder, out: EventCodec, fast: bool, topic: str, key: bytes | None,
             value: bytes | None, offset: int) -> Any:
    """What the source writes for a record: (topic, schema, key bytes, value bytes, op, position,
    unavailable), or the error's message; and whether the fast path converted it."""
    try:
        d = dec.convert(topic, 0, offset, key, value, out) if fast else dec.decode(topic, 0, offset, key, value)
    except ValidationError as exc:
        return ("error", str(exc)), False
    if d.kind != "event":
        return (d.kind, d.topic, d.reason), False
    assert d.schema is not None
    c = d.converted
    if c is not None:
        assert d.event is None
        k = out.encode_key(c.key, d.schema) if c.key is not None else None
        v = out.encode_converted(d.schema, c.op, c.before, c.after, c.source, c.ts_ms, c.transaction, c.ts_us,
                                 c.ts_ns)
        assert out.encode_value(c.event(), d.schema) == v, "the converted event decodes to the same event"
        return (d.topic, d.schema, k, v, c.op, c.source.position, ()), True
    ev = d.event
    assert ev is not None
    k = out.encode_key(ev.key, d.schema) if ev.key is not None and d.schema.key else None
    return (d.topic, d.schema, k, out.encode_value(ev, d.schema), ev.op, ev.source.position, ev.unavailable), False


@pytest.mark.parametrize("mode", ["string", "precise", "double"])
def test_converted_records_are_the_decoded_records_byte_for_byte(mode: str) -> None:
    out = EventCodec(mode)
    slow, fast = DebeziumDecoder("PostgreSQL_server"), DebeziumDecoder("PostgreSQL_server")
    converted = 0
    for offset, (topic, key, value) in enumerate(_records()):
        want, _ = _outcome(slow, out, False, topic, key, value, offset)
        got, was_converted = _outcome(fast, out, True, topic, key, value, offset)
        assert got == want, (offset, topic, value)
        converted += was_converted
    assert slow.order.to_dict() == fast.order.to_dict(), "the same positions given out, the same deletes noted"
    assert slow.known == fast.known and slow.out_topics == fast.out_topics
    assert converted >= 25, f"only {converted} records took the fast path"


def test_odd_values_take_the_decode_path_and_errors_name_the_field() -> None:
    """A value the fast path does not convert exactly is read by ``decode``: the same dead-letter reason
    (field, what was expected) and, for PostgreSQL's infinity, the same written value."""
    dec = DebeziumDecoder("PostgreSQL_server")
    out = EventCodec()
    assert dec.convert(PRODUCTS, 0, 0, b'{"id":1}', _product(1), out).converted is None  # schema first seen
    assert dec.convert(PRODUCTS, 0, 1, b'{"id":2}', _product(2), out).converted is not None
    infinity = dec.convert(PRODUCTS, 0, 2, b'{"id":3}', _product(3, updated=9223372036825200000), out)
    assert infinity.converted is None and infinity.event is not None
    assert orjson.loads(out.encode_value(infinity.event, infinity.schema))["after"]["updated"] == 253402300799999999  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"after\.price: expected decimal as base64 .* got str 'not base64!'"):
        dec.convert(PRODUCTS, 0, 3, b'{"id":4}', _product(4, price="not base64!"), out)
    placeholder = dec.convert(PRODUCTS, 0, 4, b'{"id":5}', _product(5, doc="__debezium_unavailable_value"), out)
    assert placeholder.converted is None and placeholder.event is not None
    assert placeholder.event.unavailable == ("doc",)


def test_a_converted_row_is_not_the_input_row() -> None:
    """The fast path leaves the record's rows alone (the event decoded from them is the decoded one)."""
    dec = DebeziumDecoder("PostgreSQL_server")
    out = EventCodec()
    dec.convert(PRODUCTS, 0, 0, b'{"id":1}', _product(1), out)
    d = dec.convert(PRODUCTS, 0, 1, b'{"id":7}', _product(7, "u"), out)
    c = d.converted
    assert c is not None and c.wire_after is not None and c.after is not None
    assert c.wire_after["price"] == "BOI=" and c.after["price"] == "12.50"
    assert c.key == {"id": 7}
    again = copy.deepcopy(c.wire_after)
    c.event()
    assert c.wire_after == again
