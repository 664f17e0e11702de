"""The custom folder: the code that runs a custom fold's ``apply()`` inside Spark's Python workers.

A ``mapInArrow`` function, so Python runs once per Spark partition over Arrow batches, built by
``make_folder`` whose ``FoldJob`` (the projection class, schemas as dicts, a picklable
``SinkConfig``) travels to the workers with it. Its output rows go to the loader
(``kappaflow.projections.loader``, replay) or back to the driver (follow); see ``custom.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

from kappaflow.projections.sinks.base import DELETED, VERSION, SinkConfig, Target

EMIT_CHUNK = 4096


# --- custom folds ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FoldJob:
    """Everything a worker needs to run a custom fold (picklable)."""

    projection: type
    key: tuple[str, ...]
    schemas: dict[str, dict[str, Any]]  # topic -> TableSchema.to_dict()
    out_schema: pa.Schema  # view columns + version + deleted + dead-letter columns
    view_columns: tuple[str, ...]
    version: int
    sink: SinkConfig | None = None  # follow: current rows come from the live view
    target: Target | None = None
    sorted_input: bool = True  # False: a partition's events are in offset order, keys interleaved
    # Direct reads (replay of an in-place fold): the input rows are log ranges
    # (topic, partition, start, end) and the worker reads them itself from this log.
    log_url: str | None = None
    log_options: dict[str, Any] | None = None
    key_columns: dict[str, tuple[str, ...]] | None = None  # topic -> source column per view key
    event_topics: frozenset[str] = frozenset()  # topics whose values are domain events (no envelope)
    records_read: Any = None  # direct reads: a Spark accumulator of the log records read
    # as-of enrichment (joins/asof_stage.py): (name, table topic, columns, output names) per AsOf; the
    # events carry ``_kf_asof`` ({name: the table's after row as it was, or null}), merged into ``after``
    as_of: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = ()


_MISSING = object()


def make_folder(job: FoldJob) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _Folder(job).run(batches)

    return run


_PLAIN_TYPES = ("int8", "int16", "int32", "int64", "year", "string", "enum", "boolean", "uuid", "set")


def row_decoder(schema: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """JSON row -> Python values, in place, converting only the columns whose JSON form
    differs from the Python value (decimals, dates, timestamps, bytes, JSON, floats...).

    Values of plain columns (integers, strings, booleans) are trusted as written by the
    connector; a value a converter rejects raises, and the event becomes a dead letter.
    """
    from kappaflow.events.values import default_wire, make_decoder

    convs = tuple(
        (c.name, make_decoder(c, default_wire(c, "string"))) for c in schema.columns if c.type.value not in _PLAIN_TYPES
    )

    def dec(row: dict[str, Any]) -> dict[str, Any]:
        for name, fn in convs:
            v = row.get(name)
            if v is not None:
                row[name] = fn(v)
        return row

    return dec


class _Folder:
    def __init__(self, job: FoldJob) -> None:
        from kappaflow.events import EventCodec, TableSchema

        self.job = job
        self.proj = job.projection()
        self.codec = EventCodec()
        self.schemas = {t: TableSchema.from_dict(d) for t, d in job.schemas.items()}
        self.key_schemas = {t: s.key_schema() for t, s in self.schemas.items() if s.key}
        self.row_dec = {t: row_decoder(s) for t, s in self.schemas.items()}
        self.key_dec = {t: row_decoder(s) for t, s in self.key_schemas.items()}
        self.out: list[dict[str, Any]] = []
        self.view_cols = job.view_columns
        self.follow = job.sink is not None
        self._asof: str | None = None  # the current event's ``_kf_asof`` text (as-of enrichment)

    # -- decoding --------------------------------------------------------------------------
    def _event(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes,
        key_dict: dict[str, Any] | None = None,
    ) -> Any:
        from kappaflow.projections.api import Event

        obj = orjson.loads(value)
        if type(obj) is not dict:
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        if self.job.as_of and self._asof is not None:
            self._enrich(topic, obj)
        if topic in self.job.event_topics:
            pos = obj.get("position")
            return Event(
                topic,
                partition,
                offset,
                "c",
                None,
                None,
                obj,
                None,
                {"kind": "ledger", "position": pos} if pos is not None else None,
                None,
            )
        if "payload" in obj and "schema" in obj:
            obj = obj["payload"]
        op = obj.get("op")
        if op not in ("c", "u", "d", "r"):
            if op == "t":
                return None  # truncate markers: the deletes that follow carry the removed rows
            raise ValueError(f"op: expected one of c, u, d, r, t, got {op!r}")
        dec = self.row_dec[topic]
        before = obj.get("before")
        after = obj.get("after")
        if before is not None:
            before = dec(before)
        if after is not None:
            after = dec(after)
        k = key_dict
        if k is None and key is not None:
            k = self._key_dict(topic, key)
        src = obj.get("source") or {}
        return Event(topic, partition, offset, op, k, before, after, obj.get("ts_ms"), src.get("kf_pos"), src,
                     obj.get("kf_truncate") is True)

    def _enrich(self, topic: str, obj: dict[str, Any]) -> None:
        """Add each AsOf's columns (``prefix + column``; None without a row) to the event's ``after``:
        the domain event object of an event topic, the new row of a change event (a delete has none)."""
        rows = orjson.loads(self._asof or "{}")
        if topic in self.job.event_topics:
            target: Any = obj
        else:
            env = obj["payload"] if ("payload" in obj and "schema" in obj) else obj
            target = env.get("after")
            if type(target) is not dict:
                return
        extra: dict[str, Any] = {}
        for name, table, columns, outs in self.job.as_of:
            row = rows.get(name)
            if type(row) is dict:
                row = self.row_dec[table](row)
            for c, o in zip(columns, outs, strict=True):
                extra[o] = row.get(c) if type(row) is dict else None
        target.update(extra)  # a change row's decoder converts its own columns only: these stay as they are

    def _key_dict(self, topic: str, key: bytes) -> Any:
        kobj = orjson.loads(key)
        if type(kobj) is dict and "payload" in kobj and "schema" in kobj:
            kobj = kobj["payload"]
        kd = self.key_dec.get(topic)
        return kd(kobj) if (kd is not None and type(kobj) is dict) else kobj

    # -- output ----------------------------------------------------------------------------
    def _emit_row(self, row: dict[str, Any], deleted: bool, last: tuple[Any, ...]) -> None:
        out = {c: row.get(c) for c in self.view_cols}
        out[VERSION] = self.job.version
        out[DELETED] = deleted
        out["_kf_last"] = last
        self.out.append(out)

    def _dead(self, topic: str, partition: int, offset: int, key: bytes | None, reason: str) -> None:
        self.out.append(
            {
                "_kf_dl_topic": topic,
                "_kf_dl_partition": partition,
                "_kf_dl_offset": offset,
                "_kf_dl_key": key,
                "_kf_dl_reason": reason[:2000],
            }
        )

    def _flush_out(self) -> Iterator[pa.RecordBatch]:
        if not self.out:
            return
        rows, self.out = self.out, []
        schema = self.job.out_schema
        try:
            yield pa.RecordBatch.from_pylist(rows, schema=schema)
            return
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
        good = []
        for r in rows:  # find the rows that do not fit the declared schema
            try:
                pa.RecordBatch.from_pylist([r], schema=schema)
                good.append(r)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                bad_col = _bad_column(r, schema)
                t, p, o, k = r.get("_kf_last") or (None, None, None, None)
                good.append(
                    {
                        "_kf_dl_topic": t,
                        "_kf_dl_partition": p,
                        "_kf_dl_offset": o,
                        "_kf_dl_key": k,
                        "_kf_dl_reason": f"apply() returned a row that does not fit the view schema: column "
                        f"{bad_col!r}: {exc}"[:2000],
                    }
                )
        yield pa.RecordBatch.from_pylist(good, schema=schema)

    # -- the fold loop ---------------------------------------------------------------------
    def _finish_key(self, initial: Any, row: Any, last: tuple[Any, ...] | None) -> None:
        if last is None:
            return  # no event applied (all dead-lettered): nothing changes
        if not self.follow:
            if row is not None:
                self._emit_row(row, False, last)
            return
        if row is None:
            if initial is not None:
                self._emit_row(initial, True, last)
        elif initial is None or row != initial:
            self._emit_row(row, False, last)

    def _apply_one(
        self,
        row: Any,
        k: tuple[Any, ...],
        t: str,
        p: int,
        o: int,
        rk: bytes | None,
        value: bytes,
        key_dict: dict[str, Any] | None = None,
    ) -> tuple[bool, Any]:
        """Fold one event into `row`; (applied, new row). Failures become dead letters."""
        key_names = self.job.key
        if None in k:
            self._dead(
                t,
                p,
                o,
                rk,
                f"cannot determine the view key {list(key_names)} of this event "
                "(column missing or NULL in the record key / row)",
            )
            return False, row
        try:
            ev = self._event(t, p, o, rk, value, key_dict)
        except Exception as exc:
            self._dead(t, p, o, rk, f"malformed change event: {type(exc).__name__}: {exc}")
            return False, row
        if ev is None:
            return False, row
        try:
            new = self.proj.apply(row, ev)
        except Exception as exc:
            self._dead(t, p, o, rk, f"apply() raised {type(exc).__name__}: {exc}")
            return False, row
        if new is not None:
            if not isinstance(new, dict):
                self._dead(t, p, o, rk, f"apply() returned {type(new).__name__}, expected a dict or None")
                return False, row
            wrong = [kn for kn, kv in zip(key_names, k, strict=True) if kn in new and new[kn] != kv]
            if wrong:
                self._dead(t, p, o, rk, f"apply() changed the view key column(s) {wrong} of key {list(k)}")
                return False, row
            for kn, kv in zip(key_names, k, strict=True):
                new.setdefault(kn, kv)
        return True, new

    def run(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        if self.job.log_url is not None:
            yield from self._run_direct(batches)
            return
        source: Iterable[pa.RecordBatch] = batches
        current: dict[tuple[Any, ...], dict[str, Any]] = {}
        if self.follow:
            source = list(batches)
            current = self._fetch_current(source)
        if self.job.sorted_input:
            yield from self._run_sorted(source, current)
        else:
            yield from self._run_in_place(source, current)

    def _columns(self, b: pa.RecordBatch) -> tuple[list[Any], ...]:
        return (
            b.column("_kf_topic").to_pylist(),
            b.column("_kf_partition").to_pylist(),
            b.column("_kf_offset").to_pylist(),
            b.column("_kf_key").to_pylist(),
            b.column("_kf_value").to_pylist(),
        )

    def _keys(self, b: pa.RecordBatch) -> list[tuple[Any, ...]]:
        cols = [b.column(k).to_pylist() for k in self.job.key]
        return list(zip(*cols, strict=True))

    def _run_sorted(
        self, source: Iterable[pa.RecordBatch], current: dict[tuple[Any, ...], dict[str, Any]]
    ) -> Iterator[pa.RecordBatch]:
        """Events sorted by (view key, position): one key at a time, O(1) state."""
        cur_key: Any = _MISSING
        initial: Any = None
        row: Any = None
        last: tuple[Any, ...] | None = None
        events = self.job.event_topics
        for b in source:
            topics, parts, offs, keys, values = self._columns(b)
            orders = b.column("_kf_order").to_pylist() if events and "_kf_order" in b.schema.names else None
            asofs = b.column("_kf_asof").to_pylist() if "_kf_asof" in b.schema.names else None
            prev_pos: Any = None
            for i, k in enumerate(self._keys(b)):
                if k != cur_key:
                    if cur_key is not _MISSING:
                        self._finish_key(initial, row, last)
                    cur_key = k
                    initial = current.get(k)
                    row = dict(initial) if initial is not None else None
                    last = None
                    prev_pos = None
                    if len(self.out) >= EMIT_CHUNK:
                        yield from self._flush_out()
                if orders is not None and topics[i] in events:
                    # an event re-delivered by a restarted relay carries the same position: fold it once
                    pos = orders[i]["a"] if orders[i] is not None else None
                    if pos is not None and pos == prev_pos:
                        continue
                    prev_pos = pos
                if asofs is not None:
                    self._asof = asofs[i]
                ok, new = self._apply_one(row, k, topics[i], parts[i], offs[i], keys[i], values[i])
                if ok:
                    row = new
                    last = (topics[i], parts[i], offs[i], keys[i])
        if cur_key is not _MISSING:
            self._finish_key(initial, row, last)
        yield from self._flush_out()

    def _run_in_place(
        self, source: Iterable[pa.RecordBatch], current: dict[tuple[Any, ...], dict[str, Any]]
    ) -> Iterator[pa.RecordBatch]:
        """Events in offset order with keys interleaved (one log partition): a dict of rows."""
        rows: dict[tuple[Any, ...], Any] = {}
        lasts: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        apply_one = self._apply_one
        for b in source:
            topics, parts, offs, keys, values = self._columns(b)
            for i, k in enumerate(self._keys(b)):
                if k in rows:
                    row = rows[k]
                else:
                    init = current.get(k)
                    row = dict(init) if init is not None else None
                ok, new = apply_one(row, k, topics[i], parts[i], offs[i], keys[i], values[i])
                if ok:
                    rows[k] = new
                    lasts[k] = (topics[i], parts[i], offs[i], keys[i])
        for k, row in rows.items():
            self._finish_key(current.get(k), row, lasts.get(k))
            if len(self.out) >= EMIT_CHUNK:
                yield from self._flush_out()
        yield from self._flush_out()

    def _run_direct(self, ranges: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Read whole log ranges here and fold them in offset order (no JVM round trip of
        the events: the fold is the only consumer of their bytes). The loop is
        ``_apply_one`` inlined: this is the per-event hot path of custom-fold replays."""
        from kappaflow.projections.api import Event
        from kappaflow.projections.datasource import READ_CHUNK, LogRange, _chunks, open_cached_log

        assert self.job.log_url is not None and self.job.key_columns is not None
        log = open_cached_log(self.job.log_url, self.job.log_options)
        key_names = self.job.key
        rows: dict[tuple[Any, ...], Any] = {}
        lasts: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        apply = self.proj.apply
        dead = self._dead
        loads = orjson.loads
        ops = frozenset(("c", "u", "d", "r"))
        read = 0
        for b in ranges:
            for t, p, start, end in zip(*(b.column(i).to_pylist() for i in range(4)), strict=True):
                if end <= start:
                    continue
                cols_of = self.job.key_columns[t]
                single = cols_of[0] if len(cols_of) == 1 else None
                kname = key_names[0]
                dec = self.row_dec[t]
                kdec = self.key_dec.get(t)
                for offsets, keys, values, _ts, _heads in _chunks(log, LogRange(t, p, start, end), READ_CHUNK):
                    read += len(offsets)
                    for o, rk, v in zip(offsets, keys, values, strict=True):
                        if v is None:
                            continue  # tombstone: the delete event before it carried the change
                        try:
                            kd = loads(rk)
                            if "payload" in kd and "schema" in kd:
                                kd = kd["payload"]
                            if kdec is not None:
                                kd = kdec(kd)
                            k = (kd.get(single),) if single is not None else tuple(kd.get(c) for c in cols_of)
                            obj = loads(v)
                            if "payload" in obj and "schema" in obj:
                                obj = obj["payload"]
                            op = obj["op"]
                            if op not in ops:
                                if op == "t":
                                    continue
                                raise ValueError(f"op: expected one of c, u, d, r, t, got {op!r}")
                            before = obj.get("before")
                            after = obj.get("after")
                            if before is not None:
                                before = dec(before)
                            if after is not None:
                                after = dec(after)
                            src = obj.get("source") or {}
                            ev = Event(t, p, o, op, kd, before, after, obj.get("ts_ms"), src.get("kf_pos"), src,
                                       obj.get("kf_truncate") is True)
                        except Exception as exc:
                            dead(t, p, o, rk, f"malformed change event: {type(exc).__name__}: {exc}")
                            continue
                        if None in k:
                            dead(t, p, o, rk, f"cannot determine the view key {list(key_names)} of this event")
                            continue
                        try:
                            new = apply(rows.get(k), ev)
                        except Exception as exc:
                            dead(t, p, o, rk, f"apply() raised {type(exc).__name__}: {exc}")
                            continue
                        if new is not None:
                            if type(new) is not dict:
                                dead(t, p, o, rk, f"apply() returned {type(new).__name__}, expected a dict or None")
                                continue
                            if single is not None:
                                kv = new.get(kname, _MISSING)
                                if kv is _MISSING:
                                    new[kname] = k[0]
                                elif kv != k[0]:
                                    dead(
                                        t,
                                        p,
                                        o,
                                        rk,
                                        f"apply() changed the view key column(s) [{kname!r}] of key {list(k)}",
                                    )
                                    continue
                            else:
                                wrong = [n for n, kv in zip(key_names, k, strict=True) if n in new and new[n] != kv]
                                if wrong:
                                    dead(
                                        t, p, o, rk, f"apply() changed the view key column(s) {wrong} of key {list(k)}"
                                    )
                                    continue
                                for n, kv in zip(key_names, k, strict=True):
                                    new.setdefault(n, kv)
                        rows[k] = new
                        lasts[k] = (t, p, o, rk)
        if self.job.records_read is not None:
            self.job.records_read.add(read)
        for k, row in rows.items():
            self._finish_key(None, row, lasts.get(k))
            if len(self.out) >= EMIT_CHUNK:
                yield from self._flush_out()
        yield from self._flush_out()

    def _fetch_current(self, batches: list[pa.RecordBatch]) -> dict[tuple[Any, ...], dict[str, Any]]:
        assert self.job.sink is not None and self.job.target is not None
        keys: set[tuple[Any, ...]] = set()
        for b in batches:
            cols = [b.column(k).to_pylist() for k in self.job.key]
            keys.update(zip(*cols, strict=True))
        keys = {k for k in keys if not any(v is None for v in k)}
        if not keys:
            return {}
        sink = self.job.sink.for_worker().open()
        try:
            out: dict[tuple[Any, ...], dict[str, Any]] = {}
            ordered = sorted(keys, key=repr)
            for i in range(0, len(ordered), 5000):
                for k, r in sink.fetch(self.job.target, ordered[i : i + 5000]).items():
                    r.pop(VERSION, None)
                    out[k] = r
            return out
        finally:
            sink.close()


def _bad_column(row: dict[str, Any], schema: pa.Schema) -> str:
    for f in schema:
        try:
            pa.array([row.get(f.name)], type=f.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return f.name
    return "?"


def fold_arrow_schema(view_schema: pa.Schema) -> pa.Schema:
    """The worker-side Arrow schema matching ``plan.fold_output_type``."""
    fields = [f for f in view_schema if f.name not in (VERSION, DELETED)]
    fields += [
        pa.field(VERSION, pa.int64()),
        pa.field(DELETED, pa.bool_()),
        pa.field("_kf_dl_topic", pa.string()),
        pa.field("_kf_dl_partition", pa.int32()),
        pa.field("_kf_dl_offset", pa.int64()),
        pa.field("_kf_dl_key", pa.binary()),
        pa.field("_kf_dl_reason", pa.string()),
    ]
    return pa.schema(fields)


__all__ = ["FoldJob", "fold_arrow_schema", "make_folder", "row_decoder"]
