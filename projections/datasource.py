"""Spark Python Data Source ``kappaflow``: log topics as a (streaming) DataFrame.

Usable from any PySpark code::

    from kappaflow.projections.datasource import register
    register(spark)
    df = (spark.read.format("kappaflow")
          .option("log", ".kappaflow/log")            # or kafka://host:port
          .option("topics", "shop.public.orders")
          .load())

Columns: ``topic string, partition int, offset bigint, key binary, value binary,
timestamp timestamp, op string, superseded int`` (``op`` from the record's ``kf.op``
header, NULL when absent; ``value`` is NULL for a tombstone; ``superseded``: with
``latestPerKey``, how many earlier records of the same key in the range this one replaced,
else 0, so ``count(*) + sum(superseded)`` is the number of records read).

Options
- ``log`` (required): the log URL (``open_log`` syntax); ``kafka.<name>`` options are
  ``open_log`` keyword arguments for a Kafka log, JSON values (e.g. ``kafka.client``,
  ``kafka.security.protocol``, ``kafka.consumer_options.fetch.max.bytes``;
  `log_options_to_spark` writes them from a dict).
- ``topics`` (required): comma-separated topic names.
- ``startingOffsets`` / ``endingOffsets``: ``earliest``, ``latest`` or JSON
  ``{"topic": {"0": 42, "1": 7}}`` (next offset to read / offset to stop before;
  partitions not named start at 0 / end at the end). Streams ignore ``endingOffsets``.
- ``maxRecordsPerPartition``: split a log partition into Spark partitions of at most
  this many offsets (default: one Spark partition per log partition).
- ``maxRecordsPerTrigger`` (streams): admission control, records per micro-batch. With cuts
  (below) a micro-batch ends at the newest cut within the limit, or at the oldest cut past it:
  a source transaction larger than the limit is read whole.
- ``consistency``: ``transactions`` (default) or ``per_key``. With ``transactions`` a
  micro-batch, and a batch read to ``endingOffsets=latest``, ends at the newest consistent cut
  of each source it reads (``kappaflow.connectors.cuts``: the partitions' end offsets the
  capture recorded at a source transaction boundary), so it never holds part of a source
  transaction; topics of a source that recorded no cut are read to their end. ``per_key``
  reads to the log's end (lowest latency; order and completeness hold per key only).
- ``ledgerKeys``: JSON ``{"<ledger source>.": {"name": ..., "dsn": ..., "schema": ...,
  "password_env": ...}}``: records of topics with that prefix have their personal fields
  decrypted through the ledger's key table as they are read (or the forgotten marker); see
  `kappaflow.ledger.personal`. No secrets in the option: a password comes from the environment.
- ``latestPerKey``: ``true`` yields only the last record of each key within each Spark
  partition (what compaction keeps); with one Spark partition per log partition that is
  each key's latest record, all a latest-row or group-by fold needs. ``superseded`` counts
  the records each one replaced.

Why a Python data source: both log backends (embedded SQLite and Kafka) are read by
kappaflow's own ``Log`` contract, so the same code path feeds Spark on a laptop and on
a cluster, and records arrive in the JVM as Arrow batches (no per-row pickling).
The stream offset is ``{topic: {partition: next_offset}}``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from kappaflow.errors import ConfigError, LogError

FORMAT = "kappaflow"
SCHEMA_DDL = (
    "topic string, partition int, offset bigint, key binary, value binary, timestamp timestamp, op string, "
    "superseded int"
)
ARROW_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("op", pa.string()),
        ("superseded", pa.int32()),
    ]
)
READ_CHUNK = 20_000

Offsets = dict[str, dict[int, int]]  # topic -> partition -> offset


# ---------------------------------------------------------------------------------------------
# Log handles: one per (url, options) per process. Spark reuses Python workers, and opening a
# Kafka client costs a metadata round trip, so handles are cached for the worker's lifetime.
_LOGS: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
_LOGS_LOCK = threading.Lock()


# Options of `open_log` that are tables: carried as one data source option per entry.
_TABLE_OPTIONS = ("security", "client_options", "producer_options", "consumer_options")


def log_options_to_spark(options: Mapping[str, Any]) -> dict[str, str]:
    """`open_log` keyword arguments as data source options ``kafka.<name>`` with JSON values.

    Tables (security, producer/consumer options) become one option per entry,
    ``kafka.<name>.<key>``: an entry holding a password then has "password" in its option
    name, and Spark redacts such options wherever it shows a plan or its UI.
    """
    out: dict[str, str] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            for key, item in value.items():
                out[f"kafka.{name}.{key}"] = json.dumps(item)
        else:
            out[f"kafka.{name}"] = json.dumps(value)
    return out


def _client_options(options: Mapping[str, str]) -> dict[str, Any]:
    """The inverse of `log_options_to_spark` (a hand-written plain value, e.g. ``kafka.client=confluent``,
    is taken as text, digits as an integer)."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if not k.lower().startswith("kafka."):
            continue
        name = k[len("kafka.") :]
        try:
            value = json.loads(v) if isinstance(v, str) else v
        except ValueError:
            value = int(v) if v.isdigit() else v
        head, _, key = name.partition(".")
        if key and head in _TABLE_OPTIONS:
            out.setdefault(head, {})[key] = value
        else:
            out[name] = value
    return out


