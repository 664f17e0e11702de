"""PostgreSQL connector: consistent snapshot plus pgoutput logical decoding.

``PostgresConnector(config, log).run(stop, until_caught_up=...)`` captures one source;
``postgres_status(config, log)`` reports slot lag, offsets and topic sizes.
"""

from kappaflow.connectors.postgres.connector import PostgresConnector, postgres_status

__all__ = ["PostgresConnector", "postgres_status"]
