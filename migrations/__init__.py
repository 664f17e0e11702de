"""Alembic migrations for kappaflow's own tables."""
