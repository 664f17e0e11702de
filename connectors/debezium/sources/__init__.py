"""Source blocks of the connectors kappaflow reads from Debezium topics but does not run itself.

SQL Server, Db2, Oracle and MongoDB each have their layout and position here (``generic``: any other
connector, ordered by its place in the Kafka topic, ``KafkaPosition``). PostgreSQL, MySQL/MariaDB
and the ledger keep theirs in their own connector package (``connectors/<kind>/source_info.py``).
"""

from kappaflow.connectors.debezium.sources import db2, generic, mongodb, oracle, sqlserver

__all__ = ["db2", "generic", "mongodb", "oracle", "sqlserver"]