def open_reader(url: str, client_options: Mapping[str, Any] | None = None) -> Any:
    """A Log opened for reading: embedded logs read-only (the capture process is the one
    writer), Kafka with the given client options."""
    from kappaflow.log import open_log

    if url.startswith("kafka://"):
        return open_log(url, **(client_options or {}))
    return open_log(url, read_only=True)


def open_cached_log(url: str, client_options: Mapping[str, Any] | None = None) -> Any:
    """The process-wide reader Log for `url` (opened on first use)."""
    opts = tuple(sorted((k, str(v)) for k, v in (client_options or {}).items()))
    key = (url, opts)
    with _LOGS_LOCK:
        log = _LOGS.get(key)
        if log is None:
            log = _LOGS[key] = open_reader(url, client_options)
        return log


_CUTS: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}


def cached_cut_index(url: str, client_options: Mapping[str, Any] | None = None) -> Any:
    """The process-wide `CutIndex` of the log at `url` (reads the offsets topic incrementally)."""
    from kappaflow.connectors.cuts import CutIndex

    opts = tuple(sorted((k, str(v)) for k, v in (client_options or {}).items()))
    log = open_cached_log(url, client_options)
    with _LOGS_LOCK:
        index = _CUTS.get((url, opts))
        if index is None or index.log is not log:
            index = _CUTS[(url, opts)] = CutIndex(log)
        return index


def consistent_end_offsets(url: str, client_options: Mapping[str, Any] | None, topics: list[str],
                           begin: Mapping[str, Mapping[int, int]] | None = None,
                           budget: int | None = None) -> Offsets:
    """The log's end offsets of `topics`, capped at the newest consistent cut of each source
    (`kappaflow.connectors.cuts.consistent_ends`); `begin`: the reader's start (default 0)."""
    from kappaflow.connectors.cuts import consistent_ends

    index = cached_cut_index(url, client_options)
    index.refresh()  # first: every cut read is then at or below the end offsets read next
    log = index.log
    ends = {t: dict(log.end_offsets(t)) for t in topics}
    check_not_behind(begin or {}, ends)
    return consistent_ends(index, topics, begin or {}, ends, budget)


def check_not_behind(begin: Mapping[str, Mapping[int, int]], ends: Mapping[str, Mapping[int, int]]) -> None:
    for topic, parts in ends.items():
        for p, e in parts.items():
            s = begin.get(topic, {}).get(p, 0)
            if e < s:
                raise LogError(
                    f"log end offset {e} of {topic}[{p}] is behind the stream position {s}: the topic was "
                    "recreated or truncated; delete the checkpoint and replay the projection"
                )


def forget_cached_log(url: str) -> None:
    """Close and drop cached handles for `url` (after an error, so the next use reconnects)."""
    with _LOGS_LOCK:
        for key in [k for k in _CUTS if k[0] == url]:
            del _CUTS[key]
        for key in [k for k in _LOGS if k[0] == url]:
            log = _LOGS.pop(key)
            try:
                log.close()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------
def parse_topics(value: str | None) -> list[str]:
    topics = [t.strip() for t in (value or "").split(",") if t.strip()]
    if not topics:
        raise ConfigError("kappaflow data source option 'topics': expected a comma-separated list of topic names")
    if len(set(topics)) != len(topics):
        raise ConfigError(f"kappaflow data source option 'topics': duplicate topic in {value!r}")
    return topics


