"""Joins in projections: lookups (many-to-one, table-table) into other captured tables.

- ``spec``: the ``Lookup`` declaration and the checks that need no schemas;
- ``plan``: lookups bound to the tables' schemas (``JoinPlan``) and the Spark expressions;
- ``stage``: the join stage of replay (DataFrame joins) and follow (PostgreSQL join state);
- ``state``: the join state tables in the views database.
"""

from kappaflow.projections.joins.spec import Lookup

__all__ = ["Lookup"]
