-- Read-write lock downgrade: turns this token's write hold into a read hold
-- in one step, owner-checked, by the server's clock (TIME). No other
-- writer can enter in between: the reader's field is written before the
-- writer's fields go. Waiting writers' fields ('q:') stay, so new readers
-- still wait behind them (writer preference), but this holder is already
-- in.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  this holder's token
-- ARGV[2]  the read hold's lease in milliseconds, from now (>= 1)
-- ARGV[3]  the release channel to PUBLISH on (readers waiting may enter)
-- ARGV[4]  (optional) 's': announce with SPUBLISH (Redis Cluster 7.0+: the
--          message stays in the key's shard); PUBLISH when absent, or when
--          the server refuses SPUBLISH
--
-- Returns:
--    1  downgraded: 'w' and 'wexp' removed, 'r:<token>' set to now + lease;
--       or this token already reads (its field live) and does not write
--       (an earlier run of this request did it and its reply was lost)
--    0  not held: this token neither writes nor reads within a deadline
--   -1  not held: another writer holds the write lock
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or
-- a hash with a field no read-write lock writes (another lock type's),
-- named by the type found, never by its data.
--
-- Safe to run twice: the first run leaves this token reading and not
-- writing, which a second run answers with 1, changing nothing (the read
-- deadline it set is not moved). The message goes through pcall, so an ACL
-- that refuses it does not turn a done downgrade into an error.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fields = redis.call('HGETALL', KEYS[1])
local foreign, found = false, 'another program'
for i = 1, #fields, 2 do
  local name, kind = fields[i], string.sub(fields[i], 1, 2)
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
local reader = 'r:' .. ARGV[1]
local writer = redis.call('HGET', KEYS[1], 'w')
if writer ~= ARGV[1] then
  if tonumber(redis.call('HGET', KEYS[1], reader) or '0') > now then
    return 1
  end
  if writer then return -1 end
  return 0
end
if tonumber(redis.call('HGET', KEYS[1], 'wexp') or '0') <= now then
  return 0
end
-- The reader's field first: should the removal fail, the token still
-- holds the lock (both fields, which a cleanup release removes).
redis.call('HSET', KEYS[1], reader, now + tonumber(ARGV[2]))
redis.call('HDEL', KEYS[1], 'w', 'wexp')
-- The hash lives as long as its latest deadline (as the release keeps it).
local left = redis.call('HGETALL', KEYS[1])
local latest = now
for i = 1, #left, 2 do
  local deadline = tonumber(left[i + 1])
  if deadline and deadline > latest then latest = deadline end
end
redis.call('PEXPIREAT', KEYS[1], latest)
local n
if ARGV[4] == 's' then
  n = redis.pcall('SPUBLISH', ARGV[3], '')
end
if type(n) ~= 'number' then
  redis.pcall('PUBLISH', ARGV[3], '')
end
return 1
