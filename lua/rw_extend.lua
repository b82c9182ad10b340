-- Read-write lock renewal: gives one holder's field (a reader's, or the
-- writer's) a later deadline, by the server's clock, owner-checked. Never
-- re-creates a hold that is gone (expired or released), and never moves a
-- deadline earlier (a renewal shorter than what is left changes nothing).
--
-- KEYS[1]  the lock hash
-- ARGV[1]  this holder's token
-- ARGV[2]  'r' (a reader) or 'w' (the writer)
-- ARGV[3]  the new lease in milliseconds, from now (>= 1)
--
-- Returns:
--    1  renewed (or already held for at least that long)
--    0  not held: this holder's field is gone or past its deadline
--   -1  not held: another writer holds the write lock (a writer's renewal)
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or
-- a hash with a field no read-write lock writes (another lock type's),
-- named by the type found, never by its data.
--
-- Safe to run twice: a second run sets a deadline no earlier than the
-- first's (now + lease, kept when later), and finds the same holder.
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
local field
if ARGV[2] == 'w' then
  local writer = redis.call('HGET', KEYS[1], 'w')
  if writer ~= ARGV[1] then
    if writer then return -1 end
    return 0
  end
  field = 'wexp'
else
  field = 'r:' .. ARGV[1]
end
local deadline = tonumber(redis.call('HGET', KEYS[1], field) or '0')
if deadline <= now then
  return 0
end
local wanted = now + tonumber(ARGV[3])
if wanted > deadline then
  redis.call('HSET', KEYS[1], field, wanted)
  deadline = wanted
end
-- The hash lives as long as its latest deadline (as the release keeps
-- it). A hash without an expiry (PTTL -1: made persistent from outside)
-- is left so: an expiry set from this holder's deadline alone could end
-- another holder's sooner.
local pttl = redis.call('PTTL', KEYS[1])
if pttl >= 0 and deadline > now + pttl then
  redis.call('PEXPIREAT', KEYS[1], deadline)
end
return 1
