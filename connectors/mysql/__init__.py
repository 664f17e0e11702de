"""MySQL/MariaDB connector: row-based binlog capture (see ``connector.py``)."""

from kappaflow.connectors.mysql.connector import MySQLConnector
from kappaflow.connectors.mysql.offset import MySQLOffset

__all__ = ["MySQLConnector", "MySQLOffset"]
