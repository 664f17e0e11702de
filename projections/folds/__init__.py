"""Fold kinds: how a projection's log becomes its view, one module per kind.

- ``latest.py``: latest row per key (``LatestFold``);
- ``grouped.py``: group by, with retracting aggregates (``GroupFold``); its keyed state lives in
  a sink with ``GroupedState`` and its other sinks mirror that one;
- ``windowed.py``: aggregates per group and event-time window, with a watermark from the log,
  allowed lateness and a late-data policy (``WindowFold``); its state lives with the grouped
  fold's in PostgreSQL;
- ``interval.py``: stream-stream joins within a time bound (``IntervalJoinFold``): pairs of rows of
  two topics whose event times are within a bound, with the windows' watermark; state in PostgreSQL;
- ``custom.py``: a Python ``apply(row, event)`` (``CustomFold``), run by ``custom_folder.py``
  inside Spark's workers;
- ``declarative.py``: what latest and grouped share (they fold current source rows);
- ``base.py``: the ``FoldStrategy`` protocol and the registry (fold class -> strategy).

Nothing outside this package branches on the fold kind: the engine, follow, replay, verify
and the mirrors call ``strategy_for(spec)``. A new fold kind (a join, a window) is a
``FoldSpec`` subclass in ``kappaflow.projections.api``, plus a new module here with a
``FoldStrategy`` for it (``claims``/``declare`` read it from what the class declares; then
compile, build, fold_batch, ...), registered with ``register(...)`` and imported below.
"""

from kappaflow.projections.folds.base import (
    BuildJob,
    Built,
    FoldedBatch,
    FoldStrategy,
    ReadCounter,
    declared_fold,
    register,
    strategy_for,
    strategy_of_kind,
)
from kappaflow.projections.folds.custom import CustomStrategy
from kappaflow.projections.folds.grouped import GroupedStrategy
from kappaflow.projections.folds.interval import IntervalJoinStrategy
from kappaflow.projections.folds.latest import LatestStrategy
from kappaflow.projections.folds.windowed import WindowedStrategy

__all__ = [
    "BuildJob",
    "Built",
    "CustomStrategy",
    "FoldStrategy",
    "FoldedBatch",
    "GroupedStrategy",
    "IntervalJoinStrategy",
    "LatestStrategy",
    "ReadCounter",
    "WindowedStrategy",
    "declared_fold",
    "register",
    "strategy_for",
    "strategy_of_kind",
]
