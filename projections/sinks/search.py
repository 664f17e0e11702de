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

import hashlib
import logging
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import (
    VERSION,
    Positions,
    Sink,
    SinkConfig,
    Target,
    TopicPartition,
    ViewSchemaMismatch,
    ViewSpec,
    WriteResult,
)
from kappaflow.projections.sinks.changes import Change, check_batch, iter_changes
from kappaflow.projections.sinks.codec import RowDecoder, encode_json
from kappaflow.projections.sinks.document import log_rejected
from kappaflow.projections.sinks.errors import LockLostError, SinkStateLostError
from kappaflow.projections.sinks.keys import MAX_VERSION, key_str, sort_key
from kappaflow.projections.sinks.lease import Lease, fence_generation, lease_margin

log = logging.getLogger(__name__)

Flavor = Literal["opensearch", "elasticsearch"]
StringDefault = Literal["text+keyword", "keyword", "text"]

MAX_ID_BYTES = 512  # Elasticsearch/OpenSearch hard limit on _id
_ALIAS_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,150}$")
_LABEL_RE = re.compile(r"^[a-z0-9]{1,20}$")

__all__ = [
    "ElasticsearchClient",
    "OpenSearchClient",
    "SearchClient",
    "SearchSink",
    "SearchSinkConfig",
    "SearchSinkOptions",
    "SinkStateLostError",
    "connect",
    "derive_mapping",
]


# ---------------------------------------------------------------------------
# mappings from the projection schema
# ---------------------------------------------------------------------------
def _norm_type(t: Any) -> Any:
    """A Spark type as a small tree: 'long', ('decimal', p, s), ('array', T),
    ('struct', [(name, T), ...]), ('map', K, V)."""
    from pyspark.sql import types as st

    if isinstance(t, st.StructType):
        return ("struct", [(f.name, _norm_type(f.dataType)) for f in t.fields])
    if isinstance(t, st.ArrayType):
        return ("array", _norm_type(t.elementType))
    if isinstance(t, st.MapType):
        return ("map", _norm_type(t.keyType), _norm_type(t.valueType))
    if isinstance(t, st.DecimalType):
        return ("decimal", t.precision, t.scale)
    if isinstance(t, st.CharType | st.VarcharType | st.StringType):
        return "string"
    if isinstance(t, st.DayTimeIntervalType | st.YearMonthIntervalType):
        return "interval"
    if isinstance(t, st.TimestampNTZType | st.TimestampType):
        return "timestamp"
    if isinstance(t, st.NullType):
        return "void"
    if isinstance(t, st.DataType):
        return t.typeName()
    raise ConfigError(f"search mapping: expected a Spark DataType, got {t!r}")


_SCALAR_MAPPINGS: dict[str, dict[str, Any]] = {
    "byte": {"type": "byte"}, "short": {"type": "short"}, "integer": {"type": "integer"},
    "long": {"type": "long"}, "float": {"type": "float"}, "double": {"type": "double"},
    "boolean": {"type": "boolean"}, "binary": {"type": "binary"},
    "date": {"type": "date", "format": "strict_date||epoch_millis"},
    "timestamp": {"type": "date", "format": "strict_date_optional_time||epoch_millis"},
    "interval": {"type": "long"},  # microseconds
    "void": {"type": "keyword"},
}


def _string_mapping(default: str) -> dict[str, Any]:
    if default == "keyword":
        return {"type": "keyword"}
    if default == "text":
        return {"type": "text"}
    # What Elasticsearch's dynamic mapping gives a string: full text plus an exact sub-field.
    return {"type": "text", "fields": {"keyword": {"type": "keyword", "ignore_above": 256}}}


def _field_mapping(path: str, t: Any, overrides: Mapping[str, Any], string_default: str) -> dict[str, Any]:
    if path in overrides:
        o = overrides[path]
        if isinstance(o, str):
            return _string_mapping(o) if o in ("text", "keyword", "text+keyword") else {"type": o}
        if not isinstance(o, Mapping):
            raise ConfigError(f"search field override {path!r}: expected 'text', 'keyword', 'text+keyword', a type "
                              f"name or a mapping dict, got {o!r}")
        return dict(o)
    if t == "string":
        return _string_mapping(string_default)
    if isinstance(t, str):
        if t not in _SCALAR_MAPPINGS:
            raise ConfigError(f"search mapping: field {path!r} has type {t!r} with no default mapping; give one "
                              f"in the field overrides (options 'fields')")
        return dict(_SCALAR_MAPPINGS[t])
    kind = t[0]
    if kind == "decimal":
        _, precision, scale = t
        if precision <= 18:
            return {"type": "scaled_float", "scaling_factor": 10 ** scale}
        return {"type": "double"}  # _source keeps the exact decimal string
    if kind == "array":
        return _field_mapping(path, t[1], overrides, string_default)  # fields are multi-valued
    if kind == "struct":
        return {"properties": {n: _field_mapping(f"{path}.{n}", ft, overrides, string_default) for n, ft in t[1]}}
    if kind == "map":
        return {"type": "object", "enabled": False}  # stored, not indexed: map keys are data, not fields
    raise ConfigError(f"search mapping: field {path!r} has unsupported type {t!r}")


