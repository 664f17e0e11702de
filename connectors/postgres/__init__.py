"""PostgreSQL connector: consistent snapshot plus pgoutput logical decoding.

``PostgresConnector(config, log).run(stop, until_caught_up=...)`` captures one source;
``postgres_status(config, log)`` reports slot lag, offsets and topic sizes.

The package imports its modules on first use of a name (PEP 562): ``source_info`` (the position and
source block the events package loads) must not pull in the connector and its drivers.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kappaflow.connectors.postgres.connector import PostgresConnector, postgres_status

_NAMES = {"PostgresConnector": "connector", "postgres_status": "connector"}

__all__ = ["PostgresConnector", "postgres_status"]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
