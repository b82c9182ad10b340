-- What one key holds, for `redmutex list`: its kind, how long until it
-- frees, and how many hold it, by the server's clock, read in one step.
-- Never returns a token, an owner or a permit id.
--
-- KEYS[1]  a key found by SCAN
--
-- Returns {kind, ms, holders, limit}:
--   kind     'lock' (a string that is not a number: a plain lock's token),
--            'reentrant' (a hash with 'owner'), 'read' or 'write' (a
--            read-write lock hash held by readers or a writer),
--            'semaphore' (a hash with 'limit'), or '' for anything else
--            (a fencing counter, a release marker, another program's key,
--            a lock hash with no live holder)
--   ms       time left: the key's PTTL for a lock or reentrant lock (-1:
--            no expiry), the earliest live deadline for a read-write lock
--            or semaphore
--   holders  1 for a lock, the owner's number of holds for a reentrant
--            lock, readers (or 1 writer), permits out
--   limit    a semaphore's limit, else 0
-- Reads only (expired fields are skipped, not purged): safe to run twice.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'string' then
  if tonumber(value) ~= nil then
    return {'', 0, 0, 0}
  end
  return {'lock', redis.call('PTTL', KEYS[1]), 1, 0}
end
if type(value) ~= 'table' or not value.err then
  return {'', 0, 0, 0}
end
-- Not a string: a hash, or another type (HGETALL fails on those).
local fields = redis.pcall('HGETALL', KEYS[1])
if type(fields) ~= 'table' or fields.err or #fields == 0 then
  return {'', 0, 0, 0}
end
local values = {}
for i = 1, #fields, 2 do
  values[fields[i]] = fields[i + 1]
end
local soonest = nil
local function live(deadline)
  deadline = tonumber(deadline)
  if deadline == nil or deadline <= now then
    return false
  end
  if soonest == nil or deadline < soonest then
    soonest = deadline
  end
  return true
end
-- Fields named prefix..id whose deadline is still ahead.
local function count_live(prefix)
  local n = 0
  for name, v in pairs(values) do
    if string.sub(name, 1, 2) == prefix and live(v) then
      n = n + 1
    end
  end
  return n
end
if values['limit'] then
  local out = count_live('p:')
  if out == 0 then
    return {'', 0, 0, 0}
  end
  return {'semaphore', soonest - now, out, tonumber(values['limit']) or 0}
end
if values['owner'] then
  local holds = 0
  for name, _ in pairs(values) do
    if string.sub(name, 1, 2) == 'h:' then
      holds = holds + 1
    end
  end
  return {'reentrant', redis.call('PTTL', KEYS[1]), holds, 0}
end
if values['w'] and live(values['wexp']) then
  return {'write', soonest - now, 1, 0}
end
local readers = count_live('r:')
if readers > 0 then
  return {'read', soonest - now, readers, 0}
end
return {'', 0, 0, 0}
