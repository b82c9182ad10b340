-- Multi-key acquire: take every key of a set, all or none, in one atomic
-- step. Each key becomes a plain lock holding the same token (so a
-- DistributedLock, `redmutex status` and the single-key scripts see it as
-- one), or nothing is written: no reader ever sees part of the set held.
--
-- KEYS[1..n]     the lock keys, in the set's order (one hash slot on Redis
--                Cluster: the caller groups a set by slot)
-- KEYS[n+1..2n]  (when ARGV[4] is '1') each key's fencing counter, in the
--                key's slot, in the same order
-- ARGV[1]  this acquisition's token (a fresh secret, then the holder metadata)
-- ARGV[2]  the lease in milliseconds (a positive integer)
-- ARGV[3]  n, how many lock keys
-- ARGV[4]  '1' to issue a fencing token per key, '0' not to
--
-- Returns {acquired, pttl, index, holder, fences}:
--   {1, 0, 0, nil, {f1..fn}}  acquired: every key now holds ARGV[1] for
--                  ARGV[2] ms; fi is key i's fencing token (the counter
--                  after INCR, raised to the server's clock in microseconds
--                  as lua/acquire.lua does), or 0 without fencing
--   {0, pttl, i, holder, {}}  key i (the first in order held by another
--                  owner) has pttl ms left (-1: no expiry); holder is its
--                  token (the caller keeps only its metadata); nothing was
--                  written
-- Errors:
--   WRONGTYPE  a key holds a non-string value: raised by GET before
--              anything is written
--   FENCE ...  a counter cannot be incremented: the keys are not set
--              (counters bumped before it keep their bump: a fencing
--              token may skip values, never repeat one)
--
-- Safe to run twice: a run that finds a key already holding ARGV[1] (an
-- earlier run of this request set it and its reply was lost) counts it as
-- taken (its expiry left as it is) and reads its counter back instead of
-- bumping it; keys of the set that expired since are taken again under the
-- same token.
local n = tonumber(ARGV[3])
local fencing = ARGV[4] == '1'
local mine = {}
for i = 1, n do
  local previous = redis.call('GET', KEYS[i])
  if previous == ARGV[1] then
    mine[i] = true
  elseif previous then
    return {0, redis.call('PTTL', KEYS[i]), i, previous, {}}
  end
end
local fences = {}
if fencing then
  local floor = nil
  for i = 1, n do
    local counter = KEYS[n + i]
    if mine[i] then
      fences[i] = tonumber(redis.pcall('GET', counter)) or 0
    else
      local fence = redis.pcall('INCR', counter)
      if type(fence) ~= 'number' then
        return redis.error_reply('FENCE ' .. (fence.err or 'the counter cannot be incremented'))
      end
      if fence < 1 then
        redis.call('DECR', counter)
        return redis.error_reply('FENCE the counter is negative')
      end
      if fence >= 9007199254740992 then
        redis.call('DECR', counter)
        return redis.error_reply('FENCE the counter is at 2^53 or above')
      end
      if floor == nil then
        local now = redis.call('TIME')
        floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
      end
      if fence < floor then
        fence = floor
        redis.call('SET', counter, string.format('%.0f', fence))
      end
      fences[i] = fence
    end
  end
else
  for i = 1, n do fences[i] = 0 end
end
-- A key already ours keeps its expiry (as lua/acquire.lua leaves its own
-- key alone): a copy of this request arriving late must not shorten a
-- lease its holder has extended since.
for i = 1, n do
  if not mine[i] then
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
  end
end
return {1, 0, 0, false, fences}
