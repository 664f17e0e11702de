"""The Redis sink's Lua scripts (loaded once, run by SHA, reloaded on ``NOSCRIPT``): version-guarded
writes of JSON and hash rows, positions, the pointer switch, the lock's lease, and the atomic read.
Every script that changes a view checks the fence first (see ``sink.py``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kappaflow.projections.sinks.errors import LockLostError

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


# KEYS[1] = the build marker; ARGV[1] = the view's columns (JSON, the marker's "view" field), then the fence.
# Schema evolution: the live build's recorded columns change, its rows and positions stay.
_EVOLVE = _FENCE + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('KFLOST the build marker ' .. KEYS[1] .. ' is missing')
end
redis.call('HSET', KEYS[1], 'view', ARGV[1])
return 1
"""

_SCRIPTS = {"json": _WRITE_JSON, "evolve": _EVOLVE, "hash": _WRITE_HASH, "positions": _STORE_POSITIONS,
            "switch": _SWITCH, "read": _READ, "take": _TAKE, "renew": _RENEW, "release": _RELEASE}
_SHAS = {name: _sha1(src) for name, src in _SCRIPTS.items()}


def _evalsha(client: Any, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    import redis

    try:
        return client.evalsha(_SHAS[name], len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        client.script_load(_SCRIPTS[name])
        return client.evalsha(_SHAS[name], len(keys), *keys, *args)
