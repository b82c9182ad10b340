-- Acquire, for waiters that sleep until a release message and for fenced
-- locks: take the lock if it is free (with a new fencing token when asked),
-- else say how long the holder's lease has left, so the waiter never sleeps
-- past an expiry that sends no message.
--
-- KEYS[1]  the lock key
-- KEYS[2]  (optional) the key's fencing counter, in the same hash slot
-- ARGV[1]  this acquisition's token (a fresh UUID v4)
-- ARGV[2]  the lease in milliseconds (a positive integer)
--
-- Returns {acquired, pttl, fence}:
--   {1, 0, fence}  acquired: the key now holds ARGV[1] for ARGV[2] ms. fence
--                  is the counter after INCR (0 without KEYS[2]). Also when
--                  the key already held ARGV[1]: an earlier send of this
--                  request whose reply was lost; fence is then the counter's
--                  current value, which nobody can have moved since.
--   {0, pttl, 0}   held by another owner, who has pttl ms left (-1: no expiry)
-- Errors with WRONGTYPE when the key holds a non-string value; nothing changes.
local previous = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if previous == false then
  local fence = 0
  if KEYS[2] then
    fence = redis.call('INCR', KEYS[2])
  end
  return {1, 0, fence}
elseif previous == ARGV[1] then
  local fence = 0
  if KEYS[2] then
    fence = tonumber(redis.call('GET', KEYS[2]) or '0')
  end
  return {1, 0, fence}
end
return {0, redis.call('PTTL', KEYS[1]), 0}
