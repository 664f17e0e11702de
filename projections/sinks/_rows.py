"""Shared by the document sinks (search, Redis): write batches as keyed JSON rows and back.

A write batch (see ``base.py``) is an Arrow table: the view's columns, ``_kf_version``
(the log offset that produced the row) and ``_kf_deleted``. Document stores want one
JSON document per key, so this module turns a batch into ``(key, key string, row or
None, version)`` tuples a slice at a time (a small working set: no million-dict lists
for the garbage collector to walk) and turns stored JSON back into the Python types the
view's Spark schema promises (``fetch``/``scan`` return the same values as the
PostgreSQL sink).

Versions: a latest-row view's row carries the log **offset** of its change (see
:func:`version_of`). Offsets are per partition and not comparable across partitions, but
every change of one key lives in one partition (the log partitions by key), so per key the
offset alone is strictly increasing, which is all a per-key version guard needs. Grouped
and custom views carry the engine's batch watermark instead (the sum of the next offsets of
all input partitions, growing with every batch). The sinks only require 0..2^63-1
(Elasticsearch external versions are Java longs) and compare versions per key.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson
import pyarrow as pa

from kappaflow.errors import Retry, SinkError
from kappaflow.projections.sinks.base import DELETED, VERSION, Target, ViewSpec

MAX_VERSION = (1 << 63) - 1

# (key tuple, key string, row dict or None for a delete, version)
Change = tuple[tuple[Any, ...], str, dict[str, Any] | None, int]


class SinkStateLostError(SinkError):
    """The store lost data the sink had written (index or namespace gone, server restarted empty).

    Transient, but not "retry the same batch": the positions the runner holds describe
    data that no longer exists. The runner must call ``ensure`` and ``read_positions``
    again (they now report an empty view) and replay the log from there.
    """

    retry = Retry.TRANSIENT


def version_of(partition: int, offset: int) -> int:
    """The version a change carries: its log offset (see the module docstring)."""
    if not 0 <= offset <= MAX_VERSION:
        raise SinkError(f"log offset {offset} (partition {partition}): expected 0..2^63-1 to use as a version")
    return offset


def json_default(obj: Any) -> Any:
    if isinstance(obj, decimal.Decimal):
        return str(obj)  # exact; search numeric fields accept numeric strings
    if isinstance(obj, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(obj)).decode()
    if isinstance(obj, _dt.timedelta):
        return (obj.days * 86_400 + obj.seconds) * 1_000_000 + obj.microseconds
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    if hasattr(obj, "isoformat"):  # pandas.Timestamp and friends
        return obj.isoformat()
    if hasattr(obj, "tolist"):  # numpy arrays / scalars
        return obj.tolist()
    raise TypeError(f"cannot encode a {type(obj).__name__} as JSON")


DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def encode_json(row: Mapping[str, Any]) -> bytes:
    return orjson.dumps(row, default=json_default, option=DUMPS_OPTS)


def key_str(key: tuple[Any, ...] | Any) -> str:
    """The canonical text of a view key (document id, Redis key suffix).

    One column: the value's plain text (``42``, ``alice``, ``true``, ``2024-01-02``);
    several: a compact JSON array (``["eu",42]``), unambiguous whatever the values hold.
    """
    if isinstance(key, tuple | list):
        if len(key) == 1:
            return key_str(key[0])
        return orjson.dumps(list(key), default=json_default, option=DUMPS_OPTS).decode()
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int | decimal.Decimal | uuid.UUID):
        return str(key)
    if isinstance(key, _dt.datetime | _dt.date | _dt.time):
        return key.isoformat()
    if isinstance(key, bytes):
        return base64.b64encode(key).decode()
    if isinstance(key, float):
        return repr(key)
    raise SinkError(f"view key: expected scalar key values, got {type(key).__name__}")


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


def log_rejected(sink: str, target: Target, rejected: list[tuple[tuple[Any, ...], str]]) -> None:
    """Bulk loads return only a count (``Sink.load``): name every refused row in the log instead of
    dropping it silently (the write path hands them back in ``WriteResult.rejected``)."""
    import logging

    logger = logging.getLogger("kappaflow.projections.sinks")
    for key, reason in rejected[:100]:
        logger.error("%s: loading %s: refused key %s: %s", sink, target.name, key, reason)
    if len(rejected) > 100:
        logger.error("%s: loading %s: %d more refused rows", sink, target.name, len(rejected) - 100)


# --- decoding stored JSON back to the view's types ----------------------------------------
def _decoder(dt: Any) -> Any:
    """A function JSON value -> Python value for Spark type `dt` (None for identity)."""
    from pyspark.sql import types as st

    if isinstance(dt, st.DecimalType):
        return lambda v: decimal.Decimal(str(v))
    if isinstance(dt, st.DateType):
        return lambda v: _dt.date.fromisoformat(v) if isinstance(v, str) else v
    if isinstance(dt, st.TimestampNTZType):
        return lambda v: _dt.datetime.fromisoformat(v) if isinstance(v, str) else v
    if isinstance(dt, st.TimestampType):
        def ts(v: Any) -> Any:
            if not isinstance(v, str):
                return v
            d = _dt.datetime.fromisoformat(v)
            return d if d.tzinfo else d.replace(tzinfo=_dt.UTC)
        return ts
    if isinstance(dt, st.BinaryType):
        return lambda v: base64.b64decode(v) if isinstance(v, str) else v
    if isinstance(dt, st.DayTimeIntervalType):
        return lambda v: _dt.timedelta(microseconds=v) if isinstance(v, int) else v
    if isinstance(dt, st.FloatType | st.DoubleType):
        return lambda v: float(v) if isinstance(v, int | str) else v
    if isinstance(dt, st.ArrayType):
        inner = _decoder(dt.elementType)
        if inner is None:
            return None
        return lambda v: [None if x is None else inner(x) for x in v] if isinstance(v, list) else v
    if isinstance(dt, st.StructType):
        subs = [(f.name, _decoder(f.dataType)) for f in dt.fields]
        if all(d is None for _, d in subs):
            return None

        def struct(v: Any) -> Any:
            if not isinstance(v, dict):
                return v
            return {n: (v.get(n) if d is None or v.get(n) is None else d(v[n])) for n, d in subs}
        return struct
    if isinstance(dt, st.MapType):
        vd = _decoder(dt.valueType)
        if vd is None:
            return None
        return lambda v: {k: None if x is None else vd(x) for k, x in v.items()} if isinstance(v, dict) else v
    return None


class RowDecoder:
    """Stored JSON documents -> rows typed like the view (plus ``_kf_version``)."""

    def __init__(self, view: ViewSpec) -> None:
        self.view = view
        self.names = view.column_names
        self.decoders = [(c.name, d) for c in view.columns if (d := _decoder(c.type)) is not None]

    def row(self, doc: Mapping[str, Any], version: int | None) -> dict[str, Any]:
        out = {n: doc.get(n) for n in self.names}
        for name, dec in self.decoders:
            v = out[name]
            if v is not None:
                out[name] = dec(v)
        out[VERSION] = version
        return out

    def key(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(row[k] for k in self.view.key)


def sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """Order keys like a database would (NULLs last) without comparing None to values."""
    return tuple((v is None, v) for v in key)


# --- leases: one replay/follow per projection, without a session-bound lock in the store ---------------
def lease_margin(ttl_s: float) -> float:
    """How long before a lease's expiry its holder stops trusting it: covers clock skew between
    the holder and a process that compares the lease's wall-clock expiry with its own clock."""
    return min(ttl_s * 0.1, 2.0)


