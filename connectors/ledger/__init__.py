"""The ledger source: the ledger's events table captured from PostgreSQL's WAL into event topics.

``LedgerConnector(config, log).run(stop, until_caught_up=...)`` — see ``connector.py``.
"""

from kappaflow.connectors.ledger.connector import LedgerConnector, LedgerRecordMapper, ledger_status

__all__ = ["LedgerConnector", "LedgerRecordMapper", "ledger_status"]
