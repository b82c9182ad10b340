-- Multi-key extension: set a new time to live on every key of the set, all
-- or none, only if every key still holds our token. PEXPIRE never creates a
-- key, so an expired part of the set is never brought back, and a set with
-- a part lost is not extended at all (it is lost).
--
-- KEYS[1..n]  the lock keys (one hash slot on Redis Cluster)
-- ARGV[1]  the token written by this owner's acquisition
-- ARGV[2]  the new time to live in milliseconds (a positive integer)
--
-- Returns (as lua/extend.lua, so the watchdog reads both alike):
--    1  extended: every key now expires ARGV[2] ms from now
--    0  nothing extended: a key does not exist (its lease expired)
--   -1  nothing extended: a key holds another owner's token
-- Errors with WRONGTYPE, changing nothing, when a key holds a non-string
-- value.
--
-- Safe to run twice: the second run sets the same lease again.
local gone = false
for i = 1, #KEYS do
  local current = redis.call('GET', KEYS[i])
  if current == false then
    gone = true
  elseif current ~= ARGV[1] then
    return -1
  end
end
if gone then return 0 end
for i = 1, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return 1
