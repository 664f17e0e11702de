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

import hashlib
import logging
import random
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import (
    VERSION,
    Positions,
    Sink,
    SinkConfig,
    Target,
    TopicPartition,
    ViewSchemaMismatch,
    ViewSpec,
    WriteResult,
)
from kappaflow.projections.sinks.changes import Change, check_batch, iter_changes
from kappaflow.projections.sinks.codec import DUMPS_OPTS, RowDecoder, encode_json, json_default
from kappaflow.projections.sinks.document import log_rejected
from kappaflow.projections.sinks.errors import LockLostError, SinkStateLostError
from kappaflow.projections.sinks.keys import MAX_VERSION, key_str, sort_key
from kappaflow.projections.sinks.lease import Lease

log = logging.getLogger(__name__)

ValueFormat = Literal["json", "hash"]
DEFAULT_MAX_KEY_BYTES = 64 * 1024
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
_LABEL_RE = re.compile(r"^[a-z0-9]{1,20}$")
_RETRYABLE = ("BUSY", "LOADING", "OOM", "TRYAGAIN", "MASTERDOWN", "READONLY")

__all__ = ["RedisSink", "RedisSinkConfig", "RedisSinkOptions", "SinkStateLostError", "get", "get_many"]

# Every script that changes a view ends its ARGV with the fence: the lock key ('' = unfenced)
# and the writer's token; the call is refused unless the lock holds that token.
_FENCE = r"""
local fk, ft = ARGV[#ARGV - 1], ARGV[#ARGV]
if fk ~= '' then
  local cur = redis.call('GET', fk)
  if cur ~= ft then
    return redis.error_reply('KFFENCED ' .. fk .. ' holds ' .. (cur or 'nothing') .. ', the writer has ' .. ft)
  end
end
"""

# KEYS[1] = the build marker, KEYS[2..] = row keys.
# ARGV[1] = row TTL in ms ("0": none), ARGV[2] = tombstone TTL in ms, ARGV[3] = number of upserts
# (they come first), ARGV[4..] = one value per row key (upserts, then tombstones), then the fence.
_WRITE_JSON = _FENCE + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('KFLOST the build marker ' .. KEYS[1] .. ' is missing')
end
local ttl, tttl, u = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ups, dels, stale = 0, 0, 0
for i = 2, #KEYS do
  local k, val = KEYS[i], ARGV[i + 2]
  local t = ttl
  local del = i - 1 > u
  if del then t = tttl end
  local old
  if t ~= '0' then old = redis.call('SET', k, val, 'PX', t, 'GET') else old = redis.call('SET', k, val, 'GET') end
  if old then
    local ov = string.match(old, '^{"_kf_v":(%d+)')
    local nv = string.match(val, '^{"_kf_v":(%d+)')
    if ov and (#ov > #nv or (#ov == #nv and ov >= nv)) then
      local ot = ttl
      if string.find(old, '^{"_kf_v":%d+,"_kf_deleted":true}$') then ot = tttl end
      if ot ~= '0' then redis.call('SET', k, old, 'PX', ot) else redis.call('SET', k, old) end
      stale = stale + 1
    elseif del then dels = dels + 1 else ups = ups + 1 end
  elseif del then dels = dels + 1 else ups = ups + 1 end
end
return {ups, dels, stale}
"""

# KEYS as above. ARGV[1] = row TTL ms, ARGV[2] = tombstone TTL ms, then per row key:
# version, n (number of field/value pairs; -1 = tombstone), then 2n field/value strings; the fence.
_WRITE_HASH = _FENCE + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('KFLOST the build marker ' .. KEYS[1] .. ' is missing')
end
local ttl, tttl = ARGV[1], ARGV[2]
local p = 3
local ups, dels, stale = 0, 0, 0
for i = 2, #KEYS do
  local k, v, n = KEYS[i], ARGV[p], tonumber(ARGV[p + 1])
  local ov = redis.call('HGET', k, '_kf_v')
  if ov and (#ov > #v or (#ov == #v and ov >= v)) then
    stale = stale + 1
  else
    redis.call('DEL', k)
    local t = ttl
    if n < 0 then
      redis.call('HSET', k, '_kf_v', v, '_kf_deleted', '1')
      t = tttl
    elseif n > 0 then
      redis.call('HSET', k, '_kf_v', v, unpack(ARGV, p + 2, p + 1 + 2 * n))
    else
      redis.call('HSET', k, '_kf_v', v)
    end
    if t ~= '0' then redis.call('PEXPIRE', k, t) end
    if n < 0 then dels = dels + 1 else ups = ups + 1 end
  end
  if n > 0 then p = p + 2 + 2 * n else p = p + 2 end
end
return {ups, dels, stale}
"""

# KEYS[1] = marker; ARGV = field/value pairs of positions, then the fence; a position never moves backwards.
_STORE_POSITIONS = _FENCE + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('KFLOST the build marker ' .. KEYS[1] .. ' is missing')
end
for i = 1, #ARGV - 2, 2 do
  local cur, v = redis.call('HGET', KEYS[1], ARGV[i]), ARGV[i + 1]
  if (not cur) or #v > #cur or (#v == #cur and v > cur) then redis.call('HSET', KEYS[1], ARGV[i], v) end
end
return 1
"""

# KEYS[1] = pointer, KEYS[2] = the new build's marker; ARGV[1] = build id, then the fence. Returns the old build.
_SWITCH = _FENCE + r"""
if redis.call('EXISTS', KEYS[2]) == 0 then
  return redis.error_reply('KFLOST the build marker ' .. KEYS[2] .. ' is missing')
end
local old = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
return old
"""

# Leases: KEYS[1] = the lock key, KEYS[2] = its generation counter; ARGV[1] = a random id, ARGV[2] = TTL
# in ms. Takes a free lock for the next generation; returns the fencing token '<generation>:<id>' or false.
_TAKE = r"""
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local t = redis.call('INCR', KEYS[2]) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], t, 'PX', ARGV[2])
return t
"""
# KEYS[1] = the lock key, ARGV[1] = the holder's token, ARGV[2] = TTL in ms.
_RENEW = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] = pointer; ARGV[1] = 'kf:{view}:', ARGV[2] = a build to read ('' = the pointer's),
# ARGV[3..] = row key suffixes. Returns false (no view) or {build, entry per key}; an entry is
# false or {type, payload}.
_READ = r"""
local b = ARGV[2]
if b == '' then b = redis.call('GET', KEYS[1]) end
if not b then return false end
local out = {b}
for i = 3, #ARGV do
  local k = ARGV[1] .. b .. ':' .. ARGV[i]
  local t = redis.call('TYPE', k)['ok']
  if t == 'string' then
    out[i - 1] = {'s', redis.call('GET', k)}
  elseif t == 'hash' then
    out[i - 1] = {'h', redis.call('HGETALL', k)}
  else
    out[i - 1] = false
  end
