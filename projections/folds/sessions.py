"""Session windows (``window = Session(column, gap)``): how the contributions of one group form
sessions, in Spark (replay) and on the driver (follow). The per-event rule -- partition watermark,
lateness, late-data policy -- is the windowed fold's (``folds/windowed.py``, ``Rule`` with
``session=True``); this module only turns the contributions it leaves into sessions.

The session rule (the README's "Event time" section is the user-facing copy):

- A contribution is a source key's current row in a group with its event time t (a key whose late
  retraction was not applied keeps its frozen old contribution beside its new one, as with tumbling).
- Sorted by event time, two neighbouring contributions of a group belong to one session when
  ``t_next - t_prev < gap``; a session is ``[first t, last t + gap)``. So an event that falls within
  gap of two sessions merges them, and a retraction (update moving the event time, delete, a row
  leaving ``where`` or the group) of the contribution that bridged them splits them.
- Sessions are a function of the set of contributions alone, not of the order they came in: the
  set is what the per-event rule leaves, the same for a replay and a follower cut anywhere (the rule
  reads only each partition's own log), so the sessions are the same too.
- Lateness is judged on the event's own time (``t + allowed_lateness <= partition watermark``), not
  on the session it would join: that session depends on events of other partitions, which a replay
  and a follower see in different interleavings, so a rule on it would make their late decisions
  differ. Judged on t, an on-time event can never touch a final session (final: ``W >= end +
  lateness``; an on-time t is after ``W - lateness >= end``, so it cannot join it), and a late one
  is applied only with ``late="update"``: final sessions stay final, as tumbling windows do.

Every state row of a contribution carries its session's bounds (``window_start``, ``window_end``),
so the grouped recompute (``GroupedState.apply_grouped``: affected groups = the old and the new
bounds of the staged rows) deletes the view row of a session that merged away or split, and the
tumbling fold's final flips and state dropping (``window_end + lateness <= W``) work unchanged. A
follow batch re-derives the sessions of every group it touches from that group's stored
contributions, and restages the rows whose bounds moved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import Window as SparkWindow
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, TimestampNTZType

SID, T, NEW = "_kf_sid", "_kf_t", "_kf_new"


def session_bounds(times: Sequence[int], gap: int) -> list[tuple[int, int]]:
    """(start, end) of the session of each of `times` (sorted ascending), end = last time + gap."""
    out: list[tuple[int, int]] = []
    i, n = 0, len(times)
    while i < n:
        j = i
        while j + 1 < n and times[j + 1] - times[j] < gap:
            j += 1
        bounds = (times[i], times[j] + gap)
        out.extend([bounds] * (j - i + 1))
        i = j + 1
    return out


def sessionize(state: DataFrame, group: Sequence[str], gap: int, time_type: DataType, start: str,
               end: str, tiebreak: Sequence[str] = ()) -> DataFrame:
    """Replay: contribution rows whose `start` column holds their event time get their session's
    bounds in `start` and `end` (native window functions: one shuffle by group, one sort; `tiebreak`:
    columns that order rows of equal times)."""
    t = F.unix_micros(F.col(start).cast("timestamp"))  # NTZ: wall time as UTC (the session zone is UTC)
    by_time = SparkWindow.partitionBy(*group).orderBy(T, *tiebreak)  # a total order: lag and sum agree
    df = state.withColumn(T, t)
    prev = F.lag(T).over(by_time)
    df = df.withColumn(NEW, F.when(prev.isNull() | (F.col(T) - prev >= F.lit(gap)), 1).otherwise(0))
    df = df.withColumn(SID, F.sum(NEW).over(by_time.rowsBetween(SparkWindow.unboundedPreceding,
                                                                SparkWindow.currentRow)))
    one = SparkWindow.partitionBy(*group, SID)
    ntz = isinstance(time_type, TimestampNTZType)

    def ts(us: Any) -> Any:
        v = F.timestamp_micros(us)
        return v.cast("timestamp_ntz") if ntz else v

    cols = [c for c in state.columns if c not in (start, end)]
    return df.select(*cols, ts(F.min(T).over(one)).alias(start), ts(F.max(T).over(one) + F.lit(gap)).alias(end))


def regroup(
    gap: int,
    group_of: Mapping[Any, tuple[Any, ...]],
    before: Mapping[Any, tuple[int, int]],
    after: Iterable[tuple[Any, int]],
    inserted: set[Any],
) -> tuple[dict[Any, tuple[int, int]], list[Any]]:
    """Follow: the sessions of the touched groups after a batch. `after`: (contribution id, event
    time) of every contribution of those groups after the batch; `group_of` its group; `before`: the
    stored bounds of the contributions that were stored; `inserted`: ids (re)written by the batch.
    Returns the (id -> bounds) rows to stage (new, rewritten, or whose session moved: merged, split,
    extended, shrunk) and the ids to delete (stored, gone)."""
    by_group: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
    present = set()
    for cid, t in after:
        by_group.setdefault(group_of[cid], []).append((t, cid))
        present.add(cid)
    upsert: dict[Any, tuple[int, int]] = {}
    for items in by_group.values():
        items.sort(key=lambda x: x[0])  # equal times share their bounds whatever their order
        for (_, cid), b in zip(items, session_bounds([t for t, _ in items], gap), strict=True):
            if cid in inserted or before.get(cid) != b:
                upsert[cid] = b
    gone = [cid for cid in before if cid not in present]
    return upsert, gone


__all__ = ["regroup", "session_bounds", "sessionize"]
