-- Semaphore release: removes this permit only (owner-checked by its id),
-- leaves a marker saying so, and announces the release to waiters.
--
-- KEYS[1]  the semaphore hash
-- KEYS[2]  (optional) this release's marker, {KEY}:released:<id>, in the
--          key's hash slot
-- ARGV[1]  the permit's id
-- ARGV[2]  the semaphore's release channel
-- ARGV[3]  how long the marker lives, in milliseconds (a positive integer)
-- ARGV[4]  (optional) 's': announce with SPUBLISH (Redis Cluster 7.0+: the
--          message stays in the key's shard); PUBLISH when absent, or when
--          the server refuses SPUBLISH
--
-- Returns {outcome, receivers}:
--   {1, n}   released now (the hash is deleted with its last permit); the
--            release message reached n subscribers
--   {2, 0}   released by an earlier run of this same request (its marker
--            is there), whose reply was lost
--   {0, 0}   not released: the permit is gone (its lease expired)
--  {-2, 0}   as 0, but the marker cannot be read (an ACL refuses it):
--            whether an earlier run released it cannot be told
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or a
-- hash without a limit (another lock type's).
--
-- Safe to run twice, and never adds capacity: a second run finds the field
-- gone (HDEL of a missing field changes nothing) and answers from the
-- marker. An expired permit is not released "again" either: its field was
-- purged or is past its deadline, and removing it frees nothing new.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mine = 'p:' .. ARGV[1]
local deadline = tonumber(redis.call('HGET', KEYS[1], mine) or '0')
local fence = 'f:' .. ARGV[1]
if deadline > now then
  if redis.call('HLEN', KEYS[1]) <= 2 then
    -- This permit and the limit: no permit outlives this one, and the
    -- hash goes whole.
    redis.call('DEL', KEYS[1])
  else
    redis.call('HDEL', KEYS[1], mine, fence)
    if redis.call('HLEN', KEYS[1]) <= 1 then
      -- Only the limit is left: as above.
      redis.call('DEL', KEYS[1])
    end
  end
  if KEYS[2] then
    redis.pcall('PSETEX', KEYS[2], ARGV[3], '1')
  end
  local receivers
  if ARGV[4] == 's' then
    receivers = redis.pcall('SPUBLISH', ARGV[2], '')
  end
  if type(receivers) ~= 'number' then
    receivers = redis.pcall('PUBLISH', ARGV[2], '')
  end
  if type(receivers) ~= 'number' then
    receivers = 0
  end
  return {1, receivers}
end
if deadline == 0 and not redis.call('HGET', KEYS[1], 'limit')
    and redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('WRONGTYPE the key is a hash without a limit: another lock type, not a semaphore')
end
if deadline > 0 then
  -- Past its deadline: purged here, as any acquire would.
  redis.call('HDEL', KEYS[1], mine, fence)
end
if KEYS[2] then
  local marker = redis.pcall('EXISTS', KEYS[2])
  if type(marker) ~= 'number' then
    return {-2, 0}
  end
  if marker == 1 then
    return {2, 0}
  end
end
return {0, 0}
