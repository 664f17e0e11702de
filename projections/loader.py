"""The bulk loader: the ``mapInArrow`` function through which Spark executors write a replay's rows.

Python runs once per Spark partition over Arrow batches; the factory's arguments (a picklable
``SinkConfig``, the target) travel to the workers with the function. Fold kinds produce the rows
(``kappaflow.projections.folds``); this module only loads them and returns one count row per
partition, plus the dead letters: rows already carrying a dead-letter reason (a custom fold's),
and the rows the sink refused (``Sink.load_batches``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.base import Rejected, SinkConfig, Target

DL_COLUMNS = ("_kf_dl_topic", "_kf_dl_partition", "_kf_dl_offset", "_kf_dl_key", "_kf_dl_reason")


def make_loader(
    cfg: SinkConfig, target: Target, *, state: bool = False
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """mapInArrow function: load one partition's rows into `target`, output one count row.

    ``state``: the rows are a grouped view's keyed state (``GroupedState.load_state``).
    Rows carrying a dead-letter reason are passed through instead (as output rows), and rows
    the sink refuses come back as dead letters too (topic NULL, offset = the row's version,
    key = the row key), so one Spark job both loads the view and returns the dead letters.
    """
    cfg = cfg.for_worker()  # e.g. no migrations: the driver ran them

    def load(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        dead: list[pa.RecordBatch] = []

        def rows() -> Iterator[pa.RecordBatch]:
            for b in batches:
                if "_kf_dl_reason" in b.schema.names:
                    mask = pc.is_null(b.column("_kf_dl_reason"))
                    if not pc.all(mask).as_py():
                        dead.append(b.filter(pc.invert(mask)))
                        b = b.filter(mask)
                if b.num_rows:
                    yield b

        sink = cfg.open()
        try:
            if state:
                keeper = sink.grouped_state()
                if keeper is None:
                    raise ConfigError(f"the {sink.kind} sink keeps no grouped state (view {target.view.name!r})")
                n = keeper.load_state(target, rows())
            else:
                res = sink.load_batches(target, rows())
                n = res.loaded
                if res.rejected:
                    dead.append(_refused_batch(res.rejected))
        finally:
            sink.close()
        yield _count_batch(n, dead)

    return load


def _refused_batch(refused: list[Rejected]) -> pa.RecordBatch:
    """Dead-letter rows for rows a sink refused while loading (see ``engine.sink_rejections``)."""
    from kappaflow.projections.sinks.keys import key_str

    return pa.RecordBatch.from_pydict(
        {
            "_kf_dl_topic": pa.array([None] * len(refused), pa.string()),
            "_kf_dl_partition": pa.array([None] * len(refused), pa.int32()),
            "_kf_dl_offset": pa.array([v for _, v, _ in refused], pa.int64()),
            "_kf_dl_key": [key_str(k).encode() for k, _, _ in refused],
            "_kf_dl_reason": [reason for _, _, reason in refused],
        }
    )


LOAD_RESULT_DDL = (
    "_kf_loaded bigint, _kf_dl_topic string, _kf_dl_partition int, _kf_dl_offset bigint, "
    "_kf_dl_key binary, _kf_dl_reason string"
)
_LOAD_RESULT = pa.schema(
    [
        ("_kf_loaded", pa.int64()),
        ("_kf_dl_topic", pa.string()),
        ("_kf_dl_partition", pa.int32()),
        ("_kf_dl_offset", pa.int64()),
        ("_kf_dl_key", pa.binary()),
        ("_kf_dl_reason", pa.string()),
    ]
)


def _count_batch(n: int, dead: list[pa.RecordBatch]) -> pa.RecordBatch:
    cols: dict[str, list[Any]] = {f.name: [] for f in _LOAD_RESULT}
    cols["_kf_loaded"].append(n)
    for c in DL_COLUMNS:
        cols[c].append(None)
    for b in dead:
        for c in DL_COLUMNS:
            cols[c].extend(b.column(c).to_pylist())
        cols["_kf_loaded"].extend([0] * b.num_rows)
    return pa.RecordBatch.from_pydict(cols, schema=_LOAD_RESULT)


def loaded(out: list[Any]) -> int:
    """Rows loaded, summed over a loader job's collected output rows."""
    return sum(r["_kf_loaded"] or 0 for r in out)


__all__ = ["DL_COLUMNS", "LOAD_RESULT_DDL", "loaded", "make_loader"]
