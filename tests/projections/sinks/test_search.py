"""The search sink against osmem (OpenSearch dialect): external versions, alias swap, lost state,
dead letters; the Elasticsearch adapter's request shape against a recording HTTP endpoint."""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from typing import Any

import pytest
from _sink_helpers import TOPIC, customer_view, drive, final_state, history, row, rows_by_key, wait_for
from pyspark.sql import types as T

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.sinks.base import ViewColumn, ViewSchemaMismatch, ViewSpec, batch_from_rows
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.search import (
    ElasticsearchClient,
    OpenSearchClient,
    SearchSink,
    _HttpError,
    derive_mapping,
)
from kappaflow.projections.sinks.testing import SinkContract


def _view(**options: Any) -> ViewSpec:
    return customer_view(f"cust_{uuid.uuid4().hex[:8]}", **options)


# --- mappings (pure) -------------------------------------------------------------------------------
def test_mapping_from_the_view_schema_with_overrides() -> None:
    view = ViewSpec("p", "P", ("sku",), (
        ViewColumn("sku", T.StringType()), ViewColumn("title", T.StringType()), ViewColumn("body", T.StringType()),
        ViewColumn("price", T.DecimalType(10, 2)), ViewColumn("big", T.DecimalType(30, 4)),
        ViewColumn("n", T.IntegerType()), ViewColumn("at", T.TimestampType()), ViewColumn("day", T.DateType()),
        ViewColumn("tags", T.ArrayType(T.StringType())), ViewColumn("attrs", T.MapType(T.StringType(), T.StringType())),
        ViewColumn("addr", T.StructType([T.StructField("city", T.StringType()), T.StructField("zip", T.LongType())])),
    ))
    m = derive_mapping(view, overrides={"title": "keyword", "body": {"type": "text", "analyzer": "english"},
                                        "addr.city": "keyword"})
    p = m["properties"]
    assert m["dynamic"] == "strict"
    assert p["sku"] == {"type": "keyword"}  # string keys are exact
    assert p["title"] == {"type": "keyword"}
    assert p["body"] == {"type": "text", "analyzer": "english"}
    assert p["tags"]["type"] == "text" and p["tags"]["fields"]["keyword"]["type"] == "keyword"  # ES's dynamic default
    assert p["price"] == {"type": "scaled_float", "scaling_factor": 100}
    assert p["big"] == {"type": "double"}
    assert p["n"] == {"type": "integer"} and p["at"]["type"] == "date" and p["day"]["type"] == "date"
    assert p["attrs"] == {"type": "object", "enabled": False}
    assert p["addr"] == {"properties": {"city": {"type": "keyword"}, "zip": {"type": "long"}}}
    assert derive_mapping(view, string_default="keyword")["properties"]["body"] == {"type": "keyword"}
    with pytest.raises(ConfigError, match="unknown fields"):
        derive_mapping(view, overrides={"nope": "text"})
    with pytest.raises(ConfigError, match="key column 'sku' cannot be mapped as text"):
        derive_mapping(view, overrides={"sku": "text"})


