"""Spark orders source positions as `Position.sort_key` does: each connector's registered ordering."""

from __future__ import annotations

import json
from typing import Any

from kappaflow.connectors.ledger.source_info import LedgerPosition
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.events import Position


def test_spark_order_matches_sort_key_for_every_kind(spark: Any) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructField, StructType

    from kappaflow.projections.schemas import POS_TYPE, pos_order

    kinds: list[list[Position]] = [
        [PgPosition(100, 3), PgPosition(100, 2, True), PgPosition(99, 7), PgPosition(100, 0), PgPosition(2**40, 1)],
        [BinlogPosition("mysql-bin.000012", 44, 2), BinlogPosition("mysql-bin.000012", 44, 1, snapshot=True),
         BinlogPosition("mysql-bin.000009", 900, 0), BinlogPosition("mysql-bin.000100", 4, 0),
         BinlogPosition("mysql-bin.000012", 120, 0)],
        [LedgerPosition(77), LedgerPosition(3), LedgerPosition(1000)],
    ]
    for positions in kinds:
        df = spark.createDataFrame([(i, json.dumps({"p": p.to_dict()})) for i, p in enumerate(positions)],
                                   "i int, v string")
        parsed = F.from_json("v", StructType([StructField("p", POS_TYPE)]))["p"]
        got = [r.i for r in df.orderBy(pos_order(parsed)).select("i").collect()]
        want = [i for i, _ in sorted(enumerate(positions), key=lambda ip: ip[1].sort_key())]
        assert got == want, (type(positions[0]).__name__, got, want)
