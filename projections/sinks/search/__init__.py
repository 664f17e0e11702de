"""The search sink (OpenSearch 2/3, Elasticsearch 8/9), one role per module:

- ``mapping.py``: the index mapping derived from the view's Spark schema;
- ``client.py``: the client contract the sink calls, and its errors;
- ``adapters.py``: the OpenSearch and Elasticsearch adapters, ``connect`` / ``wrap_client``;
- ``options.py``: the sink's options (sink-wide and per view);
- ``positions.py``: connection, retries, the positions index and the projection lock's leases;
- ``aliases.py``: the alias lifecycle (builds, shadows, the atomic swap) and a target's positions;
- ``bulk.py``: bulk writes with external versions, retries and rejects;
- ``sink.py``: the sink and its reads (how it is exactly-once in effect: see its docstring).

``from kappaflow.projections.sinks.search import SearchSink`` stays the import to use.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kappaflow.projections.sinks.errors import SinkStateLostError
    from kappaflow.projections.sinks.search.adapters import ElasticsearchClient, OpenSearchClient, connect, wrap_client
    from kappaflow.projections.sinks.search.client import Flavor, SearchClient, _HttpError, _Unavailable
    from kappaflow.projections.sinks.search.mapping import derive_mapping
    from kappaflow.projections.sinks.search.options import SearchSinkOptions, _parse_options
    from kappaflow.projections.sinks.search.settings import SearchSettings
    from kappaflow.projections.sinks.search.sink import SearchSink, SearchSinkConfig

# Imported on first use, so that reading the settings (``settings.py``) does not load the sink.
_EXPORTS = {
    "SearchSettings": "kappaflow.projections.sinks.search.settings",
    "SinkStateLostError": "kappaflow.projections.sinks.errors",
    "ElasticsearchClient": "kappaflow.projections.sinks.search.adapters",
    "OpenSearchClient": "kappaflow.projections.sinks.search.adapters",
    "connect": "kappaflow.projections.sinks.search.adapters",
    "wrap_client": "kappaflow.projections.sinks.search.adapters",
    "Flavor": "kappaflow.projections.sinks.search.client",
    "SearchClient": "kappaflow.projections.sinks.search.client",
    "_HttpError": "kappaflow.projections.sinks.search.client",
    "_Unavailable": "kappaflow.projections.sinks.search.client",
    "derive_mapping": "kappaflow.projections.sinks.search.mapping",
    "SearchSinkOptions": "kappaflow.projections.sinks.search.options",
    "_parse_options": "kappaflow.projections.sinks.search.options",
    "SearchSink": "kappaflow.projections.sinks.search.sink",
    "SearchSinkConfig": "kappaflow.projections.sinks.search.sink",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ElasticsearchClient",
    "Flavor",
    "OpenSearchClient",
    "SearchClient",
    "SearchSettings",
    "SearchSink",
    "SearchSinkConfig",
    "SearchSinkOptions",
    "SinkStateLostError",
    "_HttpError",
    "_Unavailable",
    "_parse_options",
    "connect",
    "derive_mapping",
    "wrap_client",
]
