"""The search client contract: the calls the search sink makes, in one dialect-neutral shape, and
the errors they raise (``_HttpError`` with status and type, ``_Unavailable``). The OpenSearch and
Elasticsearch adapters (``adapters.py``) implement it."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

from kappaflow.projections.sinks.search.settings import Flavor


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


class SearchClient(abc.ABC):
    """The calls the sink makes, in one dialect-neutral shape (errors as _HttpError / _Unavailable)."""

    flavor: Flavor

    def __init__(self, client: Any) -> None:
        self.client = client

    @abc.abstractmethod
    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @abc.abstractmethod
    def bulk(self, body: bytes) -> dict[str, Any]:
        raise NotImplementedError

    @abc.abstractmethod
    def create_index(self, index: str, *, mappings: dict[str, Any], settings: dict[str, Any],
                     aliases: dict[str, Any]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def delete_index(self, index: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def index_exists(self, index: str) -> bool:
        raise NotImplementedError

    @abc.abstractmethod
    def get_alias(self, *, name: str | None = None, index: str | None = None) -> dict[str, Any]:
        """{index: {"aliases": {...}}} for an alias name or an index pattern; {} when nothing matches."""
        raise NotImplementedError

    @abc.abstractmethod
    def update_aliases(self, actions: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def refresh(self, index: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def put_settings(self, index: str, settings: dict[str, Any]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def get_mapping(self, index: str) -> dict[str, Any]:
        raise NotImplementedError

    @abc.abstractmethod
    def put_mapping(self, index: str, mapping: dict[str, Any]) -> None:
        """Add fields (``properties``) and replace ``_meta`` of an existing index's mapping."""
        raise NotImplementedError

    @abc.abstractmethod
    def get_doc(self, index: str, doc_id: str) -> dict[str, Any] | None:
        raise NotImplementedError

    @abc.abstractmethod
    def put_doc(self, index: str, doc_id: str, doc: dict[str, Any]) -> None:
        """Index `doc` through an alias (require_alias)."""
        raise NotImplementedError

    @abc.abstractmethod
    def delete_doc(self, index: str, doc_id: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def mget(self, index: str, ids: list[str]) -> list[dict[str, Any]]:
        raise NotImplementedError

    @abc.abstractmethod
    def get_doc_meta(self, index: str, doc_id: str) -> tuple[dict[str, Any], int, int] | None:
        """(source, seq_no, primary_term) of a document, or None."""
        raise NotImplementedError

    @abc.abstractmethod
    def put_doc_cas(self, index: str, doc_id: str, doc: dict[str, Any], *, create: bool = False,
                    seq: tuple[int, int] | None = None) -> tuple[int, int]:
        """Index only if absent (create) or unchanged since `seq` (seq_no, primary_term); 409 otherwise."""
        raise NotImplementedError

    @abc.abstractmethod
    def delete_doc_cas(self, index: str, doc_id: str, seq: tuple[int, int]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def search(self, index: str, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    @abc.abstractmethod
    def count(self, index: str) -> int:
        raise NotImplementedError

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
