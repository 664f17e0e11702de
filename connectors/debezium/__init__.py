"""Debezium interop: read topics written by a real Debezium connector into kappaflow topics.

(The other direction -- kappaflow topics readable by Debezium consumers -- needs no code here:
kappaflow's own records already have Debezium's key and value shapes, see ``kappaflow.events``.)
"""

from kappaflow.connectors.debezium.decode import DebeziumDecoder, Decoded
from kappaflow.connectors.debezium.source import DebeziumSource

__all__ = ["DebeziumDecoder", "DebeziumSource", "Decoded"]