def derive_mapping(view: ViewSpec, *, overrides: Mapping[str, Any] | None = None,
                   string_default: StringDefault = "text+keyword") -> dict[str, Any]:
    """The index mapping for a view, from its Spark schema.

    Strict (``dynamic: strict``): a document with a field the view does not declare is
    rejected (dead-lettered) instead of silently widening the mapping. String key columns
    are ``keyword`` (exact, sortable). ``overrides`` maps a field path (``"name"``,
    ``"address.city"``) to ``"text"``, ``"keyword"``, ``"text+keyword"``, a type name or a
    full mapping (``{"type": "text", "analyzer": "english"}``).
    """
    overrides = dict(overrides or {})
    names = set(view.column_names)
    unknown = [p for p in overrides if p.split(".")[0] not in names]
    if unknown:
        raise ConfigError(f"view {view.name!r}: search field overrides name unknown fields {unknown}; the view has "
                          f"{sorted(names)}")
    props: dict[str, Any] = {}
    for col in view.columns:
        t = _norm_type(col.type)
        if col.name in view.key:
            if col.name in overrides:
                o = overrides[col.name]
                kind = o if isinstance(o, str) else o.get("type")
                if kind in ("text", "text+keyword"):
                    raise ConfigError(f"view {view.name!r}: key column {col.name!r} cannot be mapped as text "
                                      f"(keys must be exact and sortable); use keyword")
            if t == "string" and col.name not in overrides:
                props[col.name] = {"type": "keyword"}
                continue
        props[col.name] = _field_mapping(col.name, t, overrides, string_default)
    return {"dynamic": "strict", "properties": props}


# ---------------------------------------------------------------------------
# clients: one small adapter per flavor
# ---------------------------------------------------------------------------
class _HttpError(Exception):
    def __init__(self, status: int, kind: str, reason: str) -> None:
        super().__init__(f"HTTP {status} {kind}: {reason}")
        self.status = status
        self.kind = kind
        self.reason = reason


class _Unavailable(Exception):
    """Connection refused / reset / timed out."""


class _IndexGone(Exception):
    """The index being read was deleted (swapped out) meanwhile."""


def _error_parts(info: Any, fallback: str) -> tuple[str, str]:
    if isinstance(info, Mapping):
        err = info.get("error", info)
        if isinstance(err, Mapping):
            return str(err.get("type", "error")), str(err.get("reason", fallback))
        return "error", str(err)
    return "error", str(info or fallback)


_BULK_FILTER = "errors,items.*.status,items.*.error,items.*.result"


