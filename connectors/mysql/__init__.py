"""MySQL/MariaDB connector: row-based binlog capture (see ``connector.py``).

The package imports its modules on first use of a name (PEP 562): ``source_info`` (the position and
source block the events package loads) must not pull in the connector and its drivers.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kappaflow.connectors.mysql.connector import MySQLConnector
    from kappaflow.connectors.mysql.offset import MySQLOffset

_NAMES = {"MySQLConnector": "connector", "MySQLOffset": "offset"}

__all__ = ["MySQLConnector", "MySQLOffset"]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