def parse_offsets(option: str, value: str | None, default: str) -> str | Offsets:
    """'earliest' / 'latest' or a JSON object {topic: {partition: offset}}."""
    text = (value or default).strip()
    if text in ("earliest", "latest"):
        return text
    try:
        raw = json.loads(text)
    except ValueError:
        raise ConfigError(
            f"kappaflow data source option {option!r}: expected 'earliest', 'latest' or JSON like "
            f'{{"topic": {{"0": 42}}}}, got {text[:200]!r}'
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"kappaflow data source option {option!r}: expected a JSON object, got {text[:200]!r}")
    out: Offsets = {}
    for topic, parts in raw.items():
        if not isinstance(parts, dict):
            raise ConfigError(
                f"kappaflow data source option {option!r}.{topic}: expected an object of partition -> offset"
            )
        out[topic] = {}
        for p, off in parts.items():
            try:
                pi = int(p)
            except ValueError:
                raise ConfigError(
                    f"kappaflow data source option {option!r}.{topic}: partition {p!r} is not an integer"
                ) from None
            if not isinstance(off, int) or isinstance(off, bool) or off < -2:
                raise ConfigError(
                    f"kappaflow data source option {option!r}.{topic}.{p}: expected an offset >= 0 "
                    f"(or -2 earliest / -1 latest), got {off!r}"
                )
            out[topic][pi] = off
    return out


def offsets_to_json(offsets: Mapping[str, Mapping[int, int]]) -> str:
    return json.dumps({t: {str(p): o for p, o in sorted(parts.items())} for t, parts in sorted(offsets.items())})


def _resolve(log: Any, topics: list[str], spec: str | Offsets, *, end: bool) -> Offsets:
    """Concrete offsets per partition for 'earliest'/'latest'/JSON (missing partitions: start/end)."""
    out: Offsets = {}
    for topic in topics:
        n = log.partitions(topic)
        given = spec.get(topic, {}) if isinstance(spec, dict) else {}
        ends: dict[int, int] | None = None
        out[topic] = {}
        for p in range(n):
            off = given.get(p)
            want_latest = spec == "latest" or off == -1 or (off is None and end)
            if want_latest:
                if ends is None:
                    ends = log.end_offsets(topic)
                out[topic][p] = ends[p]
            elif off is None or off == -2:
                out[topic][p] = 0
            else:
                out[topic][p] = off
        unknown = set(given) - set(range(n))
        if unknown:
            raise ConfigError(
                f"kappaflow data source: topic {topic!r} has {n} partitions, no partition {sorted(unknown)}"
            )
    return out


