-- Acquire for waiters that sleep until a release message: take the lock if
-- it is free, else say how long the holder's lease has left, so the waiter
-- never sleeps past an expiry that sends no message.
--
-- KEYS[1]  the lock key
-- ARGV[1]  this acquisition's token (a fresh UUID v4)
-- ARGV[2]  the lease in milliseconds (a positive integer)
--
-- Returns {acquired, pttl}:
--   {1, 0}     acquired: the key now holds ARGV[1] for ARGV[2] ms (also when
--              it already held ARGV[1]: an earlier send of this request whose
--              reply was lost)
--   {0, pttl}  held by another owner, who has pttl ms left (-1: no expiry)
-- Errors with WRONGTYPE when the key holds a non-string value; nothing changes.
local previous = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if previous == false or previous == ARGV[1] then
  return {1, 0}
end
return {0, redis.call('PTTL', KEYS[1])}
