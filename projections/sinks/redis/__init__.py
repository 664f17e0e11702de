"""The Redis sink, one role per module:

- ``scripts.py``: the Lua scripts (guarded writes, positions, pointer switch, lease, read);
- ``codec.py``: RESP encoding, rows as hash fields and back;
- ``options.py``: the sink's options (sink-wide and per view);
- ``namespaces.py``: connection, retries, the projection lock, the pointer and one namespace per
  build (whose marker holds the positions);
- ``sink.py``: the sink: guarded writes, loads and reads (how it is exactly-once in effect: see
  its docstring);
- ``read.py``: :func:`get` / :func:`get_many`, the read helpers for applications.

``from kappaflow.projections.sinks.redis import RedisSink, get`` stays the import to use.
"""

from typing import TYPE_CHECKING

from kappaflow.projections.sinks.exports import lazy_exports

if TYPE_CHECKING:
    from kappaflow.projections.sinks.errors import SinkStateLostError
    from kappaflow.projections.sinks.redis.options import RedisSinkOptions, _parse_options
    from kappaflow.projections.sinks.redis.read import get, get_many
    from kappaflow.projections.sinks.redis.settings import RedisSettings
    from kappaflow.projections.sinks.redis.sink import RedisSink

# Imported on first use, so that reading the settings (``settings.py``) does not load the sink.
__getattr__ = lazy_exports(__name__, {
    ".settings": ("RedisSettings",),
    "..errors": ("SinkStateLostError",),
    ".options": ("RedisSinkOptions", "_parse_options"),
    ".read": ("get", "get_many"),
    ".sink": ("RedisSink",),
})


__all__ = [
    "RedisSettings",
    "RedisSink",
    "RedisSinkOptions",
    "SinkStateLostError",
    "_parse_options",
    "get",
    "get_many",
]
