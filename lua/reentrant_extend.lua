-- Server-side reentrant lease extension (the owner-checked renewal of
-- Redisson's hash-based reentrant lock, with distinct answers): PEXPIRE
-- only if the owner still holds the hash, and never to an earlier expiry.
--
-- KEYS[1]  the lock key (a hash)
-- ARGV[1]  the owner id
-- ARGV[2]  the new lease in milliseconds (a positive integer)
--
-- Returns:
--    1  extended: the key lives at least ARGV[2] ms from now (never less
--       than it had: another hold of the owner may need longer)
--    0  not extended: the key is gone (the lease expired)
--   -1  not extended: another owner holds it
-- Errors with WRONGTYPE, changing nothing, when the key holds something
-- other than a hash, or a hash without an owner (another lock type's).
--
-- Safe to run twice: the second run sets the same lease again, or leaves
-- a later one.
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[1] then
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return 1
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
elseif owner == false then
  return redis.error_reply('WRONGTYPE the key is a hash without an owner: another lock type, not a reentrant lock')
else
  return -1
end
