-- Read-write lock release: remove only this holder's own field, owner-checked,
-- then keep the hash's expiry at its latest remaining deadline and tell
-- waiters. A reader can never remove another reader's field.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  (optional) this release's marker, {KEY}:released:<token>
-- ARGV[1]  this holder's token
-- ARGV[2]  'r' (a reader), 'w' (the writer), 'q' (a writer gives up
--          waiting) or 'x' (cleanup: every field of this token, whatever it
--          is: a reader, the writer, a waiting writer)
-- ARGV[3]  the release channel to PUBLISH on
-- ARGV[4]  how long the marker lives, in milliseconds (a positive integer)
-- ARGV[5]  (optional) 's': announce with SPUBLISH (Redis Cluster 7.0+: the
--          message stays in the key's shard); PUBLISH when absent, or when
--          the server refuses SPUBLISH
--
-- Returns:
--    1  released (by this run, or by an earlier run of this same request
--       whose reply was lost: its marker is there)
--    0  not released: this holder's field is gone (the lease expired)
--   -1  not released: another writer holds the write lock
--   -2, -3  as 0 and -1, but the marker cannot be read (an ACL refuses
--       it): whether an earlier run of this request released cannot be
--       told
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or
-- a hash with a field no read-write lock writes (another lock type's).
--
-- Safe to run twice: a field is removed once, and a release that removed
-- one leaves a marker for a second run to find. The marker and the message
-- go through pcall, so an ACL that refuses them does not turn a done
-- release into an error.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Another lock type's hash is refused before anything is removed (its
-- fields are no deadlines: the expiry recomputed below would delete it).
-- Named by its type, never its data (a field may be a token or a permit
-- id).
local before = redis.call('HGETALL', KEYS[1])
local foreign, found = false, 'another program'
for i = 1, #before, 2 do
  local name, kind = before[i], string.sub(before[i], 1, 2)
  if name ~= 'w' and name ~= 'wexp' and kind ~= 'r:' and kind ~= 'q:' then
    foreign = true
    if name == 'limit' or kind == 'p:' then
      found = 'a semaphore'
    elseif name == 'owner' and found ~= 'a semaphore' then
      found = 'a reentrant lock'
    end
  end
end
if foreign then
  return redis.error_reply('WRONGTYPE the key is a hash of ' .. found .. ', not a read-write lock')
end
local result = 0
local writer = redis.call('HGET', KEYS[1], 'w')
if ARGV[2] == 'w' or ARGV[2] == 'x' then
  local deadline = tonumber(redis.call('HGET', KEYS[1], 'wexp') or '0')
  if writer == ARGV[1] then
    redis.call('HDEL', KEYS[1], 'w', 'wexp')
    if deadline > now then result = 1 end
  elseif writer and ARGV[2] == 'w' then
    result = -1
  end
end
if ARGV[2] ~= 'w' then
  local kinds = {ARGV[2]}
  if ARGV[2] == 'x' then kinds = {'r', 'q'} end
  for _, kind in ipairs(kinds) do
    local field = kind .. ':' .. ARGV[1]
    local deadline = tonumber(redis.call('HGET', KEYS[1], field) or '0')
    if redis.call('HDEL', KEYS[1], field) == 1 and deadline > now then
      result = 1
    end
  end
end
-- Recompute the hash's expiry from what is left.
local fields = redis.call('HGETALL', KEYS[1])
local latest = nil
for i = 1, #fields, 2 do
  if fields[i] ~= 'w' then
    local deadline = tonumber(fields[i + 1])
    if deadline and (latest == nil or deadline > latest) then latest = deadline end
  end
end
if latest == nil or latest <= now then
  redis.call('DEL', KEYS[1])
else
  redis.call('PEXPIREAT', KEYS[1], latest)
end
if result == 1 then
  if KEYS[2] and ARGV[2] ~= 'q' then
    redis.pcall('PSETEX', KEYS[2], ARGV[4], '1')
  end
  if ARGV[2] ~= 'q' then
    local n
    if ARGV[5] == 's' then
      n = redis.pcall('SPUBLISH', ARGV[3], '')
    end
    if type(n) ~= 'number' then
      redis.pcall('PUBLISH', ARGV[3], '')
    end
  end
elseif KEYS[2] then
  local marked = redis.pcall('EXISTS', KEYS[2])
  if marked == 1 then
    result = 1
  elseif type(marked) ~= 'number' then
    result = result - 2
  end
end
return result
