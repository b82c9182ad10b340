-- Server-side reentrant release: remove this hold's field; delete the key
-- when no hold is left, leaving a marker and telling waiters.
--
-- KEYS[1]  the lock key (a hash)
-- KEYS[2]  (optional) this release's marker, {KEY}:released:<hold id>
-- ARGV[1]  the owner id
-- ARGV[2]  this hold's id
-- ARGV[3]  how long the marker lives, in milliseconds (a positive integer)
-- ARGV[4]  (optional) the release channel to PUBLISH on when the key is
--          deleted (absent: no message)
-- ARGV[5]  (optional) 's': announce with SPUBLISH (Redis Cluster 7.0+);
--          PUBLISH when absent, or when the server refuses SPUBLISH
--
-- Returns:
--   nil  not the owner: the hash belongs to someone else
--    -1  the key is gone: the lease expired
--     0  still held: other holds of this owner remain
--     1  released: this was the last hold and the key was deleted (also
--        when an earlier run of this same request did it: its marker is
--        there)
--    -2, -3  as -1 and nil, but the marker cannot be read (an ACL refuses
--        it): whether an earlier run of this request released the key
--        cannot be told
-- Errors with WRONGTYPE, changing nothing, when the key holds something
-- other than a hash, or a hash without an owner (another lock type's).
--
-- Safe to run twice: the field is removed once; a second run finds it gone
-- and answers from what is left (or from the marker). The marker and the
-- message go through pcall, so an ACL that refuses them does not turn a
-- done release into an error; a second message only wakes a waiter early.
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner ~= ARGV[1] then
  local gone = owner == false and redis.call('EXISTS', KEYS[1]) == 0
  if owner == false and not gone then
    return redis.error_reply('WRONGTYPE the key is a hash without an owner: another lock type, not a reentrant lock')
  end
  if KEYS[2] then
    local marked = redis.pcall('EXISTS', KEYS[2])
    if marked == 1 then
      return 1
    elseif type(marked) ~= 'number' then
      if gone then
        return -2
      end
      return -3
    end
  end
  if gone then
    return -1
  end
  return nil
end
redis.call('HDEL', KEYS[1], 'h:' .. ARGV[2])
-- No hold left: only 'owner' (and the owner's 'fence') remain.
if redis.call('HLEN', KEYS[1]) - (redis.call('HGET', KEYS[1], 'fence') and 1 or 0) <= 1 then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then
    redis.pcall('PSETEX', KEYS[2], ARGV[3], '1')
  end
  if ARGV[4] then
    local n
    if ARGV[5] == 's' then
      n = redis.pcall('SPUBLISH', ARGV[4], '')
    end
    if type(n) ~= 'number' then
      redis.pcall('PUBLISH', ARGV[4], '')
    end
  end
  return 1
end
return 0
