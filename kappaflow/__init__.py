"""Kappaflow: change data capture and event sourcing into a compacted log, projected by Spark."""

__version__ = "0.1.0"
