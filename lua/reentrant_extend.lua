-- Server-side reentrant lease extension (seed 001's renewal script, with
-- distinct answers): PEXPIRE only if the owner still holds the hash.
--
-- KEYS[1]  the lock key (a hash)
-- ARGV[1]  the owner id
-- ARGV[2]  the new lease in milliseconds (a positive integer)
--
-- Returns:
--    1  extended
--    0  not extended: the key is gone (the lease expired)
--   -1  not extended: another owner holds it
-- Errors with WRONGTYPE when the key holds something other than a hash.
--
-- Safe to run twice: the second PEXPIRE sets the same lease again.
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
else
  return -1
end
