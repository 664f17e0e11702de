"""Capture sources: database logs (PostgreSQL WAL, MySQL/MariaDB binlog), Debezium topics, the ledger.

One package per kind; `registry` maps a source config's kind to its package's `kind.py`.
"""
