"""Redis views: version-guarded writes in a server-side script, one namespace per build, a pointer.

Keys (``kf`` is the configurable ``prefix``)
-------------------------------------------
* ``kf:{view}:current`` — the pointer: the id of the live build.
* ``kf:{view}:builds`` — a set of the view's build ids (to find leftovers).
* ``kf:{view}:{build}`` — the build's marker hash: ``format``, ``created_ms``, the view's
  columns and the stored positions (``p:{topic}:{partition}`` -> next offset to read).
* ``kf:~lock:{projection}`` — the projection lock (``try_lock``): a lease renewed in the
  background, expiring ``lock_ttl_s`` after its holder died. Its value is the holder's
  fencing token ``<generation>:<random>``; ``kf:~lockgen:{projection}`` counts generations.
* ``kf:{view}:{build}:{key}`` — one view row. ``value_format="json"`` (default): a JSON
  string ``{"_kf_v":<version>,<the row's columns>}``; ``"hash"``: a hash of the row's
  columns (text; NULLs omitted; nested values as JSON) plus ``_kf_v``. ``{key}`` is the
  key's canonical text (one column: its value; several: a JSON array). View names and
  build ids never contain ``:`` and build ids always contain ``-``, so the pointer, the
  registry and the markers can never collide with a row key.

Exactly-once in effect
----------------------
Every write carries its version (the log offset; see ``keys.py``) and goes through one
Lua script (``EVALSHA``, loaded once, reloaded on ``NOSCRIPT``) that writes a key only
if the new version is greater than the stored one; a stale or duplicate write has no
effect and is counted as skipped. Versions are compared as decimal strings (length, then
bytes): exact over the whole 63-bit range, where Lua numbers (doubles) are not. One
script call carries a chunk of keys (``batch_keys``, keys in KEYS, values in ARGV) and
``pipeline_depth`` calls are in flight while the next chunk is encoded, so the guard costs
one round trip per chunk rather than per key. JSON rows use ``SET ... GET``: the common
case (new key, or a newer version) is one command; a stale write puts the newer value
back inside the same atomic script call.

Atomic batches: a write to a live view (a follow micro-batch) sends its script calls inside one
``MULTI`` ... ``EXEC`` (``atomic_batches``, default on), so a reader -- any one command or script,
``MGET`` or :func:`get_many` -- sees the view before the batch or after it; with follow batches
ending at consistent cuts, never part of a source transaction. The calls stream as before (the
replies are ``QUEUED``); the server holds the batch until ``EXEC`` and runs it in one go (other
clients wait for that long). Builds of a shadow (no readers) skip it.

Deletes write a tombstone ``{"_kf_v":N,"_kf_deleted":true}`` that expires after
``tombstone_ttl_s`` (default 24 h, like the log's ``delete.retention.ms``): it keeps the
delete's version so an older write arriving later cannot resurrect the row. :func:`get`
and the sink's reads treat a tombstone as absent. ``ttl_s`` optionally expires rows.

Fencing: a sink that holds the projection's lock (or was given the holder's token with
``fence``) sends the lock key and its token with every script call (writes, positions, the
pointer switch); the script refuses the call (``KFFENCED`` -> :class:`LockLostError`) unless
the lock still holds that token. The check and the write are one atomic script, so a writer
whose lease expired during a partition, or was taken over, cannot write after that moment.

Each script call first checks that the build's marker exists: after the server lost its
data (restart without persistence, FLUSHALL, failover to an empty replica) the sink never
writes into an empty namespace it would then report as complete; it raises
:class:`SinkStateLostError`, ``read_positions`` reports ``{}`` and the view is rebuilt
from the log. Positions live in the marker, next to the data, for the same reason. Use a
``maxmemory-policy`` that cannot evict the pointer and markers (``noeviction`` or a
``volatile-*`` policy: they have no TTL).

Rebuild: :meth:`RedisSink.begin_shadow` creates a namespace, the replay fills it,
:meth:`RedisSink.swap` switches the pointer atomically (a script that checks the new
marker and SETs the pointer) and then removes the old namespace incrementally: marker
first (a late writer fails fast), then ``SCAN`` + ``UNLINK`` in chunks (freed in the
background). :func:`get` follows the pointer and reads the row in one script call, so a
reader never sees a namespace being removed. Scripts derive keys from the pointer, so
this sink targets standalone Redis (or Sentinel), not Redis Cluster.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import orjson
import pyarrow as pa

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import (
    VERSION,
    Positions,
    SinkConfig,
    Target,
    ViewSpec,
    WriteResult,
)
from kappaflow.projections.sinks.changes import Change, check_batch, iter_changes
from kappaflow.projections.sinks.codec import DUMPS_OPTS, RowDecoder, json_default
from kappaflow.projections.sinks.document import Backoff
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.keys import MAX_VERSION, sort_key
from kappaflow.projections.sinks.redis.codec import _hash_fields, _ms, _resp, _s, _typed_hash
from kappaflow.projections.sinks.redis.namespaces import _RETRYABLE, RedisNamespaces, _glob_escape
from kappaflow.projections.sinks.redis.options import RedisSinkOptions
from kappaflow.projections.sinks.redis.read import _read
from kappaflow.projections.sinks.redis.scripts import _SCRIPTS, _SHAS, _fenced
from kappaflow.projections.sinks.redis.settings import RedisSettings

log = logging.getLogger(__name__)


def _script_error(exc: Exception, loaded: bool) -> bool:
    """Whether a write script's error means "load the script and send again" (NOSCRIPT after a server
    restart, once); raises for the errors that end the write: fenced (:class:`LockLostError`), build
    lost (:class:`SinkStateLostError`), not retryable (:class:`SinkError`). False: retry after a backoff."""
    import redis

    text = str(exc)
    if (isinstance(exc, redis.exceptions.NoScriptError) or text.startswith("NOSCRIPT")) and not loaded:
        return True
    if text.startswith("KFFENCED"):
        raise _fenced("writing rows", text) from None
    if text.startswith("KFLOST"):
        raise SinkStateLostError(f"redis sink: {text[7:]} (the server lost its data, or the build "
                                 f"was dropped); re-read positions and replay") from None
    if not text.startswith(_RETRYABLE):
        raise SinkError(f"redis sink: the write script failed: {text}") from None
    return False


class RedisSink(RedisNamespaces):
    """Views as Redis keys (see the module docstring)."""

    kind = "redis"

    @classmethod
    def from_settings(cls, settings: RedisSettings, **kwargs: Any) -> RedisSink:
        """From ``[views.redis]`` (``url``); the sink registry's opener."""
        if not settings.url:
            raise ConfigError("views.redis.url: not set; add url under [views.redis] in kappaflow.toml or set "
                              "KAPPAFLOW_VIEWS__REDIS__URL")
        return cls(settings.url, **kwargs)

    @classmethod
    def from_config(cls, views: Any, **kwargs: Any) -> RedisSink:
        """From `kappaflow.config.ViewsConfig` (its ``redis`` settings)."""
        return cls.from_settings(views.redis, **kwargs)

    def config(self) -> SinkConfig:
        if self._url is None:
            raise SinkError("redis sink: config() needs a sink opened from a URL, not a client object")
        return SinkConfig(self.kind, RedisSettings(url=self._url), {"options": self.options.model_dump()},
                          dict(self._fences))



    # --- writes -------------------------------------------------------------------------
    def write(self, target: Target, batch: pa.Table, positions: Positions | None = None) -> WriteResult:
        """Guarded upserts/deletes, then `positions` once every chunk is acknowledged.

        Keys longer than ``max_key_bytes`` and rows that cannot be encoded are returned in
        ``rejected`` (with the version) and the rest proceeds. Raises
        :class:`SinkStateLostError` when the build's marker is gone.
        """
        view = target.view
        check_batch(view, batch, "redis sink")
        opts = self.view_options(view)
        for attempt in range(3):
            build = self._build_of(target)
            if build is None:
                raise SinkStateLostError(f"redis sink: view {view.name!r} has no live build (lost, or ensure() was "
                                         f"never called); re-read positions and replay")
            result = WriteResult()
            encode = self._encode_json if opts.value_format == "json" else self._encode_hash
            # a live view's batch is applied atomically (readers see all of it or none); a shadow has no readers
            send = self._send_atomic if opts.atomic_batches and not target.shadow else self._send
            try:
                send(encode(iter_changes(view, batch), view, build, opts, result), opts, result)
                if positions:
                    self._store(view, build, positions)
                return result
            except SinkStateLostError:
                # The live view may have been swapped under us (the old build is being dropped):
                # write again into the new one; the version guard makes the repeat harmless.
                if target.shadow or attempt == 2 or self.live_build(view) in (None, build):
                    raise
        raise AssertionError("unreachable")

    def _reject(self, result: WriteResult, key: tuple[Any, ...], reason: str) -> None:
        result.rejected.append((key, reason))

    def _encode_json(self, changes: Iterable[Change], view: ViewSpec, build: str, opts: RedisSinkOptions,
                     result: WriteResult) -> Iterator[bytes]:
        """Script calls, produced lazily (encoding overlaps with the server running earlier calls) and
        RESP-framed as they are built: EVALSHA sha n marker up_keys.. del_keys.. ttl tttl u up_vals.. del_vals.."""
        marker = self.marker_key(view, build).encode()
        prefix = f"{self.base(view)}:{build}:".encode()
        head = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in (_ms(opts.ttl_s), _ms(opts.tombstone_ttl_s)))
        fence = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in self._fence_args(view))
        lead = b"$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % _SHAS["json"].encode()
        marker_resp = b"$%d\r\n%s\r\n" % (len(marker), marker)
        max_keys, max_bytes, max_value, max_key = opts.batch_keys, opts.batch_bytes, opts.max_value_bytes, \
            opts.max_key_bytes
        dumps, default, dopts = orjson.dumps, json_default, DUMPS_OPTS
        up_keys: list[bytes] = []
        up_vals: list[bytes] = []
        del_keys: list[bytes] = []
        del_vals: list[bytes] = []
        n = nu = size = 0

        def call() -> bytes:
            nkeys = b"%d" % (n + 1)
            u = b"%d" % nu
            return b"".join([b"*%d\r\n" % (2 * n + 9), lead, b"$%d\r\n%s\r\n" % (len(nkeys), nkeys), marker_resp,
                             *up_keys, *del_keys, head, b"$%d\r\n%s\r\n" % (len(u), u), *up_vals, *del_vals,
                             fence])

        for key, ks, row, v in changes:
            if ks is None:
                self._reject(result, key, f"key: NULL in a key column (version {v})")
                continue
            rkey = prefix + ks.encode()
            lk = len(rkey)
            if type(v) is not int or not 0 <= v <= MAX_VERSION:
                self._reject(result, key, f"{VERSION}: expected an integer in 0..2^63-1, got {v!r}")
                continue
            if lk > max_key:
                self._reject(result, key, f"key: the Redis key would be {lk} bytes, longer than max_key_bytes="
                                          f"{max_key} (version {v})")
                continue
            if row is None:
                val = b'{"_kf_v":%d,"_kf_deleted":true}' % v
                del_keys.append(b"$%d\r\n%s\r\n" % (lk, rkey))
                del_vals.append(b"$%d\r\n%s\r\n" % (len(val), val))
                size += lk + 40
            else:
                try:
                    src = dumps(row, default=default, option=dopts)
                except (TypeError, orjson.JSONEncodeError) as exc:
                    self._reject(result, key, f"row: cannot encode as JSON: {exc} (version {v})")
                    continue
                val = b'{"_kf_v":%d,%s' % (v, src[1:]) if len(src) > 2 else b'{"_kf_v":%d}' % v
                lv = len(val)
                if lv > max_value:
                    self._reject(result, key, f"row: the value is {lv} bytes, more than max_value_bytes="
                                              f"{max_value} (version {v})")
                    continue
                up_keys.append(b"$%d\r\n%s\r\n" % (lk, rkey))
                up_vals.append(b"$%d\r\n%s\r\n" % (lv, val))
                nu += 1
                size += lk + lv
            n += 1
            if n >= max_keys or size >= max_bytes:
                yield call()
                up_keys, up_vals, del_keys, del_vals = [], [], [], []
                n = nu = size = 0
        if n:
            yield call()

    def _encode_hash(self, changes: Iterable[Change], view: ViewSpec, build: str, opts: RedisSinkOptions,
                     result: WriteResult) -> Iterator[bytes]:
        marker = self.marker_key(view, build).encode()
        prefix = f"{self.base(view)}:{build}:".encode()
        head = [_ms(opts.ttl_s), _ms(opts.tombstone_ttl_s)]
        fence = list(self._fence_args(view))
        sha = _SHAS["hash"].encode()
        keys: list[bytes] = []
        args: list[bytes] = []
        size = 0
        for key, ks, row, v in changes:
            if ks is None:
                self._reject(result, key, f"key: NULL in a key column (version {v})")
                continue
            rkey = prefix + ks.encode()
            if type(v) is not int or not 0 <= v <= MAX_VERSION:
                self._reject(result, key, f"{VERSION}: expected an integer in 0..2^63-1, got {v!r}")
                continue
            if len(rkey) > opts.max_key_bytes:
                self._reject(result, key, f"key: the Redis key would be {len(rkey)} bytes, longer than max_key_bytes="
                                          f"{opts.max_key_bytes} (version {v})")
                continue
            if row is None:
                keys.append(rkey)
                args += [b"%d" % v, b"-1"]
                size += len(rkey) + 24
            else:
                try:
                    fields = _hash_fields(row)
                except (TypeError, orjson.JSONEncodeError) as exc:
                    self._reject(result, key, f"row: cannot encode: {exc} (version {v})")
                    continue
                keys.append(rkey)
                args += [b"%d" % v, b"%d" % (len(fields) // 2), *fields]
                size += len(rkey) + sum(len(f) for f in fields)
            if len(keys) >= opts.batch_keys or size >= opts.batch_bytes:
                yield _resp([b"EVALSHA", sha, b"%d" % (len(keys) + 1), marker, *keys, *head, *args, *fence])
                keys, args, size = [], [], 0
        if keys:
            yield _resp([b"EVALSHA", sha, b"%d" % (len(keys) + 1), marker, *keys, *head, *args, *fence])

    def _send(self, calls: Iterable[bytes], opts: RedisSinkOptions, result: WriteResult) -> None:
        """Pipeline the script calls, `pipeline_depth` in flight. Calls not acknowledged when an error
        hits are sent again (safe: the version guard turns what was already applied into no-ops)."""
        import redis

        it = iter(calls)
        pending: deque[bytes] = deque()  # sent, reply not read yet
        resend: deque[bytes] = deque()  # to send again, first
        exhausted = False
        backoff = Backoff(self, opts)
        loaded = False
        pool = self.client.connection_pool
        conn = pool.get_connection()
        ups = dels = stale = 0
        try:
            while True:
                error: Exception
                try:
                    while len(pending) < opts.pipeline_depth:
                        if resend:
                            call = resend.popleft()
                        elif not exhausted:
                            nxt = next(it, None)
                            if nxt is None:
                                exhausted = True
                                continue
                            call = nxt
                        else:
                            break
                        pending.append(call)
                        conn.send_packed_command([call], check_health=False)
                    if not pending:
                        break
                    reply = conn.read_response()
                    loaded = False
                    pending.popleft()
                    ups, dels, stale = ups + int(reply[0]), dels + int(reply[1]), stale + int(reply[2])
                    continue
                except redis.ResponseError as exc:
                    # The oldest call failed; later calls still answer: read them before deciding.
                    failed = [pending.popleft()]
                    while pending:
                        call = pending.popleft()
                        try:
                            reply = conn.read_response()
                            ups, dels, stale = ups + int(reply[0]), dels + int(reply[1]), stale + int(reply[2])
                        except redis.ResponseError:
                            failed.append(call)
                    resend.extendleft(reversed(failed))
                    if _script_error(exc, loaded):
                        loaded = True  # after a server restart: load once, then resend
                        conn.send_command("SCRIPT", "LOAD", _SCRIPTS[opts.value_format])
                        conn.read_response()
                        continue
                    error = exc
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    resend.extendleft(reversed(pending))
                    pending.clear()
                    conn.disconnect()
                    error = exc
                backoff.wait("writing", error)
        finally:
            pool.release(conn)
            result.upserted += ups
            result.deleted += dels
            result.skipped += stale

    def _send_atomic(self, calls: Iterable[bytes], opts: RedisSinkOptions, result: WriteResult) -> None:
        """The batch's script calls inside one ``MULTI`` ... ``EXEC``: Redis runs a transaction's commands
        back to back, so any other client's command or script (a reader's ``MGET``, :func:`get_many`) sees
        the view before the batch or after it, never in between.

        Calls are still encoded lazily and streamed, ``pipeline_depth`` replies (``QUEUED``) in flight.
        The version guard and the fence stay in each script: a fenced writer's or a lost build's calls
        all fail alike (one check, one moment). A dropped connection discards the transaction (or it
        ran whole): everything is sent again in a new one. A call that failed inside an executed
        transaction while the others ran (a retryable server error) is sent again in the next
        transaction: the only case in which a reader can see part of the batch."""
        import redis

        source = iter(calls)
        head = next(source, None)
        if head is None:
            return  # nothing to write (every row refused, or an empty batch): no round trip
        todo: list[bytes] = [head]  # the calls of the transaction (produced so far), in order
        backoff = Backoff(self, opts)
        loaded = False
        pool = self.client.connection_pool
        conn = pool.get_connection()
        ups = dels = stale = 0
        clean = False  # the connection is outside MULTI (else it is dropped, not handed back mid-transaction)
        try:
            while True:
                error: Exception
                clean = False
                try:
                    replies = self._transaction(conn, todo, source, opts.pipeline_depth)
                    clean = True
                except redis.ResponseError as exc:  # the transaction was refused as a whole (EXECABORT)
                    clean = True
                    if _script_error(exc, loaded):
                        loaded = True
                        conn.send_command("SCRIPT", "LOAD", _SCRIPTS[opts.value_format])
                        conn.read_response()
                        continue
                    error = exc
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    conn.disconnect()
                    error = exc
                else:
                    failed: list[bytes] = []
                    first: Exception | None = None
                    for call, reply in zip(todo, replies, strict=True):
                        if isinstance(reply, Exception):
                            failed.append(call)
                            first = first or reply
                        else:
                            ups, dels, stale = ups + int(reply[0]), dels + int(reply[1]), stale + int(reply[2])
                    if first is None:
                        return
                    todo = failed
                    if isinstance(first, redis.ResponseError) and _script_error(first, loaded):
                        loaded = True
                        conn.send_command("SCRIPT", "LOAD", _SCRIPTS[opts.value_format])
                        conn.read_response()
                        continue
                    error = first
                backoff.wait("writing", error)
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)
            result.upserted += ups
            result.deleted += dels
            result.skipped += stale

    @staticmethod
    def _transaction(conn: Any, todo: list[bytes], source: Iterator[bytes], depth: int) -> list[Any]:
        """MULTI, the calls in `todo` and then those `source` still yields (appended to `todo`), EXEC:
        the per-call replies of the executed transaction. Raises the first error met while queueing
        (after EXEC, so the connection is left clean) or EXEC's own."""
        import redis

        queue_error: redis.ResponseError | None = None
        in_flight = 0

        def send(call: bytes) -> None:
            nonlocal in_flight, queue_error
            conn.send_packed_command([call], check_health=False)
            in_flight += 1
            while in_flight > depth:
                in_flight -= 1
                try:
                    conn.read_response()  # OK / QUEUED
                except redis.ResponseError as exc:
                    queue_error = queue_error or exc

        send(b"*1\r\n$5\r\nMULTI\r\n")
        for call in todo:
            send(call)
        for call in source:
            todo.append(call)
            send(call)
        conn.send_packed_command([b"*1\r\n$4\r\nEXEC\r\n"], check_health=False)
        while in_flight:
            in_flight -= 1
            try:
                conn.read_response()
            except redis.ResponseError as exc:
                queue_error = queue_error or exc
        try:
            replies = conn.read_response()
        except redis.ResponseError as exc:
            raise (queue_error or exc) from None
        if not isinstance(replies, list) or len(replies) != len(todo):
            raise SinkError(f"redis sink: EXEC answered {replies!r} for a transaction of {len(todo)} calls")
        return replies

    # --- reads -----------------------------------------------------------------------------
    def _decode(self, view: ViewSpec, dec: RowDecoder, raw: Any, kind: str) -> dict[str, Any] | None:
        if kind == "s":
            doc = orjson.loads(raw)
            if not isinstance(doc, dict) or doc.get("_kf_deleted"):
                return None
            return dec.row(doc, int(doc.get("_kf_v", 0)))
        fields = {_s(raw[i]): _s(raw[i + 1]) for i in range(0, len(raw), 2)} if isinstance(raw, list) else \
            {_s(k): _s(v) for k, v in raw.items()}
        if "_kf_deleted" in fields:
            return None
        return dec.row(_typed_hash(view, fields), int(fields.get("_kf_v", 0)))

    def fetch(self, target: Target, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
        view = target.view
        dec = RowDecoder(view)
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for start in range(0, len(keys), 1000):
            part = [tuple(k) for k in keys[start:start + 1000]]
            build = target.name.rsplit(":", 1)[1] if target.shadow else ""
            entries = self._retrying("read rows", functools.partial(
                _read, self.client, self.base(view), part, build))
            for key, entry in zip(part, entries, strict=True):
                if entry:
                    row = self._decode(view, dec, entry[1], _s(entry[0]))
                    if row is not None:
                        out[key] = row
        return out

    def _rows(self, target: Target) -> list[dict[str, Any]]:
        """All rows of a target. For the live view, a scan that overlapped a pointer switch (the old
        namespace may have been half removed under it) is repeated on the new build."""
        for _ in range(10):
            build = self._build_of(target)
            if build is None:
                return []
            rows = list(self._iter_rows(target, build))
            if target.shadow or self.live_build(target.view) == build:
                return rows
        raise SinkError(f"redis sink: view {target.view.name!r} was switched during every scan attempt",
                        retry=Retry.TRANSIENT)

    def _iter_rows(self, target: Target, build: str) -> Iterator[dict[str, Any]]:
        view = target.view
        dec = RowDecoder(view)
        fmt = self._marker(view, build).get("format", self.view_options(view).value_format)
        pattern = _glob_escape(f"{self.base(view)}:{build}:") + "*"
        cursor = 0
        while True:
            cursor, keys = self._retrying("scan", functools.partial(
                self.client.scan, cursor=cursor, match=pattern, count=self.options.scan_count))
            if keys:
                if fmt == "json":
                    vals = self._retrying("read rows", functools.partial(self.client.mget, keys))
                    for v in vals:
                        if v is not None and (row := self._decode(view, dec, v, "s")) is not None:
                            yield row
                else:
                    pipe = self.client.pipeline(transaction=False)
                    for k in keys:
                        pipe.hgetall(k)
                    for h in self._retrying("read rows", pipe.execute):
                        if h and (row := self._decode(view, dec, h, "h")) is not None:
                            yield row
            if int(cursor) == 0:
                return

    def scan(self, target: Target) -> Iterator[dict[str, Any]]:
        """Every row in key order (SCAN, then sorted in memory: Redis keeps no key order)."""
        dec = RowDecoder(target.view)
        yield from sorted(self._rows(target), key=lambda r: sort_key(dec.key(r)))

    def count(self, target: Target) -> int:
        return len(self._rows(target))
