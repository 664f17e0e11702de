"""Benchmark: the search and Redis view sinks against plain client baselines.

200k documents into a search server (osmem, started privately) through ``SearchSink``
(external versions, write alias with require_alias, per-item classification, positions)
and, in the same run, plain ``opensearch-py helpers.bulk`` of the same documents into an
index with the same mapping. 500k keys into a private Redis through ``RedisSink`` (the Lua
version guard, JSON values, positions) and plain pipelined ``SET`` of the same keys and
JSON values. The sinks start from an Arrow batch (what projections hand them); the
baselines from ready Python dicts (they only serialize), so the comparison favours the
baselines.

    .venv/bin/python bench/sinks.py [--docs 200000] [--keys 500000]

The last line is one JSON object: search_docs_per_s, search_raw_docs_per_s,
redis_keys_per_s (each sink write -- a micro-batch -- in one MULTI/EXEC, the default),
redis_non_atomic_keys_per_s (the same writes with ``atomic_batches=False``: the cost of
atomic batches), redis_raw_keys_per_s (plus ratios and sizes).
Goals: search >= 80% of raw; Redis >= 70% of raw and >= 150k keys/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from decimal import Decimal
from typing import Any

import orjson
import pyarrow as pa
from pyspark.sql import types as T

from kappaflow.projections.sinks.base import VERSION, ViewColumn, ViewSpec
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink, derive_mapping
from kappaflow.testing.servers.osmem import OsmemServer
from kappaflow.testing.servers.redis import PrivateRedis

VIEW_COLUMNS = (
    ViewColumn("id", T.LongType(), False), ViewColumn("name", T.StringType()),
    ViewColumn("email", T.StringType()), ViewColumn("city", T.StringType()),
    ViewColumn("total", T.DecimalType(12, 2)), ViewColumn("orders", T.IntegerType()),
)


def make_rows(n: int) -> list[dict[str, Any]]:
    cities = ["Lisbon", "Oslo", "Lima", "Osaka", "Quito", "Perth", "Accra"]
    return [{"id": i, "name": f"customer {i}", "email": f"c{i}@example.com", "city": cities[i % 7],
             "total": Decimal(i % 100_000) / 100, "orders": i % 17} for i in range(n)]


def as_batch(view: ViewSpec, rows: list[dict[str, Any]]) -> pa.Table:
    cols: dict[str, Any] = {c.name: [r[c.name] for r in rows] for c in view.columns}
    cols[VERSION] = list(range(len(rows)))
    cols["_kf_deleted"] = [False] * len(rows)
    return pa.Table.from_pydict(cols, schema=view.arrow_schema())


def timed(fn: Any) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_search(n: int, batch_rows: int) -> tuple[float, float]:
    from opensearchpy import OpenSearch, helpers

    rows = make_rows(n)
    server = OsmemServer().start()
    try:
        view = ViewSpec("bench_customers", "Bench", ("id",), VIEW_COLUMNS)
        table = as_batch(view, rows)
        # the baseline first, on the fresh server (any warm-up or ordering effect favours it)
        client = OpenSearch(hosts=[server.url], timeout=120)
        client.indices.create(index="bench_raw", body={"mappings": derive_mapping(view)})

        def raw() -> None:
            ok, errors = helpers.bulk(client, ({"_index": "bench_raw", "_id": str(r["id"]), "_source": r}
                                               for r in rows))
            assert ok == n and not errors

        raw_s = timed(raw)
        client.indices.refresh(index="bench_raw")
        assert client.count(index="bench_raw")["count"] == n
        client.indices.delete(index="bench_raw")

        sink = SearchSink(server.url)
        target = sink.ensure(view)

        def kf() -> None:
            for start in range(0, n, batch_rows):
                res = sink.write(target, table.slice(start, batch_rows),
                                 positions={("bench", 0): min(n, start + batch_rows)})
                assert not res.rejected and res.upserted == min(batch_rows, n - start), res

        kf_s = timed(kf)
        assert sink.count(target) == n
        sink.drop(target)
        return n / kf_s, n / raw_s
    finally:
        server.stop()


def bench_redis(n: int, batch_rows: int) -> tuple[float, float, float]:
    import redis

    rows = make_rows(n)
    server = PrivateRedis().start()
    try:
        view = ViewSpec("bench_customers", "Bench", ("id",), VIEW_COLUMNS)
        table = as_batch(view, rows)
        client = redis.Redis.from_url(server.url)

        def raw() -> None:
            pipe = client.pipeline(transaction=False)
            for i, r in enumerate(rows):
                pipe.set(f"raw:bench_customers:{r['id']}", orjson.dumps(r, default=str))
                if i % 1000 == 999:
                    pipe.execute()
            pipe.execute()

        raw_s = timed(raw)  # the baseline first, on the empty server
        assert client.dbsize() == n
        client.flushdb()

        def kf(sink: RedisSink) -> None:
            target = sink.ensure(view)
            for start in range(0, n, batch_rows):
                res = sink.write(target, table.slice(start, batch_rows),
                                 positions={("bench", 0): min(n, start + batch_rows)})
                assert not res.rejected and res.upserted == min(batch_rows, n - start), res

        # each sink write (a micro-batch) in one MULTI/EXEC (the default), and the same writes without
        # (atomic_batches=False: the cost of atomic batches); A-B-A-B on an emptied server, best of two
        best = {True: float("inf"), False: float("inf")}
        for atomic in (True, False, True, False):
            secs = timed(lambda a=atomic: kf(RedisSink(server.url, options={"atomic_batches": a})))
            assert client.dbsize() == n + 3  # rows + pointer, registry, marker
            client.flushdb()
            best[atomic] = min(best[atomic], secs)
        kf_s, plain_s = best[True], best[False]
        client.close()
        return n / kf_s, n / raw_s, n / plain_s
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=500_000)
    ap.add_argument("--batch-rows", type=int, default=20_000, help="rows per sink write (a micro-batch)")
    args = ap.parse_args()
    redis_kf, redis_raw, redis_plain = bench_redis(args.keys, args.batch_rows)
    print(f"redis: kappaflow {redis_kf:,.0f} keys/s (batches in MULTI/EXEC; {redis_plain:,.0f} without), "
          f"raw pipelined SET {redis_raw:,.0f} keys/s", flush=True)
    search_kf, search_raw = bench_search(args.docs, args.batch_rows)
    print(f"search: kappaflow {search_kf:,.0f} docs/s, raw helpers.bulk {search_raw:,.0f} docs/s", flush=True)
    print(json.dumps({
        "search_docs_per_s": round(search_kf),
        "search_raw_docs_per_s": round(search_raw),
        "redis_keys_per_s": round(redis_kf),
        "redis_raw_keys_per_s": round(redis_raw),
        "redis_non_atomic_keys_per_s": round(redis_plain),
        "redis_atomic_vs_non_atomic": round(redis_kf / redis_plain, 3),
        "search_vs_raw": round(search_kf / search_raw, 3),
        "redis_vs_raw": round(redis_kf / redis_raw, 3),
        "docs": args.docs,
        "keys": args.keys,
    }))


if __name__ == "__main__":
    main()
