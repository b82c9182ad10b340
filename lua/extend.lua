-- Owner-checked lease extension: set a new time to live on the lock key only if
-- it still holds our token. PEXPIRE never creates a key, so an expired lock is
-- never brought back.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the token written by this owner's SET NX PX
-- ARGV[2]  the new time to live in milliseconds (a positive integer)
--
-- Returns:
--    1  extended: the key now expires ARGV[2] ms from now
--    0  not extended: the key does not exist (the lease expired)
--   -1  not extended: the key holds another owner's token
-- Errors with WRONGTYPE when the key holds a non-string value; nothing changes.
--
-- Safe to run twice: the second PEXPIRE sets the same lease again.
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
elseif current == false then
  return 0
else
  return -1
end
