-- Server-side reentrant acquire (seed 001, after Redisson): the lock is a
-- hash whose one field is the owner and whose value is the hold count.
-- Taking it when free, or again as its owner, increments the count and
-- refreshes the lease.
--
-- KEYS[1]  the lock key (a hash)
-- ARGV[1]  the owner id ("<process uuid>:<thread id>")
-- ARGV[2]  the lease in milliseconds (a positive integer)
--
-- Returns {count, pttl}:
--   {n, 0}     acquired; n is the owner's hold count now (1 = first hold)
--   {0, pttl}  held by another owner, who has pttl ms left (-1: no expiry)
-- Errors with WRONGTYPE when the key holds something other than a hash.
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {count, 0}
end
return {0, redis.call('PTTL', KEYS[1])}
