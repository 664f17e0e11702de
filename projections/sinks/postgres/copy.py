"""Arrow <-> the CSV of PostgreSQL's COPY: pyarrow's C++ writer (binary, array, nested and interval
columns rendered to PostgreSQL text forms first) and reader (``arrow_from_csv``: what ``COPY (query)
TO STDOUT`` writes, columnar, without a Python object per value)."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv


def _pg_array_literal(values: list[Any] | None) -> str | None:
    if values is None:
        return None
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
            continue
        if isinstance(v, bytes):
            v = "\\x" + v.hex()
        elif isinstance(v, bool):
            v = "true" if v else "false"
        s = str(v)
        parts.append('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return "{" + ",".join(parts) + "}"


def _render_for_csv(table: pa.Table) -> pa.Table:
    """Replace columns pyarrow's CSV writer cannot render as PostgreSQL reads them."""
    cols = []
    changed = False
    for i, f in enumerate(table.schema):
        col = table.column(i)
        t = f.type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            col = pa.array([None if b is None else "\\x" + b.hex() for b in col.to_pylist()], pa.string())
            changed = True
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            vt = t.value_type
            if pa.types.is_list(vt) or pa.types.is_struct(vt) or pa.types.is_map(vt):
                col = pa.array(
                    [None if v is None else orjson.dumps(v, default=str).decode() for v in col.to_pylist()], pa.string()
                )
            else:
                col = pa.array([_pg_array_literal(v) for v in col.to_pylist()], pa.string())
            changed = True
        elif pa.types.is_struct(t) or pa.types.is_map(t):
            col = pa.array(
                [
                    None if v is None else orjson.dumps(v if not pa.types.is_map(t) else dict(v), default=str).decode()
                    for v in col.to_pylist()
                ],
                pa.string(),
            )
            changed = True
        elif pa.types.is_duration(t):
            col = pa.array(
                [None if v is None else f"{v.total_seconds()} seconds" for v in col.to_pylist()], pa.string()
            )
            changed = True
        cols.append(col)
    if not changed:
        return table
    return pa.Table.from_arrays(cols, names=table.column_names)


def csv_bytes(table: pa.Table) -> bytes:
    # without empty chunks (zero-copy): pyarrow 26's CSV writer emits stale buffer bytes for a table whose
    # first chunks are empty (a batch's concatenated changes when only the watermark row moved)
    chunks = [b for b in table.to_batches() if b.num_rows]
    table = pa.Table.from_batches(chunks, schema=table.schema)
    buf = io.BytesIO()
    pacsv.write_csv(_render_for_csv(table), buf, pacsv.WriteOptions(include_header=False))
    return buf.getvalue()


def arrow_from_csv(data: bytes, columns: dict[str, pa.DataType]) -> pa.Table:
    """The rows of ``COPY (...) TO STDOUT WITH (FORMAT csv)`` (no header) as an Arrow table of `columns`.

    PostgreSQL writes NULL as an empty unquoted field and an empty string as ``""``, so only unquoted
    empty fields are NULL. Values may hold newlines (``json_agg`` output does). One block holds the
    whole input (a block smaller than a row fails in pyarrow's reader), up to 1 GiB per block."""
    if not data:
        return pa.table({n: pa.array([], t) for n, t in columns.items()})
    return pacsv.read_csv(
        io.BytesIO(data),
        read_options=pacsv.ReadOptions(column_names=list(columns), block_size=min(len(data) + 1, 1 << 30)),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types=columns, null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False
        ),
    )
