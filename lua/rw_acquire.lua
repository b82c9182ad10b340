-- Read-write lock acquire. All state lives in one hash (so it works on a
-- cluster), with deadlines in milliseconds by the server's own clock (TIME):
--   w          the writer's token        wexp   the writer's deadline
--   r:<token>  one reader's deadline (each reader its own field)
--   q:<token>  a waiting writer's deadline (writer preference)
-- Fields past their deadline are dropped first, so a crashed holder frees
-- the lock by itself without touching anyone else's field.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  (optional) the key's fencing counter, in the same hash slot: a
--          writer granted gets a fencing token from it (as lua/acquire.lua
--          issues them; readers get none)
-- ARGV[1]  this holder's token (a fresh UUID v4, then the holder metadata)
-- ARGV[2]  'r' to read or 'w' to write
-- ARGV[3]  the lease in milliseconds
-- ARGV[4]  readers: 1 = enter even while writers wait (prefer readers)
--          writers: how long (ms) to stay registered as waiting when refused
--          (0: do not register, a single attempt)
--
-- Returns {acquired, wait, fence, holder}:
--   {1, 0, fence, nil}  acquired; fence is the writer's fencing token with
--                  KEYS[2] (the counter after INCR, raised to the server's
--                  clock in microseconds), else 0
--   {0, ms, 0, holder}  refused; ms until the earliest deadline that could
--                  free it; holder the writer's token, else a reader's (a
--                  token: the caller keeps only its metadata), nil when
--                  only waiting writers kept a reader out
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or
-- a hash with a field no read-write lock writes (another lock type's: a
-- reentrant lock's 'owner', a semaphore's 'limit'); with FENCE when the
-- counter cannot be incremented (as lua/acquire.lua): the lock is not
-- taken then (fields past their deadline may have been dropped).
--
-- Safe to run twice: a run that finds this token already reading (its
-- field) or writing (the 'w' field), within its deadline, answers {1, 0}
-- and changes nothing: an earlier run granted it and its reply was lost (a
-- writer's fence is then the counter's value now, which only a writer's
-- grant moves, and this writer holds the lock).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] == 'w' then
  if redis.call('HGET', KEYS[1], 'w') == ARGV[1]
      and tonumber(redis.call('HGET', KEYS[1], 'wexp') or '0') > now then
    local fence = 0
    if KEYS[2] then fence = tonumber(redis.pcall('GET', KEYS[2])) or 0 end
    return {1, 0, fence, false}
  end
elseif tonumber(redis.call('HGET', KEYS[1], 'r:' .. ARGV[1]) or '0') > now then
  return {1, 0, 0, false}
end
local fields = redis.call('HGETALL', KEYS[1])
-- Another lock type's hash is refused before anything is dropped, naming
-- the type found, never its data (a field may be a token or a permit id).
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
local writer, readers, queued, soonest, latest = false, 0, 0, nil, now
local reader = false
for i = 1, #fields, 2 do
  local name, value = fields[i], fields[i + 1]
  if name ~= 'w' then
    local deadline = tonumber(value)
    if deadline == nil or deadline <= now then
      redis.call('HDEL', KEYS[1], name)
      if name == 'wexp' then redis.call('HDEL', KEYS[1], 'w') end
    else
      if deadline > latest then latest = deadline end
      local kind = string.sub(name, 1, 2)
      if name == 'wexp' then
        writer = true
        if soonest == nil or deadline < soonest then soonest = deadline end
      elseif kind == 'r:' then
        readers = readers + 1
        if not reader then reader = string.sub(name, 3) end
        if soonest == nil or deadline < soonest then soonest = deadline end
      elseif kind == 'q:' and name ~= 'q:' .. ARGV[1] then
        queued = queued + 1
      end
    end
  end
end
local lease = tonumber(ARGV[3])
local granted, fence = false, 0
if ARGV[2] == 'r' then
  granted = not writer and (queued == 0 or ARGV[4] == '1')
  if granted then
    redis.call('HSET', KEYS[1], 'r:' .. ARGV[1], now + lease)
  end
else
  granted = not writer and readers == 0
  if granted and KEYS[2] then
    -- Bumped before anything of the grant is written: a bad counter
    -- leaves no writer without a token.
    fence = redis.pcall('INCR', KEYS[2])
    if type(fence) ~= 'number' then
      return redis.error_reply('FENCE ' .. (fence.err or 'the counter cannot be incremented'))
    end
    if fence < 1 or fence >= 9007199254740992 then
      redis.call('DECR', KEYS[2])
      return redis.error_reply('FENCE the counter is negative, or at 2^53 or above')
    end
    local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
    if fence < floor then
      fence = floor
      redis.call('SET', KEYS[2], string.format('%.0f', fence))
    end
  end
  if granted then
    redis.call('HSET', KEYS[1], 'w', ARGV[1], 'wexp', now + lease)
    redis.call('HDEL', KEYS[1], 'q:' .. ARGV[1])
  elseif tonumber(ARGV[4]) > 0 then
    local until_ms = now + tonumber(ARGV[4])
    redis.call('HSET', KEYS[1], 'q:' .. ARGV[1], until_ms)
    if until_ms > latest then latest = until_ms end
  end
end
if granted and now + lease > latest then latest = now + lease end
if redis.call('HLEN', KEYS[1]) > 0 then
  redis.call('PEXPIREAT', KEYS[1], latest)
end
if granted then return {1, 0, fence, false} end
local holder = reader
if writer then holder = redis.call('HGET', KEYS[1], 'w') end
return {0, (soonest or now) - now, 0, holder}
