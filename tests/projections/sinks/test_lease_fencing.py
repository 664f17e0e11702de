"""A search/Redis lease whose renewals keep failing stops claiming the lock, and a writer that lost
its lease cannot write (issue 13, item 7).

The holder reaches the real server (Redis, osmem) through a TCP proxy the test cuts: a partition
longer than the lease. Meanwhile another process, connected directly, takes the lock once the
store lets it. Checked: the cut-off holder's ``holds_lock`` turns False before anyone else can take
the lock; afterwards neither the holder nor a writer fenced with its token (the follower's batch
connection) can change the view or its positions, while the new holder can.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import pytest

from kappaflow.projections.sinks.base import Sink, batch_from_rows
from kappaflow.projections.sinks.errors import LockLostError
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink
from tests._netproxy import TcpProxy, proxy_to
from tests.projections.sinks._sink_helpers import customer_view, row

pytestmark = pytest.mark.integration

TTL_S = 2.0


def _open(kind: str, url: str) -> Sink:
    opts = {"lock_ttl_s": TTL_S}
    return RedisSink(url, options=opts) if kind == "redis" else SearchSink(url, options=opts)


@pytest.fixture(params=["redis", "search"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, TcpProxy]]:
    """(kind, direct url, a proxy to the same server)."""
    kind = request.param
    server = request.getfixturevalue("redis_server" if kind == "redis" else "search_server")
    u = urlsplit(server.url)
    with proxy_to(u.hostname or "127.0.0.1", int(u.port or 0)) as proxy:
        yield kind, server.url, proxy


def _via(url: str, proxy: TcpProxy) -> str:
    u = urlsplit(url)
    return u._replace(netloc=f"{proxy.host}:{proxy.port}").geturl()


def _until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        time.sleep(0.02)
    return time.monotonic()


def test_a_partitioned_holder_loses_the_lock_before_another_takes_it_and_cannot_write(
        store: tuple[str, str, TcpProxy]) -> None:
    kind, url, proxy = store
    name = "fence_" + uuid.uuid4().hex[:8]
    view = replace(customer_view("fenced_" + uuid.uuid4().hex[:8]), projection=name)
    admin = _open(kind, url)
    holder = _open(kind, _via(url, proxy))       # e.g. a replay's or follower's lock connection
    batch = _open(kind, url)                     # a follower's batch connection, fenced with the holder's token
    other = _open(kind, url)                     # another replay/follow process
    executor: Any = None
    try:
        live = admin.ensure(view)
        assert holder.try_lock(name)
        token = holder.lock_fence(name)
        assert token and token.split(":")[0].isdigit(), token
        batch.fence(name, token)
        batch.write(live, batch_from_rows(view, [row(1, 1)]), {("t", 0): 1})
        executor = holder.config().open()  # what a replay's Spark executor opens: the fence travels with it
        executor.write(live, batch_from_rows(view, [row(6, 1)]))
        assert set(r["id"] for r in admin.scan(live)) == {1, 6}

        proxy.cut()  # renewals now fail: connection refused / reset, for longer than the lease
        lost_at = _until(lambda: not holder.holds_lock(name), TTL_S + 5, "the holder did not give up its lease")
        assert holder.lock_fence(name) is None
        taken_at = _until(lambda: other.try_lock(name), TTL_S + 10, "the lease never expired for another process")
        assert lost_at <= taken_at, "another process took the lock while the old holder still claimed it"
        new_token = other.lock_fence(name)
        assert new_token and int(new_token.split(":")[0]) > int(token.split(":")[0]), (token, new_token)

        # the writer fenced with the lost lease's token changes nothing
        with pytest.raises(LockLostError, match=name):
            batch.write(live, batch_from_rows(view, [row(2, 2)]), {("t", 0): 2})
        with pytest.raises(LockLostError):
            batch.store_positions(live, {("t", 0): 3})
        # nor do the old holder and its executors once they can reach the store again
        proxy.heal()
        with pytest.raises(LockLostError):
            holder.write(live, batch_from_rows(view, [row(3, 3)]), {("t", 0): 4})
        with pytest.raises(LockLostError):
            executor.write(live, batch_from_rows(view, [row(6, 7, name="late")]))
        # the new holder writes as usual
        other.write(live, batch_from_rows(view, [row(4, 4)]), {("t", 0): 5})
        assert set(r["id"] for r in admin.scan(live)) == {1, 4, 6}
        assert admin.fetch(live, [(6,)])[(6,)]["name"] == "customer 6"
        assert admin.read_positions(live) == {("t", 0): 5}
        # unlock drops the holder's own fence; a fenced writer still needs the lock's current token
        other.unlock(name)
        with pytest.raises(LockLostError):
            batch.write(live, batch_from_rows(view, [row(5, 5)]))
        batch.fence(name, None)
        batch.write(live, batch_from_rows(view, [row(5, 5)]))
        assert set(r["id"] for r in admin.scan(live)) == {1, 4, 5, 6}
    finally:
        for s in (holder, batch, other, admin, executor):
            try:
                if s is not None:
                    s.close()
            except Exception:
                pass