class Lease:
    """A lock held by renewing it: ``acquire`` once, a daemon thread calls ``renew`` every
    ``ttl_s / 3``; a holder killed with -9 stops renewing and the lock expires after ``ttl_s``.

    ``held`` is computed when asked, not by the renewal thread: the lease is held until
    ``ttl_s`` (less ``lease_margin``) after the last renewal that SUCCEEDED was sent, so a
    holder whose renewals keep failing (a partition longer than the lease, a renewal call
    that hangs) stops claiming the lock before anyone else can take it. Once lost, a lease
    stays lost: the holder takes the lock again (a new generation) or gives up.

    ``token`` (``"<generation>:<random>"``) is what the store holds while this lease owns the
    lock; the sinks fence writes with it (``Sink.fence``), so a writer whose lease was lost or
    taken over cannot write. Stores without session-bound locks (Redis, search servers)
    implement the three callables; PostgreSQL uses an advisory lock instead.
    """

    def __init__(self, name: str, ttl_s: float, renew: Callable[[], bool], release: Callable[[], None], *,
                 token: str = "", taken_at: float | None = None) -> None:
        import threading
        import time

        self.name = name
        self.ttl_s = ttl_s
        self.token = token
        self._renew = renew
        self._release = release
        self._stop = threading.Event()
        self.lost = False
        # `taken_at`: monotonic time the take request was SENT (the store's expiry counts from later)
        self.valid_until = (taken_at if taken_at is not None else time.monotonic()) + ttl_s - lease_margin(ttl_s)
        self._thread = threading.Thread(target=self._run, name=f"kappaflow-lease-{name}", daemon=True)
        self._thread.start()

    @property
    def generation(self) -> int:
        return fence_generation(self.token)

    @property
    def held(self) -> bool:
        """Still ours: not lost, and the last successful renewal has not run out."""
        import time

        return not self.lost and time.monotonic() < self.valid_until

    def _run(self) -> None:
        import logging
        import time

        logger = logging.getLogger(__name__)
        while not self._stop.wait(self.ttl_s / 3):
            sent = time.monotonic()
            try:
                ok = self._renew()
            except Exception as exc:  # a store hiccup: try again next round while the lease has time
                if time.monotonic() >= self.valid_until:
                    self.lost = True
                    logger.error("lease %s expired: renewals kept failing for more than %.0f s (last: %s); "
                                 "this holder no longer has the lock and its writes are refused", self.name,
                                 self.ttl_s, exc)
                    return
                logger.warning("renewing lease %s failed: %s", self.name, exc)
                continue
            if not ok or self._stop.is_set():
                if not ok:
                    self.lost = True
                    logger.error("lease %s was lost (expired and taken?)", self.name)
                return
            if time.monotonic() >= self.valid_until:
                # renewed only after it had run out here: writes were refused meanwhile, and a
                # lease that ran out stays lost (the holder takes the lock again or gives up)
                self.lost = True
                logger.error("lease %s ran out before its renewal returned; giving it up", self.name)
                return
            self.valid_until = sent + self.ttl_s - lease_margin(self.ttl_s)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.lost:
            self._release()


def fence_generation(token: str | None) -> int:
    """The lease generation in a fencing token (``"<generation>:<random>"``); 0 when it has none."""
    head = (token or "").partition(":")[0]
    return int(head) if head.isdigit() else 0


class LockLostError(SinkError):
    """A fenced write was refused: the writer's lease on the projection lock expired or was taken
    over (transient: the writer may take the lock again, or give up if another holder has it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry=Retry.TRANSIENT)
