-- Owner-checked release: delete the lock key only if it still holds our
-- token, and announce the release to waiters subscribed to the key's channel.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the token written by this owner's acquisition
-- ARGV[2]  the key's release channel (redmutex:released:{tag}…)
--
-- Returns:
--   {1, n}   released (the key held our token and was deleted); n is the
--            number of subscribers the release message reached
--   {0, 0}   not released: the key does not exist (the lease expired)
--   {-1, 0}  not released: the key holds another owner's token
-- Errors with WRONGTYPE when the key holds a non-string value; nothing changes.
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return {1, redis.call('PUBLISH', ARGV[2], '')}
elseif current == false then
  return {0, 0}
else
  return {-1, 0}
end
