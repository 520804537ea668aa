"""The Lua scripts of an accounting domain (``kvxfer/store/_keyspace.py`` draws its
keys), and the marker a put whose accounting failed leaves in its blob's place.

Each script touches only keys of one domain (one hash tag), given or derived from the
domain's blob-key prefix, so it runs on one Redis Cluster node; none of them reads a
blob's bytes (a blob never passes through Lua: no extra copy on the server).
"""

from __future__ import annotations

__all__ = ["PUT", "UNMARK", "TOUCH_MANY", "DELETE", "MARKER", "is_marker"]

# KEYS: blob, lru, sizes, bytes, clock. ARGV: key, size, replace (0/1), capacity (-1:
# none), blob-key prefix, marker. Returns -1 when the key is there and not replaced (the
# SET NX that follows in the transaction then writes nothing), -2 when the accounting
# failed (the marker then stands in the blob's place), else the number evicted. A value
# of another type under the blob's key (a hash, a list: not a blob) is replaced.
PUT = """
local blob, lru, sizes, total, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local key, size, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local kind = redis.call('TYPE', blob)['ok']
local exists = kind ~= 'none'
-- a value of another type (a hash, a list) is no blob: replaced, never kept
if ARGV[3] ~= '1' and kind == 'string' then return -1 end
local old = tonumber(redis.call('HGET', sizes, key) or '0')
local ok, used = pcall(redis.call, 'INCRBY', total, size - old)
if not ok then
  if not exists then redis.call('SET', blob, ARGV[6]) end
  return -2
end
if exists then redis.call('DEL', blob) end
redis.call('HSET', sizes, key, size)
redis.call('ZADD', lru, redis.call('INCR', clock), key)
local evicted = 0
if cap >= 0 then
  while used > cap do
    local oldest = redis.call('ZRANGE', lru, 0, 0)[1]
    if not oldest or oldest == key then break end
    local s = tonumber(redis.call('HGET', sizes, oldest) or '0')
    redis.call('DEL', ARGV[5] .. oldest)
    redis.call('ZREM', lru, oldest)
    redis.call('HDEL', sizes, oldest)
    used = redis.call('DECRBY', total, s)
    evicted = evicted + 1
  end
end
return evicted
"""

# KEYS: blob. ARGV: the marker PUT leaves when its accounting failed. Removes it.
UNMARK = """
if redis.call('STRLEN', KEYS[1]) == string.len(ARGV[1]) and
    redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 0
"""
#: What a put whose accounting failed leaves in its blob's place until its writer
#: removes it: a miss to every reader.
MARKER = "kvxfer: a put whose accounting failed; never a blob"
_MARKER_BYTES = MARKER.encode()


def is_marker(blob: bytes | None) -> bool:
    return blob is not None and len(blob) == len(_MARKER_BYTES) and blob == _MARKER_BYTES


# KEYS: lru, sizes, bytes, clock, then the blob of each key. ARGV: the keys. Marks
# each present blob used in turn (so a batch's keys are marked used in its order) and
# drops the bookkeeping of one that is gone (deleted or evicted by the server); returns,
# per key, whether its blob is there (1) or not (0), or 2 where a value of another type
# (a hash, a list) stands under its key: not a blob, so a miss of that key alone.
TOUCH_MANY = """
local lru, sizes, total, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local found = {}
for i, key in ipairs(ARGV) do
  found[i] = redis.call('EXISTS', KEYS[4 + i])
  if found[i] == 1 and redis.call('TYPE', KEYS[4 + i])['ok'] ~= 'string' then
    found[i] = 2  -- a value of another type: not a blob (gone), a miss of its key alone
  end
  if found[i] == 1 then
    if redis.call('ZSCORE', lru, key) then
      redis.call('ZADD', lru, 'XX', redis.call('INCR', clock), key)
    end
  else
    local s = redis.call('HGET', sizes, key)
    if s then
      redis.call('HDEL', sizes, key)
      redis.call('DECRBY', total, tonumber(s))
    end
    redis.call('ZREM', lru, key)
  end
end
return found
"""

# KEYS: blob, lru, sizes, bytes. ARGV: key. Returns whether the blob was there.
DELETE = """
local n = redis.call('DEL', KEYS[1])
local s = redis.call('HGET', KEYS[3], ARGV[1])
if s then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], tonumber(s))
end
redis.call('ZREM', KEYS[2], ARGV[1])
return n
"""
