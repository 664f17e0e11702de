"""The ledger source: the ledger's events table captured from PostgreSQL's WAL into event topics.

``LedgerConnector(config, log).run(stop, until_caught_up=...)`` — see ``connector.py``.

The package imports its modules on first use of a name (PEP 562): ``source_info`` (the position and
source block the events package loads) must not pull in the connector and its drivers.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kappaflow.connectors.ledger.connector import LedgerConnector, LedgerRecordMapper, ledger_status

_NAMES = {"LedgerConnector": "connector", "LedgerRecordMapper": "connector", "ledger_status": "connector"}

__all__ = ["LedgerConnector", "LedgerRecordMapper", "ledger_status"]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
