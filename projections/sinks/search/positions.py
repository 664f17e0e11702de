"""The search sink's bookkeeping index (``kappaflow-positions``, on the same server as the data):
each build's next offsets, and the lease documents of the projection lock. Also the connection,
the options and the backoff every other part of the sink uses."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from kappaflow.errors import SinkError
from kappaflow.projections.sinks.base import (
    Positions,
    TopicPartition,
    ViewSpec,
)
from kappaflow.projections.sinks.document import DocumentSink
from kappaflow.projections.sinks.errors import LockLostError, SinkStateLostError
from kappaflow.projections.sinks.lease import Lease, fence_generation, lease_margin
from kappaflow.projections.sinks.search.adapters import connect, wrap_client
from kappaflow.projections.sinks.search.client import Flavor, _HttpError, _Unavailable
from kappaflow.projections.sinks.search.options import SearchSinkOptions

log = logging.getLogger(__name__)


class PositionsIndex(DocumentSink):
    """Connection, options, retries, the positions index and the projection lock."""

    label = "search sink"
    options_model = SearchSinkOptions
    build_noun = "index"

    def __init__(self, url_or_client: Any, *, flavor: Flavor = "opensearch",
                 options: SearchSinkOptions | Mapping[str, Any] | None = None,
                 client_options: Mapping[str, Any] | None = None) -> None:
        if isinstance(url_or_client, str | tuple | list):
            self._url: str | tuple[str, ...] | None = (url_or_client if isinstance(url_or_client, str)
                                                      else tuple(url_or_client))
            self.client = connect(url_or_client, flavor, **dict(client_options or {}))
        else:
            self._url = None
            self.client = wrap_client(url_or_client)
        self.flavor: Flavor = self.client.flavor
        super().__init__(options)
        self.options: SearchSinkOptions
        self._client_options = dict(client_options or {})
        self._positions_ready = False
        self._fence_until: dict[str, float] = {}  # projection -> monotonic time the lease doc was read valid to

    def try_lock(self, projection: str) -> bool:
        """Take the projection's lock if free: a lease document in the positions index, created only if
        absent and renewed with compare-and-set in the background; an expired or released lease is taken
        over for the next generation, whose token fences this sink's writes (see the module docstring)."""
        if projection in self._leases:
            return False
        self._ensure_positions_index()
        index, doc_id = self.options.positions_index, f"~lock:{projection}"
        ttl = self.options.lock_ttl_s
        rand = secrets.token_hex(16)
        state: dict[str, Any] = {"generation": 1}

        def doc(expires: bool = True) -> dict[str, Any]:
            return {"lock": projection, "token": f"{state['generation']}:{rand}", "generation": state["generation"],
                    "expires_ms": int((time.time() + ttl) * 1000) if expires else 0}

        sent = time.monotonic()
        try:
            seq = self._retrying("take lock", lambda: self.client.put_doc_cas(index, doc_id, doc(), create=True))
        except _HttpError as exc:
            if exc.status != 409:
                raise SinkError(f"search sink: taking the lock of {projection!r}: {exc}") from None
            held = self._call("read lock", lambda: self.client.get_doc_meta(index, doc_id))
            if held is not None and held[0].get("expires_ms", 0) > time.time() * 1000:
                return False
            if held is not None:
                state["generation"] = int(held[0].get("generation") or fence_generation(held[0].get("token"))) + 1
            sent = time.monotonic()
            try:  # expired, released (or vanished meanwhile): take it over, unless someone else is faster
                seq = self._retrying("take over lock", lambda: self.client.put_doc_cas(
                    index, doc_id, doc(), create=held is None, seq=None if held is None else held[1:]))
            except _HttpError as exc2:
                if exc2.status == 409:
                    return False
                raise SinkError(f"search sink: taking the lock of {projection!r}: {exc2}") from None
        state["seq"] = seq
        token = f"{state['generation']}:{rand}"

        def renew() -> bool:
            try:
                state["seq"] = self.client.put_doc_cas(index, doc_id, doc(), seq=state["seq"])
                return True
            except _HttpError as exc:
                if exc.status in (404, 409):
                    return False
                raise

        def release() -> None:
            # released, not deleted: the document keeps the generation, so the next holder's is higher
            try:
                self.client.put_doc_cas(index, doc_id, doc(expires=False), seq=state["seq"])
            except (_HttpError, _Unavailable) as exc:
                log.warning("search sink: releasing the lock of %s: %s (it expires on its own)", projection, exc)

        self._hold(projection, Lease(f"search:{projection}", ttl, renew, release, token=token, taken_at=sent))
        return True

    def fence(self, projection: str, token: str | None) -> None:
        self._fence_until.pop(projection, None)
        super().fence(projection, token)

    def _check_fence(self, view: ViewSpec, what: str) -> None:
        """Refuse (LockLostError) a write to a fenced projection's view once its lease is gone."""
        projection = view.projection
        token = self._fences.get(projection)
        if token is None:
            return
        gen = fence_generation(token)
        lease = self._leases.get(projection)
        if lease is not None and lease.token == token:
            if lease.held:
                return
            raise LockLostError(f"search sink: {what} refused: this writer's lease on the lock of projection "
                                f"{projection!r} (generation {gen}) ran out or was lost; it must not write")
        if time.monotonic() < self._fence_until.get(projection, 0.0):
            return
        index, doc_id = self.options.positions_index, f"~lock:{projection}"
        held = self._call("read lock", lambda: self.client.get_doc_meta(index, doc_id))
        now_ms = time.time() * 1000
        doc = held[0] if held is not None else {}
        if doc.get("token") != token or doc.get("expires_ms", 0) <= now_ms:
            now = (f"generation {doc.get('generation')} holds it" if doc.get("token") != token and doc
                   else "it expired" if doc else "it is gone")
            raise LockLostError(f"search sink: {what} refused: the lock of projection {projection!r} is no longer "
                                f"held with this writer's token (generation {gen}; {now}); it must not write")
        remaining = (doc["expires_ms"] - now_ms) / 1000 - lease_margin(self.options.lock_ttl_s)
        self._fence_until[projection] = time.monotonic() + max(0.0, remaining)

    def is_locked(self, projection: str) -> bool:
        self._ensure_positions_index()
        index, doc_id = self.options.positions_index, f"~lock:{projection}"
        held = self._call("read lock", lambda: self.client.get_doc_meta(index, doc_id))
        return held is not None and held[0].get("expires_ms", 0) > time.time() * 1000

    def _retryable(self, what: str, exc: Exception) -> bool:
        if isinstance(exc, _Unavailable):
            return True
        return isinstance(exc, _HttpError) and exc.status in (429, 500, 502, 503, 504)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """_retrying, with non-retryable HTTP errors turned into SinkError naming `what`."""
        try:
            return self._retrying(what, fn)
        except _HttpError as exc:
            raise SinkError(f"search sink: {what}: {exc}") from None

    def _ensure_positions_index(self) -> None:
        if self._positions_ready:
            return
        alias = self.options.positions_index
        if not self._call("read positions alias", lambda: self.client.get_alias(name=alias)):
            physical = f"{alias}-000001"
            mappings = {"dynamic": False, "properties": {
                "view": {"type": "keyword"}, "index": {"type": "keyword"}, "updated_ms": {"type": "long"},
                "positions": {"type": "object", "enabled": False}}}
            try:
                self._retrying("create positions index", lambda: self.client.create_index(
                    physical, mappings=mappings, settings={}, aliases={alias: {}}))
            except _HttpError as exc:
                if exc.kind != "resource_already_exists_exception":
                    raise SinkError(f"search sink: cannot create the positions index {physical!r}: {exc}") from None
                # Created concurrently, or an orphan without its alias: make sure the alias is there.
                self._call("add positions alias", lambda: self.client.update_aliases(
                    [{"add": {"index": physical, "alias": alias}}]))
        self._positions_ready = True

    def _get_positions(self, index: str) -> dict[TopicPartition, int]:
        self._ensure_positions_index()
        try:
            doc = self._retrying("read positions", lambda: self.client.get_doc(self.options.positions_index, index))
        except _HttpError as exc:
            if exc.status == 404:  # the positions index itself is gone
                self._positions_ready = False
                return {}
            raise SinkError(f"search sink: reading positions of {index!r}: {exc}") from None
        if not doc:
            return {}
        raw = doc.get("positions") or {}
        return {(topic, int(p)): int(off) for topic, parts in raw.items() for p, off in parts.items()}

    def _put_positions(self, view: ViewSpec, index: str, positions: Mapping[TopicPartition, int]) -> None:
        nested: dict[str, dict[str, int]] = {}
        for (topic, partition), offset in sorted(positions.items()):
            nested.setdefault(topic, {})[str(partition)] = int(offset)
        doc = {"view": view.name, "index": index, "updated_ms": int(time.time() * 1000), "positions": nested}
        try:
            self._retrying("store positions", lambda: self.client.put_doc(self.options.positions_index, index, doc))
        except _HttpError as exc:
            if exc.status == 404:
                self._positions_ready = False
                raise SinkStateLostError(f"search sink: the positions index {self.options.positions_index!r} is "
                                         f"gone (the server lost its data?); re-read positions and replay") from None
            raise SinkError(f"search sink: storing positions of {index!r}: {exc}") from None

    def _read_positions(self, view: ViewSpec, home: str) -> dict[TopicPartition, int]:
        return self._get_positions(home)

    def _write_positions(self, view: ViewSpec, home: str, positions: Positions) -> None:
        merged = self._get_positions(home)
        for tp, offset in positions.items():
            merged[tp] = max(int(offset), merged.get(tp, 0))
        self._check_fence(view, f"storing the positions of {home!r}")
        self._put_positions(view, home, merged)
