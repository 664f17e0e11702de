"""Projections: fold the log into materialized views on Spark."""