# --- retries (pure logic: a scripted client) ---------------------------------------------------------
class _ScriptedClient(OpenSearchClient):
    """The OpenSearch adapter with its bulk call answered from a script (an exception to raise, or
    per-item statuses), to drive the sink's retry rules through exact 429/503 sequences."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__(None)
        self.script = script
        self.bodies: list[bytes] = []

    def bulk(self, body: bytes) -> dict[str, Any]:
        self.bodies.append(body)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        n = body.count(b"\n") // 2
        statuses = step if isinstance(step, list) else [step] * n
        items = []
        for s in statuses:
            item: dict[str, Any] = {"status": s}
            if s >= 300:
                item["error"] = {"type": "es_rejected_execution_exception" if s == 429 else "x", "reason": "busy"}
            items.append({"index": item})
        return {"errors": any(s >= 300 for s in statuses), "items": items}


def test_busy_server_is_retried_with_backoff() -> None:
    view = customer_view("retry")
    client = _ScriptedClient([_HttpError(429, "too_many_requests", "slow down"), _HttpError(503, "unavailable", "x"),
                              [201, 429, 201], [201]])
    sink = SearchSink(client, options={"backoff_initial_s": 0.1})
    sleeps: list[float] = []
    sink._sleep = sleeps.append
    from kappaflow.projections.sinks.base import Target

    target = Target(view, "retry__kf_shadow_1", shadow=True)
    res = sink.write(target, batch_from_rows(view, [row(i, i) for i in range(3)]))
    assert res.upserted == 3 and not res.rejected
    assert len(client.bodies) == 4
    assert client.bodies[3].count(b"\n") == 2 and b'"_id":"1"' in client.bodies[3]  # only the busy item again
    assert len(sleeps) == 3 and sleeps[1] > sleeps[0] * 0.5  # exponential with jitter
    exhausted = SearchSink(_ScriptedClient([_HttpError(503, "unavailable", "down")] * 3),
                           options={"max_retries": 2, "backoff_initial_s": 0.01})
    exhausted._sleep = lambda _s: None
    with pytest.raises(SinkError, match="failed after 3 attempts") as exc:
        exhausted.write(target, batch_from_rows(view, [row(1, 1)]))
    assert exc.value.transient


# --- Elasticsearch request shape (elasticsearch-py against a recording endpoint) -------------------------
class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[dict[str, Any]] = []
    indexes: dict[str, set[str]] = {}

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.elasticsearch+json;compatible-with=9")
        self.send_header("X-Elastic-Product", "Elasticsearch")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.requests.append({"method": self.command, "path": self.path, "body": body,
                              "content_type": self.headers.get("Content-Type"), "accept": self.headers.get("Accept")})
        path = self.path.split("?")[0]
        if path.startswith("/_alias/"):
            name = path.removeprefix("/_alias/")
            found: dict[str, Any] = {i: {"aliases": {name: {}}} for i, al in self.indexes.items() if name in al}
            self._answer(200 if found else 404, found or {"error": "alias missing", "status": 404})
        elif path.endswith("/_alias"):
            self._answer(404, {"error": "no index", "status": 404})
        elif self.command == "PUT" and path.count("/") == 1 and not path.startswith("/_") and body:
            self.indexes[path[1:]] = set(json.loads(body).get("aliases", {}))
            self._answer(200, {"acknowledged": True})
        elif self.command == "HEAD":
            self._answer(404, {})
        elif path == "/_bulk":
            n = sum(line.startswith((b'{"index"', b'{"delete"')) for line in body.splitlines())
            self._answer(200, {"errors": False, "items": [{"index": {"status": 201}}] * n})
        elif "/_doc/" in path and self.command == "GET":
            self._answer(404, {"found": False})
        else:
            self._answer(200, {"acknowledged": True, "result": "created"})

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def test_elasticsearch_adapter_request_shape() -> None:
    """elasticsearch-py 9 is checked for request shape only: the osmem test server answers HTTP 406 to its
    compatibility media type; the OpenSearch path runs the same sink code live."""
    from elasticsearch import Elasticsearch

    _Recorder.requests = []
    _Recorder.indexes = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        sink = SearchSink(url, flavor="elasticsearch", options={"max_retries": 0})
        assert isinstance(sink.client, ElasticsearchClient)
        assert isinstance(sink.client.client, Elasticsearch)
        view = customer_view("esview", search={"fields": {"name": {"type": "text", "analyzer": "english"}}})
        target = sink.ensure(view)
        sink.write(target, batch_from_rows(view, [row(1, 10), row(2, 11, deleted=True)]))
        sink.client.update_aliases([{"remove": {"index": "a", "alias": "esview"}},
                                    {"add": {"index": "b", "alias": "esview"}}])
    finally:
        server.shutdown()
    reqs = _Recorder.requests
    creates = [r for r in reqs if r["method"] == "PUT" and r["path"].startswith("/esview__kf_live_")]
    assert len(creates) == 1
    body = json.loads(creates[0]["body"])
    assert body["mappings"]["properties"]["name"] == {"type": "text", "analyzer": "english"}
    assert body["mappings"]["dynamic"] == "strict"
    assert set(body["aliases"]) == {"esview", creates[0]["path"][1:] + "__w"}
    assert "compatible-with=9" in (creates[0]["content_type"] or "")
    bulk = next(r for r in reqs if r["path"].startswith("/_bulk"))
    assert "require_alias=true" in bulk["path"]
    assert "x-ndjson" in (bulk["content_type"] or "")
    lines = [json.loads(x) for x in bulk["body"].splitlines()]
    assert lines[0]["index"] == {"_index": creates[0]["path"][1:] + "__w", "_id": "1", "version": 10,
                                 "version_type": "external"}
    assert lines[1]["id"] == 1 and lines[1]["total"] == "1.01"
    assert lines[2]["delete"] == {"_index": creates[0]["path"][1:] + "__w", "_id": "2", "version": 11,
                                  "version_type": "external"}
    aliases = next(r for r in reqs if r["path"].startswith("/_aliases"))
    assert [list(a) for a in json.loads(aliases["body"])["actions"]] == [["remove"], ["add"]]


# --- live, against osmem ---------------------------------------------------------------------------------
@pytest.mark.integration
def test_duplicate_and_out_of_order_delivery_keep_the_newest(search_server: Any) -> None:
    view = _view()
    sink = SearchSink(search_server.url)
    target = sink.ensure(view)
    first = [row(i, 100 + i) for i in range(50)]
    res = sink.write(target, batch_from_rows(view, first))
    assert (res.upserted, res.skipped) == (50, 0)
    res = sink.write(target, batch_from_rows(view, first))  # the same batch twice
    assert (res.upserted, res.skipped) == (0, 50)
    res = sink.write(target, batch_from_rows(view, [row(1, 5, name="older"), row(2, 102, name="same"),
                                                    row(3, 999, name="newer")]))
    assert (res.upserted, res.skipped) == (1, 2)
    res = sink.write(target, batch_from_rows(view, [row(4, 500, deleted=True)]))
    assert (res.deleted, res.skipped) == (1, 0)
    res = sink.write(target, batch_from_rows(view, [row(4, 400, name="resurrected?")]))  # older than the delete
    assert (res.upserted, res.skipped) == (0, 1)
    res = sink.write(target, batch_from_rows(view, [row(5, 700, name="new"), row(5, 600, name="old")]))
    assert (res.upserted, res.skipped) == (1, 1)
    got = sink.fetch(target, [(1,), (3,), (4,), (5,), (1234,)])
    assert got[(1,)]["name"] == "customer 1" and got[(1,)]["_kf_version"] == 101
    assert got[(3,)]["name"] == "newer" and got[(3,)]["_kf_version"] == 999
    assert (4,) not in got and (1234,) not in got and got[(5,)]["name"] == "new"
    assert sink.count(target) == 49
    scanned = list(sink.scan(target))
    assert [r["id"] for r in scanned] == sorted(r["id"] for r in scanned)
    assert scanned[0]["total"] == first[0]["total"] and scanned[0]["tags"] == ["a", "t0"]


@pytest.mark.integration
def test_alias_swap_while_reading_never_shows_empty_or_partial(search_server: Any) -> None:
    from opensearchpy import OpenSearch

    view = _view()
    sink = SearchSink(search_server.url)
    target = sink.ensure(view)
    alias = sink.alias(view)
    n = 300
    sink.write(target, batch_from_rows(view, [row(i, i, gen=1) for i in range(n)]))
    sink.count(target)  # refresh
    reads: dict[str, Any] = {"n": 0, "gens": set()}
    problems: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        client = OpenSearch(hosts=[search_server.url])
        while not stop.is_set():
            r = client.search(index=alias, body={"size": 1000, "query": {"match_all": {}},
                                                 "track_total_hits": True})
            total = r["hits"]["total"]["value"]
            gens = {h["_source"]["gen"] for h in r["hits"]["hits"]}
            if total != n or len(r["hits"]["hits"]) != n or len(gens) != 1:
                problems.append(f"read {reads['n']}: total {total}, generations {gens}")
            reads["gens"] |= gens
            reads["n"] += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        wait_for(lambda: reads["n"] >= 3, timeout=30, what="the reader's first reads")
        shadow = sink.begin_shadow(view)
        for start in range(0, n, 100):
            sink.write(shadow, batch_from_rows(view, [row(i, 1000 + i, gen=2) for i in range(start, start + 100)]),
                       positions={(TOPIC, 0): 1000 + start + 100})
        live = sink.swap(shadow)
        before = reads["n"]
        wait_for(lambda: reads["n"] >= before + 3, timeout=30, what="reads after the swap")
    finally:
        stop.set()
        t.join(30)
    assert not problems, problems[:5]
    assert reads["gens"] == {1, 2}
    assert sink.read_positions(live) == {(TOPIC, 0): 1300}  # positions moved with the swap
    assert len(sink._indexes(view, "live")) == 0  # the old index was deleted


@pytest.mark.integration
def test_mapping_rejects_are_dead_lettered_and_the_rest_proceeds(search_server: Any) -> None:
    # A field override stricter than the data (a code column indexed as integer) makes the server
    # refuse some documents; an id beyond the 512-byte limit is refused before sending.
    view = ViewSpec(f"codes_{uuid.uuid4().hex[:8]}", "Codes", ("k",),
                    (ViewColumn("k", T.StringType()), ViewColumn("code", T.StringType())),
                    options={"search": {"fields": {"code": {"type": "integer"}}}})
    sink = SearchSink(search_server.url)
    target = sink.ensure(view)
    rows = [{"k": f"k{i}", "code": str(i), "_kf_version": i} for i in range(20)]
    rows[7]["code"] = "not-a-number"
    rows.append({"k": "x" * 600, "code": "1", "_kf_version": 99})
    res = sink.write(target, batch_from_rows(view, rows), positions={(TOPIC, 0): 100})
    assert res.upserted == 19
    reasons = dict(res.rejected)
    assert set(reasons) == {("k7",), ("x" * 600,)}
    assert "mapper_parsing_exception" in reasons[("k7",)] and "version 7" in reasons[("k7",)]
    assert "at most 512" in reasons[("x" * 600,)] and "version 99" in reasons[("x" * 600,)]
    assert sink.count(target) == 19
    assert sink.read_positions(target) == {(TOPIC, 0): 100}


@pytest.mark.integration
def test_rebuild_drops_leftovers_and_positions_never_move_back(search_server: Any) -> None:
    view = _view()
    sink = SearchSink(search_server.url)
    target = sink.ensure(view)
    sink.write(target, batch_from_rows(view, [row(i, i) for i in range(10)]), positions={(TOPIC, 0): 10})
    sink.store_positions(target, {(TOPIC, 0): 5, (TOPIC, 1): 3})
    assert sink.read_positions(target) == {(TOPIC, 0): 10, (TOPIC, 1): 3}
    leftover = sink.begin_shadow(view)
    shadow = sink.begin_shadow(view)
    with pytest.raises(SinkStateLostError):
        sink.write(leftover, batch_from_rows(view, [row(1, 1)]))
    sink.write(shadow, batch_from_rows(view, [row(i, i, gen=3) for i in range(4)]), positions={(TOPIC, 0): 4})
    live = sink.swap(shadow)
    assert sink.count(live) == 4 and sink.read_positions(live) == {(TOPIC, 0): 4}
    sink.drop(live)
    assert sink.live(view) is None and sink.read_positions(live) == {}


@pytest.mark.integration
def test_schema_mismatch_and_name_conflicts(search_server: Any) -> None:
    view = _view()
    sink = SearchSink(search_server.url)
    sink.ensure(view)
    changed = ViewSpec(view.name, view.projection, view.key,
                       (*view.columns[:2], ViewColumn("total", T.DoubleType()), *view.columns[3:4]))
    with pytest.raises(ViewSchemaMismatch) as exc:
        sink.ensure(changed)
    assert "'total'" in str(exc.value) and "'tags'" in str(exc.value) and "replay" in str(exc.value)
    overridden = ViewSpec(view.name, view.projection, view.key, view.columns,
                          options={"search": {"fields": {"name": "keyword"}}})
    with pytest.raises(ViewSchemaMismatch, match="field mapping changed"):
        sink.ensure(overridden)
    taken = f"plain_{uuid.uuid4().hex[:8]}"
    sink.client.create_index(taken, mappings={}, settings={}, aliases={})
    with pytest.raises(ConfigError, match="kappaflow needs that name for an alias"):
        sink.ensure(customer_view(taken))
    with pytest.raises(ConfigError, match="bulk_docs"):
        SearchSink(search_server.url, options={"bulk_docs": 0})


@pytest.mark.integration
def test_server_restart_mid_batch_rebuilds_from_the_log_without_loss() -> None:
    """osmem is in-memory: a restart loses the index, its alias and the positions. A retry after the
    restart fails on the missing alias (require_alias) instead of auto-creating an empty index, the sink
    reports lost state, and the runner replays from the now-empty positions: nothing is lost."""
    from kappaflow.testing.servers._process import free_port
    from kappaflow.testing.servers.osmem import OsmemServer

    port = free_port()
    servers = [OsmemServer(port=port).start()]
    try:
        view = _view(search={"bulk_docs": 100})
        sink = SearchSink(servers[0].url, options={"max_retries": 100, "backoff_initial_s": 0.01,
                                                   "backoff_max_s": 0.05})
        events = history(1500, 250)
        state = {"bulks": 0, "stopped": False, "sleeps": 0}
        real_bulk = sink.client.bulk

        def bulk(body: bytes) -> dict[str, Any]:
            state["bulks"] += 1
            if state["bulks"] == 5 and not state["stopped"]:  # the 2nd bulk of the 2nd batch
                state["stopped"] = True
                servers[0].stop()
            return real_bulk(body)

        def sleep(_s: float) -> None:  # the sink's backoff: restart on the second retry
            state["sleeps"] += 1
            if state["sleeps"] == 2:
                servers.append(OsmemServer(port=port).start())

        sink.client.bulk = bulk
        sink._sleep = sleep
        losses = drive(sink, view, events, batch=300)
        assert state["stopped"] and len(servers) == 2 and losses == 1
        target = sink.live(view)
        assert target is not None
        assert rows_by_key(sink, target) == final_state(events)
        assert sink.read_positions(target) == {(TOPIC, 0): 1500}
    finally:
        for s in servers:
            s.stop()


@pytest.mark.integration
def test_parallel_bulk_requests_and_config_round_trip(search_server: Any) -> None:
    import pickle

    view = _view(search={"bulk_docs": 50, "concurrency": 3})
    sink = SearchSink(search_server.url)
    target = sink.ensure(view)
    events = history(1200, 400, seed=3)
    res = sink.write(target, batch_from_rows(view, events))
    assert res.upserted + res.deleted + res.skipped == 1200
    assert rows_by_key(sink, target) == final_state(events)
    other = pickle.loads(pickle.dumps(sink.config())).open()
    try:
        assert other.fetch(target, [(e["id"],) for e in events[:5]]) == sink.fetch(target, [(e["id"],)
                                                                                            for e in events[:5]])
    finally:
        other.close()


@pytest.mark.integration
def test_projection_lock_is_exclusive_and_expires_after_its_holder_dies(search_server: Any) -> None:
    a = SearchSink(search_server.url, options={"lock_ttl_s": 1})
    b = SearchSink(search_server.url, options={"lock_ttl_s": 1})
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


@pytest.mark.integration
class TestSearchSinkContract(SinkContract):
    widens_integers_in_place = False  # an index maps int as integer, bigint as long: not changeable in place

    @pytest.fixture
    def sink(self, search_server: Any) -> Any:
        s = SearchSink(search_server.url)
        yield s
        s.close()


def test_refresh_per_batch_refreshes_once_per_batch_not_per_request(search_server: Any) -> None:
    """refresh_per_batch: one refresh of the live index after a batch of 5 bulk requests (osmem makes
    documents searchable at once, so what is checked is the call the sink makes); none for a shadow
    being filled, none without the option."""
    counted = _view(search={"bulk_docs": 10, "refresh_per_batch": True, "refresh_interval": "-1"})
    plain = _view(search={"bulk_docs": 10})
    sink = SearchSink(search_server.url)
    refreshed: list[str] = []
    real = sink.client.refresh

    def refresh(index: str) -> None:
        refreshed.append(index)
        real(index)

    sink.client.refresh = refresh  # type: ignore[method-assign]
    live = sink.ensure(counted)
    res = sink.write(live, batch_from_rows(counted, [row(i, 100 + i) for i in range(50)]),
                     positions={(TOPIC, 0): 150})
    assert res.upserted == 50 and len(refreshed) == 1, refreshed
    sink.write(live, batch_from_rows(counted, [row(i, 100 + i) for i in range(50)]))  # all stale: nothing new
    assert len(refreshed) == 1, refreshed
    shadow = sink.begin_shadow(counted)
    sink.write(shadow, batch_from_rows(counted, [row(i, 200 + i) for i in range(50)]))
    assert len(refreshed) == 1, refreshed
    other = sink.ensure(plain)
    sink.write(other, batch_from_rows(plain, [row(i, 100 + i) for i in range(50)]))
    assert len(refreshed) == 1, refreshed
    assert sink.count(live) == 50
