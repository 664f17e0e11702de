"""OpenSearch / Elasticsearch views: external versions, one index per build behind an alias.

Why it is exactly-once in effect without transactions
-----------------------------------------------------
Every document is written with ``version_type=external`` and ``version`` = the log offset
of the change that produced it (``_kf_version``; see ``keys.py`` for why the offset alone
is monotonic per key), so the *server* refuses a write that is not newer than what it
holds: HTTP 409, counted as ``skipped``, never an error. Retries, replays, a batch
delivered twice, an older change after a newer one: the newest document stays. Deletes
(``_kf_deleted`` rows) are externally versioned too; the server remembers a delete's
version for ``index.gc_deletes`` (60 s by default), so a late older write cannot
resurrect the document within that window. (Re-delivery after a restart replays only
changes past the stored positions, so older writes do not arrive later than that.)

Layout
------
* The view's public name is an **alias** (``ViewSpec.name`` lower-cased, or
  ``view.options["search"]["index"]``); readers query it.
* Each build is an index ``{alias}__kf_{label}_{id}`` with a private write alias
  ``{index}__w``. Every bulk request targets an alias with ``require_alias=true``: if the
  server lost the index (an in-memory server restarted, someone deleted it) the write fails
  with 404 instead of auto-creating an empty index with a guessed mapping, and the sink
  raises :class:`SinkStateLostError` (the runner re-reads positions and replays).
* Rebuild: :meth:`SearchSink.begin_shadow` creates a new index, the replay fills it,
  :meth:`SearchSink.swap` refreshes it and moves the alias in **one** ``_aliases`` call
  (remove + add: atomic on the server), then deletes the old index. Readers of the alias
  never see an empty or partial view.

Mappings come from the view's Spark schema (:func:`derive_mapping`), strict, with
per-field overrides (text vs keyword, analyzers) from the sink options or
``view.options["search"]["fields"]``. A document the mapping rejects is reported in
``WriteResult.rejected`` (the runner sends it to the dead-letter topic) with the
server's reason and its version (= log offset); the rest of the batch proceeds.
429/5xx/connection errors are retried with exponential backoff and jitter.

Positions are stored per build in a small index ``kappaflow-positions`` (doc id = the
build's index), on the *same* server as the data, after the data of each batch. Keeping
them next to the data rather than in PostgreSQL is deliberate: when the server loses its
data (osmem is in-memory; a cluster restored from an older snapshot) it loses the
positions with it, so the view reads as empty and is rebuilt from the log, instead of
positions that describe documents which no longer exist. Since positions belong to a
build, the alias swap moves data and positions together. The positions index is written
through an alias with ``require_alias`` for the same reason.

The projection lock (``try_lock``, one replay or follow at a time) is a lease document in
the positions index, created only if absent and renewed by compare-and-set (``if_seq_no``);
a holder killed with -9 stops renewing and the lease can be taken over after ``lock_ttl_s``.
Every take is a new generation (``generation`` in the document, kept when a holder releases
it); the holder's token ``<generation>:<random>`` fences writes. A search server cannot make
a bulk request conditional on another document, so the fence is checked by the writer right
before each bulk request, positions write and alias swap: a holder checks that its own lease
has not run out (it stops trusting it ``lease_margin`` before it expires), another writer
given the token (``fence``, e.g. a follower's batch connection) reads the lease document and
trusts it until that expiry (less the margin). A writer whose lease ran out, or was taken
over, is refused with :class:`LockLostError` before it sends anything more.

Flavors
-------
``flavor="opensearch"`` uses ``opensearch-py`` (OpenSearch 2/3); ``"elasticsearch"``
uses ``elasticsearch`` (Elasticsearch 8/9); chosen by ``views.search_flavor``. The test
server (osmem) speaks the OpenSearch dialect and answers HTTP 406 to the compatibility
media type elasticsearch-py 9 sends, so the Elasticsearch adapter is unit-checked for
request shape and exercised live only through the OpenSearch path (the two share all
code but the client calls in :class:`ElasticsearchClient` / :class:`OpenSearchClient`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import (
    SinkConfig,
    Target,
    ViewSpec,
)
from kappaflow.projections.sinks.codec import RowDecoder
from kappaflow.projections.sinks.keys import key_str, sort_key
from kappaflow.projections.sinks.search.bulk import BulkWriter
from kappaflow.projections.sinks.search.client import _HttpError, _IndexGone
from kappaflow.projections.sinks.search.settings import SearchSettings


class SearchSink(BulkWriter):
    """Views as OpenSearch/Elasticsearch indexes (see the module docstring)."""

    kind = "search"

    @classmethod
    def from_settings(cls, settings: SearchSettings, **kwargs: Any) -> SearchSink:
        """From ``[views.search]`` (``url``, ``flavor``); the sink registry's opener."""
        if not settings.url:
            raise ConfigError("views.search.url: not set; add url under [views.search] in kappaflow.toml or set "
                              "KAPPAFLOW_VIEWS__SEARCH__URL")
        return cls(settings.url, flavor=settings.flavor, **kwargs)

    @classmethod
    def from_config(cls, views: Any, **kwargs: Any) -> SearchSink:
        """From `kappaflow.config.ViewsConfig` (its ``search`` settings)."""
        return cls.from_settings(views.search, **kwargs)

    def config(self) -> SinkConfig:
        if self._url is None:
            raise SinkError("search sink: config() needs a sink opened from a URL, not a client object")
        url = self._url if isinstance(self._url, str) else ",".join(self._url)
        return SinkConfig(self.kind, SearchSettings(url=url, flavor=self.flavor),
                          {"options": self.options.model_dump(), "client_options": dict(self._client_options)},
                          dict(self._fences))

    # --- the projection lock (one replay or follow at a time) ---------------------------
    # --- per-view settings ---------------------------------------------------

    # --- retries -----------------------------------------------------------
    # --- positions index -------------------------------------------------------

    # --- targets -----------------------------------------------------------------
    # --- writes ------------------------------------------------------------------

    # --- reads ---------------------------------------------------------------------
    def _read_index(self, target: Target) -> str:
        """Where to read a target: the public alias for the live view (what readers see)."""
        return target.name if target.shadow else self.alias(target.view)

    def fetch(self, target: Target, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
        if not keys:
            return {}
        dec = RowDecoder(target.view)
        index = self._read_index(target)
        ids = [key_str(k) for k in keys]
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for start in range(0, len(ids), 1000):
            docs = self._call("mget", functools.partial(self.client.mget, index, ids[start:start + 1000]))
            for key, doc in zip(keys[start:start + 1000], docs, strict=True):
                if doc.get("found"):
                    out[tuple(key)] = dec.row(doc["_source"], doc.get("_version"))
        return out

    def scan(self, target: Target) -> Iterator[dict[str, Any]]:
        """Every document in key order (sorted by the key fields on the server, paged with search_after).

        Pages of one scan must come from one index: the live view is scanned through its physical
        index, and a scan whose index was swapped out and deleted under it starts again on the new one.
        """
        if target.shadow:
            yield from self._scan_index(target.view, target.name)
            return
        for _ in range(10):
            index = self._live_index(target.view)
            if index is None:
                return
            try:
                rows = list(self._scan_index(target.view, index))
            except _IndexGone:
                continue
            yield from rows
            return
        raise SinkError(f"search sink: view {target.view.name!r} was swapped during every scan attempt",
                        retry=Retry.TRANSIENT)

    def _scan_index(self, view: ViewSpec, index: str) -> Iterator[dict[str, Any]]:
        dec = RowDecoder(view)
        sort = [{k: "asc"} for k in view.key]
        after: list[Any] | None = None
        try:
            self._retrying("refresh", lambda: self.client.refresh(index))
            while True:
                body: dict[str, Any] = {"size": 1000, "sort": sort, "version": True, "query": {"match_all": {}}}
                if after is not None:
                    body["search_after"] = after
                hits = self._retrying("search", functools.partial(self.client.search, index, body))[
                    "hits"]["hits"]
                if not hits:
                    return
                for h in hits:
                    yield dec.row(h["_source"], h.get("_version"))
                after = hits[-1]["sort"]
        except _HttpError as exc:
            if exc.status == 404 and exc.kind == "index_not_found_exception":
                raise _IndexGone(index) from None
            raise SinkError(f"search sink: scanning {index!r}: {exc}") from None

    def count(self, target: Target) -> int:
        index = self._read_index(target)
        self._call("refresh", lambda: self.client.refresh(index))
        return int(self._call("count", lambda: self.client.count(index)))

    # --- positions -------------------------------------------------------------------
    # --- convenience -------------------------------------------------------------------
    def sorted_rows(self, target: Target) -> list[dict[str, Any]]:
        """All rows, sorted by key in Python (for views whose key fields are not sortable)."""
        rows = list(self.scan(target))
        dec = RowDecoder(target.view)
        return sorted(rows, key=lambda r: sort_key(dec.key(r)))


