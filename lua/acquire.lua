-- Acquire, for fenced locks and on servers that refuse SET NX with GET
-- (before 7.0; elsewhere SET NX PX GET, then PTTL when it lost): take the
-- lock if it is free (with a new fencing token when asked),
-- else say how long the holder's lease has left, so the waiter never sleeps
-- past an expiry that sends no message.
--
-- KEYS[1]  the lock key
-- KEYS[2]  (optional) the key's fencing counter, in the same hash slot
-- ARGV[1]  this acquisition's token (a fresh UUID v4, then the holder metadata;
--          see src/client/holder.rs)
-- ARGV[2]  the lease in milliseconds (a positive integer)
--
-- Returns {acquired, pttl, fence, holder}:
--   {1, 0, fence, nil}  acquired: the key now holds ARGV[1] for ARGV[2] ms. fence
--                  (0 without KEYS[2]) is the counter after INCR, raised to
--                  the server's clock in microseconds (TIME) when it is
--                  below it, and stored back: tokens never go backwards on
--                  one server, and a primary promoted after a failover
--                  that lost the last increments still issues larger ones
--                  than the old primary did, unless its clock is behind
--                  the old one's by more than the failover took.
--   {1, 0, fence, nil}  also when the key already held ARGV[1]: an earlier run of
--                  this same request set it and its reply was lost; fence is
--                  the counter's value now, which nobody can have moved
--                  since (only an acquisition bumps it).
--   {0, pttl, 0, holder}  held by another owner, who has pttl ms left (-1: no
--                  expiry); holder is their token (what SET NX GET would
--                  have answered: the caller keeps only its metadata)
-- Errors (nothing changed, the lock is not taken):
--   WRONGTYPE  the lock key holds a non-string value
--   FENCE ...  the counter cannot be incremented (not an integer, another
--              type, at its maximum, at 2^53 or above, or negative): it is bumped (and a
--              negative one put back) before the key is set, so a bad
--              counter never leaves a lock nobody holds
--
-- Safe to run twice: the second run recognises its own token.
-- (No SET NX GET: Redis 6.2 refuses NX with GET, and this script is also
-- what acquires there.)
local previous = redis.call('GET', KEYS[1])
if not KEYS[2] then
  if previous == ARGV[1] then
    return {1, 0, 0, false}
  elseif previous then
    return {0, redis.call('PTTL', KEYS[1]), 0, previous}
  end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, 0, 0, false}
end
if previous == ARGV[1] then
  return {1, 0, tonumber(redis.pcall('GET', KEYS[2])) or 0, false}
elseif previous then
  return {0, redis.call('PTTL', KEYS[1]), 0, previous}
end
local fence = redis.pcall('INCR', KEYS[2])
if type(fence) ~= 'number' then
  return redis.error_reply('FENCE ' .. (fence.err or 'the counter cannot be incremented'))
end
if fence < 1 then
  -- A negative counter: tokens must be positive and increasing. Undone.
  redis.call('DECR', KEYS[2])
  return redis.error_reply('FENCE the counter is negative')
end
if fence >= 9007199254740992 then
  -- 2^53: past it Lua's numbers (doubles) cannot tell two tokens apart.
  redis.call('DECR', KEYS[2])
  return redis.error_reply('FENCE the counter is at 2^53 or above')
end
-- The clock floor (exact: microseconds since 1970 stay below 2^53).
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
if fence < floor then
  fence = floor
  redis.call('SET', KEYS[2], string.format('%.0f', fence))
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, 0, fence, false}
