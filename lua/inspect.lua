-- What one key holds, for `redmutex list`: its kind, how long until it
-- frees, how many hold it and who, by the server's clock, read in one
-- step. Never returns a token's secret part, an owner or a permit id: only
-- the holder metadata after the first '|' of a token (see
-- src/client/holder.rs).
--
-- KEYS[1]  a key found by SCAN
--
-- Returns {kind, ms, holders, limit, now, meta...}:
--   kind     'lock' (a string that is not a number: a plain lock's token),
--            'reentrant' (a hash with 'owner'), 'read' or 'write' (a
--            read-write lock hash held by readers or a writer),
--            'semaphore' (a hash with 'limit'), '' for nothing held (no
--            key, or a lock hash with no live holder), or 'other' for a
--            key that is no lock (a number: a fencing counter; another
--            type; a hash of no lock type of this crate)
--   ms       time left: the key's PTTL for a lock or reentrant lock (-1:
--            no expiry), the earliest live deadline for a read-write lock
--            or semaphore
--   holders  1 for a lock, the owner's number of holds for a reentrant
--            lock, readers (or 1 writer), permits out
--   limit    a semaphore's limit, else 0
--   now      the server's time, in ms since the epoch
--   meta...  the holder metadata ('|HOST|PID|PROGRAM|AT|LABEL') of at most
--            16 holders whose tokens carry it: the value of a lock, the
--            writer, each live reader or permit, each hold of a reentrant
--            lock (in no particular order)
-- A key that is not there, or not a lock, answers {kind, 0, 0, 0}.
-- Reads only (expired fields are skipped, not purged): safe to run twice.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local metas = {}
-- Keeps what follows the secret of `token`, if it carries metadata.
local function meta(token)
  local m = string.match(token, '^[^|]*(|.*)$')
  if m and #metas < 16 then
    metas[#metas + 1] = m
  end
end
local function reply(kind, ms, holders, limit)
  local out = {kind, ms, holders, limit, now}
  for i = 1, #metas do
    out[#out + 1] = metas[i]
  end
  return out
end
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'string' then
  if tonumber(value) ~= nil then
    return {'other', 0, 0, 0}
  end
  meta(value)
  return reply('lock', redis.call('PTTL', KEYS[1]), 1, 0)
end
if type(value) ~= 'table' or not value.err then
  return {'', 0, 0, 0}
end
-- Not a string: a hash, or another type (HGETALL fails on those).
local fields = redis.pcall('HGETALL', KEYS[1])
if type(fields) ~= 'table' or fields.err then
  return {'other', 0, 0, 0}
end
if #fields == 0 then
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
-- Fields named prefix..token whose deadline is still ahead (their
-- holders' metadata kept).
local function count_live(prefix)
  local n = 0
  for name, v in pairs(values) do
    if string.sub(name, 1, 2) == prefix and live(v) then
      n = n + 1
      meta(string.sub(name, 3))
    end
  end
  return n
end
if values['limit'] then
  local out = count_live('p:')
  if out == 0 then
    return {'', 0, 0, 0}
  end
  return reply('semaphore', soonest - now, out, tonumber(values['limit']) or 0)
end
if values['owner'] then
  local holds = 0
  for name, _ in pairs(values) do
    if string.sub(name, 1, 2) == 'h:' then
      holds = holds + 1
      meta(string.sub(name, 3))
    end
  end
  return reply('reentrant', redis.call('PTTL', KEYS[1]), holds, 0)
end
if values['w'] and live(values['wexp']) then
  meta(values['w'])
  return reply('write', soonest - now, 1, 0)
end
local readers = count_live('r:')
if readers > 0 then
  return reply('read', soonest - now, readers, 0)
end
-- A read-write lock's hash whose holders' deadlines all passed is free;
-- a hash with none of the lock types' fields is another program's.
for name, _ in pairs(values) do
  local kind = string.sub(name, 1, 2)
  if name ~= 'w' and name ~= 'wexp' and kind ~= 'r:' and kind ~= 'q:' then
    return {'other', 0, 0, 0}
  end
end
return {'', 0, 0, 0}
