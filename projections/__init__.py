"""Projections: fold the log into materialized views on Spark.

    from kappaflow.projections import Projection, Count, Sum
    class CustomerTotals(Projection):
        name = "customer_totals"
        sources = ["shop.public.orders"]
        key = ["customer_id"]
        aggregates = {"orders": Count(), "total": Sum("amount")}

Run with ``kappaflow replay module:CustomerTotals`` / ``kappaflow follow ...``, or from
Python with ``replay(CustomerTotals, Runtime(...))`` / ``follow(...)``.
"""

from kappaflow.projections.api import (
    Aggregate,
    AsOf,
    Avg,
    CollectList,
    CollectSet,
    Count,
    Event,
    Hopping,
    IntervalJoin,
    Lookup,
    Max,
    Min,
    Nested,
    Projection,
    ProjectionSpec,
    Session,
    Source,
    Sum,
    Tumbling,
    load_projection,
)

__all__ = [
    "Aggregate",
    "AsOf",
    "Avg",
    "CollectList",
    "CollectSet",
    "Count",
    "Event",
    "Hopping",
    "IntervalJoin",
    "Lookup",
    "Max",
    "Min",
    "Nested",
    "Projection",
    "ProjectionSpec",
    "Session",
    "Source",
    "Sum",
    "Tumbling",
    "load_projection",
]
