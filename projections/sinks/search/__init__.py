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

from typing import TYPE_CHECKING

from kappaflow.projections.sinks.exports import lazy_exports

if TYPE_CHECKING:
    from kappaflow.projections.sinks.errors import SinkStateLostError
    from kappaflow.projections.sinks.search.adapters import ElasticsearchClient, OpenSearchClient, connect, wrap_client
    from kappaflow.projections.sinks.search.client import Flavor, SearchClient, _HttpError, _Unavailable
    from kappaflow.projections.sinks.search.mapping import derive_mapping
    from kappaflow.projections.sinks.search.options import SearchSinkOptions, _parse_options
    from kappaflow.projections.sinks.search.settings import SearchSettings
    from kappaflow.projections.sinks.search.sink import SearchSink

# Imported on first use, so that reading the settings (``settings.py``) does not load the sink.
__getattr__ = lazy_exports(__name__, {
    ".settings": ("SearchSettings",),
    "..errors": ("SinkStateLostError",),
    ".adapters": ("ElasticsearchClient", "OpenSearchClient", "connect", "wrap_client"),
    ".client": ("Flavor", "SearchClient", "_HttpError", "_Unavailable"),
    ".mapping": ("derive_mapping",),
    ".options": ("SearchSinkOptions", "_parse_options"),
    ".sink": ("SearchSink",),
})


__all__ = [
    "ElasticsearchClient",
    "Flavor",
    "OpenSearchClient",
    "SearchClient",
    "SearchSettings",
    "SearchSink",
    "SearchSinkOptions",
    "SinkStateLostError",
    "_HttpError",
    "_Unavailable",
    "_parse_options",
    "connect",
    "derive_mapping",
    "wrap_client",
]
