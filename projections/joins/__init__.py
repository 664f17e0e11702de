"""Joins in projections: lookups (many-to-one, table-table) into other captured tables, and nested
collections (one-to-many: a document per parent with the list of its child rows).

- ``spec``: the ``Lookup`` and ``Nested`` declarations and the checks that need no schemas;
- ``plan``: lookups bound to the tables' schemas (``JoinPlan``) and the Spark expressions;
- ``stage``: the join stage of replay (DataFrame joins) and follow (PostgreSQL join state);
- ``state``: the join state tables in the views database.
"""

from kappaflow.projections.joins.spec import Lookup, Nested

__all__ = ["Lookup", "Nested"]
