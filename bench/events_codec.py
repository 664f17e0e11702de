"""Benchmark: encode/decode rate of the change-event JSON codec.

A 6-column row event (int, text, numeric, timestamptz, bool, jsonb) from a
PostgreSQL source, in the default codec configuration (decimal_mode="string",
schemaless), plus the precise/with-schema variants for reference.
Prints one JSON object on its last line.

    .venv/bin/python bench/events_codec.py [--n 200000]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.events import ChangeEvent, Column, EventCodec, FieldType, Op, SourceInfo, TableSchema

SCHEMA = TableSchema(
    "shop.public.orders",
    (
        Column("id", FieldType.INT64, optional=False, native_type="int8"),
        Column("customer", FieldType.STRING, native_type="text"),
        Column("amount", FieldType.DECIMAL, scale=2, precision=12, native_type="numeric(12,2)"),
        Column("created_at", FieldType.TIMESTAMPTZ, native_type="timestamptz"),
        Column("paid", FieldType.BOOLEAN, native_type="bool"),
        Column("attrs", FieldType.JSON, native_type="jsonb"),
    ),
    key=("id",),
)


def make_events(n: int) -> list[ChangeEvent]:
    t0 = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)
    events = []
    for i in range(n):
        row = {
            "id": i,
            "customer": f"customer-{i % 997}",
            "amount": Decimal(i % 100000) / 100,
            "created_at": t0 + timedelta(microseconds=i * 1001),
            "paid": i % 3 == 0,
            "attrs": {"channel": "web", "items": i % 7, "tags": ["a", "b"]},
        }
        src = SourceInfo(
            "postgresql", "shop", "shop", "public", "orders",
            PgPosition(0x16B3748 + i * 64, 0), 1714564800000 + i, tx_id=1000 + i,
        )
        events.append(ChangeEvent(Op.CREATE, {"id": i}, None, row, src, 1714564800100 + i))
    return events


TIMER = time.perf_counter
"""The clock every rate is measured with (wall time, best of `repeat`); the JSON's ``timer`` names it."""


def rate(fn, items, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = TIMER()
        for x in items:
            fn(x)
        best = min(best, TIMER() - t)
    return len(items) / best


def main(argv: list[str] | None = None) -> dict[str, float | int | str]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args(argv)
    events = make_events(args.n)
    result: dict[str, float | int | str] = {
        "events": args.n, "row": "int8,text,numeric(12,2),timestamptz,bool,jsonb", "timer": TIMER.__name__,
    }
    for label, codec in (
        ("", EventCodec()),
        ("precise_", EventCodec("precise")),
        ("schema_", EventCodec("precise", include_schema=True)),
    ):
        enc = codec.encode_value
        datas = [enc(e, SCHEMA) for e in events]
        dec = codec.decode_value
        assert dec(datas[1], SCHEMA) == events[1]
        result[f"{label}encode_per_s"] = round(rate(lambda e, enc=enc: enc(e, SCHEMA), events))
        result[f"{label}decode_per_s"] = round(rate(lambda d, dec=dec: dec(d, SCHEMA), datas))
        if not label:
            result["value_bytes"] = len(datas[1])
    key_enc = EventCodec().encode_key
    result["key_encode_per_s"] = round(rate(lambda e: key_enc(e.key, SCHEMA), events))
    for k, v in result.items():
        if k.endswith("_per_s"):
            print(f"{k:>24}: {v:>12,}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
