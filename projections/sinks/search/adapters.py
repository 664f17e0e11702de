"""The OpenSearch (opensearch-py) and Elasticsearch (elasticsearch-py) adapters of the search client
contract, and ``connect`` / ``wrap_client`` choosing one by flavor or client object."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.search.client import (
    _BULK_FILTER,
    Flavor,
    SearchClient,
    _error_parts,
    _HttpError,
    _Unavailable,
)


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

    def put_mapping(self, index: str, mapping: dict[str, Any]) -> None:
        self._call(self.client.indices.put_mapping, index=index, body=mapping)

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

    def put_mapping(self, index: str, mapping: dict[str, Any]) -> None:
        self._call(self.client.indices.put_mapping, index=index, properties=mapping.get("properties"),
                   meta=mapping.get("_meta"))

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
    the client's constructor as given (auth, TLS, ``timeout`` / ``request_timeout``, ...). Several servers:
    a sequence of URLs or one comma-separated string (as ``views.search.url`` holds them)."""
    hosts = [u.strip() for u in url.split(",") if u.strip()] if isinstance(url, str) else list(url)
    if flavor == "opensearch":
        try:
            from opensearchpy import OpenSearch
        except ImportError:  # pragma: no cover - a core dependency
            raise ConfigError("views.search.flavor = 'opensearch' needs opensearch-py: pip install opensearch-py") \
                from None
        opts = {"timeout": timeout_s, "max_retries": 0, "retry_on_timeout": False, **client_options}
        return OpenSearchClient(OpenSearch(hosts=hosts, **opts))
    if flavor == "elasticsearch":
        try:
            from elasticsearch import Elasticsearch
        except ImportError:  # pragma: no cover - a core dependency
            raise ConfigError("views.search.flavor = 'elasticsearch' needs elasticsearch-py: "
                              "pip install elasticsearch") from None
        opts = {"request_timeout": timeout_s, "max_retries": 0, "retry_on_timeout": False, **client_options}
        return ElasticsearchClient(Elasticsearch(hosts=hosts, **opts))
    raise ConfigError(f"views.search.flavor: expected 'opensearch' or 'elasticsearch', got {flavor!r}")


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
