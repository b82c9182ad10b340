-- Server-side reentrant acquire (after Redisson's hash-based reentrant
-- lock, with one field per hold so a lost reply cannot count a hold
-- twice): the lock is a hash with the field 'owner' (who holds it), one
-- field 'h:<hold id>' per hold, and 'fence' (the owner's fencing token)
-- once a fenced hold drew one. Taking it when free, or again as its
-- owner, adds this hold's field and makes the lease last at least ARGV[2].
--
-- KEYS[1]  the lock key (a hash)
-- KEYS[2]  (optional) the key's fencing counter, in the same hash slot:
--          the owner's first fenced hold takes a fencing token from it (as
--          lua/acquire.lua issues them) and keeps it in the field 'fence';
--          every later hold of the owner carries that one
-- ARGV[1]  the owner id ("<process uuid>:<thread id>")
-- ARGV[2]  the lease in milliseconds (a positive integer)
-- ARGV[3]  this hold's id (a fresh UUID v4, then the holder metadata)
--
-- Returns {count, pttl, fence, holder}:
--   {n, 0, fence, nil}  acquired; n is the owner's number of holds now (1 =
--                  first); fence is the owner's fencing token with KEYS[2]
--                  (the counter after INCR, raised to the server's clock in
--                  microseconds, drawn by its first fenced hold and kept in
--                  'fence'), else 0
--   {0, pttl, 0, holder}  held by another owner, who has pttl ms left (-1:
--                  no expiry); holder is one of their hold ids (a token:
--                  the caller keeps only its metadata), nil when none is
--                  found
-- Errors with WRONGTYPE, changing nothing, when the key holds something
-- other than a hash, or a hash without an owner (another lock type's: a
-- read-write lock or a semaphore); with FENCE, changing nothing, when the
-- counter cannot be incremented (as lua/acquire.lua).
--
-- The key's expiry only ever moves later: a nested hold with a shorter
-- lease never shortens the holds already there.
--
-- Safe to run twice: the second run sets the same field again, counts the
-- same holds and finds the owner's token in 'fence' (never drawing again).
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == false and redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('WRONGTYPE the key is a hash without an owner: another lock type, not a reentrant lock')
end
if owner ~= false and owner ~= ARGV[1] then
  local holder = false
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'h:' then
      holder = string.sub(fields[i], 3)
      break
    end
  end
  return {0, redis.call('PTTL', KEYS[1]), 0, holder}
end
-- The owner's fencing token lives in the hash ('fence'): drawn by its
-- first fenced hold, carried by every later one (and found again by a
-- resend), so all of the owner's guards write with one token.
local fence, stored = 0, false
if owner == ARGV[1] then
  stored = redis.call('HGET', KEYS[1], 'fence')
end
if KEYS[2] and stored then
  fence = tonumber(stored) or 0
elseif KEYS[2] then
  fence = redis.pcall('INCR', KEYS[2])
  if type(fence) ~= 'number' then
    return redis.error_reply('FENCE ' .. (fence.err or 'the counter cannot be incremented'))
  end
  if fence < 1 or fence >= 9007199254740992 then
    redis.call('DECR', KEYS[2])
    return redis.error_reply('FENCE the counter is negative, or at 2^53 or above')
  end
  local t = redis.call('TIME')
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if fence < floor then
    fence = floor
    redis.call('SET', KEYS[2], string.format('%.0f', fence))
  end
  redis.call('HSET', KEYS[1], 'fence', string.format('%.0f', fence))
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'h:' .. ARGV[3], '1')
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
-- The holds: every field but 'owner' and 'fence'.
return {redis.call('HLEN', KEYS[1]) - 1 - (redis.call('HGET', KEYS[1], 'fence') and 1 or 0), 0, fence, false}
