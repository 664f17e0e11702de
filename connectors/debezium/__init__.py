"""Debezium interop: read topics written by a real Debezium connector into kappaflow topics.

(The other direction -- kappaflow topics readable by Debezium consumers -- needs no code here:
kappaflow's own records already have Debezium's key and value shapes, see ``kappaflow.events``.)

The package imports its modules on first use of a name (PEP 562): ``source_info`` (the position and
source block the events package loads) must not pull in the connector and its drivers.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kappaflow.connectors.debezium.decode import DebeziumDecoder, Decoded
    from kappaflow.connectors.debezium.source import DebeziumSource

_NAMES = {"DebeziumDecoder": "decode", "Decoded": "decode", "DebeziumSource": "source"}

__all__ = ["DebeziumDecoder", "DebeziumSource", "Decoded"]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