# ---------------------------------------------------------------------------------------------
class LogRange(InputPartition):
    """One Spark partition: offsets [start, end) of one log partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"LogRange({self.topic!r}, {self.partition}, {self.start}, {self.end})"


def plan_ranges(start: Offsets, end: Offsets, max_per_split: int | None) -> list[LogRange]:
    out: list[LogRange] = []
    for topic in sorted(end):
        for p in sorted(end[topic]):
            s, e = start.get(topic, {}).get(p, 0), end[topic][p]
            if e <= s:
                continue
            step = max_per_split or (e - s)
            for a in range(s, e, step):
                out.append(LogRange(topic, p, a, min(e, a + step)))
    return out


# A chunk of records as columns: offsets, keys, values, timestamps (ms), header blobs or
# decoded header tuples. Both read paths below produce it.
Columns = tuple[list[int], list[Any], list[Any], list[int], list[Any]]


def _record_chunks(log: Any, rng: LogRange, chunk: int, start: int | None = None) -> Iterator[Columns]:
    """Through the Log contract: ``read()`` in chunks (any backend)."""
    offset = rng.start if start is None else start
    topic = rng.topic
    while offset < rng.end:
        try:
            recs = log.read(topic, rng.partition, offset, min(chunk, rng.end - offset))
        except LogError as exc:
            raise LogError(f"reading {topic}[{rng.partition}] at offset {offset}: {exc}", retry=exc.retry) from exc
        if not recs:
            break
        if recs[-1].offset >= rng.end:
            recs = [r for r in recs if r.offset < rng.end]
            if not recs:
                break
        yield (
            [r.offset for r in recs],
            [r.key for r in recs],
            [r.value for r in recs],
            [r.timestamp_ms for r in recs],
            [r.headers for r in recs],
        )
        offset = recs[-1].offset + 1


def _chunks(log: Any, rng: LogRange, chunk: int) -> Iterator[Columns]:
    """The log's columnar read where it has one (the embedded log and the confluent Kafka
    client: about half the cost per record, no LogRecord per record, headers as the log keeps
    them for `_op_of`), else ``read()`` through the contract."""
    if not hasattr(log, "read_columns"):
        yield from _record_chunks(log, rng, chunk)
        return
    try:
        for cols in log.read_columns(rng.topic, rng.partition, rng.start, rng.end,
                                     batches_per_fetch=max(1, chunk // 1024)):
            yield cols.offsets, cols.keys, cols.values, cols.timestamps_ms, cols.headers
    except LogError as exc:
        raise LogError(f"reading {rng.topic}[{rng.partition}]: {exc}", retry=exc.retry) from exc


_OP_TEXT: dict[bytes, str | None] = {}
_OP_PREFIX = b"\x05\x00kf.op\x01\x00\x00\x00"


def _op_of(headers: Any) -> str | None:
    """The ``kf.op`` header: from decoded header tuples, or from an embedded header blob
    (``u16 name length, name, i32 value length, value``; kappaflow writes kf.op first)."""
    if not headers:
        return None
    if isinstance(headers, bytes):
        if headers.startswith(_OP_PREFIX):
            v = headers[11:12]
        else:
            from kappaflow.log.embedded.codec import decode_headers

            return _op_of(decode_headers(headers))
    else:
        found: bytes | None = None
        for hk, hv in headers:
            if hk == "kf.op":
                found = hv
                break
        if found is None:
            return None
        v = found
    op = _OP_TEXT.get(v, "")
    if op == "":
        op = _OP_TEXT[v] = str(v.decode("ascii", "replace"))
    return op


@functools.cache
def _zero() -> pa.Scalar:
    """Made on first use: ``pa.scalar`` imports pandas (~40 MB), which the planning side of a
    stream -- one Python process per streaming query, that never reads records -- does without."""
    return pa.scalar(0, pa.int32())


def _batch(topic: str, partition: int, cols: Columns, superseded: list[int] | None = None) -> pa.RecordBatch:
    offsets, keys, values, ts, heads = cols
    n = len(offsets)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([topic] * n, pa.string()),
            pa.array([partition] * n, pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([x * 1000 for x in ts], pa.timestamp("us", tz="UTC")),
            pa.array([_op_of(h) for h in heads], pa.string()),
            pa.repeat(_zero(), n) if superseded is None else pa.array(superseded, pa.int32()),
        ],
        schema=ARROW_SCHEMA,
    )


def read_range(
    log: Any, rng: LogRange, chunk: int = READ_CHUNK, *, latest_per_key: bool = False
) -> Iterator[pa.RecordBatch]:
    """Arrow batches of the records in `rng` (compaction gaps are simply absent).

    ``latest_per_key``: only the last record of each key in the range (keyless records
    are all kept), in offset order, i.e. what compaction would keep. Every record of a
    key lives in one partition, so when a Spark partition covers a whole log partition
    this IS each key's latest record, and folds that only need current rows (latest row,
    group by) skip parsing and shuffling the superseded ones.
    """
    if not latest_per_key:
        for cols in _chunks(log, rng, chunk):
            yield _batch(rng.topic, rng.partition, cols)
        return
    latest: dict[Any, tuple[int, Any, int, Any]] = {}
    keyless: list[tuple[int, Any, Any, int, Any]] = []
    seen: Counter[Any] = Counter()  # records per key (C-level counting), for `superseded`
    for offsets, keys, values, ts, heads in _chunks(log, rng, chunk):
        seen.update(keys)
        if None in keys:
            keyless += [
                (o, None, v, t, h) for o, k, v, t, h in zip(offsets, keys, values, ts, heads, strict=True) if k is None
            ]
        # dict.update keeps the last value per key: one C-level pass per chunk
        latest.update(zip(keys, zip(offsets, values, ts, heads, strict=True), strict=True))
    latest.pop(None, None)
    survivors = sorted([(o, k, v, t, h) for k, (o, v, t, h) in latest.items()] + keyless, key=_first)
    for i in range(0, len(survivors), chunk):
        part = survivors[i : i + chunk]
        out: Columns = (
            [r[0] for r in part],
            [r[1] for r in part],
            [r[2] for r in part],
            [r[3] for r in part],
            [r[4] for r in part],
        )
        yield _batch(rng.topic, rng.partition, out, [0 if r[1] is None else seen[r[1]] - 1 for r in part])


def _first(r: tuple[Any, ...]) -> Any:
    return r[0]


# ---------------------------------------------------------------------------------------------
class _Options:
    def __init__(self, options: Mapping[str, str]) -> None:
        opts = {k.lower(): v for k, v in options.items()}
        url = opts.get("log")
        if not url:
            raise ConfigError("kappaflow data source option 'log': expected the log URL (a path or kafka://host:port)")
        self.url: str = url
        self.client = _client_options(options)
        self.topics = parse_topics(opts.get("topics"))
        self.starting = parse_offsets("startingOffsets", opts.get("startingoffsets"), "earliest")
        self.ending = parse_offsets("endingOffsets", opts.get("endingoffsets"), "latest")
        self.max_per_split = _positive(opts, "maxRecordsPerPartition")
        self.latest_per_key = opts.get("latestperkey", "false").strip().lower() in ("true", "1", "yes")
        self.max_per_trigger = _positive(opts, "maxRecordsPerTrigger")
        self.ledger_keys = parse_ledger_keys(opts.get("ledgerkeys"))
        self.consistent = parse_consistency(opts.get("consistency")) == "transactions"

    def log(self) -> Any:
        return open_cached_log(self.url, self.client)

    def keys_for(self, topic: str) -> Any:
        """The key store of the ledger whose topic this is, or None (not a ledger topic)."""
        for prefix, spec in self.ledger_keys.items():
            if topic.startswith(prefix):
                return _keystore(spec)
        return None


CONSISTENCY = ("transactions", "per_key")


def parse_consistency(value: str | None) -> str:
    text = (value or "transactions").strip().lower()
    if text not in CONSISTENCY:
        raise ConfigError(f"kappaflow data source option 'consistency': expected 'transactions' or 'per_key', "
                          f"got {value!r}")
    return text


def parse_ledger_keys(value: str | None) -> dict[str, dict[str, str]]:
    if not value:
        return {}
    try:
        parsed = json.loads(value)
        ok = isinstance(parsed, dict) and all(isinstance(v, dict) and v.get("dsn") for v in parsed.values())
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError("kappaflow data source option 'ledgerKeys': expected JSON "
                          '{"<source>.": {"name": ..., "dsn": ..., "schema": ...}}')
    return parsed


_KEYSTORES: dict[str, Any] = {}


def _keystore(spec: Mapping[str, str]) -> Any:
    key = json.dumps(spec, sort_keys=True)
    ks = _KEYSTORES.get(key)
    if ks is None:
        from kappaflow.config import LedgerSourceConfig
        from kappaflow.ledger.personal import KeyStore

        cfg = LedgerSourceConfig(name=spec.get("name", "ledger"), dsn=spec["dsn"],
                                 schema_name=spec.get("schema", "kappaflow_ledger"),
                                 password_env=spec.get("password_env"))
        ks = _KEYSTORES[key] = KeyStore.connect(cfg.connect_dsn(), cfg.schema_name)
    return ks


def _revealed(batches: Iterator[pa.RecordBatch], keys: Any) -> Iterator[pa.RecordBatch]:
    """Ledger records with personal fields decrypted (one key lookup per batch, none without)."""
    from kappaflow.ledger.personal import reveal_log_values

    idx = ARROW_SCHEMA.get_field_index("value")
    for batch in batches:
        values = batch.column(idx).to_pylist()
        new = reveal_log_values(values, keys)
        if new is values:
            yield batch
            continue
        cols = list(batch.columns)
        cols[idx] = pa.array(new, pa.binary())
        yield pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)


def _positive(opts: Mapping[str, str], name: str) -> int | None:
    v = opts.get(name.lower())
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"kappaflow data source option {name!r}: expected an integer >= 1, got {v!r}")
    return n


class KappaflowDataSource(DataSource):
    """``spark.read.format("kappaflow")`` and ``spark.readStream.format("kappaflow")``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return _BatchReader(_Options(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _StreamReader(_Options(self.options))


class _BatchReader(DataSourceReader):
    def __init__(self, opts: _Options) -> None:
        self.opts = opts

    def partitions(self) -> list[LogRange]:
        log = self.opts.log()
        start = _resolve(log, self.opts.topics, self.opts.starting, end=False)
        if self.opts.consistent and self.opts.ending == "latest":
            end = consistent_end_offsets(self.opts.url, self.opts.client, self.opts.topics, start)
        else:
            end = _resolve(log, self.opts.topics, self.opts.ending, end=True)
        return plan_ranges(start, end, self.opts.max_per_split)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read_with_reconnect(self.opts, partition)


def _read_with_reconnect(opts: _Options, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    if not isinstance(partition, LogRange):
        return  # Spark's placeholder partition when there is nothing to read
    try:
        log = opts.log()
    except Exception:
        forget_cached_log(opts.url)
        raise
    try:
        batches = read_range(log, partition, latest_per_key=opts.latest_per_key)
        keys = opts.keys_for(partition.topic)
        yield from batches if keys is None else _revealed(batches, keys)
    except Exception:
        forget_cached_log(opts.url)
        raise


class _StreamReader(DataSourceStreamReader):
    """Offsets are JSON-safe dicts ``{topic: {"partition": next_offset}}``."""

    def __init__(self, opts: _Options) -> None:
        self.opts = opts

    @staticmethod
    def _to_json_safe(off: Offsets) -> dict[str, dict[str, int]]:
        return {t: {str(p): o for p, o in parts.items()} for t, parts in off.items()}

    @staticmethod
    def _from_json_safe(d: Mapping[str, Mapping[str, int]]) -> Offsets:
        return {t: {int(p): int(o) for p, o in parts.items()} for t, parts in d.items()}

    def initialOffset(self) -> dict[str, dict[str, int]]:
        log = self.opts.log()
        return self._to_json_safe(_resolve(log, self.opts.topics, self.opts.starting, end=False))

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        if self.opts.max_per_trigger:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any] | None = None, limit: Any = None) -> dict[str, dict[str, int]]:
        log = self.opts.log()
        begin = self._from_json_safe(start) if start else _resolve(log, self.opts.topics, "earliest", end=False)
        max_rows = getattr(limit, "max_rows", None)
        ends: Offsets = {}
        try:
            if self.opts.consistent:
                ends = consistent_end_offsets(self.opts.url, self.opts.client, self.opts.topics, begin,
                                              int(max_rows) if max_rows else None)
            else:
                ends = {topic: dict(log.end_offsets(topic)) for topic in self.opts.topics}
                check_not_behind(begin, ends)
        except Exception:
            forget_cached_log(self.opts.url)
            raise
        if max_rows and not self.opts.consistent:
            ends = _admit(begin, ends, int(max_rows))
        return self._to_json_safe(ends)

    def reportLatestOffset(self) -> dict[str, dict[str, int]] | None:
        log = self.opts.log()
        return self._to_json_safe({t: dict(log.end_offsets(t)) for t in self.opts.topics})

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[LogRange]:
        return plan_ranges(self._from_json_safe(start), self._from_json_safe(end), self.opts.max_per_split)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read_with_reconnect(self.opts, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: kappaflow stores consumed positions with the view, not in the log."""

    def stop(self) -> None:
        forget_cached_log(self.opts.url)


def _admit(begin: Offsets, ends: Offsets, budget: int) -> Offsets:
    """At most `budget` records in total, shared among partitions in proportion to their backlog."""
    avail = {(t, p): max(0, e - begin.get(t, {}).get(p, 0)) for t, parts in ends.items() for p, e in parts.items()}
    total = sum(avail.values())
    if total <= budget:
        return ends
    out: Offsets = {t: {} for t in ends}
    for (t, p), a in avail.items():
        share = (a * budget) // total
        if a and share == 0:
            share = 1
        out[t][p] = begin.get(t, {}).get(p, 0) + min(a, share)
    return out


def register(spark: Any) -> None:
    """Register the ``kappaflow`` format with `spark` (idempotent)."""
    spark.dataSource.register(KappaflowDataSource)


__all__ = [
    "ARROW_SCHEMA",
    "FORMAT",
    "SCHEMA_DDL",
    "KappaflowDataSource",
    "LogRange",
    "consistent_end_offsets",
    "log_options_to_spark",
    "offsets_to_json",
    "open_cached_log",
    "parse_offsets",
    "plan_ranges",
    "read_range",
    "register",
]