end
return out
"""


def _fenced(what: str, text: str) -> LockLostError:
    """KFFENCED from a script: this writer's lease on the projection lock is gone."""
    detail = text[len("KFFENCED "):]
    return LockLostError(f"redis sink: {what} refused: this writer no longer holds the projection lock ({detail}); "
                         "its lease expired or was taken over, so it must not write")


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


_SCRIPTS = {"json": _WRITE_JSON, "hash": _WRITE_HASH, "positions": _STORE_POSITIONS, "switch": _SWITCH,
            "read": _READ, "take": _TAKE, "renew": _RENEW, "release": _RELEASE}
_SHAS = {name: _sha1(src) for name, src in _SCRIPTS.items()}


def _resp(args: Sequence[bytes]) -> bytes:
    """RESP encoding of one command (arguments already bytes): several times faster than
    redis-py's generic packer for commands with thousands of arguments."""
    parts = [b"*%d\r\n" % len(args)]
    parts.extend(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    return b"".join(parts)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _evalsha(client: Any, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    import redis

    try:
        return client.evalsha(_SHAS[name], len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        client.script_load(_SCRIPTS[name])
        return client.evalsha(_SHAS[name], len(keys), *keys, *args)


class RedisSinkOptions(BaseModel):
    """Redis sink options. Sink-wide here; per view under ``view.options["redis"]`` (same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str = "kf"
    value_format: ValueFormat = "json"
    ttl_s: float | None = Field(None, gt=0)
    tombstone_ttl_s: float = Field(86_400.0, gt=0)
    max_key_bytes: int = Field(DEFAULT_MAX_KEY_BYTES, ge=64, le=512 * 1024 * 1024)
    """Longest full Redis key accepted. Redis allows 512 MB, but long keys slow every command and
    waste memory; 64 KiB is far beyond any sane view key. Longer keys are dead-lettered."""
    max_value_bytes: int = Field(64 * 1024 * 1024, ge=64, le=512 * 1024 * 1024)
    batch_keys: int = Field(1000, ge=1, le=100_000)
    batch_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    pipeline_depth: int = Field(8, ge=1, le=1000)
    scan_count: int = Field(1000, ge=10)
    max_retries: int = Field(8, ge=0)
    backoff_initial_s: float = Field(0.1, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    lock_ttl_s: float = Field(30.0, ge=1)
    """Lease of the projection lock (try_lock): renewed every third of it, expires after a kill -9."""


def _ms(seconds: float | None) -> bytes:
    return b"0" if seconds is None else b"%d" % max(1, round(seconds * 1000))


@dataclass(frozen=True)
class RedisSinkConfig(SinkConfig):
    """Picklable recipe for a RedisSink in another process (Spark executors)."""

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    fences: Mapping[str, str] = field(default_factory=dict)  # projection -> the lock holder's token

    def open(self) -> RedisSink:
        sink = RedisSink(self.url, options=dict(self.options))
        for projection, token in self.fences.items():
            sink.fence(projection, token)
        return sink


class RedisSink(Sink):
    """Views as Redis keys (see the module docstring)."""

    kind = "redis"

    def __init__(self, url_or_client: Any, *, options: RedisSinkOptions | Mapping[str, Any] | None = None) -> None:
        import redis

        if isinstance(url_or_client, str):
            self._url: str | None = url_or_client
            self.client = redis.Redis.from_url(url_or_client)
        else:
            self._url = None
            self.client = url_or_client
        self.options = (options if isinstance(options, RedisSinkOptions)
                        else _parse_options(options or {}, "redis sink options"))
        if not _PREFIX_RE.match(self.options.prefix):
            raise ConfigError(f"redis sink option 'prefix': expected letters, digits, '_', '.', '-', got "
                              f"{self.options.prefix!r}")
        self._sleep: Callable[[float], None] = time.sleep
        self._leases: dict[str, Lease] = {}
        self._fences: dict[str, str] = {}
        self.rejected_in_load: list[tuple[tuple[Any, ...], str]] = []

    @classmethod
    def from_config(cls, views: Any, **kwargs: Any) -> RedisSink:
        """From `kappaflow.config.ViewsConfig` (``redis_url``)."""
        if not getattr(views, "redis_url", None):
            raise ConfigError("views.redis_url: not set; add it to kappaflow.toml or KAPPAFLOW_VIEWS__REDIS_URL")
        return cls(views.redis_url, **kwargs)

    def config(self) -> RedisSinkConfig:
        if self._url is None:
            raise SinkError("redis sink: config() needs a sink opened from a URL, not a client object")
        return RedisSinkConfig(self._url, self.options.model_dump(), dict(self._fences))

    def close(self) -> None:
        for name in list(self._leases):
            self.unlock(name)
        try:
            self.client.close()
        except Exception:  # closing is best effort
            pass

    # --- the projection lock (one replay or follow at a time) ------------------------------
    def _lock_key(self, projection: str) -> str:
        return f"{self.options.prefix}:~lock:{projection}"  # '~' never occurs in view names

    def try_lock(self, projection: str) -> bool:
        """Take the projection's lock if free: a lease (``lock_ttl_s``) renewed in the background, so a
        holder killed with -9 releases it when the lease runs out. Each take is a new generation; the
        lease's token fences this sink's writes to the projection's views (see the module docstring)."""
        if projection in self._leases:
            return False
        key = self._lock_key(projection)
        gen_key = f"{self.options.prefix}:~lockgen:{projection}"
        ttl_ms = int(self.options.lock_ttl_s * 1000)
        sent = time.monotonic()
        raw = self._retrying("take lock", lambda: _evalsha(
            self.client, "take", [key, gen_key], [secrets.token_hex(16), ttl_ms]))
        if not raw:
            return False
        token = _s(raw)
        self._leases[projection] = Lease(
            f"redis:{projection}", self.options.lock_ttl_s,
            renew=lambda: bool(_evalsha(self.client, "renew", [key], [token, ttl_ms])),
            release=lambda: _evalsha(self.client, "release", [key], [token]), token=token, taken_at=sent)
        self._fences[projection] = token
        return True

    def unlock(self, projection: str) -> None:
        lease = self._leases.pop(projection, None)
        if lease is not None:
            if self._fences.get(projection) == lease.token:
                del self._fences[projection]
            lease.release()

    def holds_lock(self, projection: str) -> bool:
        lease = self._leases.get(projection)
        return lease is not None and lease.held

    def lock_fence(self, projection: str) -> str | None:
        lease = self._leases.get(projection)
        return lease.token if lease is not None and lease.held else None

    def fence(self, projection: str, token: str | None) -> None:
        if token is None:
            self._fences.pop(projection, None)
        else:
            self._fences[projection] = token

    def _fence_args(self, view: ViewSpec) -> tuple[bytes, bytes]:
        """The fence every view-changing script call ends with: (lock key, token), or ('', '')."""
        token = self._fences.get(view.projection)
        if token is None:
            return b"", b""
        return self._lock_key(view.projection).encode(), token.encode()

    def is_locked(self, projection: str) -> bool:
        return bool(self._retrying("read lock", lambda: self.client.exists(self._lock_key(projection))))

    # --- names and per-view options -------------------------------------------------
    def view_options(self, view: ViewSpec) -> RedisSinkOptions:
        extra = view.options.get("redis") if view.options else None
        if not extra:
            return self.options
        if not isinstance(extra, Mapping):
            raise ConfigError(f"view {view.name!r}: options['redis']: expected a table of Redis sink options")
        return _parse_options({**self.options.model_dump(), **extra}, f"view {view.name!r}: options['redis']")

    def base(self, view: ViewSpec) -> str:
        if not _NAME_RE.match(view.name):
            raise ConfigError(f"redis sink: view name {view.name!r}: expected letters, digits, '_', '.', '-'")
        return f"{self.view_options(view).prefix}:{view.name}"

    def pointer_key(self, view: ViewSpec) -> str:
        return f"{self.base(view)}:current"

    def _registry(self, view: ViewSpec) -> str:
        return f"{self.base(view)}:builds"

    def marker_key(self, view: ViewSpec, build: str) -> str:
        return f"{self.base(view)}:{build}"

    def row_key(self, view: ViewSpec, build: str, key: tuple[Any, ...] | Any) -> str:
        return f"{self.base(view)}:{build}:{key_str(key)}"

    def _build_of(self, target: Target) -> str | None:
        """The build a target writes to: the shadow's own, or the one the pointer names now."""
        if target.shadow:
            return target.name.rsplit(":", 1)[1]
        return self.live_build(target.view)

    def live_build(self, view: ViewSpec) -> str | None:
        raw = self._retrying("read pointer", lambda: self.client.get(self.pointer_key(view)))
        return None if raw is None else _s(raw)

    # --- retries --------------------------------------------------------------
    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        import redis

        opts = self.options
        delay = opts.backoff_initial_s
        attempt = 0
        while True:
            try:
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                error: Exception = exc
            except redis.ResponseError as exc:
                text = str(exc)
                if text.startswith("KFFENCED"):
                    raise _fenced(what, text) from None
                if text.startswith("KFLOST"):
                    raise SinkStateLostError(f"redis sink: {text[7:]} (the server lost its data?); re-read "
                                             f"positions and replay") from None
                if not text.startswith(_RETRYABLE):
                    raise SinkError(f"redis sink: {what} failed: {text}") from None
                error = exc
            attempt += 1
            if attempt > opts.max_retries:
                raise SinkError(f"redis sink: {what} failed after {attempt} attempts: {error}",
                                retry=Retry.TRANSIENT) from None
            log.warning("redis sink: %s failed (%s); retry %d in %.2fs", what, error, attempt, delay)
            self._sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, opts.backoff_max_s)

    # --- targets ------------------------------------------------------------------
    def _marker(self, view: ViewSpec, build: str) -> dict[str, str]:
        raw = self._retrying("read marker", lambda: self.client.hgetall(self.marker_key(view, build)))
        return {_s(k): _s(v) for k, v in raw.items()}

    def _columns_json(self, view: ViewSpec) -> str:
        return orjson.dumps({"key": list(view.key), "columns": [c.to_dict() for c in view.columns]}).decode()

    def _create_build(self, view: ViewSpec, label: str) -> str:
        build = f"{label}-{time.strftime('%Y%m%d%H%M%S', time.gmtime())}{secrets.token_hex(3)}"
        opts = self.view_options(view)
        mapping: dict[Any, Any] = {"format": opts.value_format, "created_ms": str(int(time.time() * 1000)),
                   "view": self._columns_json(view)}
        marker = self.marker_key(view, build)

        def create() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(marker, mapping=mapping)
            pipe.sadd(self._registry(view), build)
            pipe.execute()

        self._retrying("create build", create)
        return build

    def live(self, view: ViewSpec) -> Target | None:
        build = self.live_build(view)
        for _ in range(10):
            if build is None:
                return None
            if self._marker(view, build):
                return Target(view, self.base(view))
            again = self.live_build(view)  # switched meanwhile (the old marker goes first)? look again
            if again == build:
                return None  # the live build lost its marker: the view is gone (see ensure)
            build = again
        return None

    def ensure(self, view: ViewSpec) -> Target:
        """Create the pointer and a first, empty build if missing; else check the live build fits the view.

        A pointer whose build marker is gone (the server lost data) is replaced by a fresh
        build: the view then reads as empty with no positions, and is rebuilt from the log."""
        opts = self.view_options(view)
        target = Target(view, self.base(view))
        live = self.live_build(view)
        if live is not None:
            marker = self._marker(view, live)
            if marker:
                self._check_schema(view, live, marker, opts)
                return target
            log.warning("redis sink: view %s: the live build %s lost its marker (server lost data?); starting "
                        "an empty view to rebuild from the log", view.name, live)
            self._retrying("clear pointer", lambda: self.client.delete(self.pointer_key(view)))
        build = self._create_build(view, "live")
        won = self._retrying("set pointer", lambda: self.client.set(self.pointer_key(view), build, nx=True))
        if not won:  # another process created the view first: use theirs
            self._drop_build(view, build)
            return self.ensure(view)
        return target

    def _check_schema(self, view: ViewSpec, build: str, marker: Mapping[str, str], opts: RedisSinkOptions) -> None:
        problems: list[str] = []
        if marker.get("format") != opts.value_format:
            problems.append(f"values are stored as {marker.get('format')!r}, the sink is configured for "
                            f"{opts.value_format!r}")
        try:
            stored = orjson.loads(marker.get("view", "{}"))
        except orjson.JSONDecodeError:
            stored = {}
        have = {c["name"]: c for c in stored.get("columns", [])}
        for col in view.columns:
            got = have.get(col.name)
            if got is None:
                problems.append(f"column {col.name!r} is missing (the projection makes {col.type.simpleString()})")
            elif got.get("type") != col.type.jsonValue():
                problems.append(f"column {col.name!r} has type {got.get('type')!r} in Redis, the projection makes "
                                f"{col.type.simpleString()}")
        extra = [n for n in have if n not in view.column_names]
        if extra:
            problems.append(f"column(s) {extra} are not produced by the projection")
        if stored.get("key") is not None and list(stored["key"]) != list(view.key):
            problems.append(f"key is {stored['key']}, the projection's key is {list(view.key)}")
        if problems:
            raise ViewSchemaMismatch(
                f"Redis view {self.base(view)!r} (build {build}) does not match projection {view.projection!r}: "
                + "; ".join(problems) + ". Rebuild it with `kappaflow replay` (a new namespace is built and the "
                "pointer switched).")

    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        if not _LABEL_RE.match(label):
            raise ConfigError(f"redis sink: shadow label {label!r}: expected 1-20 lowercase letters or digits")
        live = self.live_build(view)
        builds = self._retrying("list builds", lambda: self.client.smembers(self._registry(view)))
        # a replay killed between the pointer switch and dropping the old build leaves that build behind;
        # the old one may be the first build (label "live", from ensure): a replay (which holds the
        # projection lock, so no ensure runs meanwhile) drops those too
        stale = (f"{label}-", "live-") if label == "shadow" else (f"{label}-",)
        for b in sorted(_s(x) for x in builds):
            if b != live and b.startswith(stale):
                self._drop_build(view, b)
        build = self._create_build(view, label)
        return Target(view, self.marker_key(view, build), shadow=True)

    def swap(self, shadow: Target) -> Target:
        """Switch the pointer to the shadow's build atomically, then remove the old namespace incrementally."""
        if not shadow.shadow:
            raise SinkError(f"redis sink: swap: {shadow.name!r} is not a shadow target")
        view = shadow.view
        build = shadow.name.rsplit(":", 1)[1]
        old = self._retrying("switch pointer", lambda: _evalsha(
            self.client, "switch", [self.pointer_key(view), self.marker_key(view, build)],
            [build, *self._fence_args(view)]))
        if old is not None and _s(old) != build:
            self._drop_build(view, _s(old))
        return Target(view, self.base(view))

    def drop(self, target: Target) -> None:
        view = target.view
        if target.shadow:
            self._drop_build(view, target.name.rsplit(":", 1)[1])
            return
        build = self.live_build(view)
        self._retrying("delete pointer", lambda: self.client.delete(self.pointer_key(view)))
        if build is not None:
            self._drop_build(view, build)

    def _drop_build(self, view: ViewSpec, build: str) -> int:
        """Marker first (writers to this build fail fast), then SCAN + UNLINK the rows in chunks."""
        self._retrying("drop marker", lambda: self.client.unlink(self.marker_key(view, build)))
        pattern = _glob_escape(f"{self.base(view)}:{build}:") + "*"
        removed = 0
        cursor = 0
        count = self.options.scan_count
        while True:
            cursor, keys = self._retrying("scan", lambda c=cursor: self.client.scan(  # type: ignore[misc]
                cursor=c, match=pattern, count=count))
            if keys:
                removed += int(self._retrying("unlink", lambda k=keys: self.client.unlink(*k)))  # type: ignore[misc]
            if int(cursor) == 0:
                break
        self._retrying("forget build", lambda: self.client.srem(self._registry(view), build))
        return removed

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
            try:
                self._send(encode(iter_changes(view, batch), view, build, opts, result), opts, result)
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
        delay = opts.backoff_initial_s
        attempt = 0
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
                    text = str(exc)
                    if isinstance(exc, redis.exceptions.NoScriptError) and not loaded:
                        loaded = True  # after a server restart: load once, then resend
                        conn.send_command("SCRIPT", "LOAD", _SCRIPTS[opts.value_format])
                        conn.read_response()
                        continue
                    if text.startswith("KFFENCED"):
                        raise _fenced("writing rows", text) from None
                    if text.startswith("KFLOST"):
                        raise SinkStateLostError(f"redis sink: {text[7:]} (the server lost its data, or the build "
                                                 f"was dropped); re-read positions and replay") from None
                    if not text.startswith(_RETRYABLE):
                        raise SinkError(f"redis sink: the write script failed: {text}") from None
                    error = exc
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    resend.extendleft(reversed(pending))
                    pending.clear()
                    conn.disconnect()
                    error = exc
                attempt += 1
                if attempt > opts.max_retries:
                    raise SinkError(f"redis sink: writing failed after {attempt} attempts: {error}",
                                    retry=Retry.TRANSIENT) from None
                log.warning("redis sink: write failed (%s); retry %d in %.2fs", error, attempt, delay)
                self._sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, opts.backoff_max_s)
        finally:
            pool.release(conn)
            result.upserted += ups
            result.deleted += dels
            result.skipped += stale

    def load(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """Bulk-load a replay's rows (one Spark partition) batch by batch; refused rows are logged by key
        and reason (``load`` returns a count only), the rest is loaded."""
        n = 0
        for b in batches:
            res = self.write(target, b if isinstance(b, pa.Table) else pa.Table.from_batches([b]))
            n += res.upserted
            if res.rejected:
                self.rejected_in_load.extend(res.rejected)
                log_rejected("redis sink", target, res.rejected)
        return n

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
            entries = self._retrying("read rows", lambda p=part, b=build: _read(  # type: ignore[misc]
                self.client, self.base(view), p, b))
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
            cursor, keys = self._retrying("scan", lambda c=cursor: self.client.scan(  # type: ignore[misc]
                cursor=c, match=pattern, count=self.options.scan_count))
            if keys:
                if fmt == "json":
                    vals = self._retrying("read rows", lambda k=keys: self.client.mget(k))  # type: ignore[misc]
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

    # --- positions ---------------------------------------------------------------------------
    def read_positions(self, target: Target) -> dict[TopicPartition, int]:
        """Next offsets stored in the build's marker; {} when there is no build (or it was lost)."""
        build = self._build_of(target)
        if build is None:
            return {}
        out: dict[TopicPartition, int] = {}
        for name, value in self._marker(target.view, build).items():
            if name.startswith("p:"):
                topic, _, part = name[2:].rpartition(":")
                out[(topic, int(part))] = int(value)
        return out

    def store_positions(self, target: Target, positions: Positions) -> None:
        build = self._build_of(target)
        if build is None:
            raise SinkStateLostError(f"redis sink: view {target.view.name!r} has no live build (lost?)")
        self._store(target.view, build, positions)

    def _store(self, view: ViewSpec, build: str, positions: Positions) -> None:
        if not positions:
            return
        args: list[Any] = []
        for (topic, partition), offset in sorted(positions.items()):
            args += [f"p:{topic}:{partition}", int(offset)]
        args += self._fence_args(view)
        self._retrying("store positions", lambda: _evalsha(
            self.client, "positions", [self.marker_key(view, build)], args))


def _hash_fields(row: Mapping[str, Any]) -> list[bytes]:
    out: list[bytes] = []
    for name, value in row.items():
        if value is None:
            continue  # an absent field is NULL
        if isinstance(value, str):
            b = value.encode()
        elif isinstance(value, bool):
            b = b"true" if value else b"false"
        elif isinstance(value, int | float):
            b = repr(value).encode()
        else:
            b = encode_json({"v": value})[5:-1]  # the value's JSON text
        out += [name.encode(), b]
    return out


def _typed_hash(view: ViewSpec, fields: Mapping[str, str]) -> dict[str, Any]:
    """Hash fields (text) -> JSON-like values RowDecoder understands."""
    from pyspark.sql import types as st

    doc: dict[str, Any] = {}
    for col in view.columns:
        v = fields.get(col.name)
        if v is None:
            continue
        t = col.type
        if isinstance(t, st.StringType | st.CharType | st.VarcharType):
            doc[col.name] = v
        elif isinstance(t, st.BooleanType):
            doc[col.name] = v == "true"
        elif isinstance(t, st.ByteType | st.ShortType | st.IntegerType | st.LongType):
            doc[col.name] = int(v)
        elif isinstance(t, st.FloatType | st.DoubleType):
            doc[col.name] = float(v)
        else:
            try:
                doc[col.name] = orjson.loads(v)
            except orjson.JSONDecodeError:
                doc[col.name] = v
    return doc


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


# ---------------------------------------------------------------------------
# the read helper for applications
# ---------------------------------------------------------------------------
def _read(client: Any, base: str, keys: Sequence[Any], build: str = "") -> list[Any]:
    """Entries for `keys` read from `build` (default: the one the pointer names), in one atomic call."""
    res = _evalsha(client, "read", [f"{base}:current"], [f"{base}:", build, *(key_str(k) for k in keys)])
    if not res:
        return [False] * len(keys)
    return list(res[1:]) + [False] * (len(keys) - (len(res) - 1))


def _plain(entry: Any) -> dict[str, Any] | None:
    if not entry:
        return None
    kind, payload = _s(entry[0]), entry[1]
    if kind == "s":
        doc = orjson.loads(payload)
        if not isinstance(doc, dict) or doc.get("_kf_deleted"):
            return None
        doc.pop("_kf_v", None)
        return doc
    out = {_s(payload[i]): _s(payload[i + 1]) for i in range(0, len(payload), 2)}
    if "_kf_deleted" in out:
        return None
    out.pop("_kf_v", None)
    return out


def get(client: Any, view: str, key: Any, *, prefix: str = "kf") -> dict[str, Any] | None:
    """The live row of `view` for `key` (a value, or a tuple for composite keys), or None.

    Follows the pointer and reads the row in one atomic script call, so it is never
    confused by a rebuild switching namespaces underneath it. JSON rows come back as
    decoded dicts, hash rows as {field: text}; kappaflow's ``_kf_v`` is removed. Usable
    with any redis-py client: ``get(redis.Redis.from_url(url), "customers", 42)``.
    """
    return _plain(_read(client, f"{prefix}:{view}", [key])[0])


def get_many(client: Any, view: str, keys: Sequence[Any], *, prefix: str = "kf") -> list[dict[str, Any] | None]:
    """Like :func:`get` for several keys, all read from the same build in one call."""
    if not keys:
        return []
    return [_plain(e) for e in _read(client, f"{prefix}:{view}", keys)]


def _parse_options(data: Mapping[str, Any], where: str) -> RedisSinkOptions:
    """Options from a mapping; a bad value is a ConfigError naming the field and what was given."""
    import pydantic

    from kappaflow.config import format_validation_error

    try:
        return RedisSinkOptions(**data)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None
