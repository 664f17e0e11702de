"""Capture sources: database logs (PostgreSQL WAL, MySQL/MariaDB binlog) and Debezium topics."""
