-- Break-glass release: delete the lock key whatever token it holds, and
-- answer which token that was. Not owner-checked (operators only).
--
-- KEYS[1]  the lock key
-- KEYS[2]  this request's marker, {KEY}:released:<request id>, in the
--          key's hash slot
-- ARGV[1]  how long the marker lives, in milliseconds (a positive integer)
--
-- Returns the token the key held (false: it was free), deleted by this run
-- or by an earlier run of this same request.
-- Errors with WRONGTYPE when the key holds a non-string value; nothing changes.
--
-- Safe to run twice: the first run records what it deleted in its marker
-- before deleting; a second run finds the marker and answers from it,
-- deleting nothing (not a lock somebody took in between). The marker is
-- written with redis.call: if it cannot be written, nothing is deleted.
local done = redis.call('GET', KEYS[2])
if done then
  if done == '' then
    return false
  end
  return done
end
local value = redis.call('GET', KEYS[1])
redis.call('PSETEX', KEYS[2], ARGV[1], value or '')
if value then
  redis.call('DEL', KEYS[1])
end
return value
