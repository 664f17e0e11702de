"""MySQL/MariaDB connector: row-based binlog capture."""
