-- Semaphore acquire: at most `limit` permits at once, each with its own
-- deadline by the server's clock (TIME), all in one hash (one cluster slot):
--   limit      the number of permits (stored with the semaphore)
--   p:<id>     one permit's deadline, in milliseconds of server time
--   f:<id>     (fenced permits) the permit's fencing token
-- Permits past their deadline are dropped first, so a crashed holder's
-- permit comes back by itself after its lease. The key expires with the
-- latest deadline, so nothing outlives the last holder.
--
-- KEYS[1]  the semaphore hash
-- KEYS[2]  (optional) the fencing counter, in the key's hash slot: each
--          permit granted gets the counter after INCR, raised to the
--          server's clock in microseconds when below it and stored back
--          (so a failover that lost increments cannot make tokens go
--          backwards; see acquire.lua)
-- ARGV[1]  this permit's id, chosen by the client before sending (a UUID,
--          then the holder metadata)
-- ARGV[2]  the limit this caller opened the semaphore with (>= 1)
-- ARGV[3]  the lease in milliseconds (>= 1)
--
-- Returns {acquired, wait, fence, holder}:
--   {1, 0, f, nil}  acquired (or already held by this id, see below); f is
--              the permit's fencing token (0 without KEYS[2])
--   {0, ms, 0, id}  refused: `limit` live permits; ms until the earliest
--              deadline, and id the permit whose deadline that is (a
--              token: the caller keeps only its metadata)
-- Errors, nothing changed: `LIMIT <stored>` when live permits exist under
-- another limit; WRONGTYPE when the key is not a hash, or a hash with no
-- limit or a field no semaphore writes (another lock type's: its fields
-- are never read as permits or purged). `FENCE ...` when the counter
-- cannot be incremented (bumped, and a negative one put back, before the
-- permit is written); expired permits are purged by then, which takes
-- nothing from anyone.
--
-- Safe to run twice: a run that finds `p:<id>` within its deadline answers
-- {1, 0, its stored token} and changes nothing: an earlier run granted it
-- and its reply was lost. A second permit is never taken for one id.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mine, my_fence = 'p:' .. ARGV[1], 'f:' .. ARGV[1]
local limit = tonumber(ARGV[2])
-- One read of the whole hash answers every question below (a place of
-- this id already, the stored limit, the other permits' deadlines).
local fields = redis.call('HGETALL', KEYS[1])
local has_limit, stored, foreign = false, nil, nil
local my_deadline, own = nil, 0
for i = 1, #fields, 2 do
  local name, value = fields[i], fields[i + 1]
  if name == 'limit' then
    has_limit, stored = true, tonumber(value)
  elseif name == mine then
    my_deadline = tonumber(value)
  elseif name == my_fence then
    own = tonumber(value) or 0
  else
    -- Another lock type's field: named by its type below, never by the
    -- field itself (it may be a token).
    local kind = string.sub(name, 1, 2)
    if name == 'owner' then
      foreign = 'a reentrant lock'
    elseif foreign == nil and (name == 'w' or name == 'wexp' or kind == 'r:' or kind == 'q:') then
      foreign = 'a read-write lock'
    elseif foreign == nil and kind ~= 'p:' and kind ~= 'f:' then
      foreign = 'another program'
    end
  end
end
-- Granted by an earlier run of this same request: its token again, before
-- anything else is looked at (as that run answered).
if my_deadline ~= nil and my_deadline > now then
  return {1, 0, own, false}
end
if foreign ~= nil then
  return redis.error_reply('WRONGTYPE the key is a hash of ' .. foreign .. ', not a semaphore')
end
if #fields > 0 and not has_limit then
  return redis.error_reply('WRONGTYPE the key is a hash without a limit: another lock type, not a semaphore')
end
local held, soonest, latest, first = 0, nil, now, false
local purged = {}
for i = 1, #fields, 2 do
  local name = fields[i]
  if string.sub(name, 1, 2) == 'p:' then
    local deadline = tonumber(fields[i + 1])
    if deadline == nil or deadline <= now then
      purged[#purged + 1] = name
      purged[#purged + 1] = 'f:' .. string.sub(name, 3)
    else
      held = held + 1
      if soonest == nil or deadline < soonest then
        soonest, first = deadline, string.sub(name, 3)
      end
      if deadline > latest then latest = deadline end
    end
  end
end
-- The limit binds while permits are out; with none, the caller's is taken
-- (a stored limit that is not a number binds nothing, and is replaced).
if held > 0 and stored ~= nil and stored ~= limit then
  return redis.error_reply('LIMIT ' .. tostring(stored))
end
if held > 0 and stored ~= nil then
  limit = stored
end
-- Expired permits go (in slices: Lua's unpack returns a bounded number of
-- values), whether or not this one is granted.
for i = 1, #purged, 1000 do
  redis.call('HDEL', KEYS[1], unpack(purged, i, math.min(i + 999, #purged)))
end
if held >= limit then
  return {0, soonest - now, 0, first}
end
local fence = 0
if KEYS[2] then
  fence = redis.pcall('INCR', KEYS[2])
  if type(fence) ~= 'number' then
    return redis.error_reply('FENCE ' .. (fence.err or 'the counter cannot be incremented'))
  end
  if fence < 1 then
    -- A negative counter: tokens must be positive and increasing. Undone.
    redis.call('DECR', KEYS[2])
    return redis.error_reply('FENCE the counter is negative')
  end
  if fence >= 9007199254740992 then
    -- 2^53: past it Lua's numbers (doubles) cannot tell two tokens apart.
    redis.call('DECR', KEYS[2])
    return redis.error_reply('FENCE the counter is at 2^53 or above')
  end
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if fence < floor then
    fence = floor
    redis.call('SET', KEYS[2], string.format('%.0f', fence))
  end
  redis.call('HSET', KEYS[1], 'f:' .. ARGV[1], string.format('%.0f', fence))
end
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], mine, deadline, 'limit', limit)
if deadline > latest then latest = deadline end
redis.call('PEXPIREAT', KEYS[1], latest)
return {1, 0, fence, false}
