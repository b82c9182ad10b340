-- Server-side reentrant acquire (after Redisson's hash-based reentrant
-- lock, with one field per hold so a lost reply cannot count a hold
-- twice): the lock is a hash with the field 'owner' (who holds it) and one
-- field 'h:<hold id>' per hold. Taking it when free, or again as its
-- owner, adds this hold's field and makes the lease last at least ARGV[2].
--
-- KEYS[1]  the lock key (a hash)
-- ARGV[1]  the owner id ("<process uuid>:<thread id>")
-- ARGV[2]  the lease in milliseconds (a positive integer)
-- ARGV[3]  this hold's id (a fresh UUID v4, then the holder metadata)
--
-- Returns {count, pttl}:
--   {n, 0}     acquired; n is the owner's number of holds now (1 = first)
--   {0, pttl}  held by another owner, who has pttl ms left (-1: no expiry)
-- Errors with WRONGTYPE, changing nothing, when the key holds something
-- other than a hash, or a hash without an owner (another lock type's: a
-- read-write lock or a semaphore).
--
-- The key's expiry only ever moves later: a nested hold with a shorter
-- lease never shortens the holds already there.
--
-- Safe to run twice: the second run sets the same field again and counts
-- the same holds.
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == false and redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('WRONGTYPE the key is a hash without an owner: another lock type, not a reentrant lock')
end
if owner ~= false and owner ~= ARGV[1] then
  return {0, redis.call('PTTL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'h:' .. ARGV[3], '1')
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {redis.call('HLEN', KEYS[1]) - 1, 0}