class SearchClient:
    """The calls the sink makes, in one dialect-neutral shape (errors as _HttpError / _Unavailable)."""

    flavor: Flavor

    def __init__(self, client: Any) -> None:
        self.client = client

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def bulk(self, body: bytes) -> dict[str, Any]:
        raise NotImplementedError

    def create_index(self, index: str, *, mappings: dict[str, Any], settings: dict[str, Any],
                     aliases: dict[str, Any]) -> None:
        raise NotImplementedError

    def delete_index(self, index: str) -> None:
        raise NotImplementedError

    def index_exists(self, index: str) -> bool:
        raise NotImplementedError

    def get_alias(self, *, name: str | None = None, index: str | None = None) -> dict[str, Any]:
        """{index: {"aliases": {...}}} for an alias name or an index pattern; {} when nothing matches."""
        raise NotImplementedError

    def update_aliases(self, actions: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def refresh(self, index: str) -> None:
        raise NotImplementedError

    def put_settings(self, index: str, settings: dict[str, Any]) -> None:
        raise NotImplementedError

    def get_mapping(self, index: str) -> dict[str, Any]:
        raise NotImplementedError

    def get_doc(self, index: str, doc_id: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def put_doc(self, index: str, doc_id: str, doc: dict[str, Any]) -> None:
        """Index `doc` through an alias (require_alias)."""
        raise NotImplementedError

    def delete_doc(self, index: str, doc_id: str) -> None:
        raise NotImplementedError

    def mget(self, index: str, ids: list[str]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def get_doc_meta(self, index: str, doc_id: str) -> tuple[dict[str, Any], int, int] | None:
        """(source, seq_no, primary_term) of a document, or None."""
        raise NotImplementedError

    def put_doc_cas(self, index: str, doc_id: str, doc: dict[str, Any], *, create: bool = False,
                    seq: tuple[int, int] | None = None) -> tuple[int, int]:
        """Index only if absent (create) or unchanged since `seq` (seq_no, primary_term); 409 otherwise."""
        raise NotImplementedError

    def delete_doc_cas(self, index: str, doc_id: str, seq: tuple[int, int]) -> None:
        raise NotImplementedError

    def search(self, index: str, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def count(self, index: str) -> int:
        raise NotImplementedError

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


class OpenSearchClient(SearchClient):
    """opensearch-py (OpenSearch 2/3; also what the osmem test server speaks)."""

    flavor: Flavor = "opensearch"

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from opensearchpy import exceptions as ex

        try:
            return fn(*args, **kwargs)
        except (ex.ConnectionError, ex.ConnectionTimeout) as exc:
            raise _Unavailable(str(exc)) from None
        except ex.TransportError as exc:
            status = exc.status_code if isinstance(exc.status_code, int) else 0
            kind, reason = _error_parts(exc.info, str(exc.error))
            raise _HttpError(status, kind, reason) from None

    def bulk(self, body: bytes) -> dict[str, Any]:
        return dict(self._call(self.client.bulk, body=body,
                               params={"require_alias": "true", "filter_path": _BULK_FILTER}))

    def create_index(self, index: str, *, mappings: dict[str, Any], settings: dict[str, Any],
                     aliases: dict[str, Any]) -> None:
        self._call(self.client.indices.create, index=index,
                   body={"mappings": mappings, "settings": settings, "aliases": aliases})

    def delete_index(self, index: str) -> None:
        self._call(self.client.indices.delete, index=index, params={"ignore_unavailable": "true"})

    def index_exists(self, index: str) -> bool:
        return bool(self._call(self.client.indices.exists, index=index))

    def get_alias(self, *, name: str | None = None, index: str | None = None) -> dict[str, Any]:
        try:
            return dict(self._call(self.client.indices.get_alias, name=name, index=index))
        except _HttpError as exc:
            if exc.status == 404:
                return {}
            raise

    def update_aliases(self, actions: list[dict[str, Any]]) -> None:
        self._call(self.client.indices.update_aliases, body={"actions": actions})

    def refresh(self, index: str) -> None:
        self._call(self.client.indices.refresh, index=index)

    def put_settings(self, index: str, settings: dict[str, Any]) -> None:
        self._call(self.client.indices.put_settings, index=index, body=settings)

    def get_mapping(self, index: str) -> dict[str, Any]:
        out = self._call(self.client.indices.get_mapping, index=index)
        return dict(next(iter(out.values()))["mappings"]) if out else {}

    def get_doc(self, index: str, doc_id: str) -> dict[str, Any] | None:
        try:
            return dict(self._call(self.client.get, index=index, id=doc_id)["_source"])
        except _HttpError as exc:
            if exc.status == 404 and exc.kind != "index_not_found_exception":
                return None
            raise

    def put_doc(self, index: str, doc_id: str, doc: dict[str, Any]) -> None:
        self._call(self.client.index, index=index, id=doc_id, body=doc, params={"require_alias": "true"})

    def delete_doc(self, index: str, doc_id: str) -> None:
        try:
            self._call(self.client.delete, index=index, id=doc_id)
        except _HttpError as exc:
            if exc.status != 404:
                raise

    def mget(self, index: str, ids: list[str]) -> list[dict[str, Any]]:
        return list(self._call(self.client.mget, index=index, body={"ids": ids})["docs"])

    def get_doc_meta(self, index: str, doc_id: str) -> tuple[dict[str, Any], int, int] | None:
        try:
            d = self._call(self.client.get, index=index, id=doc_id)
        except _HttpError as exc:
            if exc.status == 404 and exc.kind != "index_not_found_exception":
                return None
            raise
        return dict(d["_source"]), int(d["_seq_no"]), int(d["_primary_term"])

    def put_doc_cas(self, index: str, doc_id: str, doc: dict[str, Any], *, create: bool = False,
                    seq: tuple[int, int] | None = None) -> tuple[int, int]:
        params: dict[str, str] = {"require_alias": "true"}
        if create:
            params["op_type"] = "create"
        if seq is not None:
            params.update(if_seq_no=str(seq[0]), if_primary_term=str(seq[1]))
        r = self._call(self.client.index, index=index, id=doc_id, body=doc, params=params)
        return int(r["_seq_no"]), int(r["_primary_term"])

    def delete_doc_cas(self, index: str, doc_id: str, seq: tuple[int, int]) -> None:
        self._call(self.client.delete, index=index, id=doc_id,
                   params={"if_seq_no": str(seq[0]), "if_primary_term": str(seq[1])})

    def search(self, index: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call(self.client.search, index=index, body=body))

    def count(self, index: str) -> int:
        return int(self._call(self.client.count, index=index)["count"])


class ElasticsearchClient(SearchClient):
    """elasticsearch-py 8/9 (Elasticsearch 8/9). Request shape unit-checked only: the osmem test
    server answers HTTP 406 to elasticsearch-py 9's compatibility media type."""

    flavor: Flavor = "elasticsearch"

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import elastic_transport
        import elasticsearch

        try:
            resp = fn(*args, **kwargs)
        except (elastic_transport.ConnectionError, elastic_transport.ConnectionTimeout) as exc:
            raise _Unavailable(str(exc)) from None
        except elasticsearch.ApiError as exc:
            kind, reason = _error_parts(exc.body, str(exc.message))
            raise _HttpError(int(exc.meta.status), kind, reason) from None
        return getattr(resp, "body", resp)

    def bulk(self, body: bytes) -> dict[str, Any]:
        return dict(self._call(self.client.bulk, operations=body, require_alias=True, filter_path=_BULK_FILTER))

    def create_index(self, index: str, *, mappings: dict[str, Any], settings: dict[str, Any],
                     aliases: dict[str, Any]) -> None:
        self._call(self.client.indices.create, index=index, mappings=mappings, settings=settings, aliases=aliases)

    def delete_index(self, index: str) -> None:
        self._call(self.client.indices.delete, index=index, ignore_unavailable=True)

    def index_exists(self, index: str) -> bool:
        return bool(self._call(self.client.indices.exists, index=index))

    def get_alias(self, *, name: str | None = None, index: str | None = None) -> dict[str, Any]:
        try:
            return dict(self._call(self.client.indices.get_alias, name=name, index=index))
        except _HttpError as exc:
            if exc.status == 404:
                return {}
            raise

    def update_aliases(self, actions: list[dict[str, Any]]) -> None:
        self._call(self.client.indices.update_aliases, actions=actions)

    def refresh(self, index: str) -> None:
        self._call(self.client.indices.refresh, index=index)

    def put_settings(self, index: str, settings: dict[str, Any]) -> None:
        self._call(self.client.indices.put_settings, index=index, settings=settings)

    def get_mapping(self, index: str) -> dict[str, Any]:
        out = self._call(self.client.indices.get_mapping, index=index)
        return dict(next(iter(out.values()))["mappings"]) if out else {}

    def get_doc(self, index: str, doc_id: str) -> dict[str, Any] | None:
        try:
            return dict(self._call(self.client.get, index=index, id=doc_id)["_source"])
        except _HttpError as exc:
            if exc.status == 404 and exc.kind != "index_not_found_exception":
                return None
            raise

    def put_doc(self, index: str, doc_id: str, doc: dict[str, Any]) -> None:
        self._call(self.client.index, index=index, id=doc_id, document=doc, require_alias=True)

    def delete_doc(self, index: str, doc_id: str) -> None:
        try:
            self._call(self.client.delete, index=index, id=doc_id)
        except _HttpError as exc:
            if exc.status != 404:
                raise

    def mget(self, index: str, ids: list[str]) -> list[dict[str, Any]]:
        return list(self._call(self.client.mget, index=index, ids=ids)["docs"])

    def get_doc_meta(self, index: str, doc_id: str) -> tuple[dict[str, Any], int, int] | None:
        try:
            d = self._call(self.client.get, index=index, id=doc_id)
        except _HttpError as exc:
            if exc.status == 404 and exc.kind != "index_not_found_exception":
                return None
            raise
        return dict(d["_source"]), int(d["_seq_no"]), int(d["_primary_term"])

    def put_doc_cas(self, index: str, doc_id: str, doc: dict[str, Any], *, create: bool = False,
                    seq: tuple[int, int] | None = None) -> tuple[int, int]:
        kwargs: dict[str, Any] = {"require_alias": True}
        if create:
            kwargs["op_type"] = "create"
        if seq is not None:
            kwargs.update(if_seq_no=seq[0], if_primary_term=seq[1])
        r = self._call(self.client.index, index=index, id=doc_id, document=doc, **kwargs)
        return int(r["_seq_no"]), int(r["_primary_term"])

    def delete_doc_cas(self, index: str, doc_id: str, seq: tuple[int, int]) -> None:
        self._call(self.client.delete, index=index, id=doc_id, if_seq_no=seq[0], if_primary_term=seq[1])

    def search(self, index: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call(self.client.search, index=index, **body))

    def count(self, index: str) -> int:
        return int(self._call(self.client.count, index=index)["count"])


def connect(url: str | Sequence[str], flavor: Flavor = "opensearch", *, timeout_s: float = 60.0,
            **client_options: Any) -> SearchClient:
    """A client for `flavor`. Client-level retries are off: the sink retries with its own backoff
    (it must look at every bulk item, and notice a server that lost its data). `client_options` go to
    the client's constructor as given (auth, TLS, ``timeout`` / ``request_timeout``, ...)."""
    hosts = [url] if isinstance(url, str) else list(url)
    if flavor == "opensearch":
        try:
            from opensearchpy import OpenSearch
        except ImportError:  # pragma: no cover - a core dependency
            raise ConfigError("views.search_flavor = 'opensearch' needs opensearch-py: pip install opensearch-py") \
                from None
        opts = {"timeout": timeout_s, "max_retries": 0, "retry_on_timeout": False, **client_options}
        return OpenSearchClient(OpenSearch(hosts=hosts, **opts))
    if flavor == "elasticsearch":
        try:
            from elasticsearch import Elasticsearch
        except ImportError:  # pragma: no cover - a core dependency
            raise ConfigError("views.search_flavor = 'elasticsearch' needs elasticsearch-py: "
                              "pip install elasticsearch") from None
        opts = {"request_timeout": timeout_s, "max_retries": 0, "retry_on_timeout": False, **client_options}
        return ElasticsearchClient(Elasticsearch(hosts=hosts, **opts))
    raise ConfigError(f"views.search_flavor: expected 'opensearch' or 'elasticsearch', got {flavor!r}")


def wrap_client(client: Any) -> SearchClient:
    """Adapt an opensearch-py / elasticsearch-py client object (or pass a SearchClient through)."""
    if isinstance(client, SearchClient):
        return client
    mod = type(client).__module__
    if mod.startswith("opensearchpy"):
        return OpenSearchClient(client)
    if mod.startswith("elasticsearch"):
        return ElasticsearchClient(client)
    raise ConfigError(f"search sink: expected a URL or an OpenSearch/Elasticsearch client, got {type(client).__name__}")


# ---------------------------------------------------------------------------
# the sink
# ---------------------------------------------------------------------------
class SearchSinkOptions(BaseModel):
    """Search sink options. Sink-wide here; per view under ``view.options["search"]`` (same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str | None = None
    """The public alias (per view; default: the view name, lower-cased)."""
    fields: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    """Per-field mapping overrides: 'text', 'keyword', 'text+keyword', a type name or a mapping dict."""
    string_default: StringDefault = "text+keyword"
    settings: dict[str, Any] = Field(default_factory=dict)
    """Extra index settings, e.g. {"analysis": {...}} for custom analyzers, shards, replicas."""
    refresh_interval: str | None = None  # of a live index; None: the server's default
    build_refresh_interval: str | None = "30s"  # while a shadow fills (fewer refreshes: faster)
    bulk_docs: int = Field(1000, ge=1)
    bulk_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    concurrency: int = Field(1, ge=1, le=16)
    """Bulk requests in flight at once."""
    max_retries: int = Field(8, ge=0)
    backoff_initial_s: float = Field(0.2, gt=0)
    backoff_max_s: float = Field(20.0, gt=0)
    positions_index: str = "kappaflow-positions"
    lock_ttl_s: float = Field(30.0, ge=1)
    """Lease of the projection lock (try_lock): renewed every third of it, expires after a kill -9."""


@dataclass(frozen=True)
class SearchSinkConfig(SinkConfig):
    """Picklable recipe for a SearchSink in another process (Spark executors)."""

    url: str | tuple[str, ...]
    flavor: Flavor = "opensearch"
    options: Mapping[str, Any] = field(default_factory=dict)
    client_options: Mapping[str, Any] = field(default_factory=dict)
    fences: Mapping[str, str] = field(default_factory=dict)  # projection -> the lock holder's token

    def open(self) -> SearchSink:
        sink = SearchSink(self.url, flavor=self.flavor, options=dict(self.options),
                          client_options=dict(self.client_options))
        for projection, token in self.fences.items():
            sink.fence(projection, token)
        return sink


@dataclass
class _Bulk:
    """One bulk request: NDJSON lines and, per line, the change it carries."""

    lines: list[bytes] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    size: int = 0


class SearchSink(Sink):
    """Views as OpenSearch/Elasticsearch indexes (see the module docstring)."""

    kind = "search"

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
        self.options = (options if isinstance(options, SearchSinkOptions)
                        else _parse_options(options or {}, "search sink options"))
        self._client_options = dict(client_options or {})
        self._sleep: Callable[[float], None] = time.sleep
        self._positions_ready = False
        self._leases: dict[str, Lease] = {}
        self._fences: dict[str, str] = {}
        self._fence_until: dict[str, float] = {}  # projection -> monotonic time the lease doc was read valid to
        self.rejected_in_load: list[tuple[tuple[Any, ...], str]] = []

    @classmethod
    def from_config(cls, views: Any, **kwargs: Any) -> SearchSink:
        """From `kappaflow.config.ViewsConfig` (``search_url``, ``search_flavor``)."""
        if not getattr(views, "search_url", None):
            raise ConfigError("views.search_url: not set; add it to kappaflow.toml or KAPPAFLOW_VIEWS__SEARCH_URL")
        return cls(views.search_url, flavor=views.search_flavor, **kwargs)

    def config(self) -> SearchSinkConfig:
        if self._url is None:
            raise SinkError("search sink: config() needs a sink opened from a URL, not a client object")
        return SearchSinkConfig(self._url, self.flavor, self.options.model_dump(), self._client_options,
                                dict(self._fences))

    def close(self) -> None:
        for name in list(self._leases):
            self.unlock(name)
        try:
            self.client.close()
        except Exception:  # closing is best effort
            pass

    # --- the projection lock (one replay or follow at a time) ---------------------------
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

        self._leases[projection] = Lease(f"search:{projection}", ttl, renew, release, token=token, taken_at=sent)
        self._fences[projection] = token
        return True

    def unlock(self, projection: str) -> None:
        lease = self._leases.pop(projection, None)
        if lease is not None:
            if self._fences.get(projection) == lease.token:
                del self._fences[projection]
            lease.release()

    def holds_lock(self, projection: str) -> bool:
        lease = self._leases.get(projection)
        return lease is not None and lease.held

    def lock_fence(self, projection: str) -> str | None:
        lease = self._leases.get(projection)
        return lease.token if lease is not None and lease.held else None

    def fence(self, projection: str, token: str | None) -> None:
        self._fence_until.pop(projection, None)
        if token is None:
            self._fences.pop(projection, None)
        else:
            self._fences[projection] = token

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

    # --- per-view settings ---------------------------------------------------
    def view_options(self, view: ViewSpec) -> SearchSinkOptions:
        extra = view.options.get("search") if view.options else None
        if not extra:
            return self.options
        if not isinstance(extra, Mapping):
            raise ConfigError(f"view {view.name!r}: options['search']: expected a table of search sink options")
        return _parse_options({**self.options.model_dump(), **extra}, f"view {view.name!r}: options['search']")

    def alias(self, view: ViewSpec) -> str:
        name = self.view_options(view).index or view.name.lower()
        if not _ALIAS_RE.match(name):
            raise ConfigError(f"view {view.name!r}: search index name {name!r}: expected lowercase letters, digits, "
                              f"'_', '.', '-', starting with a letter or digit")
        return name

    def mapping(self, view: ViewSpec) -> dict[str, Any]:
        opts = self.view_options(view)
        return derive_mapping(view, overrides=opts.fields, string_default=opts.string_default)

    def _index_prefix(self, view: ViewSpec) -> str:
        return f"{self.alias(view)}__kf_"

    @staticmethod
    def _write_alias(index: str) -> str:
        return f"{index}__w"

    def physical_index(self, target: Target) -> str | None:
        """The index a target's documents live in (None when a live view has no index)."""
        if target.shadow:
            return target.name
        return self._live_index(target.view)

    # --- retries -----------------------------------------------------------
    def _retrying(self, what: str, fn: Callable[[], Any], opts: SearchSinkOptions | None = None) -> Any:
        opts = opts or self.options
        delay = opts.backoff_initial_s
        attempt = 0
        while True:
            try:
                return fn()
            except _Unavailable as exc:
                error: Exception = exc
            except _HttpError as exc:
                if exc.status not in (429, 500, 502, 503, 504):
                    raise
                error = exc
            attempt += 1
            if attempt > opts.max_retries:
                raise SinkError(f"search sink: {what} failed after {attempt} attempts: {error}",
                                retry=Retry.TRANSIENT) from None
            log.warning("search sink: %s failed (%s); retry %d in %.2fs", what, error, attempt, delay)
            self._sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, opts.backoff_max_s)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """_retrying, with non-retryable HTTP errors turned into SinkError naming `what`."""
        try:
            return self._retrying(what, fn)
        except _HttpError as exc:
            raise SinkError(f"search sink: {what}: {exc}") from None

    # --- positions index -------------------------------------------------------
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

    # --- targets -----------------------------------------------------------------
    def _live_index(self, view: ViewSpec) -> str | None:
        alias = self.alias(view)
        found = sorted(self._call("read alias", lambda: self.client.get_alias(name=alias)))
        if not found:
            return None
        if len(found) > 1:
            raise SinkError(f"search sink: alias {alias!r} points at {len(found)} indexes {found}; expected one "
                            f"(was it changed by hand?)")
        if not found[0].startswith(self._index_prefix(view)):
            raise SinkError(f"search sink: alias {alias!r} points at {found[0]!r}, which kappaflow did not create "
                            f"(expected a name starting with {self._index_prefix(view)!r})")
        return found[0]

    def live(self, view: ViewSpec) -> Target | None:
        return Target(view, self.alias(view)) if self._live_index(view) is not None else None

    def _meta(self, view: ViewSpec, mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {"view": view.name, "projection": view.projection, "key": list(view.key),
                "columns": [c.to_dict() for c in view.columns],
                "mapping_fingerprint": hashlib.sha256(orjson.dumps(mapping, option=orjson.OPT_SORT_KEYS))
                .hexdigest()[:16]}

    def _create_index(self, view: ViewSpec, label: str, *, live: bool) -> str:
        opts = self.view_options(view)
        mapping = self.mapping(view)
        index = f"{self._index_prefix(view)}{label}_{time.strftime('%Y%m%d%H%M%S', time.gmtime())}" \
                f"{secrets.token_hex(3)}"
        body = {**mapping, "_meta": {"kappaflow": self._meta(view, mapping)}}
        settings: dict[str, Any] = dict(opts.settings)
        interval = opts.refresh_interval if live else opts.build_refresh_interval
        if interval is not None:
            settings["index"] = {**settings.get("index", {}), "refresh_interval": interval}
        aliases: dict[str, Any] = {self._write_alias(index): {}}
        if live:
            aliases[self.alias(view)] = {}
        self._ensure_positions_index()
        try:
            self._retrying("create index", lambda: self.client.create_index(
                index, mappings=body, settings=settings, aliases=aliases))
        except _HttpError as exc:
            raise SinkError(f"search sink: cannot create index {index!r} for view {view.name!r}: {exc}") from None
        self._put_positions(view, index, {})
        return index

    def ensure(self, view: ViewSpec) -> Target:
        """Create the alias and a first index if missing; else check the live index fits the view."""
        alias = self.alias(view)
        mapping = self.mapping(view)  # validates overrides before touching the server
        self._positions_ready = False  # check it again: the server may have lost it
        self._drop_strays(view)
        index = self._live_index(view)
        if index is None:
            if self._call("check index", lambda: self.client.index_exists(alias)):
                raise ConfigError(f"search sink: an index named {alias!r} exists; kappaflow needs that name for an "
                                  f"alias over its builds of view {view.name!r}. Rename or delete the index, or set "
                                  f"options['search']['index'] to another name.")
            self._create_index(view, "live", live=True)
            return Target(view, alias)
        self._check_schema(view, index, mapping)
        return Target(view, alias)

    def _check_schema(self, view: ViewSpec, index: str, mapping: Mapping[str, Any]) -> None:
        current = self._call("read mapping", lambda: self.client.get_mapping(index))
        meta = (current.get("_meta") or {}).get("kappaflow") or {}
        have_cols = {c["name"]: c for c in meta.get("columns", [])}
        problems: list[str] = []
        for col in view.columns:
            got = have_cols.get(col.name)
            if got is None:
                problems.append(f"column {col.name!r} is missing (the projection makes {col.type.simpleString()})")
            elif got.get("type") != col.type.jsonValue():
                problems.append(f"column {col.name!r} has type {got.get('type')!r} in the index, the projection "
                                f"makes {col.type.simpleString()}")
        extra = [n for n in have_cols if n not in view.column_names]
        if extra:
            problems.append(f"column(s) {extra} are not produced by the projection")
        if meta.get("key") is not None and list(meta["key"]) != list(view.key):
            problems.append(f"key is {meta['key']}, the projection's key is {list(view.key)}")
        if not problems and meta.get("mapping_fingerprint") != self._meta(view, mapping)["mapping_fingerprint"]:
            problems.append("the field mapping changed (field overrides or string_default)")
        if problems:
            raise ViewSchemaMismatch(
                f"search index {index!r} (alias {self.alias(view)!r}) does not match projection "
                f"{view.projection!r}: " + "; ".join(problems)
                + ". Rebuild it with `kappaflow replay` (a new index is built and the alias swapped).")

    def _drop_strays(self, view: ViewSpec) -> None:
        """Delete indexes named like a write alias: a bulk delete sent after the server lost the build
        auto-creates one (deletes cannot carry require_alias). They hold nothing of value."""
        pattern = f"{self._index_prefix(view)}*"
        for index in self._call("list indexes", lambda: self.client.get_alias(index=pattern)):
            if index.endswith("__w"):
                log.warning("search sink: deleting stray index %s (auto-created by a write after data loss)", index)
                self._call("delete stray index", lambda i=index: self.client.delete_index(i))  # type: ignore[misc]

    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        if not _LABEL_RE.match(label):
            raise ConfigError(f"search sink: shadow label {label!r}: expected 1-20 lowercase letters or digits")
        self._positions_ready = False
        self._drop_strays(view)
        live = self._live_index(view)
        # a replay killed between the alias swap and dropping the old index leaves that index behind;
        # the old one may be the first build (label "live", from ensure): a replay (which holds the
        # projection lock, so no ensure runs meanwhile) drops those too
        stale = set(self._indexes(view, label)) | set(self._indexes(view, "live") if label == "shadow" else ())
        for index in sorted(stale):
            if index != live:
                self._drop_index(index)
        return Target(view, self._create_index(view, label, live=False), shadow=True)

    def _indexes(self, view: ViewSpec, label: str) -> list[str]:
        pattern = f"{self._index_prefix(view)}{label}_*"
        return sorted(i for i in self._call("list indexes", lambda: self.client.get_alias(index=pattern))
                      if not i.endswith("__w"))

    def swap(self, shadow: Target) -> Target:
        """Refresh the shadow, then move the alias onto it in one atomic `_aliases` call; drop the old index."""
        if not shadow.shadow:
            raise SinkError(f"search sink: swap: {shadow.name!r} is not a shadow target")
        view, index = shadow.view, shadow.name
        alias = self.alias(view)
        opts = self.view_options(view)
        if not self._call("check index", lambda: self.client.index_exists(index)):
            raise SinkStateLostError(f"search sink: the shadow index {index!r} is gone (lost?); rebuild it")
        if opts.build_refresh_interval is not None:
            live_interval = opts.refresh_interval or "1s"
            self._call("restore refresh interval", lambda: self.client.put_settings(
                index, {"index": {"refresh_interval": live_interval}}))
        self._call("refresh", lambda: self.client.refresh(index))
        old = sorted(self._call("read alias", lambda: self.client.get_alias(name=alias)))
        actions: list[dict[str, Any]] = [{"remove": {"index": o, "alias": alias}} for o in old if o != index]
        actions.append({"add": {"index": index, "alias": alias}})
        self._check_fence(view, f"swapping alias {alias!r}")
        self._call("swap alias", lambda: self.client.update_aliases(actions))
        for o in old:
            if o != index and o.startswith(self._index_prefix(view)):
                self._drop_index(o)
        return Target(view, alias)

    def _drop_index(self, index: str) -> None:
        self._call("delete index", lambda: self.client.delete_index(index))
        try:
            self._retrying("delete positions", lambda: self.client.delete_doc(self.options.positions_index, index))
        except (_HttpError, SinkError) as exc:
            log.warning("search sink: could not delete the positions of %s: %s", index, exc)

    def drop(self, target: Target) -> None:
        index = self.physical_index(target)
        if index is not None:
            self._drop_index(index)

    # --- writes ------------------------------------------------------------------
    def write(self, target: Target, batch: pa.Table, positions: Positions | None = None) -> WriteResult:
        """Upsert/delete with external versions, then store `positions` (never moving one back).

        409s are counted as ``skipped``; documents the server refuses are returned in
        ``rejected`` with the reason and version (the rest proceeds); 429/5xx/connection
        errors are retried with backoff. Raises :class:`SinkStateLostError` when the target
        vanished and a transient :class:`SinkError` when retries run out.
        """
        view = target.view
        check_batch(view, batch, "search sink")
        opts = self.view_options(view)
        index = self.physical_index(target)
        if index is None:
            raise SinkStateLostError(f"search sink: view {view.name!r} has no live index (lost, or ensure() was "
                                     f"never called); re-read positions and replay")
        # Always the build's private write alias, never the public name: bulk deletes cannot carry
        # require_alias, and a delete into a missing index auto-creates it on the server.
        dest = self._write_alias(index)
        result = WriteResult()
        bulks = self._encode(iter_changes(view, batch), dest, opts, result)
        if opts.concurrency > 1:
            self._send_parallel(bulks, target, opts, result)
        else:
            for bulk in bulks:
                self._send(bulk, target, opts, result)
        if positions:
            self.store_positions(target, positions)
        return result

    def _encode(self, changes: Iterator[Change], dest: str, opts: SearchSinkOptions,
                result: WriteResult) -> Iterator[_Bulk]:
        """NDJSON lines grouped into bulk requests by count and bytes, produced lazily."""
        head = b'{"index":{"_index":' + orjson.dumps(dest) + b',"_id":'
        dhead = b'{"delete":{"_index":' + orjson.dumps(dest) + b',"_id":'
        tail = b',"version_type":"external"}}\n'
        max_docs, max_bytes = opts.bulk_docs, opts.bulk_bytes
        bulk = _Bulk()
        for ch in changes:
            key, ks, row, version = ch
            if ks is None:
                result.rejected.append((key, f"key: NULL in a key column (version {version})"))
                continue
            if type(version) is not int or not 0 <= version <= MAX_VERSION:
                result.rejected.append((key, f"{VERSION}: expected an integer in 0..2^63-1, got {version!r}"))
                continue
            id_json = orjson.dumps(ks)
            if len(id_json) - 2 > MAX_ID_BYTES and len(ks.encode()) > MAX_ID_BYTES:
                result.rejected.append((key, f"key: the document id is {len(ks.encode())} bytes, the server allows "
                                             f"at most {MAX_ID_BYTES} (version {version})"))
                continue
            if row is None:
                line = b'%s%s,"version":%d%s' % (dhead, id_json, version, tail)
            else:
                try:
                    src = encode_json(row)
                except (TypeError, orjson.JSONEncodeError) as exc:
                    result.rejected.append((key, f"row: cannot encode as JSON: {exc} (version {version})"))
                    continue
                if len(src) > max_bytes:
                    result.rejected.append((key, f"row: the document is {len(src)} bytes, more than bulk_bytes="
                                                 f"{max_bytes} (version {version})"))
                    continue
                line = b'%s%s,"version":%d%s%s\n' % (head, id_json, version, tail, src)
            if bulk.lines and (len(bulk.lines) >= max_docs or bulk.size + len(line) > max_bytes):
                yield bulk
                bulk = _Bulk()
            bulk.lines.append(line)
            bulk.changes.append(ch)
            bulk.size += len(line)
        if bulk.lines:
            yield bulk

    def _send_parallel(self, bulks: Iterator[_Bulk], target: Target, opts: SearchSinkOptions,
                       result: WriteResult) -> None:
        with ThreadPoolExecutor(opts.concurrency) as pool:
            inflight: list[Future[WriteResult]] = []
            for bulk in bulks:
                if len(inflight) >= opts.concurrency:
                    _merge(result, inflight.pop(0).result())
                inflight.append(pool.submit(self._send_one, bulk, target, opts))
            for fut in inflight:
                _merge(result, fut.result())

    def _send_one(self, bulk: _Bulk, target: Target, opts: SearchSinkOptions) -> WriteResult:
        out = WriteResult()
        self._send(bulk, target, opts, out)
        return out

    def _send(self, bulk: _Bulk, target: Target, opts: SearchSinkOptions, result: WriteResult) -> None:
        """One bulk request; retries what the server was too busy for, classifies every item."""
        lines, changes = bulk.lines, bulk.changes
        delay = opts.backoff_initial_s
        attempt = 0
        while lines:
            self._check_fence(target.view, f"writing into {target.name!r}")
            body = b"".join(lines)
            try:
                resp = self._retrying("bulk request", lambda body=body: self.client.bulk(body), opts)  # type: ignore[misc]
            except _HttpError as exc:
                if exc.status == 413 and len(lines) > 1:  # request too large: halve it
                    half = len(lines) // 2
                    self._send(_Bulk(lines[:half], changes[:half]), target, opts, result)
                    lines, changes = lines[half:], changes[half:]
                    continue
                raise SinkError(f"search sink: bulk request into {target.name!r} refused: {exc} (first change: "
                                f"key {changes[0][0]}, version {changes[0][3]})") from None
            items = resp.get("items") or []
            if len(items) != len(lines):
                raise SinkError(f"search sink: the bulk reply has {len(items)} items for {len(lines)} actions",
                                retry=Retry.TRANSIENT)
            retry_lines: list[bytes] = []
            retry_changes: list[Change] = []
            lost = False
            for line, ch, item in zip(lines, changes, items, strict=True):
                op_type, op = next(iter(item.items()))
                status = int(op.get("status", 0))
                if status < 300 or (status == 404 and op_type == "delete" and "error" not in op):
                    if op_type == "delete":
                        result.deleted += 1
                    else:
                        result.upserted += 1
                elif status == 409:
                    result.skipped += 1
                elif status in (429, 500, 502, 503, 504):
                    retry_lines.append(line)
                    retry_changes.append(ch)
                else:
                    kind, reason = _error_parts(op, f"HTTP {status}")
                    if status == 404 and kind == "index_not_found_exception":
                        lost = True
                        continue
                    err = op.get("error")
                    cause = err.get("caused_by") if isinstance(err, Mapping) else None
                    if isinstance(cause, Mapping) and cause.get("reason"):
                        reason = f"{reason} (caused by {cause.get('type')}: {cause.get('reason')})"
                    result.rejected.append((ch[0], f"HTTP {status} {kind}: {reason} (version {ch[3]})"))
            if lost:
                self._positions_ready = False
                raise SinkStateLostError(
                    f"search sink: {target.name!r} is gone from the server (its index or alias is missing: the "
                    f"server lost its data?); re-read positions and replay")
            lines, changes = retry_lines, retry_changes
            if lines:
                attempt += 1
                if attempt > opts.max_retries:
                    raise SinkError(f"search sink: {len(lines)} documents still refused as busy after {attempt} "
                                    f"attempts (first: key {changes[0][0]}, version {changes[0][3]})",
                                    retry=Retry.TRANSIENT)
                self._sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, opts.backoff_max_s)

    def load(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """Bulk-load a replay's rows (one Spark partition) batch by batch; refused rows are logged by key
        and reason (``load`` returns a count only), the rest is loaded."""
        n = 0
        for b in batches:
            res = self.write(target, b if isinstance(b, pa.Table) else pa.Table.from_batches([b]))
            n += res.upserted
            if res.rejected:
                self.rejected_in_load.extend(res.rejected)
                log_rejected("search sink", target, res.rejected)
        return n

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
            docs = self._call("mget", lambda s=start: self.client.mget(index, ids[s:s + 1000]))  # type: ignore[misc]
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
                hits = self._retrying("search", lambda b=body: self.client.search(index, b))[  # type: ignore[misc]
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
    def read_positions(self, target: Target) -> dict[TopicPartition, int]:
        """Stored next offsets of the target's index; {} when the view (or its positions) do not exist —
        e.g. after the server lost its data, which makes the runner replay from the start of the log."""
        index = self.physical_index(target)
        if index is None:
            return {}
        return self._get_positions(index)

    def store_positions(self, target: Target, positions: Positions) -> None:
        if not positions:
            return
        index = self.physical_index(target)
        if index is None:
            raise SinkStateLostError(f"search sink: view {target.view.name!r} has no live index (lost?); "
                                     f"re-read positions and replay")
        merged = self._get_positions(index)
        for tp, offset in positions.items():
            merged[tp] = max(int(offset), merged.get(tp, 0))
        self._check_fence(target.view, f"storing the positions of {index!r}")
        self._put_positions(target.view, index, merged)

    # --- convenience -------------------------------------------------------------------
    def sorted_rows(self, target: Target) -> list[dict[str, Any]]:
        """All rows, sorted by key in Python (for views whose key fields are not sortable)."""
        rows = list(self.scan(target))
        dec = RowDecoder(target.view)
        return sorted(rows, key=lambda r: sort_key(dec.key(r)))


def _merge(into: WriteResult, part: WriteResult) -> None:
    into.upserted += part.upserted
    into.deleted += part.deleted
    into.skipped += part.skipped
    into.rejected.extend(part.rejected)


def _parse_options(data: Mapping[str, Any], where: str) -> SearchSinkOptions:
    """Options from a mapping; a bad value is a ConfigError naming the field and what was given."""
    import pydantic

    from kappaflow.config import format_validation_error

    try:
        return SearchSinkOptions(**data)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None
