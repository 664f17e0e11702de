"""A write batch as a stream of keyed changes, the input of the document sinks (search, Redis).

A write batch (see ``base.py``) is an Arrow table: the view's columns, ``_kf_version``
(the log offset that produced the row) and ``_kf_deleted``. Document stores want one
JSON document per key, so this module turns a batch into ``(key, key string, row or
None, version)`` tuples a slice at a time (a small working set: no million-dict lists
for the garbage collector to walk).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from kappaflow.errors import SinkError
from kappaflow.projections.sinks.base import DELETED, VERSION, ViewSpec
from kappaflow.projections.sinks.keys import key_str

# (key tuple, key string, row dict or None for a delete, version)
Change = tuple[tuple[Any, ...], str, dict[str, Any] | None, int]


def check_batch(view: ViewSpec, batch: pa.Table, sink: str) -> None:
    want = (*view.column_names, VERSION, DELETED)
    missing = [c for c in want if c not in batch.column_names]
    if missing:
        raise SinkError(f"{sink}: the batch for view {view.name!r} lacks column(s) {missing}; expected "
                        f"the view's columns plus {VERSION} and {DELETED}")


def _as_text(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """Decimals and dates as their JSON text, converted in Arrow's C++ (no Decimal/date objects)."""
    import pyarrow.compute as pc

    t = col.type
    if pa.types.is_decimal(t) or pa.types.is_date32(t) or pa.types.is_date64(t):
        return pc.cast(col, pa.string())
    return col


def iter_changes(view: ViewSpec, batch: pa.Table, *, slice_rows: int = 4096) -> Iterator[Change]:
    """The batch's rows as changes, converted a slice at a time.

    Row values are JSON-ready: decimals and dates arrive as their text (exact, and what the
    JSON encoding would produce anyway), everything else as Arrow's Python values.
    """
    names = list(view.column_names)
    key_idx = [names.index(k) for k in view.key]
    single = len(key_idx) == 1
    k0 = key_idx[0]
    table = batch.select([*names, VERSION, DELETED])
    for rb in table.to_batches(max_chunksize=slice_rows):
        raw_key = rb.column(k0)
        values = [_as_text(c).to_pylist() for c in rb.columns[:-2]]
        versions = rb.column(len(names)).to_pylist()
        deleted = rb.column(len(names) + 1).to_pylist()
        if single:
            keys = raw_key.to_pylist()
            t = raw_key.type
            if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
                import pyarrow.compute as pc

                texts = pc.cast(raw_key, pa.string()).to_pylist()
            else:
                texts = [None if k is None else key_str(k) for k in keys]
            for i, vals in enumerate(zip(*values, strict=True)):
                yield (keys[i],), texts[i], (None if deleted[i] else dict(zip(names, vals, strict=True))), \
                    versions[i]
        else:
            kcols = [rb.column(j).to_pylist() for j in key_idx]
            for i, vals in enumerate(zip(*values, strict=True)):
                key = tuple(kc[i] for kc in kcols)
                yield key, key_str(key), (None if deleted[i] else dict(zip(names, vals, strict=True))), versions[i]


__all__ = ["Change", "check_batch", "iter_changes"]
