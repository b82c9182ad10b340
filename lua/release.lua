-- Owner-checked release: delete the lock key only if it still holds our
-- token, leave a marker saying so, and announce the release to waiters
-- subscribed to the key's channel.
--
-- KEYS[1]  the lock key
-- KEYS[2]  (optional) this release's marker, {KEY}:released:<token>, in
--          the key's hash slot
-- ARGV[1]  the token written by this owner's acquisition
-- ARGV[2]  the key's release channel (redmutex:released:{tag}...)
-- ARGV[3]  how long the marker lives, in milliseconds (a positive integer)
-- ARGV[4]  (optional) 's': announce with SPUBLISH (Redis Cluster 7.0+: the
--          message stays in the key's shard); PUBLISH when absent, or when
--          the server refuses SPUBLISH
--
-- Returns one integer (an integer is the cheapest reply to send and to
-- parse):
--   n + 3    released now: the key held our token and was deleted; the
--            message reached n subscribers
--   1        released now; the message could not be sent (an ACL user
--            without the channel), so who got it is unknown
--   2        released by an earlier run of this same request, whose reply
--            was lost: its marker is there
--   0        not released: the key does not exist (the lease expired)
--   -1       not released: the key holds another owner's token
--   -2, -3   as 0 and -1, but the marker cannot be read (an ACL refuses
--            it): whether an earlier run of this request released the key
--            cannot be told
-- Errors with WRONGTYPE when the key holds a non-string value; nothing changes.
--
-- Safe to run twice: the second run finds the key gone or taken and the
-- marker there, and answers 2. The marker and the message go through
-- pcall, so a user whose ACL refuses them still releases, and a release
-- that deleted the key never turns into an error.
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then
    redis.pcall('PSETEX', KEYS[2], ARGV[3], '1')
  end
  local n
  if ARGV[4] == 's' then
    n = redis.pcall('SPUBLISH', ARGV[2], '')
  end
  if type(n) ~= 'number' then
    n = redis.pcall('PUBLISH', ARGV[2], '')
  end
  if type(n) ~= 'number' then
    return 1
  end
  return n + 3
end
local code = -1
if current == false then
  code = 0
end
if KEYS[2] then
  local marked = redis.pcall('EXISTS', KEYS[2])
  if marked == 1 then
    return 2
  elseif type(marked) ~= 'number' then
    code = code - 2
  end
end
return code
